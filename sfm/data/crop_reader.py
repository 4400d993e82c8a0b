"""Crops to values: :class:`CropReader` fills the crops a plan names, from bricks, the brick cache or regions.

A crop is read as brick-aligned tiles on a thread pool, each tile normalised straight into its place
in the output batch, so many ranged reads are in flight at once and a 1024^3 crop never exists twice
in memory. Values are normalised per survey from the stored statistics: clipped to the 0.1/99.9
percentiles, then standardised with the stored mean and std; dead traces are 0. Bricks may come from
this process's brick cache (:mod:`sfm.data.brick_cache`), and a crop of a region plan is cut from its
region, decoded once for the whole node in the region pool (:mod:`sfm.data.region_pool`).
"""


from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from sfm.errors import SFMError

from sfm.data.brick_cache import BrickCache
from sfm.data.bricks import zero_nonfinite
from sfm.data.crops import Crop
from sfm.data.int8_batch import DEAD
from sfm.data.region_pool import RegionPool, region_bytes
from sfm.data.regions import Region, RegionPlan
from sfm.data.survey import Surveys

_TILE_VOXELS = 1 << 22  # largest tile read in one zarr call (16 MiB of float32)


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


def region_pool_for(plan: RegionPlan, data, node_ranks: int = 1) -> RegionPool:
    """The pool of decoded regions the ``node_ranks`` training processes of this node share (with their
    DataLoader workers): ``data.pool_mb``, or two regions per lane of the plan for each of them."""
    largest = max(region_bytes(g.extent, data.batch_dtype) for g in plan.grids)
    budget = int(data.pool_mb) * (1 << 20) or 2 * plan.lanes * largest * max(1, int(node_ranks))
    pool = RegionPool(data.pool_dir, budget)
    pool.keep = budget // largest + 8  # a map of every file: recycled files fault no page
    return pool


