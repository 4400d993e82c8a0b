"""Scores of a per-voxel fault segmentation against its labels: average precision of the fault class
(threshold free), the F1-maximising threshold, and F1 / IoU at a threshold.

Every function takes scores or predictions and labels of any shape (flattened) and works over all their
voxels together, the way the downstream evaluation pools the voxels of its test volumes.
"""

from __future__ import annotations

import numpy as np

from sfm.synth.geology import Volume


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


def scores(train_probs: list[np.ndarray], train: list[Volume], test_probs: list[np.ndarray], test: list[Volume]
           ) -> dict[str, float]:
    """AP on the test volumes, and F1/IoU there at the threshold chosen on the training volumes."""
    threshold = best_threshold(np.concatenate([p.ravel() for p in train_probs]),
                               np.concatenate([f.ravel() for _, f in train]))
    probs = np.concatenate([p.ravel() for p in test_probs])
    labels = np.concatenate([f.ravel() for _, f in test])
    f1, iou = f1_iou(probs >= threshold, labels)
    return {"ap": average_precision(probs, labels), "f1": f1, "iou": iou, "threshold": threshold}
