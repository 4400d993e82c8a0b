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
