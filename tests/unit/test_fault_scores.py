"""Fault scores (sfm.finetune.fault_scores): average precision, the F1 threshold and F1 at a 2-voxel tolerance,
each on cases worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from sfm.finetune import fault_scores


def brute_force_ap(scores: np.ndarray, labels: np.ndarray) -> float:
    """AP straight from its definition: for every distinct threshold (high to low), the recall gained
    times the precision there."""
    ap, last_recall = 0.0, 0.0
    for t in sorted(set(scores.tolist()), reverse=True):
        pred = scores >= t
        tp = np.sum(pred & labels)
        recall, precision = tp / labels.sum(), tp / pred.sum()
        ap += (recall - last_recall) * precision
        last_recall = recall
    return float(ap)


def test_average_precision_follows_its_definition_with_ties():
    rng = np.random.default_rng(0)
    for _ in range(5):
        labels = rng.random(300) < 0.2
        scores = np.round(rng.random(300) + 0.5 * labels, 1)  # coarse: many ties
        assert fault_scores.average_precision(scores, labels) == pytest.approx(brute_force_ap(scores, labels), abs=1e-12)
    labels = np.array([1, 0, 1, 0, 0], bool)
    assert fault_scores.average_precision(np.array([5, 4, 3, 2, 1.0]), labels) == pytest.approx((1 + 2 / 3) / 2)
    assert fault_scores.average_precision(labels * 1.0, labels) == 1.0  # perfect ranking
    assert fault_scores.average_precision(np.zeros(5), labels) == pytest.approx(0.4)  # no ranking: the prevalence


def test_float32_scores_rank_as_their_float64_values_do():
    """The evaluation's float32 predictions take a packed-key sort: it must give the same AP and threshold
    as the general path, with negative scores, ties, and -0.0 tied with 0.0."""
    rng = np.random.default_rng(2)
    for _ in range(10):
        labels = rng.random(400) < 0.2
        scores = np.round(rng.standard_normal(400) + 0.7 * labels, 1).astype(np.float32)
        scores[:6], scores[6:12] = -0.0, 0.0
        wide = scores.astype(np.float64)
        assert fault_scores.average_precision(scores, labels) == fault_scores.average_precision(wide, labels)
        assert fault_scores.average_precision(scores, labels) == pytest.approx(brute_force_ap(wide, labels), abs=1e-12)
        assert fault_scores.best_threshold(scores, labels) == fault_scores.best_threshold(wide, labels)
    s, y, last = fault_scores.ranked(np.array([0.5, -0.0, 2.0, 0.0, -1.0], np.float32), np.array([1, 0, 1, 1, 0]))
    assert s.tolist() == [2.0, 0.5, 0.0, 0.0, -1.0] and last.tolist() == [0, 1, 3, 4]
    assert sorted(y[2:4].tolist()) == [False, True] and y[[0, 1, 4]].tolist() == [True, True, False]


def test_best_threshold_maximises_f1():
    rng = np.random.default_rng(1)
    labels = rng.random(400) < 0.3
    scores = rng.random(400) + 0.4 * labels
    t = fault_scores.best_threshold(scores, labels)
    best = max(fault_scores.f1_iou(scores >= c, labels)[0] for c in scores)
    assert fault_scores.f1_iou(scores >= t, labels)[0] == pytest.approx(best)
    f1, iou = fault_scores.f1_iou(np.array([1, 1, 0, 0], bool), np.array([1, 0, 1, 0], bool))
    assert (f1, iou) == (pytest.approx(0.5), pytest.approx(1 / 3))


def plane(inline: int, shape=(20, 12, 10)) -> np.ndarray:
    """A fault one voxel thick: the whole of inline ``inline``."""
    out = np.zeros(shape, bool)
    out[inline] = True
    return out


def test_fault_f1_at_two_voxels_counts_a_fault_drawn_beside_its_label():
    faults = plane(10)
    f1 = lambda pred, **kw: fault_scores.tolerant_f1(fault_scores.tolerant_counts(pred, faults, **kw))  # noqa: E731
    assert fault_scores.f1_iou(plane(11), faults)[0] == 0.0  # one voxel off: nothing right voxel by voxel
    assert f1(plane(11)) == 1.0 and f1(plane(12)) == 1.0  # ... but found, at 1 and at 2 voxels
    assert f1(plane(13)) == 0.0  # 3 voxels off: missed
    assert f1(plane(11), tolerance=0.5) == 0.0 and f1(plane(10), tolerance=0.0) == 1.0
    # the plane predicted 1 voxel off on crosslines 0-5 of 12, and a false fault far away on inline 2, crosslines
    # 0-5: 60 of 120 predicted voxels are near the label (precision 1/2); the labels on crosslines 0-5 are found, and
    # those on crossline 6 too (sqrt(1 + 1) = 1.41 voxels from inline 11, crossline 5): 70 of 120 (recall 7/12)
    pred = plane(11)
    pred[:, 6:] = False
    pred[2] = True
    pred[2, 6:] = False
    counts = fault_scores.tolerant_counts(pred, faults)
    assert counts.tolist() == [60, 120, 70, 120]
    assert fault_scores.tolerant_f1(counts) == pytest.approx(2 * 0.5 * 7 / 12 / (0.5 + 7 / 12))
    # a diagonal step: sqrt(1 + 1 + 1) = 1.73 voxels is within 2, sqrt(4 + 1) = 2.24 is not
    point = np.zeros((9, 9, 9), bool)
    point[4, 4, 4] = True
    near, far = np.zeros_like(point), np.zeros_like(point)
    near[5, 5, 5] = far[6, 5, 4] = True
    assert fault_scores.tolerant_counts(near, point).tolist() == [1, 1, 1, 1]
    assert fault_scores.tolerant_counts(far, point).tolist() == [0, 1, 0, 1]


def test_fault_f1_at_a_tolerance_counts_labelled_voxels_only_and_sums_over_volumes():
    faults = plane(10)
    labelled = np.zeros(faults.shape, bool)
    labelled[:, ::4] = True  # labels on every 4th crossline: 3 of 12
    pred = plane(11) | plane(3)  # inline 3: far from any fault, but only its labelled voxels count
    counts = fault_scores.tolerant_counts(pred, faults, labelled)
    assert counts.tolist() == [30, 60, 30, 30]  # 3 crosslines x 10 samples per inline
    assert fault_scores.tolerant_f1(counts) == pytest.approx(2 * 0.5 * 1.0 / 1.5)
    both = counts + fault_scores.tolerant_counts(plane(9), faults)  # a second volume: its hits add up
    assert both.tolist() == [150, 180, 150, 150]
    assert fault_scores.tolerant_f1([0, 0, 0, 0]) == 1.0  # neither a fault nor a prediction: nothing wrong
    assert fault_scores.tolerant_f1([0, 0, 0, 5]) == 0.0 and fault_scores.tolerant_f1([0, 5, 0, 0]) == 0.0
