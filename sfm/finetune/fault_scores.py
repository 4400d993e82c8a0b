"""Scores of a per-voxel fault segmentation against its labels: average precision of the fault class
(threshold free), the F1-maximising threshold, F1 / IoU at a threshold, and F1 with a tolerance.

Every function but the tolerant one takes scores or predictions and labels of any shape (flattened) and works
over all their voxels together, the way the evaluation pools the voxels of its test volumes.

Fault F1 at a tolerance (:func:`tolerant_counts`, :func:`tolerant_f1`): a fault one voxel thick, predicted one
voxel beside its label, is a miss and a false alarm for the voxel F1, though an interpreter sees the fault found.
So a predicted fault voxel counts as right when a labelled fault lies within ``tolerance`` voxels of it
(Euclidean distance), and a labelled fault voxel as found when a predicted one lies within ``tolerance`` of it:
precision and recall of those hits, and their F1 (fault-detection papers score thin faults so, e.g. with a
2-voxel tolerance). It needs the volumes' shapes, so it takes each volume whole.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from sfm.synth.geology import Volume

TOLERANCE = 2.0  # voxels: the tolerance of the fault F1 every score reports (f1_tol2)


def ranked(scores: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scores and labels sorted by score, high to low, and the last index of each distinct score there
    (tied scores share a threshold, so their order among themselves does not matter).

    float32 scores (what the evaluation predicts) take one ``np.sort`` of 64-bit keys that hold the
    score's bits and the label, several times faster than ``argsort`` over the 2M voxels of the test
    volumes; any other dtype sorts by ``argsort``. Returns (scores [n], labels bool [n], last [distinct])."""
    s = np.asarray(scores).ravel()
    y = np.asarray(labels).ravel().astype(bool)
    if s.dtype == np.float32:
        bits = (s + np.float32(0.0)).view(np.int32).astype(np.int64)  # + 0.0: -0.0 becomes 0.0
        bits = np.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # ordered like the floats they hold
        key = np.sort((bits << 1) | y)[::-1]
        bits, y = key >> 1, (key & 1).astype(bool)
        bits = np.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        s = bits.astype(np.int32).view(np.float32)
    else:
        s = s.astype(np.float64)
        order = np.argsort(-s, kind="stable")
        s, y = s[order], y[order]
    last = np.r_[np.flatnonzero(np.diff(s)), len(s) - 1]
    return s, y, last


def average_precision(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the precision-recall curve as a step function (scikit-learn's definition):
    sum over thresholds of (recall_n - recall_{n-1}) * precision_n; tied scores share a threshold."""
    _, y, last = ranked(scores, labels)
    positives = int(y.sum())
    if positives == 0:
        return float("nan")
    tp = np.cumsum(y)[last]
    precision = tp / (last + 1)
    recall = tp / positives
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def best_threshold(scores: np.ndarray, labels: np.ndarray) -> float:
    """The threshold ``t`` that maximises F1 of ``scores >= t``."""
    s, y, last = ranked(scores, labels)
    tp = np.cumsum(y)[last]
    f1 = 2 * tp / (last + 1 + y.sum())
    return float(s[last[int(np.argmax(f1))]])


def f1_iou(pred: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """F1 and IoU of the fault class for boolean predictions."""
    pred, labels = np.asarray(pred, bool).ravel(), np.asarray(labels).ravel().astype(bool)
    tp = float(np.count_nonzero(pred & labels))
    wrong = float(np.count_nonzero(pred ^ labels))
    return (2 * tp / (2 * tp + wrong) if tp + wrong else 1.0), (tp / (tp + wrong) if tp + wrong else 1.0)


def ball(radius: float) -> np.ndarray:
    """The voxels within ``radius`` (Euclidean) of the centre: bool [2r + 1, 2r + 1, 2r + 1], r = floor(radius)."""
    r = int(np.floor(radius))
    i, j, k = np.ogrid[-r:r + 1, -r:r + 1, -r:r + 1]
    return i * i + j * j + k * k <= radius * radius


def dilate(mask: np.ndarray, structure: np.ndarray) -> np.ndarray:
    """The voxels of ``mask`` [D, H, W] bool grown by ``structure`` [2r + 1] * 3 bool (centred): True wherever a True
    voxel of ``mask`` lies at one of the structure's offsets (a binary dilation; the volume's edge bounds it)."""
    out = np.zeros_like(mask)
    if not mask.any():
        return out
    r = structure.shape[0] // 2
    for offset in np.argwhere(structure) - r:
        target = tuple(slice(max(0, o), n + min(0, o)) for o, n in zip(offset, mask.shape))
        source = tuple(slice(max(0, -o), n - max(0, o)) for o, n in zip(offset, mask.shape))
        out[target] |= mask[source]
    return out


def tolerant_counts(pred: np.ndarray, faults: np.ndarray, labelled: np.ndarray | None = None,
                    tolerance: float = TOLERANCE) -> np.ndarray:
    """The hits of one volume at ``tolerance``: [predicted fault voxels within ``tolerance`` of a labelled fault,
    predicted fault voxels, labelled fault voxels within ``tolerance`` of a predicted one, labelled fault voxels]
    (int64 [4]; sum them over volumes, then :func:`tolerant_f1`). ``pred``, ``faults`` bool [D, H, W] (any 3D
    shape); ``labelled`` bool [D, H, W]: the voxels someone interpreted (default: all). Both sides count only
    labelled voxels, so with labels on a few lines the distances are taken within those lines."""
    pred, faults = np.asarray(pred, bool), np.asarray(faults, bool)
    if labelled is not None:
        pred, faults = pred & labelled, faults & labelled
    near = ball(tolerance)
    near_fault, near_pred = dilate(faults, near), dilate(pred, near)
    return np.array([np.count_nonzero(near_fault & pred), np.count_nonzero(pred),
                     np.count_nonzero(near_pred & faults), np.count_nonzero(faults)], np.int64)


def tolerant_f1(counts: Sequence[int]) -> float:
    """F1 of :func:`tolerant_counts` (summed over volumes): precision = predicted voxels near a labelled fault over
    predicted voxels, recall = labelled voxels near a predicted fault over labelled voxels; 0 when either is 0,
    1 when there is neither a labelled nor a predicted fault."""
    near_label, predicted, found, labelled = (int(c) for c in counts)
    if predicted == 0 and labelled == 0:
        return 1.0
    precision = near_label / predicted if predicted else 0.0
    recall = found / labelled if labelled else 0.0
    return 2 * precision * recall / (precision + recall) if precision + recall else 0.0


def scores(train_probs: list[np.ndarray], train: list[Volume], test_probs: list[np.ndarray], test: list[Volume]
           ) -> dict[str, float]:
    """AP on the test volumes, and F1 / IoU / F1 at a 2-voxel tolerance there at the threshold chosen on the
    training volumes."""
    threshold = best_threshold(np.concatenate([p.ravel() for p in train_probs]),
                               np.concatenate([f.ravel() for _, f in train]))
    probs = np.concatenate([p.ravel() for p in test_probs])
    labels = np.concatenate([f.ravel() for _, f in test])
    f1, iou = f1_iou(probs >= threshold, labels)
    hits = sum(tolerant_counts(p >= threshold, f) for p, (_, f) in zip(test_probs, test))
    return {"ap": average_precision(probs, labels), "f1": f1, "f1_tol2": tolerant_f1(hits), "iou": iou,
            "threshold": threshold}