class CropReader:
    """Fills crops [1, *shape] of ``dtype`` from the surveys: :meth:`submit` one, :meth:`read` several.

    Args:
        surveys: the :class:`sfm.data.survey.Surveys` the crops' survey indices refer to.
        data: the checked ``JobConfig.data``: ``crop``; ``read_threads``: crops (tiles of large crops) read at
            once, each fetching its bricks concurrently, so about ``read_threads * bricks per tile`` requests
            are in flight; ``batch_dtype``: "float32" or "float16", the values normalised, or "int8" (int8
            stores only): the stored values, dead traces :data:`sfm.data.int8_batch.DEAD`, normalised on the
            device from each survey's :meth:`sfm.data.survey.SurveyInfo.affine`, which also carries an
            inverted crop's sign (:class:`sfm.data.int8_batch.Int8Batch`); ``cache_mb``: MiB of bricks kept
            normalised in memory in each process (:mod:`sfm.data.brick_cache`; brick-reader layouts), so
            surveys that fit are fetched, decoded and normalised once; the crops are the same. 0: none.
        slab: ``(start, stop)``: read and return only rows ``[start, stop)`` of axis 0 of each crop as
            delivered (after flips and swap), [1, stop - start, H, W], fetching only the bricks those rows
            need. The crops themselves do not change, so the context-parallel ranks of a group, each with its
            own slab (:func:`sfm.distributed.context_parallel.crop_slab`), read disjoint parts of the same
            crops. None: the whole crop.
        regions: the node's pool of decoded regions (:func:`region_pool_for`), where the crops of a region
            plan are cut from; None: every crop reads its own bricks.
    """

    def __init__(self, surveys: Surveys, data, slab: tuple[int, int] | None = None,
                 regions: RegionPool | None = None):
        self.surveys = surveys
        crop = tuple(int(c) for c in data.crop)
        if slab is not None:
            slab = (int(slab[0]), int(slab[1]))
            if not 0 <= slab[0] < slab[1] <= crop[0]:
                raise SFMError(f"slab {list(slab)} is not a range of the crop's {crop[0]} inline rows")
        self.slab = slab
        # what one read delivers: the slab's rows of the crop, or all of it
        self.shape = crop if slab is None else (slab[1] - slab[0], *crop[1:])
        self.dtype = np.dtype(data.batch_dtype)
        self.read_threads = int(data.read_threads)
        self.cache_bytes = int(data.cache_mb) << 20
        self.regions = regions
        self.copy_cpu = 0.0  # thread CPU seconds cutting crops out of regions
        self._cache: BrickCache | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pid: int | None = None  # the process the thread pool and the cache belong to
        self._lock = threading.Lock()

    # ---- processes: the thread pool and the brick cache are each process's own ------------------
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_pool=None, _cache=None, _lock=None, _pid=None, copy_cpu=0.0)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def pool(self) -> ThreadPoolExecutor:
        """This process's reading threads (the stores opened and retrying again after :meth:`close`)."""
        self.surveys.open()
        if self._pid != os.getpid():  # a fork: the parent's threads and cache are not here
            self._pool, self._cache, self._pid = None, None, os.getpid()
        if self._pool is None:
            self.surveys.retrying(True)
            self._pool = ThreadPoolExecutor(max_workers=self.read_threads, thread_name_prefix="sfm-read")
        return self._pool

    def cpu_stats(self) -> dict[str, float]:
        """Thread CPU seconds this process spent per phase: receive, decode, normalise (brick reader
        reads) and copy (crops cut out of pooled regions); the regions it built and reused; the brick
        cache's hits, misses and size (MiB)."""
        out = self.surveys.read_cpu()
        out["copy"] = self.copy_cpu
        cache = self._cache
        out.update(cache_hits=cache.hits if cache else 0, cache_misses=cache.misses if cache else 0,
                   cache_mb=cache.nbytes / 2**20 if cache else 0.0)
        pool = self.regions
        out.update(regions_built=pool.built if pool else 0, regions_reused=pool.reused if pool else 0)
        return out

    def _negates(self, c: Crop) -> bool:
        """Whether reading ``c`` negates its values: an inverted crop, except in int8 batches, where the
        sign travels in the sample's affine (:meth:`SurveyInfo.affine`)."""
        return c.invert and self.dtype != np.int8

    # ---- reading -------------------------------------------------------------------------------
    def submit(self, c: Crop, out: np.ndarray) -> list[Future]:
        """Start reading crop ``c`` (its slab, if set) into ``out`` [1, *shape] (or ``shape``) of ``dtype``;
        one future per tile (or region cut)."""
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
        per_brick = self.surveys.store(c.survey).range_reader is not None
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

        self.regions.use(RegionPool.name(s.identity, r, self.dtype), r.extent, self.dtype,
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
        reader = self.surveys.reader(survey)
        try:
            fill = s.copy_stored_into if self.dtype == np.int8 else s.normalise_into
            if reader is not None and self.cache_bytes:
                self._brick_cache().read_into(survey, reader, s.shape, region, dst, fill)
            elif reader is not None:
                reader.read_into(region, dst, fill)
            else:
                values = self.surveys.array(survey)[region]
                fill(zero_nonfinite(values) if s.source_kind == "mdio" else values, dst)  # MDIO: NaN at holes
        except Exception as err:
            axes = ("inline", "crossline", "sample")
            where = ", ".join(f"{name} {r.start}:{r.stop}" for name, r in zip(axes, region))
            retried = self.surveys.retry_seconds
            raise SFMError(f"reading survey {s.name} ({s.store_url}) region [{where}] (indices) failed: "
                           f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}; check the store "
                           f"is reachable (transient failures were retried for {retried:.0f} s)") from err

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

    def read(self, crops: list[Crop], out: np.ndarray | None = None) -> np.ndarray:
        """The crops [len(crops), 1, *shape] of ``dtype``, read concurrently."""
        out = np.empty((len(crops), 1, *self.shape), dtype=self.dtype) if out is None else out
        wait_all([f for n, c in enumerate(crops) for f in self.submit(c, out[n])])
        return out

    def close(self) -> None:
        """Stop reading: queued reads are dropped, running ones stop retrying."""
        self.surveys.retrying(False)
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
