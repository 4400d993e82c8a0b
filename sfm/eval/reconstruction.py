"""Masked-patch reconstruction on held-out surveys, for the model and for baselines that need no training.

Every predictor is scored by the same code on the same crops and masks (fixed by ``eval.seed``), over
the voxels of masked patches only, in the loss's own space (``model.patch_targets``): with ``norm_pix_loss`` every patch
is normalised by its own mean and std, ``t = (x - mu_patch) / sd_patch``. This is what the model is
trained to predict and what the registry compares (``masked_nmse``). A voxel-space prediction ``p``
enters it through the same map, ``(p - mu_patch) / sd_patch``, with the true patch's statistics; so:

- ``zero`` in target space is predicting the true patch mean in voxel space: an oracle constant
  that knows the hidden patch's mean. Its NMSE is 1 by construction (``nmse`` divides by the target
  variance, and normalised patches have zero mean).
- ``mean`` (the per-survey mean) is a constant in voxel space; it lands at ``-mu_patch / sd_patch``
  in target space, never better than ``zero``.
- ``interp`` fills masked voxels from the visible patches (:func:`interpolate_masked`).

There is no voxel-space figure for the model: with ``norm_pix_loss`` it predicts each hidden patch's
shape, not its level or scale, and any way of supplying those (interpolated level, visible scale)
would score the supplier more than the model.

Metrics, per predictor, over all masked voxels of all crops:

- ``nmse`` = sum (pred - target)^2 / sum (target - mean(target))^2;
- ``psnr`` = 10 log10(peak^2 / mse) with peak = max |target|.

Metric names: ``masked_nmse``/``masked_psnr`` (the model), ``baseline_<name>_nmse``/``_psnr``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from sfm.config import DataConfig, JobConfig
from sfm.data import CropDataset, crop_dataset

TARGET_PREDICTORS = ("model", "zero", "mean", "interp")


class MaskedError:
    """Accumulates squared error, target energy and peak over masked voxels."""

    def __init__(self):
        self.sq_err = 0.0
        self.energy = 0.0
        self.total = 0.0
        self.count = 0
        self.peak = 0.0

    def add(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> None:
        """pred, target: [N, L, P]; mask: [N, L] (1 masked)."""
        m = mask.bool()
        p, t = pred[m].double(), target[m].double()
        if t.numel() == 0:
            return
        self.sq_err += float(((p - t) ** 2).sum())
        self.energy += float((t**2).sum())
        self.total += float(t.sum())
        self.count += t.numel()
        self.peak = max(self.peak, float(t.abs().max()))

    def result(self) -> dict[str, float]:
        if self.count == 0:
            raise ValueError("no masked voxels were scored")
        mean = self.total / self.count
        variance_sum = self.energy - self.count * mean * mean
        mse = self.sq_err / self.count
        return {"nmse": self.sq_err / variance_sum if variance_sum > 0 else float("inf"), "mse": mse,
                "psnr": 10 * math.log10(self.peak**2 / mse) if mse > 0 else float("inf")}


# ---- baselines ---------------------------------------------------------------------------------


def _linear_fill_along_last(values: torch.Tensor, visible: torch.Tensor):
    """Linear interpolation along the last axis between the nearest visible voxels on either side.

    values, visible: [..., n]. Returns (two_sided [..., n], gap [..., n], one_sided [..., n],
    distance [..., n]): the two-sided estimate and the gap between its two anchors (inf where a side
    is missing), and the nearest visible value with its distance (inf where the line has none).
    """
    n = values.shape[-1]
    idx = torch.arange(n, device=values.device).expand_as(values)
    prev = torch.cummax(torch.where(visible, idx, torch.full_like(idx, -1)), dim=-1).values
    rev = torch.where(visible, n - 1 - idx, torch.full_like(idx, -1)).flip(-1)
    nxt = (n - 1 - torch.cummax(rev, dim=-1).values).flip(-1)  # n where there is no visible voxel after
    has_prev, has_next = prev >= 0, nxt < n
    v_prev = torch.gather(values, -1, prev.clamp(min=0))
    v_next = torch.gather(values, -1, nxt.clamp(max=n - 1))
    span = (nxt - prev).clamp(min=1).to(values.dtype)
    w = (idx - prev).to(values.dtype) / span
    both = has_prev & has_next
    inf = torch.full_like(values, math.inf)
    two_sided = torch.where(both, v_prev + w * (v_next - v_prev), torch.zeros_like(values))
    gap = torch.where(both, span, inf)
    d_prev = torch.where(has_prev, (idx - prev).to(values.dtype), inf)
    d_next = torch.where(has_next, (nxt - idx).to(values.dtype), inf)
    one_sided = torch.where(d_prev <= d_next, v_prev, v_next)
    distance = torch.minimum(d_prev, d_next)
    return two_sided, gap, torch.where(distance.isfinite(), one_sided, torch.zeros_like(values)), distance


def interpolate_masked(volume: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Fill the hidden voxels of ``volume`` [N, D, H, W] from the visible ones (``visible`` [N, D, H, W] bool).

    Along each of the three axes, a hidden voxel gets the linear interpolation between the nearest
    visible voxels before and after it on its line. The axes that have both anchors are combined with
    weights 1/gap (the closer pair counts more). Each axis estimate is exact on any function linear in
    that axis, so a voxel with two-sided anchors is reproduced exactly on any trilinear field
    ``f(i, j, k) = sum c_abc i^a j^b k^c`` (a, b, c in {0, 1}): this is trilinear interpolation for
    data with holes. A voxel with no two-sided axis takes the nearest visible voxel along the axes
    that have one (weights 1/distance); one with none at all gets 0, the survey mean. Visible voxels
    keep their values.
    """
    volume = volume.double()
    visible = visible.bool()
    num_two = torch.zeros_like(volume)
    den_two = torch.zeros_like(volume)
    num_one = torch.zeros_like(volume)
    den_one = torch.zeros_like(volume)
    for axis in (1, 2, 3):
        two, gap, one, dist = (t.movedim(-1, axis) for t in
                               _linear_fill_along_last(volume.movedim(axis, -1), visible.movedim(axis, -1)))
        num_two += torch.where(gap.isfinite(), two / gap, 0.0)
        den_two += torch.where(gap.isfinite(), 1.0 / gap, 0.0)
        w_one = torch.where(dist.isfinite(), 1.0 / dist.clamp(min=1.0), 0.0)
        num_one += w_one * one
        den_one += w_one
    filled = torch.where(den_two > 0, num_two / den_two.clamp(min=1e-30),
                         torch.where(den_one > 0, num_one / den_one.clamp(min=1e-30), 0.0))
    return torch.where(visible, volume, filled).float()


