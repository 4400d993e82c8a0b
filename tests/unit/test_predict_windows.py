"""Where the windows of a whole-survey prediction lie and how they are weighted (sfm.predict.windows)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from sfm.predict.windows import WindowGrid, mirror, mirrorings, origins, taper


@pytest.mark.parametrize("n, c, overlap", [(70, 16, 0.5), (64, 16, 0.5), (100, 32, 0.25), (33, 32, 0.5),
                                           (16, 16, 0.5), (12, 16, 0.5), (50, 16, 0.0)])
def test_windows_cover_the_axis_evenly_first_at_zero_last_flush(n, c, overlap):
    starts = origins(n, c, overlap)
    assert starts[0] == 0 and starts == sorted(set(starts))
    if n <= c:
        assert starts == [0]
        return
    assert starts[-1] == n - c
    steps = np.diff(starts)
    assert steps.max() <= max(1, c * (1 - overlap)) + 0.5 and steps.max() - steps.min() <= 1  # even spacing


def test_weights_reaching_every_voxel_sum_to_one_and_follow_the_gaussian():
    shape, crop = (37, 21, 12), (16, 8, 16)  # the last axis shorter than the crop: one padded window
    grid = WindowGrid(shape, crop, 0.5)
    total = np.zeros(shape)
    for origin in itertools.product(*(axis.starts for axis in grid.axes)):
        w = grid.weight(origin)
        total[tuple(slice(o, o + s) for o, s in zip(origin, w.shape))] += w
    np.testing.assert_allclose(total, 1.0, rtol=1e-5)
    assert grid.count == len(grid.axes[0].starts) * len(grid.axes[1].starts) * 1
    # within one window the weights are the Gaussian taper up to the per-voxel normalisation
    g = taper(16)
    assert g.argmax() in (7, 8) and g[0] == pytest.approx(np.exp(-0.5 * (7.5 / 2) ** 2) / np.exp(-0.5 * (0.5 / 2) ** 2))
    second = grid.axes[0].starts[1]
    only = grid.axes[0].weights(0)[:second]  # inlines before the second window are reached by the first alone
    np.testing.assert_allclose(only, 1.0, rtol=1e-6)


def test_mirror_views_map_back_on_any_axis():
    x = torch.arange(2 * 3 * 4 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 4, 5)
    assert len(mirrorings((4, 4, 5))) == 8 and len(mirrorings((4, 6, 5))) == 4
    for view in mirrorings((4, 4, 5)):
        seen = mirror(x, view, axis=2)
        torch.testing.assert_close(mirror(seen, view, inverse=True, axis=2), x)
    torch.testing.assert_close(mirror(x, (True, False, True), axis=2), x.flip(2).transpose(2, 3))


def test_a_volume_in_memory_is_predicted_with_the_windows_weights_and_mirrorings_sfm_predict_uses():
    """A network that reads each voxel's own amplitude: the blended prediction must reproduce sigmoid(amplitude)
    exactly, with and without mirroring (a window or view mapped back wrongly would misplace it), on an axis
    shorter than the crop too (one window, padded with zeros)."""
    from sfm.model.segmenter import Segmenter, Task
    from sfm.predict.windows import predict_box, predict_volume, window_probabilities

    net = Segmenter(None, Task(head="unet", width=2), crop=(16, 16, 32))
    net.forward = lambda imgs: imgs  # one logit per voxel: a binary task
    volume = np.random.default_rng(2).standard_normal((40, 36, 20)).astype(np.float32)
    for mirror_views in (False, True):
        probs = predict_volume(net, volume, overlap=0.5, mirror=mirror_views)
        np.testing.assert_allclose(probs, 1 / (1 + np.exp(-volume)), rtol=1e-5)
    # a box of the survey, from the amplitude its windows read: the whole volume's values there
    grid = WindowGrid(volume.shape, net.crop, 0.5)
    lo, hi = (17, 0, 0), (23, 36, 20)
    start, stop = grid.span(lo, hi)
    assert start[0] <= 17 - 8 and stop[0] >= 23 + 8 and (start[1:], stop[1:]) == ((0, 0), (36, 20))
    torch.manual_seed(0)
    real = Segmenter(None, Task(head="unet", width=2), crop=(16, 16, 32)).eval()
    whole = predict_volume(real, volume, overlap=0.5)
    run = lambda imgs: window_probabilities(real, imgs)  # noqa: E731
    box = predict_box(run, volume[start[0]:stop[0]], grid, lo, hi, start=start)[0]
    np.testing.assert_allclose(box, whole[17:23], atol=1e-6)


def test_test_time_mirroring_makes_a_real_network_mirror_equivariant():
    """Averaged over symmetric windows and every mirroring, the prediction of a mirrored volume is the mirrored
    prediction; without mirroring a (random) network's is not."""
    from sfm.model import mae_config
    from sfm.model.mae import MaskedAutoencoder3D
    from sfm.model.segmenter import Segmenter
    from sfm.predict.windows import predict_volume

    torch.manual_seed(3)
    net = Segmenter(MaskedAutoencoder3D(mae_config("tiny", crop=(32, 32, 32), patch=(4, 4, 8))))
    volume = np.random.default_rng(4).standard_normal((64, 64, 32)).astype(np.float32)
    for flip in (lambda v: v[::-1], lambda v: v[:, ::-1], lambda v: v.transpose(1, 0, 2)):
        seen = predict_volume(net, np.ascontiguousarray(flip(volume)), overlap=0.5, mirror=True)
        np.testing.assert_allclose(seen, flip(predict_volume(net, volume, overlap=0.5, mirror=True)), atol=1e-5)
        plain = predict_volume(net, np.ascontiguousarray(flip(volume)), overlap=0.5)
        assert np.abs(plain - flip(predict_volume(net, volume, overlap=0.5))).max() > 1e-3
