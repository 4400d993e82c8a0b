"""Sample index to crop: :class:`CropSampler`.

Sample ``i`` is a pure function of ``(seed, epoch, i)``: its survey (weighted by live volume), its
origin (optionally on the brick grid, so a crop reads whole bricks and nothing else), its
augmentation, and hence its values. Origins are drawn uniformly among those whose live
(``trace_mask``) fraction is at least ``min_live_fraction`` (found once, from a summed-area table), so
no crop under it appears. Values are normalised per survey from the stored statistics: clipped to the
0.1/99.9 percentiles, then standardised with the stored mean and std; dead traces are 0. A crop is
read as brick-aligned tiles on a thread pool, each tile normalised straight into its place in the
output batch, so many ranged reads are in flight at once and a 1024^3 crop never exists twice in
memory.
"""


from __future__ import annotations

import collections
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable, NamedTuple

import numpy as np

from sfm.data.brick_cache import BrickCache
from sfm.data.bricks import BrickReader, zero_nonfinite
from sfm.data.int8_batch import DEAD
from sfm.config import ALIGNMENTS, AUGMENTATIONS, BATCH_DTYPES
from sfm.errors import SFMError

from sfm.data.region_pool import RegionPool, region_bytes
from sfm.data.regions import Region, RegionPlan, RegionSettings
from sfm.storage.resilient_store import open_survey_store, ResilientStore
from sfm.data.survey import SurveyInfo, open_amplitude, read_survey_info

log = logging.getLogger(__name__)


_TILE_VOXELS = 1 << 22  # largest tile read in one zarr call (16 MiB of float32)

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


def brick_tiles(origin: tuple[int, ...], extent: tuple[int, ...], bricks: tuple[int, ...],
                max_voxels: int | None = None) -> list[tuple[tuple[int, int], ...]]:
    """Split a region into tiles along brick boundaries, each at most ``max_voxels`` (default
    ``_TILE_VOXELS``) where possible.

    Returns ``[((a0, a1), (b0, b1), (c0, c1)), ...]`` relative to ``origin``. Tiles share no brick,
    so reading them concurrently fetches nothing twice.
    """
    max_voxels = max_voxels or _TILE_VOXELS

    def split(box):
        size = [hi - lo for lo, hi in box]
        if int(np.prod(size)) <= max_voxels:
            return [box]
        for axis in np.argsort(size)[::-1]:
            lo, hi = box[axis]
            mid_abs = origin[axis] + (lo + hi) // 2
            cut = int(round(mid_abs / bricks[axis])) * bricks[axis] - origin[axis]
            if lo < cut < hi:
                left, right = list(box), list(box)
                left[axis], right[axis] = (lo, cut), (cut, hi)
                return split(tuple(left)) + split(tuple(right))
        return [box]

    return split(tuple((0, int(n)) for n in extent))


