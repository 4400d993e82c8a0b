"""Many crops per fetched region: the region plan (:class:`RegionPlan`).

A region is a box of whole stored bricks (``data.region_bricks``, e.g. 2 x 2 x 2 bricks of 128^3: 256^3
voxels). It is fetched once (bricks stored back to back by one GET), decoded once, normalised straight
into the pool (dead traces 0) and ``k`` = ``data.crops_per_region`` crops are cut from it, at any voxel
origin inside it, each with its own flips and swap.

The plan is a pure function of ``(seed, epoch, sample index)``, so resume stays exact. Rank ``r``'s
sample ``n`` of batch ``b`` is its local sample ``l = b * B + n``; it belongs to lane ``l mod R``, with
``R`` = ``data.regions_in_flight`` >= B lanes, so the B samples of a batch lie in B different regions.
The ``c``-th sample of lane ``q`` (``c = l // R``) is crop ``(c + o) mod k`` of the lane's region
``(c + o) // k``, where ``o = q * k // R`` staggers the lanes: about ``B / k`` regions start per batch
instead of ``R`` every ``k R / B`` batches. A region is named by its *anchor*, the global index of its
first sample, and drawn from ``(seed, epoch, anchor)`` as a crop would be; its crops from
``(seed, epoch, index, 1)``. Regions belong to one dp rank (the anchor is one of its samples), so the
ranks of a node never fetch one region twice; the DataLoader workers of a rank, which make alternate
batches of the same lanes, and the context-parallel ranks of a group share regions through the pool.

The pool of decoded regions a node's processes share is :class:`sfm.data.region_pool.RegionPool`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Region(NamedTuple):
    """A box of survey ``survey``: ``origin`` + ``extent`` voxels (inline, crossline, sample), drawn for
    the samples of ``draw`` = (seed, epoch, anchor)."""

    survey: int
    origin: tuple[int, int, int]
    extent: tuple[int, int, int]
    draw: tuple[int, int, int] = (0, 0, -1)


class _SurveyRegions:
    """The regions of one survey a crop of ``crop`` can come from: every box of ``region_bricks``
    bricks whose origin is on the brick grid (clipped at the survey's far edges), weighted by the
    number of allowed crop origins inside it (``allowed``: [n_i, n_j] bool on the ``step`` grid)."""

    def __init__(self, shape, bricks, region_bricks, crop, allowed: np.ndarray, step: tuple[int, int, int]):
        self.shape, self.crop, self.step = shape, crop, step
        self.extent = tuple(min(n * b, s) for n, b, s in zip(region_bricks, bricks, shape))
        self.allowed = allowed
        table = np.zeros((allowed.shape[0] + 1, allowed.shape[1] + 1), dtype=np.int64)
        table[1:, 1:] = allowed.cumsum(0).cumsum(1)
        self.table = table
        axes = [np.arange(0, s - c + 1, b) for s, c, b in zip(shape, crop, bricks)]
        oi, oj = np.meshgrid(axes[0], axes[1], indexing="ij")
        lo_i, hi_i = self._window(oi, 0)
        lo_j, hi_j = self._window(oj, 1)
        counts = (table[hi_i, hi_j] - table[lo_i, hi_j] - table[hi_i, lo_j] + table[lo_i, lo_j]).ravel()
        keep = counts > 0
        self.origins_ij = np.stack([oi.ravel()[keep], oj.ravel()[keep]], axis=1)
        self.cumulative = np.cumsum(counts[keep])
        self.origins_t = axes[2]

    def _window(self, origin, axis: int):
        """Index range [lo, hi) on the step grid of crop origins inside a region starting at ``origin``."""
        end = np.minimum(origin + self.extent[axis], self.shape[axis]) - self.crop[axis]
        a = self.step[axis]
        lo = -(-origin // a)
        hi = np.maximum(lo, end // a + 1)
        return lo, hi

    @property
    def count(self) -> int:
        return int(self.cumulative[-1]) if self.cumulative.size else 0

    def draw(self, rng: np.random.Generator) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """(origin, extent) of a region drawn with ``rng``."""
        n = int(np.searchsorted(self.cumulative, rng.integers(0, self.count), side="right"))
        i0, j0 = (int(v) for v in self.origins_ij[n])
        t0 = int(self.origins_t[rng.integers(0, len(self.origins_t))])
        origin = (i0, j0, t0)
        extent = tuple(min(o + e, s) - o for o, e, s in zip(origin, self.extent, self.shape))
        return origin, extent

    def crop_origin(self, region: Region, rng: np.random.Generator) -> tuple[int, int, int]:
        """A crop origin inside ``region``, uniform among the allowed ones."""
        (lo_i, hi_i), (lo_j, hi_j) = (self._window(np.int64(region.origin[a]), a) for a in (0, 1))
        t = self.table
        inside = int(t[hi_i, hi_j] - t[lo_i, hi_j] - t[hi_i, lo_j] + t[lo_i, lo_j])
        width = int(hi_j - lo_j)
        if inside == (hi_i - lo_i) * width:  # every origin allowed (most regions): no search
            i, j = divmod(int(rng.integers(0, inside)), width)
        else:
            flat = np.flatnonzero(self.allowed[lo_i:hi_i, lo_j:hi_j])
            i, j = divmod(int(flat[rng.integers(0, flat.size)]), width)
        a_t = self.step[2]
        t_lo = -(-region.origin[2] // a_t)
        t_hi = (region.origin[2] + region.extent[2] - self.crop[2]) // a_t
        t = int(rng.integers(t_lo, t_hi + 1)) * a_t
        return (int(lo_i + i) * self.step[0], int(lo_j + j) * self.step[1], t)


class RegionPlan:
    """Which region, and where in it, each sample comes from (see the module docstring).

    Args:
        surveys: the plan's :class:`sfm.data.survey.SurveyInfo` list; ``origins``: their allowed crop
            origins (:class:`sfm.data.survey.CropOrigins`), ``weights``: survey probabilities.
        steps: the crop-origin grid of each survey along each axis (1s, or the bricks when aligned).
        data: the checked ``JobConfig.data``: ``crop`` (D, H, W), ``crops_per_region`` k >= 2,
            ``region_bricks`` (the region in bricks), ``regions_in_flight`` (lanes; 0: the batch size) and
            ``batch_size``.
        world_size: the data-parallel ranks the sample indices are laid out for.
    """

    def __init__(self, surveys, origins, weights, steps, data, world_size: int):
        self.k = int(data.crops_per_region)
        self.batch_size, self.world_size = int(data.batch_size), int(world_size)
        self.lanes = max(int(data.regions_in_flight) or self.batch_size, self.batch_size)
        self.weights = weights
        self._drawn: dict[tuple[int, int, int], Region] = {}
        crop, region_bricks = tuple(int(c) for c in data.crop), tuple(int(b) for b in data.region_bricks)
        self.grids = [_SurveyRegions(s.shape, s.bricks, region_bricks, crop, o.allowed, st)
                      for s, o, st in zip(surveys, origins, steps)]

    def anchor(self, index: int) -> int:
        """The global index of the first sample of sample ``index``'s region."""
        b_global, n = divmod(int(index), self.batch_size)
        b, rank = divmod(b_global, self.world_size)
        local = b * self.batch_size + n
        c, q = divmod(local, self.lanes)
        offset = q * self.k // self.lanes
        first_c = max(0, (c + offset) // self.k * self.k - offset)
        first = first_c * self.lanes + q
        fb, fn = divmod(first, self.batch_size)
        return (fb * self.world_size + rank) * self.batch_size + fn

    def region(self, seed: int, epoch: int, anchor: int) -> Region:
        """The region named by ``anchor``: a survey by weight, then a box within it (remembered: its
        other k - 1 samples ask again)."""
        draw = (int(seed), int(epoch), int(anchor))
        hit = self._drawn.get(draw)
        if hit is not None:
            return hit
        rng = np.random.default_rng(list(draw))
        survey = int(rng.choice(len(self.grids), p=self.weights))
        origin, extent = self.grids[survey].draw(rng)
        region = self._drawn[draw] = Region(survey, origin, extent, draw)
        if len(self._drawn) > 4 * self.lanes * self.k:
            self._drawn.pop(next(iter(self._drawn)))  # the oldest: dicts keep insertion order
        return region
