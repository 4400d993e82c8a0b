"""Scores of a task model on held-out labels: AP, F1 and IoU, per class for several classes.

Only labelled voxels count (255, not interpreted, is left out). A binary task scores class 1: average
precision of its probability (threshold free), and F1 / IoU at the threshold that maximises F1 on the
validation labels, and fault F1 at a 2-voxel tolerance (``f1_tol2``, :func:`sfm.finetune.fault_scores.tolerant_f1`)
at that threshold. A task of C classes scores each class one against the rest: AP of its probability,
F1 / IoU of the voxels whose most probable class it is; the headline figures are the means over the
classes the held-out labels hold.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sfm.config import LABEL_IGNORE
from sfm.finetune.fault_scores import average_precision, best_threshold, f1_iou, tolerant_counts, tolerant_f1


def labelled(probs: list[np.ndarray], labels: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The labelled voxels of several parts: (probabilities [V] of class 1, or [C, V]; labels [V])."""
    keep = [lab != LABEL_IGNORE for lab in labels]
    flat = [p[:, k] if p.ndim == k.ndim + 1 else p[k] for p, k in zip(probs, keep)]
    return np.concatenate(flat, axis=-1), np.concatenate([lab[k] for lab, k in zip(labels, keep)])


def validation_score(probs: list[np.ndarray], labels: list[np.ndarray]) -> float:
    """What early stopping maximises: AP of class 1 (binary), or the mean AP over the classes present."""
    p, y = labelled(probs, labels)
    if p.ndim == 1:
        return average_precision(p, y == 1)
    present = [c for c in range(p.shape[0]) if (y == c).any()]
    return float(np.mean([average_precision(p[c], y == c) for c in present])) if present else float("nan")


def held_out_scores(probs: list[np.ndarray], labels: list[np.ndarray], threshold: float | None = None
                    ) -> dict[str, Any]:
    """AP, F1 and IoU over the labelled voxels of held-out parts (``probs`` per part: [D, H, W] of class 1, or
    [C, D, H, W]; ``labels`` per part [D, H, W] uint8). Binary: F1 / IoU and F1 at a 2-voxel tolerance
    (``f1_tol2``) at ``threshold`` (default: the F1-maximising one here). Classes: ``per_class`` {class: {ap,
    f1, iou, voxels}} and their means."""
    p, y = labelled(probs, labels)
    out: dict[str, Any] = {"voxels": int(len(y))}
    if p.ndim == 1:
        threshold = best_threshold(p, y == 1) if threshold is None else threshold
        f1, iou = f1_iou(p >= threshold, y == 1)
        hits = sum(tolerant_counts(q >= threshold, lab == 1, lab != LABEL_IGNORE) for q, lab in zip(probs, labels))
        return {**out, "ap": average_precision(p, y == 1), "f1": f1, "f1_tol2": tolerant_f1(hits), "iou": iou,
                "threshold": float(threshold), "positive_fraction": float(np.mean(y == 1))}
    predicted = p.argmax(axis=0)
    per_class = {}
    for c in range(p.shape[0]):
        if (y == c).any():
            f1, iou = f1_iou(predicted == c, y == c)
            per_class[str(c)] = {"ap": average_precision(p[c], y == c), "f1": f1, "iou": iou,
                                 "voxels": int((y == c).sum())}
    means = {k: float(np.mean([s[k] for s in per_class.values()])) for k in ("ap", "f1", "iou")}
    return {**out, **means, "accuracy": float(np.mean(predicted == y)), "per_class": per_class}


def threshold_of(probs: list[np.ndarray], labels: list[np.ndarray]) -> float | None:
    """The F1-maximising threshold of class 1 on validation parts (binary tasks; None for classes)."""
    p, y = labelled(probs, labels)
    return best_threshold(p, y == 1) if p.ndim == 1 else None
