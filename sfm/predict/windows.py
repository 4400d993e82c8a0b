"""Where the windows of a whole-survey prediction lie, how much each counts, and how each is mirrored.

A survey [IL, XL, NS] is covered by windows of the network's crop (D, H, W), evenly spaced along each axis
so that neighbours overlap by about ``overlap`` of a crop (nnU-Net's sliding window: its step is at most
``crop * (1 - overlap)``, the first window at 0 and the last flush with the end). An axis shorter than the
crop has one window, padded with zeros (the value a dead trace has) past the survey's end.

Each window's probabilities are weighted by a Gaussian importance map, as nnU-Net blends: sigma an eighth
of the crop, so a voxel is decided mostly by the windows that see it near their centre, where they have the
most context, and window borders leave no seams. The map is a product of one Gaussian per axis, and the
windows form a grid (every inline origin with every crossline origin with every sample origin), so the sum
of the weights that reach a voxel is a product too: ``W(i, j, k) = W0(i) W1(j) W2(k)``. :meth:`Axis.weights`
divides each window's taper by that sum up front, so the blended volume is the plain sum of weighted
windows, and a slab of it is final as soon as the windows that reach it are added (no weight volume kept).

Test-time mirroring (:func:`mirrorings`) sees each window also flipped along the inline and crossline axes
(and with those two swapped where the crop is square in them), maps each back and averages, as
:func:`sfm.predict.volume_predict.predict` does for the downstream evaluation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

SIGMA_OF_CROP = 1 / 8  # nnU-Net's importance map: sigma = crop / 8


def origins(n: int, c: int, overlap: float) -> list[int]:
    """Window origins along an axis of ``n`` voxels for windows of ``c``: evenly spaced, at most
    ``c * (1 - overlap)`` apart (at least 1), the first at 0 and the last at ``n - c``; ``[0]`` when ``n <= c``."""
    if n <= c:
        return [0]
    target = max(1.0, c * (1.0 - overlap))
    steps = math.ceil((n - c) / target)
    return [round(k * (n - c) / steps) for k in range(steps + 1)]


def taper(c: int) -> np.ndarray:
    """[c] float64 Gaussian, centred, sigma ``c / 8``, 1 at its peak."""
    t = np.arange(c, dtype=np.float64) - (c - 1) / 2
    g = np.exp(-0.5 * (t / (c * SIGMA_OF_CROP)) ** 2)
    return g / g.max()


@dataclass
class Axis:
    """One axis of the window grid: ``n`` voxels of survey, windows of ``c`` at :attr:`starts`."""

    n: int
    c: int
    overlap: float

    def __post_init__(self):
        self.starts = origins(self.n, self.c, self.overlap)
        g = taper(self.c)
        total = np.zeros(max(self.n, self.c))
        for o in self.starts:
            total[o:o + self.c] += g
        # each window's taper over the summed tapers, cut at the survey's end: the weights reaching a voxel sum to 1
        self._weights = {o: (g / total[o:o + self.c])[: self.n - o].astype(np.float32) for o in self.starts}

    def weights(self, origin: int) -> np.ndarray:
        """[min(c, n - origin)] float32: the normalised weights of the window at ``origin``."""
        return self._weights[origin]

    def reaching(self, lo: int, hi: int) -> list[int]:
        """The origins of the windows that reach voxels [lo, hi)."""
        return [o for o in self.starts if o < hi and o + self.c > lo]


class WindowGrid:
    """The windows covering a survey of ``shape`` for a network whose crop is ``crop``, overlapping by
    ``overlap`` (0 <= overlap < 1) of a crop along each axis."""

    def __init__(self, shape: Sequence[int], crop: Sequence[int], overlap: float):
        self.shape = tuple(int(n) for n in shape)
        self.crop = tuple(int(c) for c in crop)
        self.axes = [Axis(n, c, float(overlap)) for n, c in zip(self.shape, self.crop)]

    def weight(self, origin: Sequence[int]) -> np.ndarray:
        """[d, h, w] float32: the weights of the window at ``origin``, cut at the survey's end."""
        w0, w1, w2 = (axis.weights(o) for axis, o in zip(self.axes, origin))
        return w0[:, None, None] * w1[None, :, None] * w2[None, None, :]

    def row(self, inline_origin: int) -> list[tuple[int, int, int]]:
        """Every window whose inline origin is ``inline_origin``, crosslines outer, samples inner."""
        return [(inline_origin, j, k) for j in self.axes[1].starts for k in self.axes[2].starts]

    @property
    def count(self) -> int:
        return math.prod(len(axis.starts) for axis in self.axes)


# ---- test-time mirroring ----------------------------------------------------------------------------


View = tuple[bool, bool, bool]  # (flip inlines, flip crosslines, swap the two)


def mirrorings(crop: Sequence[int]) -> list[View]:
    """The label-preserving mirror images of a crop, as (flip inlines, flip crosslines, swap the two): all 8,
    or the 4 flips when the crop is not square in IL x XL."""
    swaps = (False, True) if crop[0] == crop[1] else (False,)
    return [(fi, fj, sw) for fi in (False, True) for fj in (False, True) for sw in swaps]


def mirror(x: torch.Tensor, view: View, inverse: bool = False, axis: int = 1) -> torch.Tensor:
    """``x`` whose inline and crossline axes are ``axis`` and ``axis + 1`` (e.g. [N, IL, XL, ...] with
    ``axis`` 1, or [N, C, IL, XL, NS] with 2) seen in ``view``; ``inverse``: mapped back from it."""
    fi, fj, sw = view
    if sw and inverse:
        x = x.transpose(axis, axis + 1)
    if fi:
        x = x.flip(axis)
    if fj:
        x = x.flip(axis + 1)
    if sw and not inverse:
        x = x.transpose(axis, axis + 1)
    return x