# ---- the two spaces ------------------------------------------------------------------------------


def patch_stats(model, imgs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-patch mean and std exactly as ``model.patch_targets`` uses them: each [N, L, 1]."""
    patches = model.patchify(imgs).float()
    if not model.cfg.norm_pix_loss:
        return torch.zeros_like(patches[..., :1]), torch.ones_like(patches[..., :1])
    return patches.mean(dim=-1, keepdim=True), (patches.var(dim=-1, keepdim=True) + 1.0e-6) ** 0.5


def visible_voxels(model, imgs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """mask [N, L] (1 masked) -> [N, D, H, W] bool, True on voxels of visible patches."""
    per_voxel = (1 - mask.float())[..., None].expand(-1, -1, model.patchify(imgs).shape[-1])
    return model.unpatchify(per_voxel, model.grid_shape(imgs))[:, 0] > 0.5


def predictions(model, imgs: torch.Tensor, pred: torch.Tensor, mask: torch.Tensor,
                survey_means: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every predictor's prediction of every patch in target space: {TARGET_PREDICTORS name: [N, L, P]}.

    imgs [N, 1, D, H, W]; pred [N, L, P] (the model's, target space); mask [N, L] (1 masked);
    survey_means [N] (each crop's survey mean in the standardised space).
    """
    mu, sd = patch_stats(model, imgs)
    patches = model.patchify(imgs).float()
    visible = visible_voxels(model, imgs, mask)
    interp = model.patchify(interpolate_masked(imgs[:, 0], visible)[:, None])
    mean = survey_means.float()[:, None, None].expand_as(patches)
    return {"model": pred.float(), "zero": torch.zeros_like(patches), "mean": (mean - mu) / sd,
            "interp": (interp - mu) / sd}


def survey_mean_standardised(crops: CropDataset, index: int) -> float:
    """The survey mean of sample ``index``'s survey, mapped the way the loader maps amplitudes (~0)."""
    s = crops.surveys[crops.locate(index).survey]
    return float((np.clip(s.mean, *s.clip) - s.mean) / s.std)


def evaluate_model(model, store_urls: list[str], cfg: JobConfig, example: dict | None = None) -> dict[str, Any]:
    """Score ``model`` and the baselines on ``eval.crops`` held-out crops with fixed masks.

    ``example``, if given, receives the first crop for a report: ``input`` [D, H, W] (standardised
    amplitudes), ``visible`` [D, H, W] bool, ``target`` and ``prediction`` [D, H, W] (target space:
    every patch normalised; the prediction holds the model's output on hidden patches and the target
    on visible ones).
    """
    crop = tuple(model.cfg.crop)
    held_out = DataConfig(crop=crop, seed=cfg.eval.seed, min_live_fraction=cfg.data.min_live_fraction, augment="")
    crops = crop_dataset(store_urls, held_out)  # unaugmented crops of the eval seed
    target_scores = {name: MaskedError() for name in TARGET_PREDICTORS}
    generator_state = torch.get_rng_state()
    torch.manual_seed(cfg.eval.seed)  # same masks for every model evaluated with this config
    model.eval()
    try:
        with torch.no_grad():
            for first in range(0, cfg.eval.crops, cfg.eval.batch_size):
                indices = list(range(first, min(cfg.eval.crops, first + cfg.eval.batch_size)))
                imgs = torch.from_numpy(crops.read(indices))
                _, pred, mask = model(imgs)
                means = torch.tensor([survey_mean_standardised(crops, i) for i in indices])
                target = model.patch_targets(imgs)
                for name, p in predictions(model, imgs, pred, mask, means).items():
                    target_scores[name].add(p, target, mask)
                if example is not None and first == 0:
                    grid = model.grid_shape(imgs)
                    keep = mask[:1, :, None].bool()
                    example.update(input=imgs[0, 0].numpy(), visible=visible_voxels(model, imgs[:1], mask[:1])[0].numpy(),
                                   target=model.unpatchify(target[:1], grid)[0, 0].numpy(),
                                   prediction=model.unpatchify(torch.where(keep, pred[:1].float(), target[:1]),
                                                               grid)[0, 0].numpy())
    finally:
        torch.set_rng_state(generator_state)
        crops.close()
    target = {name: acc.result() for name, acc in target_scores.items()}
    metrics: dict[str, Any] = {
        "masked_nmse": target["model"]["nmse"], "masked_psnr": target["model"]["psnr"],
        "crops": cfg.eval.crops, "crop": list(crop), "mask_ratio": model.cfg.mask_ratio,
    }
    for name in TARGET_PREDICTORS[1:]:
        metrics[f"baseline_{name}_nmse"] = target[name]["nmse"]
        metrics[f"baseline_{name}_psnr"] = target[name]["psnr"]
    metrics["beats_zero_baseline"] = bool(metrics["masked_nmse"] < metrics["baseline_zero_nmse"])
    metrics["beats_interp_baseline"] = bool(metrics["masked_nmse"] < metrics["baseline_interp_nmse"])
    return metrics


def metrics_table(metrics: dict[str, Any]) -> list[list[str]]:
    """Rows [predictor, NMSE, PSNR] (target space) for reports and cards."""
    def cell(key: str) -> str:
        value = metrics.get(key)
        return "-" if value is None else f"{value:.4f}" if "nmse" in key else f"{value:.2f}"

    rows = [["model", cell("masked_nmse"), cell("masked_psnr")]]
    labels = {"zero": "zero (true patch mean)", "mean": "per-survey mean", "interp": "trilinear interpolation"}
    rows += [[label, cell(f"baseline_{name}_nmse"), cell(f"baseline_{name}_psnr")] for name, label in labels.items()]
    return rows


def summarize(metrics: dict[str, Any]) -> str:
    return (f"held-out masked NMSE {metrics['masked_nmse']:.4f} (zero {metrics['baseline_zero_nmse']:.4f}, "
            f"mean {metrics['baseline_mean_nmse']:.4f}, interp {metrics['baseline_interp_nmse']:.4f}), "
            f"PSNR {metrics['masked_psnr']:.2f} dB over {metrics['crops']} crops (per-patch normalised targets)")


__all__ = ["evaluate_model", "interpolate_masked", "MaskedError", "predictions", "metrics_table", "summarize"]
