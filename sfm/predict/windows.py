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
(and with those two swapped where the crop is square in them), maps each back and averages
(:func:`window_probabilities`).

This is the one windows module: ``sfm predict`` streams a survey through it (:mod:`sfm.predict.slabs`), and
fine-tuning's early stopping, the fine-tune flow's held-out scores and the downstream evaluation predict what
they hold in memory through :func:`predict_box` / :func:`predict_volume`: the same windows, weights, mirrorings
and order of summation, so a registered score is the score of what ``sfm predict`` writes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

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

    def span(self, lo: Sequence[int], hi: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(start, stop) per axis: the survey voxels the windows reaching the box [lo, hi) read (within the
        survey; past its end a window reads zeros)."""
        start, stop = [], []
        for axis, a, b in zip(self.axes, lo, hi):
            reach = axis.reaching(int(a), int(b))
            start.append(reach[0])
            stop.append(min(axis.n, reach[-1] + axis.c))
        return tuple(start), tuple(stop)

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


IDENTITY: View = (False, False, False)


def window_probabilities(net: nn.Module, imgs: np.ndarray, views: Sequence[View] = (IDENTITY,)) -> np.ndarray:
    """imgs [B, 1, D, H, W] float32 -> probabilities [B, C, D, H, W] float32 of a task model ``net`` (``net(x)``:
    logits, ``net.probabilities``: their probabilities; on its own device), the mean over ``views`` of each view's
    probabilities mapped back (one view: no mirroring)."""
    total = None
    with torch.inference_mode():
        x = torch.from_numpy(np.ascontiguousarray(imgs)).to(next(net.parameters()).device)
        for view in views:
            seen = mirror(x, view, axis=2).contiguous()
            p = mirror(net.probabilities(net(seen)).float(), view, inverse=True, axis=2)
            total = p if total is None else total + p
        if len(views) > 1:
            total /= len(views)
        return total.cpu().numpy()


def cut_window(amplitude: np.ndarray, start: Sequence[int], origin: Sequence[int], out: np.ndarray) -> None:
    """``out`` [D, H, W] = the window at ``origin`` of a survey whose voxels from ``start`` on ``amplitude``
    holds, zeros past what it holds (past the survey's end)."""
    box = [slice(o - s, min(o - s + c, n)) for o, s, c, n in zip(origin, start, out.shape, amplitude.shape)]
    part = amplitude[tuple(box)]
    if part.shape != out.shape:
        out.fill(0.0)
    out[tuple(slice(0, n) for n in part.shape)] = part


def add_window(out: np.ndarray, lo: Sequence[int], origin: Sequence[int], probs: np.ndarray, weight: np.ndarray
               ) -> None:
    """Add the probabilities ``probs`` [C, D, H, W] of the window at ``origin`` times its ``weight`` [d, h, w]
    (:meth:`WindowGrid.weight`: cut at the survey's end) into ``out`` [C, ...], which holds the survey's voxels from
    ``lo`` on; what of the window lies outside ``out`` is left out."""
    a = [max(o, l) for o, l in zip(origin, lo)]
    b = [min(o + w, l + n) for o, w, l, n in zip(origin, weight.shape, lo, out.shape[1:])]
    if any(x >= y for x, y in zip(a, b)):
        return
    src = tuple(slice(x - o, y - o) for x, y, o in zip(a, b, origin))
    dst = tuple(slice(x - l, y - l) for x, y, l in zip(a, b, lo))
    out[(slice(None),) + dst] += probs[(slice(None),) + src] * weight[src]


def predict_box(run: Callable[[np.ndarray], np.ndarray], amplitude: np.ndarray, grid: WindowGrid, lo: Sequence[int],
                hi: Sequence[int], *, start: Sequence[int] = (0, 0, 0), batch_size: int = 8) -> np.ndarray:
    """The blended probabilities [C, *(hi - lo)] float32 of the survey voxels [lo, hi) per axis, as ``sfm predict``
    computes them: every window of ``grid`` (the whole survey's) that reaches the box is cut from ``amplitude`` (the
    survey's normalised voxels from ``start`` on, covering :meth:`WindowGrid.span` of the box), run through ``run``
    (imgs [B, 1, D, H, W] -> probabilities [B, C, D, H, W]) in batches of ``batch_size`` windows of one inline
    origin, and added times its weights in the streaming prediction's order (inline origins, crosslines, samples):
    the same sums, so the same values (to float tolerance, whatever else shares a batch)."""
    lo, hi, start = tuple(int(x) for x in lo), tuple(int(x) for x in hi), tuple(int(x) for x in start)
    crop = grid.crop
    batch = np.zeros((batch_size, 1, *crop), np.float32)
    out = None
    for i in grid.axes[0].reaching(lo[0], hi[0]):
        row = [o for o in grid.row(i) if all(o[a] < hi[a] and o[a] + crop[a] > lo[a] for a in (1, 2))]
        for first in range(0, len(row), batch_size):
            chunk = row[first:first + batch_size]
            for m, origin in enumerate(chunk):
                cut_window(amplitude, start, origin, batch[m, 0])
            probs = run(batch[:len(chunk)])
            if out is None:
                out = np.zeros((probs.shape[1], *(b - a for a, b in zip(lo, hi))), np.float32)
            for origin, p in zip(chunk, probs):
                add_window(out, lo, origin, p, grid.weight(origin))
    return out


def predict_volume(net: nn.Module, amplitude: np.ndarray, *, overlap: float, mirror: bool = False,
                   batch_size: int = 8) -> np.ndarray:
    """A task model's probabilities of a whole volume held in memory, amplitude [IL, XL, NS] normalised (windows of
    ``net.crop`` overlapping by ``overlap``, Gaussian-weighted; with ``mirror`` each window also seen in every
    :func:`mirrorings` view): [IL, XL, NS] of class 1 for a binary task (one channel), [C, IL, XL, NS] otherwise."""
    grid = WindowGrid(amplitude.shape, net.crop, overlap)
    views = mirrorings(grid.crop) if mirror else [IDENTITY]
    net.eval()
    out = predict_box(lambda imgs: window_probabilities(net, imgs, views), amplitude, grid, (0, 0, 0),
                      amplitude.shape, batch_size=batch_size)
    return out[0] if out.shape[0] == 1 else out
