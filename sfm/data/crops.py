"""Sample index to crop: the crop plan, :class:`CropPlan`.

Sample ``i`` is a pure function of ``(seed, epoch, i)``: its survey (weighted by live volume), its
origin (optionally on the brick grid, so a crop reads whole bricks and nothing else), its
augmentation (flips, swap, time reversal, polarity), and with many crops per region the region it is
cut from (:mod:`sfm.data.regions`). Origins are drawn uniformly among those whose live
(``trace_mask``) fraction is at least ``min_live_fraction`` (found once, from a summed-area table), so
no crop under it appears. The plan reads nothing: :class:`sfm.data.crop_reader.CropReader` fills the
crops it names.
"""


from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from sfm.errors import SFMError

from sfm.data.regions import Region, RegionPlan
from sfm.data.survey import SurveyInfo


class Crop(NamedTuple):
    """Where sample ``i`` comes from. The source region is ``origin + extent`` of survey ``survey``;
    the crop is that region flipped along inline/crossline as drawn, then transposed if ``swap``;
    reversed along the sample (time) axis if ``reverse_time`` and negated if ``invert`` (the other
    SEG polarity convention)."""

    survey: int
    origin: tuple[int, int, int]
    extent: tuple[int, int, int]
    flip_inline: bool = False
    flip_crossline: bool = False
    swap: bool = False
    region: Region | None = None  # the fetched region the crop is cut from (crops_per_region > 1)
    reverse_time: bool = False
    invert: bool = False

    def slab(self, start: int, stop: int) -> "Crop":
        """The crop whose voxels are rows ``[start, stop)`` (axis 0) of this crop as delivered.

        Row ``r`` of the delivered crop is source inline ``r`` (crossline ``r`` when swapped) from the
        origin, or the mirrored one ``n - 1 - r`` when that source axis is flipped; so the rows come
        from one contiguous source range, and the sub-box with the same flips and swap delivers them.
        """
        axis = 1 if self.swap else 0
        n = self.extent[axis]
        if not 0 <= start < stop <= n:
            raise ValueError(f"slab [{start}, {stop}) is not a range of rows of a crop with {n}")
        flipped = self.flip_crossline if self.swap else self.flip_inline
        lo = n - stop if flipped else start
        origin, extent = list(self.origin), list(self.extent)
        origin[axis] += lo
        extent[axis] = stop - start
        return self._replace(origin=tuple(origin), extent=tuple(extent))

    @property
    def shape(self) -> tuple[int, int, int]:
        """(D, H, W) of the crop as delivered."""
        d, h, w = self.extent
        return (h, d, w) if self.swap else (d, h, w)


class CropPlan:
    """Where each sample comes from: :meth:`locate` ``(epoch, index)`` -> :class:`Crop`, a pure function of
    ``(data.seed, epoch, index)``.

    Sample ``(b * world_size + rank) * batch_size + n`` is the ``n``-th sample of data-parallel rank
    ``rank``'s batch ``b``: with ``data.crops_per_region`` k > 1 the region plan
    (:class:`sfm.data.regions.RegionPlan`, :attr:`regions`) lays the samples of a rank out in regions by
    that layout; otherwise every crop is drawn on its own.

    Args:
        surveys: the :class:`sfm.data.survey.SurveyInfo` of each survey (e.g. a :class:`sfm.data.survey.Surveys`).
        data: the checked ``JobConfig.data``: ``crop`` (D, H, W) voxels along (inline, crossline, sample),
            ``seed``, ``min_live_fraction``, ``align`` ("voxel": any origin; "brick": origins on the brick
            grid, so an aligned crop that is a multiple of the brick reads exactly its own voxels), ``augment``
            (any of "flip_inline", "flip_crossline", "swap": inline and crossline swapped, only drawn when the
            crop's D == H, "reverse_time": the sample axis reversed, and "invert_polarity": values negated),
            ``batch_size`` and the region settings.
        world_size: the data-parallel ranks the samples are laid out for.
    """

    def __init__(self, surveys: Sequence[SurveyInfo], data, world_size: int = 1):
        self.surveys = list(surveys)
        self.crop = tuple(int(c) for c in data.crop)
        self.seed = int(data.seed)
        self.batch_size, self.world_size = int(data.batch_size), int(world_size)
        self.align = data.align
        self.augment = data.augmentations()
        self.swap_allowed = "swap" in self.augment and self.crop[0] == self.crop[1]
        fraction = float(data.min_live_fraction)
        d, h, _ = self.crop
        self.origins = [s.crop_origins(d, h, fraction, self.step(s)[:2]) for s in self.surveys]
        live = np.array([s.trace_mask.sum() * s.shape[2] * (o.count > 0) for s, o in zip(self.surveys, self.origins)],
                        dtype=np.float64)
        if live.sum() == 0:
            raise SFMError(f"no crop of {self.crop} has at least {fraction:.0%} live traces in any "
                           "survey; lower data.min_live_fraction or use a smaller crop")
        self.weights = live / live.sum()  # surveys weighted by live volume
        self.regions: RegionPlan | None = None
        if int(data.crops_per_region) > 1:
            self.regions = RegionPlan(self.surveys, self.origins, self.weights, [self.step(s) for s in self.surveys],
                                      data, self.world_size)

    def step(self, s: SurveyInfo) -> tuple[int, int, int]:
        """The grid of crop origins in survey ``s``: its bricks when aligned, else every voxel."""
        return s.bricks if self.align == "brick" else (1, 1, 1)

    def locate(self, epoch: int, index: int) -> Crop:
        """The :class:`Crop` of sample ``index`` of epoch ``epoch``."""
        if self.regions is not None:
            return self._locate_in_region(epoch, index)
        rng = np.random.default_rng([self.seed, int(epoch), int(index)])
        k = int(rng.choice(len(self.surveys), p=self.weights))
        s, origins = self.surveys[k], self.origins[k]
        i0, j0 = origins.pick(int(rng.integers(0, origins.count)))
        a = self.step(s)[2]
        t0 = int(rng.integers(0, (s.shape[2] - self.crop[2]) // a + 1)) * a
        return Crop(k, (i0, j0, t0), self.crop, **self._orientation(rng))

    def _locate_in_region(self, epoch: int, index: int) -> Crop:
        plan = self.regions
        region = plan.region(self.seed, epoch, plan.anchor(index))
        rng = np.random.default_rng([self.seed, int(epoch), int(index), 1])
        origin = plan.grids[region.survey].crop_origin(region, rng)
        return Crop(region.survey, origin, self.crop, region=region, **self._orientation(rng))

    def _orientation(self, rng: np.random.Generator) -> dict[str, bool]:
        """A crop's flips, swap, time reversal and polarity (its :class:`Crop` fields), each only as
        ``augment`` allows. The flips and swap are always drawn; the other two after them and only when
        one of them is on, so the streams without them are the ones they always were."""
        swap, flip_il, flip_xl = (bool(v) for v in rng.integers(0, 2, size=3))
        on_time, on_sign = "reverse_time" in self.augment, "invert_polarity" in self.augment
        reverse = invert = False
        if on_time or on_sign:
            reverse, invert = (bool(v) for v in rng.integers(0, 2, size=2))
        return dict(flip_inline="flip_inline" in self.augment and flip_il,
                    flip_crossline="flip_crossline" in self.augment and flip_xl, swap=self.swap_allowed and swap,
                    reverse_time=on_time and reverse, invert=on_sign and invert)