class CropSampler:
    """Random crops [1, D, H, W] float32 from a set of survey stores.

    Args:
        store_urls: survey stores (local paths or s3:// URLs).
        crop: (D, H, W) voxels along (inline, crossline, sample), from 32^3 to 1024^3 and beyond.
        seed, epoch: the stream; sample ``i`` is a pure function of ``(seed, epoch, i)``.
        min_live_fraction: crops whose fraction of live traces is below this are never returned.
        read_threads: crops (tiles of large crops) read at once; each read fetches its bricks
            concurrently, so about ``read_threads * bricks per tile`` requests are in flight.
        align: "voxel" (any origin) or "brick" (origins on the brick grid: an aligned crop that is a
            multiple of the brick reads exactly its own voxels).
        augment: any of "flip_inline", "flip_crossline", "swap" (swap inline/crossline; only drawn
            when the crop's D == H, otherwise the crop's shape would change), "reverse_time" (the
            sample axis reversed) and "invert_polarity" (values negated; for int8 batches the sign
            travels in each sample's affine, :class:`sfm.data.int8_batch.Int8Batch`).
        client, retry_seconds: see :func:`open_survey_store`.
        brick_reader: read through :mod:`sfm.data.bricks` where the store layout allows (a third less CPU
            than zarr's read path); False: always through zarr.
        regions: many crops per fetched region (:mod:`sfm.data.regions`); None or k = 1: each crop
            fetches its own bricks. Needs :meth:`plan_batches` (the dataset calls it).
        dtype: "float32" or "float16": the crops' value type, normalised; "int8" (int8 stores only):
            the stored values, dead traces :data:`sfm.data.int8_batch.DEAD`, normalised on the device
            from each survey's :meth:`sfm.data.survey.SurveyInfo.affine` (:class:`sfm.data.int8_batch.Int8Batch`).
        slab: ``(start, stop)``: read and return only rows ``[start, stop)`` of axis 0 of each crop
            as delivered (after flips and swap), [1, stop - start, H, W], fetching only the bricks
            those rows need. The crops themselves (``locate``) do not change, so the context-parallel
            ranks of a group, each with its own slab (:func:`sfm.distributed.context_parallel.crop_slab`), read
            disjoint parts of the same crops. None: the whole crop.
        cache_mb: keep up to this many MiB of bricks normalised in memory in each process
            (:mod:`sfm.data.brick_cache`; brick-reader layouts), so surveys that fit are fetched, decoded
            and normalised once, not for every crop that touches them; the crops are the same. 0: none.
    """

    def __init__(self, store_urls: list[str], crop: tuple[int, int, int], seed: int = 0,
                 min_live_fraction: float = 0.5, read_threads: int = 8, *, epoch: int = 0, align: str = "voxel",
                 augment: Iterable[str] = (), client: str = "auto", retry_seconds: float = 120.0,
                 brick_reader: bool = True, slab: tuple[int, int] | None = None,
                 regions: RegionSettings | None = None, dtype: str = "float32", cache_mb: int = 0):
        if not store_urls:
            raise SFMError("no survey stores to read; ingest at least one survey")
        self.crop = tuple(int(c) for c in crop)
        if len(self.crop) != 3 or min(self.crop) < 1:
            raise SFMError(f"data.crop = {list(crop)} is not a crop shape; give 3 positive sizes, e.g. [64, 64, 64]")
        if align not in ALIGNMENTS:
            raise SFMError(f"data.align = {align!r} is not an alignment; use one of {', '.join(ALIGNMENTS)}")
        augment = tuple(a for a in augment if a)
        unknown = [a for a in augment if a not in AUGMENTATIONS]
        if unknown:
            raise SFMError(f"data.augment has unknown augmentation(s) {', '.join(unknown)}; valid: "
                           f"{', '.join(AUGMENTATIONS)}")
        if not 0.0 <= float(min_live_fraction) <= 1.0:
            raise SFMError(f"data.min_live_fraction = {min_live_fraction} must lie in [0, 1]")
        self.seed, self.epoch = int(seed), int(epoch)
        self.min_live_fraction = float(min_live_fraction)
        self.read_threads = max(1, int(read_threads))
        self.align = align
        self.augment = augment
        self.swap_allowed = "swap" in augment and self.crop[0] == self.crop[1]
        if slab is not None:
            slab = (int(slab[0]), int(slab[1]))
            if not 0 <= slab[0] < slab[1] <= self.crop[0]:
                raise SFMError(f"slab {list(slab)} is not a range of the crop's {self.crop[0]} inline rows")
        self.slab = slab
        # what one read delivers: the slab's rows of the crop, or all of it
        self.shape = self.crop if slab is None else (slab[1] - slab[0], *self.crop[1:])
        if dtype not in BATCH_DTYPES:
            raise SFMError(f"data.batch_dtype = {dtype!r} is not a crop type; use one of {', '.join(BATCH_DTYPES)}")
        self.dtype = np.dtype(dtype)
        self.regions = regions or RegionSettings()
        self.regions.check()
        self.plan: RegionPlan | None = None
        self.pool_of_regions: RegionPool | None = None
        self.copy_cpu = 0.0  # thread CPU seconds cutting crops out of regions
        self.client, self.retry_seconds = client, float(retry_seconds)
        self.brick_reader = bool(brick_reader)
        if int(cache_mb) < 0:
            raise SFMError(f"data.cache_mb = {cache_mb} is not a size; give MiB >= 0 (0: no brick cache)")
        self.cache_bytes = int(cache_mb) << 20
        self._cache: BrickCache | None = None
        self._stores: list[ResilientStore] = []
        self._arrays: list[Any] = []
        infos = []
        for url in store_urls:
            info, amp = read_survey_info(url, open_survey_store(url, client, retry_seconds), client, retry_seconds)
            infos.append(info)
            self._stores.append(amp.store_path.store)  # where the amplitude is read (an MDIO store, for a reference)
            self._arrays.append(amp)
        fits = [all(n >= c for n, c in zip(s.shape, self.crop)) for s in infos]
        if not any(fits):
            shapes = ", ".join(f"{s.store_url}: {s.shape}" for s in infos)
            raise SFMError(f"every survey is smaller than the crop {self.crop} ({shapes}); set data.crop smaller")
        self.surveys = [s for s, ok in zip(infos, fits) if ok]
        if self.dtype == np.int8:
            self._check_int8_stores()
        self._stores = [s for s, ok in zip(self._stores, fits) if ok]
        self._arrays = [a for a, ok in zip(self._arrays, fits) if ok]
        self._readers = self._brick_readers()
        d, h, _ = self.crop
        self.origins = [s.crop_origins(d, h, self.min_live_fraction, self._step(s)[:2]) for s in self.surveys]
        live = np.array([s.trace_mask.sum() * s.shape[2] * (o.count > 0) for s, o in zip(self.surveys, self.origins)],
                        dtype=np.float64)
        if live.sum() == 0:
            raise SFMError(f"no crop of {self.crop} has at least {self.min_live_fraction:.0%} live traces in any "
                           "survey; lower data.min_live_fraction or use a smaller crop")
        self.weights = live / live.sum()  # surveys weighted by live volume
        self._pid = os.getpid()
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _check_int8_stores(self) -> None:
        """int8 batches deliver stored int8 values: every survey must be an int8 store of sfm's own."""
        other = [s for s in self.surveys if s.stored_dtype != "int8"]
        mdio = [s for s in other if s.source_kind == "mdio"]
        if mdio:
            raise SFMError(f"data.batch_dtype = \"int8\" delivers stored int8 values, but survey {mdio[0].name} "
                           f"({mdio[0].store_url}) is an MDIO store read in place ({mdio[0].stored_dtype}); set "
                           "data.batch_dtype to float16, or export it to SEG-Y and ingest that with --dtype int8")
        if other:
            raise SFMError(f"data.batch_dtype = \"int8\" delivers stored int8 values, but survey store "
                           f"{other[0].store_url} holds {other[0].stored_dtype}; ingest with --dtype int8 or "
                           "set data.batch_dtype to float16")

    # ---- processes: the live handles are reopened in each process that reads ----------------
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_stores=[], _arrays=[], _readers=[], _pool=None, _lock=None, _pid=None, copy_cpu=0.0,
                     _cache=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _ensure_open(self) -> None:
        """(Re)open stores and the thread pool in this process: clients do not survive a fork."""
        if self._pid == os.getpid() and self._arrays:
            return
        import zarr

        with self._lock:
            if self._pid == os.getpid() and self._arrays:
                return
            self._stores, self._arrays = [], []
            for s in self.surveys:
                store = open_survey_store(s.store_url, self.client, self.retry_seconds)
                try:
                    group = zarr.open_group(store, mode="r")
                    amp = open_amplitude(dict(group.attrs), group, self.client, self.retry_seconds)
                except Exception as err:
                    raise SFMError(f"cannot reopen survey store {s.store_url}: {type(err).__name__}: {err}; check "
                                   "the S3 endpoint is reachable") from err
                self._arrays.append(amp)
                self._stores.append(amp.store_path.store)
            self._readers = self._brick_readers()
            self._pool = None
            self._cache = None  # each process keeps its own
            self._pid = os.getpid()

    def _brick_readers(self) -> list[BrickReader | None]:
        return [BrickReader.for_array(a) if self.brick_reader else None for a in self._arrays]

    @property
    def pool(self) -> ThreadPoolExecutor:
        self._ensure_open()
        if self._pool is None:  # first use, or reading again after close()
            for store in self._stores:
                store.closed = False
            self._pool = ThreadPoolExecutor(max_workers=self.read_threads, thread_name_prefix="sfm-read")
        return self._pool

    def fetch_stats(self) -> dict[str, int]:
        """Bytes, requests and retries this process has fetched from storage so far."""
        return {k: sum(getattr(s, k) for s in self._stores) for k in ("bytes_fetched", "requests", "retries")}

    def cpu_stats(self) -> dict[str, float]:
        """Thread CPU seconds this process spent per phase: receive, decode, normalise (brick reader
        reads) and copy (crops cut out of pooled regions); the regions it built and reused; the brick
        cache's hits, misses and size (MiB)."""
        spent = collections.Counter()
        for reader in self._readers:
            if reader is not None:
                spent.update(reader.cpu)
        out = {phase: float(spent.get(phase, 0.0)) for phase in ("receive", "decode", "normalise")}
        out["copy"] = self.copy_cpu
        cache = self._cache
        out.update(cache_hits=cache.hits if cache else 0, cache_misses=cache.misses if cache else 0,
                   cache_mb=cache.nbytes / 2**20 if cache else 0.0)
        pool = self.pool_of_regions
        out.update(regions_built=pool.built if pool else 0, regions_reused=pool.reused if pool else 0)
        return out

    def plan_batches(self, batch_size: int, world_size: int) -> None:
        """Lay out the region plan for batches of ``batch_size`` samples and ``world_size`` dp ranks
        (:class:`sfm.data.regions.RegionPlan`); nothing to do with one crop per region."""
        r = self.regions
        if int(r.crops_per_region) <= 1:
            return
        steps = [self._step(s) for s in self.surveys]
        self.plan = RegionPlan(self.surveys, self.origins, self.weights, self.crop, steps, r.crops_per_region,
                               tuple(r.region_bricks), r.regions_in_flight, batch_size, world_size)
        largest = max(region_bytes(g.extent, self.dtype) for g in self.plan.grids)
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        budget = int(r.pool_mb) * (1 << 20) or 2 * self.plan.lanes * largest * max(1, local_ranks)
        self.pool_of_regions = RegionPool(r.pool_dir, budget)
        self.pool_of_regions.keep = budget // largest + 8  # a map of every file: recycled files fault no page

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    # ---- where sample i comes from -------------------------------------------------------------
    def locate(self, index: int) -> Crop:
        """The :class:`Crop` of sample ``index``: a pure function of (seed, epoch, index)."""
        if self.plan is not None:
            return self._locate_in_region(index)
        rng = np.random.default_rng([self.seed, self.epoch, int(index)])
        k = int(rng.choice(len(self.surveys), p=self.weights))
        s, origins = self.surveys[k], self.origins[k]
        i0, j0 = origins.pick(int(rng.integers(0, origins.count)))
        a = self._step(s)[2]
        t0 = int(rng.integers(0, (s.shape[2] - self.crop[2]) // a + 1)) * a
        return Crop(k, (i0, j0, t0), self.crop, **self._orientation(rng))

    def _locate_in_region(self, index: int) -> Crop:
        plan = self.plan
        region = plan.region(self.seed, self.epoch, plan.anchor(index))
        rng = np.random.default_rng([self.seed, self.epoch, int(index), 1])
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

    def _negates(self, c: Crop) -> bool:
        """Whether reading ``c`` negates its values: an inverted crop, except in int8 batches, where the
        sign travels in the sample's affine (:meth:`SurveyInfo.affine`)."""
        return c.invert and self.dtype != np.int8

    def _step(self, s: SurveyInfo) -> tuple[int, int, int]:
        return s.bricks if self.align == "brick" else (1, 1, 1)

    # ---- reading -------------------------------------------------------------------------------
    def submit(self, index: int, out: np.ndarray) -> list[Future]:
        """Start reading sample ``index`` (its slab, if set) into ``out`` [1, *shape] (or ``shape``)
        float32; one future per tile."""
        return self.submit_crop(self.locate(index), out)

    def submit_crop(self, c: Crop, out: np.ndarray) -> list[Future]:
        """:meth:`submit` for a sample already located (``c = locate(index)``)."""
        if self.slab is not None:
            c = c.slab(*self.slab)
        s = self.surveys[c.survey]
        if out.size != int(np.prod(self.shape)) or out.dtype != self.dtype or not out.flags.c_contiguous:
            raise ValueError(f"out must be contiguous {self.dtype} holding {self.shape}, got {out.dtype} {out.shape}")
        view = out.reshape(c.shape)  # a view, since out is contiguous
        if c.swap:  # view[i, j, t] addresses the source voxel (origin + (i, j, t))
            view = view.transpose(1, 0, 2)
        view = view[:: -1 if c.flip_inline else 1, :: -1 if c.flip_crossline else 1, :: -1 if c.reverse_time else 1]
        if c.region is not None:
            return [self.pool.submit(self._cut, c, view)]
        full = s.live_traces(c.origin[0], c.origin[1], c.extent[0], c.extent[1]) == c.extent[0] * c.extent[1]
        pool = self.pool
        # a blocking range reader reads a tile's bricks one after another: one brick per tile keeps
        # read_threads requests in flight
        per_brick = self._stores[c.survey].range_reader is not None
        tiles = brick_tiles(c.origin, c.extent, s.bricks, int(np.prod(s.bricks)) if per_brick else None)
        return [pool.submit(self._read_tile, c, tile, view, full) for tile in tiles]

    def _cut(self, c: Crop, view: np.ndarray) -> None:
        """Copy crop ``c`` out of its region, fetching and decoding the region first if no process of
        this node has."""
        r = c.region
        s = self.surveys[r.survey]
        box = tuple(slice(o - ro, o - ro + n) for o, ro, n in zip(c.origin, r.origin, c.extent))

        def copy(region: np.ndarray) -> None:
            clock = time.thread_time()
            if self._negates(c):
                np.negative(region[box], out=view)
            else:
                np.copyto(view, region[box])
            spent = time.thread_time() - clock
            with self._lock:
                self.copy_cpu += spent

        self.pool_of_regions.use(RegionPool.name(s.identity, r, self.dtype), r.extent, self.dtype,
                                 lambda dst: self._fill_region(r, dst), copy)

    def _fill_region(self, r: Region, dst: np.ndarray) -> None:
        """``dst`` [*r.extent] = the region, normalised, dead traces 0."""
        s = self.surveys[r.survey]
        (i0, j0, k0), (d, h, w) = r.origin, r.extent
        self._read_box(r.survey, (slice(i0, i0 + d), slice(j0, j0 + h), slice(k0, k0 + w)), dst)
        if s.live_traces(i0, j0, d, h) < d * h:
            dst[~s.trace_mask[i0:i0 + d, j0:j0 + h]] = DEAD if self.dtype == np.int8 else 0

    def _read_box(self, survey: int, region: tuple[slice, slice, slice], dst: np.ndarray) -> None:
        s = self.surveys[survey]
        reader = self._readers[survey]
        try:
            fill = s.copy_stored_into if self.dtype == np.int8 else s.normalise_into
            if reader is not None and self.cache_bytes:
                self._brick_cache().read_into(survey, reader, s.shape, region, dst, fill)
            elif reader is not None:
                reader.read_into(region, dst, fill)
            else:
                values = self._arrays[survey][region]
                fill(zero_nonfinite(values) if s.source_kind == "mdio" else values, dst)  # MDIO: NaN at holes
        except Exception as err:
            axes = ("inline", "crossline", "sample")
            where = ", ".join(f"{name} {r.start}:{r.stop}" for name, r in zip(axes, region))
            raise SFMError(f"reading survey {s.name} ({s.store_url}) region [{where}] (indices) failed: "
                           f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}; check the store "
                           f"is reachable (transient failures were retried for {self.retry_seconds:.0f} s)") from err

    def _brick_cache(self) -> BrickCache:
        """This process's :class:`BrickCache` (``cache_mb``), made on first use."""
        with self._lock:
            if self._cache is None:
                self._cache = BrickCache(self.cache_bytes)
            return self._cache

    def _read_tile(self, c: Crop, tile, view: np.ndarray, full: bool) -> None:
        s = self.surveys[c.survey]
        (a0, a1), (b0, b1), (t0, t1) = tile
        i0, j0, k0 = c.origin
        region = (slice(i0 + a0, i0 + a1), slice(j0 + b0, j0 + b1), slice(k0 + t0, k0 + t1))
        dst = view[a0:a1, b0:b1, t0:t1]
        self._read_box(c.survey, region, dst)
        if not full and self.dtype == np.int8:
            np.copyto(dst, DEAD, where=~s.trace_mask[i0 + a0 : i0 + a1, j0 + b0 : j0 + b1, None])
        elif not full:
            dst *= s.trace_mask[i0 + a0 : i0 + a1, j0 + b0 : j0 + b1, None]
        if self._negates(c):
            np.negative(dst, out=dst)

    def read(self, index: int, out: np.ndarray | None = None) -> np.ndarray:
        """Sample ``index`` as [1, *shape] ([1, D, H, W] without a slab) of ``dtype``, normalised."""
        out = np.empty((1, *self.shape), dtype=self.dtype) if out is None else out
        wait_all(self.submit(index, out))
        return out

    def read_many(self, indices: list[int], out: np.ndarray | None = None) -> np.ndarray:
        """Samples [len(indices), 1, *shape], read concurrently."""
        out = np.empty((len(indices), 1, *self.shape), dtype=self.dtype) if out is None else out
        wait_all([f for n, i in enumerate(indices) for f in self.submit(i, out[n])])
        return out

    def close(self) -> None:
        """Stop reading: queued reads are dropped, running ones stop retrying."""
        for store in self._stores:
            store.closed = True
        if self._pool is not None and self._pid == os.getpid():
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = None


def wait_all(futures: list[Future]) -> None:
    """Wait for all; on the first failure cancel the rest and raise it."""
    try:
        for f in futures:
            f.result()
    except BaseException:
        for f in futures:
            f.cancel()
        raise
