"""Downstream probe: fault detection from frozen encoder features, pretrained encoder against a random one.

The question a probe answers is "did pretraining put useful structure into the encoder?", so the
encoder is frozen and only a small head is trained, once on the pretrained encoder's features and
once, identically, on those of a randomly initialised encoder of the same architecture.

Data: labelled synthetic volumes from :func:`sfm.synth.synthesize_volume` (exact fault labels),
seeds disjoint from the demo surveys', normalised the way the training sampler normalises a survey
(clipped to the 0.1/99.9 percentiles, standardised). Each volume is tiled into non-overlapping crops
of the model's crop size; the first ``train_volumes`` volumes train the head, the rest score it.

Labels are per patch, not per voxel: the encoder emits one token per patch ([N, L, E]), so a
patch-level head reads exactly what the frozen features hold. A voxel-level head would need an
upsampling decoder that learns on its own and blurs the comparison. A patch is a fault patch when at
least ``fault_fraction`` of its voxels lie on a fault plane (the generator marks voxels within about
one voxel of a plane, so a plane crossing an 8^3 patch marks 10-25 % of it).

Features: each patch token with its contrast to its six neighbours (:func:`features`). Head: one
linear layer, class-balanced ridge regression in closed form (:func:`train_head`): deterministic,
cheap enough for every flow run, and too small to learn fault detection by itself, so what it finds
is in the features. The decision threshold is the one that maximises F1 on the training patches.
Scores: F1 and IoU of the fault class on the held-out volumes, next to the F1 of calling every patch
a fault (the floor).

What to expect: a randomly initialised ViT is close to a random projection of each patch's voxels,
which keeps nearly all of their information, so it is a strong reference. An encoder pretrained only
briefly (the CPU demo's 200 steps over ~1,600 crops) has started to keep what reconstruction needs and
drop the rest, and scores *below* the random one. The gap narrows as training goes on (F1 -0.17 after
200 steps, -0.09 after 650, -0.07 after 1,000 on the demo); when it turns positive is not measured
here. The flow reports both numbers; tests/test_evaluate_default_run.py states the gap.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

PROBE_SEED = 7000  # volume seeds PROBE_SEED, PROBE_SEED + 1, ...: far from the demo surveys' 0, 1, 2


def probe_volumes(count: int, shape: tuple[int, int, int], seed: int = PROBE_SEED
                  ) -> list[tuple[np.ndarray, np.ndarray]]:
    """``count`` labelled synthetic volumes: (amplitude float32 [IL, XL, NS] normalised, faults uint8 [IL, XL, NS])."""
    from sfm.synth import synthesize_volume

    out = []
    for i in range(count):
        amplitude, faults = synthesize_volume(shape, seed + i)
        lo, hi = np.percentile(amplitude, (0.1, 99.9))
        clipped = np.clip(amplitude, lo, hi)
        out.append((((clipped - clipped.mean()) / (clipped.std() or 1.0)).astype(np.float32), faults))
    return out


def tile(volume: np.ndarray, crop: tuple[int, int, int]) -> np.ndarray:
    """Non-overlapping crops of ``volume`` [IL, XL, NS] -> [M, 1, D, H, W] (the remainder is dropped)."""
    d, h, w = crop
    ni, nx, ns = (n // c for n, c in zip(volume.shape, crop))
    if min(ni, nx, ns) == 0:
        raise ValueError(f"probe volume {volume.shape} is smaller than the crop {crop}")
    v = volume[: ni * d, : nx * h, : ns * w].reshape(ni, d, nx, h, ns, w)
    return np.ascontiguousarray(v.transpose(0, 2, 4, 1, 3, 5).reshape(-1, 1, d, h, w))


def patch_labels(model, faults: torch.Tensor, fault_fraction: float) -> torch.Tensor:
    """faults [M, 1, D, H, W] (0/1) -> [M, L] bool: a patch is a fault patch if >= fault_fraction of it is fault."""
    return model.patchify(faults.float()).mean(dim=-1) >= fault_fraction


@torch.no_grad()
def features(encoder, crops: torch.Tensor, batch_size: int = 16) -> torch.Tensor:
    """Frozen patch features with local contrast: crops [M, 1, D, H, W] -> [M * L, 2E].

    Each patch token [E] is joined by its absolute difference from the mean of its six face
    neighbours in the crop's patch grid (edge patches repeat themselves): a fault is a break between
    neighbouring patches, and a linear head can only see one if both sides are in its input.
    """
    encoder.eval()
    tokens = torch.cat([encoder.encode(crops[i : i + batch_size]) for i in range(0, len(crops), batch_size)]).float()
    m, _, e = tokens.shape
    grid = encoder.grid_shape(crops[:1])
    g = tokens.reshape(m, *grid, e).permute(0, 4, 1, 2, 3)  # [M, E, gd, gh, gw]
    p = F.pad(g, (1, 1, 1, 1, 1, 1), mode="replicate")
    neighbours = (p[:, :, 2:, 1:-1, 1:-1] + p[:, :, :-2, 1:-1, 1:-1] + p[:, :, 1:-1, 2:, 1:-1]
                  + p[:, :, 1:-1, :-2, 1:-1] + p[:, :, 1:-1, 1:-1, 2:] + p[:, :, 1:-1, 1:-1, :-2]) / 6
    local = torch.cat([g, (g - neighbours).abs()], dim=1)  # [M, 2E, gd, gh, gw]
    return local.permute(0, 2, 3, 4, 1).reshape(-1, 2 * e)


def _f1_iou(pred: torch.Tensor, label: torch.Tensor) -> tuple[float, float]:
    tp = float((pred & label).sum())
    fp = float((pred & ~label).sum())
    fn = float((~pred & label).sum())
    f1 = 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 1.0
    iou = tp / (tp + fp + fn) if tp + fp + fn else 1.0
    return f1, iou


def best_threshold(scores: torch.Tensor, label: torch.Tensor) -> float:
    """The score threshold that maximises F1 of ``scores >= t`` against ``label`` (both [M])."""
    order = torch.argsort(scores, descending=True)
    s, y = scores[order], label[order].float()
    tp = torch.cumsum(y, 0)
    fp = torch.cumsum(1 - y, 0)
    f1 = 2 * tp / (tp + fp + y.sum())  # predicting the top k+1 as positive
    k = int(torch.argmax(f1))
    return float(s[k])


def train_head(x: torch.Tensor, y: torch.Tensor, *, ridge: float = 10.0):
    """A linear head on standardised features x [M, F] for labels y [M] (bool): class-balanced ridge
    regression onto +-1, solved in closed form (deterministic, a fraction of a second). Returns a
    scorer: features [K, F] -> scores [K] (higher: more likely a fault)."""
    mean, std = x.mean(0), x.std(0) + 1e-6
    xs = torch.cat([(x - mean) / std, torch.ones(len(x), 1)], dim=1).double()
    positives = float(y.float().mean())
    weight = torch.where(y, 0.5 / max(positives, 1e-9), 0.5 / max(1 - positives, 1e-9)).double()
    gram = (xs * weight[:, None]).T @ xs + ridge * torch.eye(xs.shape[1], dtype=xs.dtype)
    beta = torch.linalg.solve(gram, (xs * weight[:, None]).T @ (y.double() * 2 - 1)).float()

    def scorer(feats: torch.Tensor) -> torch.Tensor:
        return torch.cat([(feats - mean) / std, torch.ones(len(feats), 1)], dim=1) @ beta

    return scorer


def score_encoder(encoder, train: tuple[torch.Tensor, torch.Tensor], test: tuple[torch.Tensor, torch.Tensor]
                  ) -> dict[str, float]:
    """Fit the head on ``train`` (crops, patch labels [M, L]) and score it on ``test``; F1/IoU of the fault class."""
    x_train, y_train = features(encoder, train[0]), train[1].reshape(-1)
    x_test, y_test = features(encoder, test[0]), test[1].reshape(-1)
    scorer = train_head(x_train, y_train)
    threshold = best_threshold(scorer(x_train), y_train)
    f1, iou = _f1_iou(scorer(x_test) >= threshold, y_test)
    train_f1, _ = _f1_iou(scorer(x_train) >= threshold, y_train)
    return {"f1": f1, "iou": iou, "train_f1": train_f1}


def fault_probe(model, *, train_volumes: int = 8, test_volumes: int = 4, shape: tuple[int, int, int] | None = None,
                fault_fraction: float = 0.02, seed: int = PROBE_SEED) -> dict[str, Any]:
    """Fault-detection F1/IoU from frozen features of ``model`` and of a random encoder of the same shape.

    ``shape`` is each volume's (IL, XL, NS), by default 2 x 2 x 4 crops. Returns ``probe_f1``/``probe_iou``
    (pretrained), ``probe_random_f1``/``probe_random_iou``, the held-out fault-patch prevalence and
    ``probe_all_positive_f1`` (F1 of calling every patch a fault, the floor any useful head must clear).
    """
    from sfm.model.mae import MaskedAutoencoder3D

    t0 = time.perf_counter()
    crop = tuple(model.cfg.crop)
    shape = shape or (2 * crop[0], 2 * crop[1], 4 * crop[2])  # 16 crops per volume: (64, 64, 128) for the demo
    volumes = probe_volumes(train_volumes + test_volumes, shape, seed)
    crops = [torch.from_numpy(tile(a, crop)) for a, _ in volumes]
    labels = [patch_labels(model, torch.from_numpy(tile(f, crop)), fault_fraction) for _, f in volumes]
    train = (torch.cat(crops[:train_volumes]), torch.cat(labels[:train_volumes]))
    test = (torch.cat(crops[train_volumes:]), torch.cat(labels[train_volumes:]))

    rng_state = torch.get_rng_state()
    try:
        torch.manual_seed(seed)
        random_encoder = MaskedAutoencoder3D(model.cfg)  # same architecture, MAE's initialisation
        pretrained = score_encoder(model, train, test)
        random = score_encoder(random_encoder, train, test)
    finally:
        torch.set_rng_state(rng_state)
    prevalence = float(test[1].float().mean())
    return {
        "probe_f1": pretrained["f1"], "probe_iou": pretrained["iou"],
        "probe_random_f1": random["f1"], "probe_random_iou": random["iou"],
        "probe_train_f1": pretrained["train_f1"], "probe_random_train_f1": random["train_f1"],
        "probe_all_positive_f1": 2 * prevalence / (1 + prevalence) if prevalence else 0.0,
        "probe_fault_prevalence": prevalence, "probe_patches_train": int(train[1].numel()),
        "probe_patches_test": int(test[1].numel()), "probe_fault_fraction": fault_fraction,
        "probe_seconds": time.perf_counter() - t0,
    }


def summarize(metrics: dict[str, Any]) -> str:
    gain = metrics["probe_f1"] - metrics["probe_random_f1"]
    return (f"fault probe F1 {metrics['probe_f1']:.3f} pretrained vs {metrics['probe_random_f1']:.3f} random "
            f"({gain:+.3f}); IoU {metrics['probe_iou']:.3f} vs {metrics['probe_random_iou']:.3f}; "
            f"all-positive F1 {metrics['probe_all_positive_f1']:.3f}")


__all__ = ["fault_probe", "summarize", "probe_volumes", "tile", "patch_labels", "best_threshold"]
