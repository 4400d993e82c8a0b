"""Masked-patch reconstruction on held-out surveys, for the model and for baselines that need no training.

Metrics live in the loss's own target space (``model.patch_targets``: with ``norm_pix_loss`` each patch
normalised by its own mean and std), over the voxels of masked patches only:

- ``nmse`` = sum (pred - target)^2 / sum (target - mean(target))^2 over masked voxels;
- ``psnr`` = 10 log10(peak^2 / mse) with peak = max |target| over masked voxels.

Every predictor (the model, the zero baseline) is scored by the same code on the same crops and masks,
which are fixed by ``eval.seed``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from sfm.config import JobConfig
from sfm.data import CropSampler


class _MaskedError:
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
        self.sq_err += float(((p - t) ** 2).sum())
        self.energy += float((t**2).sum())
        self.total += float(t.sum())
        self.count += t.numel()
        self.peak = max(self.peak, float(t.abs().max()))

    def result(self) -> dict[str, float]:
        mean = self.total / self.count
        variance_sum = self.energy - self.count * mean * mean
        mse = self.sq_err / self.count
        return {"nmse": self.sq_err / variance_sum, "mse": mse,
                "psnr": 10 * math.log10(self.peak**2 / mse) if mse > 0 else float("inf")}


def evaluate_model(model, store_urls: list[str], cfg: JobConfig) -> dict[str, Any]:
    """Score ``model`` and the zero baseline on ``eval.crops`` held-out crops with fixed masks."""
    crop = tuple(model.cfg.crop)
    sampler = CropSampler(store_urls, crop, seed=cfg.eval.seed, min_live_fraction=cfg.data.min_live_fraction)
    predictors: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"zero": torch.zeros_like}
    scores = {"model": _MaskedError(), **{name: _MaskedError() for name in predictors}}
    generator_state = torch.get_rng_state()
    torch.manual_seed(cfg.eval.seed)  # same masks for every model evaluated with this config
    model.eval()
    try:
        with torch.no_grad():
            for first in range(0, cfg.eval.crops, cfg.eval.batch_size):
                indices = list(range(first, min(cfg.eval.crops, first + cfg.eval.batch_size)))
                imgs = torch.from_numpy(sampler.read_many(indices))
                _, pred, mask = model(imgs)
                target = model.patch_targets(imgs)
                scores["model"].add(pred, target, mask)
                for name, predictor in predictors.items():
                    scores[name].add(predictor(target), target, mask)
    finally:
        torch.set_rng_state(generator_state)
        sampler.close()
    results = {name: acc.result() for name, acc in scores.items()}
    metrics: dict[str, Any] = {
        "masked_nmse": results["model"]["nmse"], "masked_psnr": results["model"]["psnr"],
        "crops": cfg.eval.crops, "crop": list(crop), "mask_ratio": model.cfg.mask_ratio,
    }
    for name in predictors:
        metrics[f"baseline_{name}_nmse"] = results[name]["nmse"]
        metrics[f"baseline_{name}_psnr"] = results[name]["psnr"]
    metrics["beats_zero_baseline"] = bool(metrics["masked_nmse"] < metrics["baseline_zero_nmse"])
    return metrics


def summarize(metrics: dict[str, Any]) -> str:
    return (f"held-out masked NMSE {metrics['masked_nmse']:.4f} (zero baseline {metrics['baseline_zero_nmse']:.4f}), "
            f"PSNR {metrics['masked_psnr']:.2f} dB over {metrics['crops']} crops")


__all__ = ["evaluate_model", "summarize"]
