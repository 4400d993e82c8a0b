"""Streaming random 3D crops from survey stores (local or s3://): the training loader.

Layers, bottom up:

- :class:`ResilientStore` wraps the zarr store of a survey (obstore or s3fs on S3, the local
  filesystem otherwise): transient failures (connection reset or refused, 5xx, throttling, timeouts)
  are retried with exponential backoff and jitter for up to ``retry_seconds``; it counts the bytes
  and requests it fetched. Nothing is copied to local disk.
- :class:`CropSampler` turns a sample index into a crop. Sample ``i`` is a pure function of
  ``(seed, epoch, i)``: its survey (weighted by live volume), its origin (optionally on the brick
  grid, so a crop reads whole bricks and nothing else), its augmentation, and hence its values.
  Origins are drawn uniformly among those whose live (``trace_mask``) fraction is at least
  ``min_live_fraction`` (found once, from a summed-area table), so no crop under it appears. Values are
  normalised per survey from the stored statistics: clipped to the 0.1/99.9 percentiles, then
  standardised with the stored mean and std; dead traces are 0. A crop is read as brick-aligned
  tiles on a thread pool, each tile normalised straight into its place in the output batch, so many
  ranged reads are in flight at once and a 1024^3 crop never exists twice in memory.
- :class:`CropDataset` (a torch ``IterableDataset``) is one rank's stream of batches
  ``[B, 1, D, H, W]``. Batch ``b`` of rank ``r`` holds samples ``(b * world_size + r) * B + [0, B)``;
  DataLoader worker ``w`` of ``n`` makes batches ``start + w, start + w + n, ...``, which the
  DataLoader hands out in order. So ranks and workers never share a sample, the sequence a rank sees
  does not depend on the number of workers, and a position is just ``(epoch, batch)``.
- :class:`BatchStream` is the loader a training loop consumes: a DataLoader over the dataset (worker
  processes, pinned memory when CUDA is present) with ``state_dict()`` / ``load_state_dict()`` for
  exact resume. :func:`training_stream` builds one from ``JobConfig.data``.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import random
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, NamedTuple

import numpy as np
import torch
from torch.utils.data import IterableDataset
from zarr.storage import WrapperStore

from sfm import storage
from sfm.bricks import BrickReader
from sfm.errors import SFMError
from sfm.s3_ranges import RangeReadError, S3RangeReader, reachable_directly

log = logging.getLogger(__name__)

_TILE_VOXELS = 1 << 22  # largest tile read in one zarr call (16 MiB of float32)
AUGMENTATIONS = ("flip_inline", "flip_crossline", "swap")
ALIGNMENTS = ("voxel", "brick")
CLIENTS = ("auto", "http", "obstore", "fsspec")


# --------------------------------------------------------------------------------------------
# the store: retries, byte counts, the S3 client


def is_transient(err: BaseException) -> bool:
    """True for failures worth retrying: connection resets/refusals, timeouts, 5xx and throttling.

    Missing objects, denied access, bad arguments and a server that cannot serve byte ranges are
    permanent: retrying cannot fix them.
    """
    if isinstance(err, RangeReadError):
        return err.transient
    if isinstance(err, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ValueError,
                        TypeError, KeyError, IndexError, AttributeError, NotImplementedError, MemoryError,
                        SFMError)):
        return False
    name = type(err).__name__
    if name in ("PermissionDeniedError", "UnauthenticatedError", "InvalidPathError", "NotSupportedError",
                "UnknownConfigurationKeyError", "NoCredentialsError", "PartialCredentialsError"):
        return False
    text = str(err)
    if _range_unsupported(err):
        return False
    if any(code in text for code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "NoSuchBucket")):
        return False
    return True


_SMALL_READS_KEPT = 4096
_SMALL_READ_BYTES = 64 << 10


def _index_sized(byte_range) -> bool:
    """True for a range read the size of a shard index: at most 64 KiB, at the start or the end."""
    from zarr.abc.store import RangeByteRequest, SuffixByteRequest

    if isinstance(byte_range, RangeByteRequest):
        return byte_range.start == 0 and byte_range.end <= _SMALL_READ_BYTES
    return isinstance(byte_range, SuffixByteRequest) and byte_range.suffix <= _SMALL_READ_BYTES


def _range_unsupported(err: BaseException) -> bool:
    """obstore refuses a 200 answer to a ranged GET (rclone serve s3 sends one)."""
    return "NotPartial" in str(err) or "non-partial response" in str(err)


class ResilientStore(WrapperStore):
    """A zarr store wrapper: retries transient read failures with backoff; counts what it fetched.

    Args:
        store: the zarr store to read through.
        label: names the survey in log lines.
        retry_seconds: how long a read may keep failing before the error is raised.
        fallback: makes a replacement store when this one's client cannot do ranged reads against
            this server (obstore against ``rclone serve s3``); reads continue on the replacement.
    """

    def __init__(self, store, label: str = "", retry_seconds: float = 120.0, fallback=None):
        super().__init__(store)
        self.label = label
        self.retry_seconds = float(retry_seconds)
        self.fallback = fallback
        self.bytes_fetched = 0
        self.requests = 0
        self.retries = 0
        self.closed = False  # set by CropSampler.close: reads still running stop retrying
        self._count_lock = threading.Lock()
        # bricks: blocking ranged GETs on the reading thread (sfm.s3_ranges), keys under range_prefix;
        # None: every read goes through the zarr store
        self.range_reader: S3RangeReader | None = None
        self.range_prefix = ""
        # shard indexes (a small range at the start or end of a shard object): published stores never
        # change, so each is fetched once instead of once per crop
        self._small_reads: collections.OrderedDict = collections.OrderedDict()

    def _with_store(self, store):
        clone = type(self)(store, self.label, self.retry_seconds, self.fallback)
        clone.range_reader, clone.range_prefix = self.range_reader, self.range_prefix
        return clone

    async def _retrying(self, call):
        deadline = time.monotonic() + self.retry_seconds
        attempt = 0
        while True:
            store = self._store
            try:
                return await call(store)
            except Exception as err:
                if _range_unsupported(err) and (store is not self._store or self.fallback is not None):
                    if store is self._store:  # the first read to find out switches; the others just retry
                        log.warning("%s: the server cannot serve byte ranges to this client (%s); reading "
                                    "through the fallback client", self.label, type(store).__name__)
                        self._store, self.fallback = self.fallback(), None
                    continue
                attempt += 1
                await asyncio.sleep(self._retry_delay(err, attempt, deadline))

    def _retry_delay(self, err: Exception, attempt: int, deadline: float) -> float:
        """Seconds to wait before retry ``attempt`` (1, 2, ...) after ``err``; re-raises ``err`` when it
        is permanent, the deadline has passed or the store was closed."""
        now = time.monotonic()
        if not is_transient(err) or now >= deadline or self.closed:
            raise err
        self.retries += 1
        if attempt == 1:
            log.warning("%s: transient read failure (%s: %s); retrying for up to %.0f s", self.label,
                        type(err).__name__, str(err).splitlines()[0][:600] if str(err) else "", deadline - now)
        delay = min(5.0, 0.05 * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
        return min(delay, max(0.0, deadline - now))

    def read_range_into(self, key: str, start: int, end: int, out: np.ndarray) -> np.ndarray | None:
        """Blocking, on the calling thread: bytes ``[start, end)`` of ``key`` (relative to this store) as
        a view of the uint8 buffer ``out`` through :attr:`range_reader`; None when the object does not
        exist. Retried and counted like :meth:`get`."""
        deadline = time.monotonic() + self.retry_seconds
        attempt = 0
        while True:
            try:
                got = self.range_reader.read_into(self.range_prefix + key, start, end, out)
                break
            except Exception as err:
                attempt += 1
                time.sleep(self._retry_delay(err, attempt, deadline))
        self._count(got)
        return got

    def _count(self, buf) -> None:
        with self._count_lock:
            self.requests += 1
            if buf is not None:
                self.bytes_fetched += len(buf)

    async def get(self, key, prototype, byte_range=None):
        small = _index_sized(byte_range)
        if small:
            hit = self._small_reads.get((key, byte_range))
            if hit is not None:
                self._small_reads.move_to_end((key, byte_range))
                return hit
        buf = await self._retrying(lambda s: s.get(key, prototype, byte_range))
        self._count(buf)
        if small and buf is not None:
            self._small_reads[(key, byte_range)] = buf
            if len(self._small_reads) > _SMALL_READS_KEPT:
                self._small_reads.popitem(last=False)
        return buf

    async def get_partial_values(self, prototype, key_ranges):
        key_ranges = list(key_ranges)
        bufs = await self._retrying(lambda s: s.get_partial_values(prototype, key_ranges))
        for buf in bufs:
            self._count(buf)
        return bufs


def _obstore_available() -> bool:
    try:
        import obstore  # noqa: F401
    except ImportError:
        return False
    return True


def _obstore_zarr_store(url: str):
    """A read-only zarr ObjectStore over obstore's S3Store for ``s3://bucket/prefix``."""
    import datetime as dt

    import zarr.storage
    from obstore.store import S3Store

    bucket, _, prefix = url[len("s3://"):].partition("/")
    endpoint = storage.s3_endpoint_url()
    config: dict[str, Any] = {"region": os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
                              or "us-east-1"}
    client: dict[str, Any] = {"connect_timeout": "5s", "timeout": "30s", "pool_idle_timeout": "20s"}
    if endpoint:
        config["endpoint"] = endpoint
        client["allow_http"] = endpoint.startswith("http://")
    provider = None
    if not os.environ.get("AWS_ACCESS_KEY_ID") and (os.environ.get("AWS_PROFILE") or
                                                     os.path.exists(os.path.expanduser("~/.aws/credentials"))):
        from obstore.auth.boto3 import Boto3CredentialProvider  # profiles: obstore's own chain lacks them

        provider = Boto3CredentialProvider()
    retry = {"max_retries": 2, "retry_timeout": dt.timedelta(seconds=10),
             "backoff": {"init_backoff": dt.timedelta(milliseconds=50), "max_backoff": dt.timedelta(seconds=1)}}
    s3 = S3Store(bucket, prefix=prefix or None, config=config, client_options=client, retry_config=retry,
                 credential_provider=provider)
    return zarr.storage.ObjectStore(s3, read_only=True)


def _fsspec_zarr_store(url: str):
    """A read-only zarr FsspecStore over s3fs, with its own retries kept short (ours wrap it)."""
    import zarr.storage

    options = storage.s3_storage_options()
    options["config_kwargs"] = {**options.get("config_kwargs", {}), "retries": {"max_attempts": 2, "mode": "standard"}}
    store = zarr.storage.FsspecStore.from_url(url, storage_options=options, read_only=True)
    store.fs.retries = 1  # s3fs's own retry loop (a class attribute; this instance is ours: its options differ)
    return store


def open_survey_store(store_url: str, client: str = "auto", retry_seconds: float = 120.0) -> ResilientStore:
    """The zarr store to read survey ``store_url`` through (see :class:`ResilientStore`).

    ``client`` (S3 only; local paths ignore it):

    - "http": bricks by :class:`sfm.s3_ranges.S3RangeReader` (ranged GETs into the reading thread's
      buffer: the least CPU per GB), metadata and shard indexes as "auto" reads them;
    - "obstore" (Rust) or "fsspec" (s3fs): everything through that client;
    - "auto": "http" unless a proxy is configured for the endpoint; the rest through obstore when
      installed, falling back to s3fs when the server cannot serve byte ranges to obstore.
    """
    if client not in CLIENTS:
        raise SFMError(f"data.client = {client!r} is not a client; use one of {', '.join(CLIENTS)}")
    url = storage.normalize(store_url)
    if not storage.is_s3(url):
        return ResilientStore(storage.zarr_store(url, read_only=True), url, retry_seconds)
    if client == "obstore" and not _obstore_available():
        raise SFMError("data.client = 'obstore' but obstore is not installed; pip install obstore or use 'auto'")
    if client == "fsspec" or (client != "obstore" and not _obstore_available()):
        store = ResilientStore(_fsspec_zarr_store(url), url, retry_seconds)
    else:
        fallback = (lambda: _fsspec_zarr_store(url)) if client != "obstore" else None
        store = ResilientStore(_obstore_zarr_store(url), url, retry_seconds, fallback)
    if client == "http" or (client == "auto" and reachable_directly(storage.s3_endpoint_url())):
        bucket, _, prefix = url[len("s3://"):].partition("/")
        store.range_reader = S3RangeReader(bucket)
        store.range_prefix = prefix.rstrip("/") + "/" if prefix else ""
    return store


# --------------------------------------------------------------------------------------------
# surveys and crops


@dataclass
class SurveyInfo:
    """What the sampler needs to know about one survey; small enough to send to worker processes."""

    store_url: str
    name: str
    shape: tuple[int, int, int]  # (IL, XL, NS)
    bricks: tuple[int, int, int]  # the read unit: chunk shape (the inner chunk when sharded)
    trace_mask: np.ndarray  # [IL, XL] bool
    live_cells: np.ndarray  # [IL+1, XL+1] summed-area table of trace_mask
    clip: tuple[float, float]  # stored 0.1 / 99.9 percentiles (amplitude units)
    mean: float
    std: float
    scale: float = 1.0  # amplitude = stored * scale + offset (float16 stores; identity for float32)
    offset: float = 0.0

    def normalise_into(self, stored: np.ndarray, dst: np.ndarray) -> None:
        """``dst = (clip(amplitude, p0.1, p99.9) - mean) / std`` from stored values, in three passes:
        the clip is done in stored units (the decode is increasing), decode and standardise fold into
        one multiply-add. (Cutting the passes into cache-sized blocks, or two passes through torch,
        saved under 0.05 s of CPU per GB: a brick just decoded is still in the L3 cache.)"""
        lo, hi = ((c - self.offset) / self.scale for c in self.clip)
        np.clip(stored, lo, hi, out=dst, casting="unsafe")
        dst *= np.float32(self.scale / self.std)
        dst += np.float32((self.offset - self.mean) / self.std)

    def live_traces(self, i0: int, j0: int, d: int, h: int) -> int:
        t = self.live_cells
        return int(t[i0 + d, j0 + h] - t[i0, j0 + h] - t[i0 + d, j0] + t[i0, j0])

    def crop_origins(self, d: int, h: int, min_live_fraction: float, step: tuple[int, int]) -> "CropOrigins":
        """Every (inline, crossline) origin on the ``step`` grid whose d x h window of traces is at
        least ``min_live_fraction`` live, from the summed-area table in one vectorised pass."""
        t = self.live_cells
        a, b = step
        n_i, n_j = (self.shape[0] - d) // a + 1, (self.shape[1] - h) // b + 1
        i, j = np.arange(n_i)[:, None] * a, np.arange(n_j)[None, :] * b
        live = t[i + d, j + h] - t[i, j + h] - t[i + d, j] + t[i, j]
        return CropOrigins(live >= min_live_fraction * d * h - 1e-9, step)


class CropOrigins:
    """The allowed origins of one survey as a bool grid; ``pick(r)`` is the r-th allowed one, so an
    origin is drawn uniformly among them with one integer draw (no rejection loop that can run out)."""

    def __init__(self, allowed: np.ndarray, step: tuple[int, int]):
        self.allowed = allowed  # [n_i, n_j] bool
        self.step = step
        self.before_row = np.concatenate([[0], np.cumsum(allowed.sum(axis=1))])  # allowed origins in rows < i
        self.count = int(self.before_row[-1])

    def pick(self, r: int) -> tuple[int, int]:
        i = int(np.searchsorted(self.before_row, r, side="right")) - 1
        j = int(np.flatnonzero(self.allowed[i])[r - self.before_row[i]])
        return i * self.step[0], j * self.step[1]


def read_survey_info(store_url: str, store=None) -> tuple[SurveyInfo, Any]:
    """The survey's :class:`SurveyInfo` and its opened ``amplitude`` zarr array."""
    import zarr

    store = store if store is not None else open_survey_store(store_url)
    try:
        group = zarr.open_group(store, mode="r")
        attrs = dict(group.attrs)
        amp = group["amplitude"]
        mask = np.asarray(group["trace_mask"][...], dtype=bool)
    except (FileNotFoundError, KeyError) as err:
        raise SFMError(f"survey store {store_url} does not exist or is incomplete ({type(err).__name__}: {err}); "
                       "ingest the survey first") from err
    except Exception as err:
        raise SFMError(f"cannot open survey store {store_url}: {type(err).__name__}: {err}; check the URL, the "
                       "S3 endpoint and credentials") from err
    from sfm.contracts import read_store_attrs

    read_store_attrs(attrs, f"survey store {store_url}")  # the survey_store contract, checked on read
    stats = attrs.get("stats")
    if not stats or "percentiles" not in stats:
        raise SFMError(f"survey store {store_url} has no statistics in its attributes; re-ingest the survey")
    table = np.zeros((mask.shape[0] + 1, mask.shape[1] + 1), dtype=np.int32 if mask.size < 2**31 else np.int64)
    table[1:, 1:] = mask.cumsum(0, dtype=table.dtype).cumsum(1, dtype=table.dtype)
    pct = stats["percentiles"]
    transform = attrs.get("amplitude_transform") or {}
    amp_attrs = dict(amp.attrs)
    scale = float(transform.get("scale", amp_attrs.get("scale_factor", 1.0)))
    offset = float(transform.get("offset", amp_attrs.get("add_offset", 0.0)))
    info = SurveyInfo(
        store_url=store_url, name=str(attrs.get("name") or attrs.get("survey_id") or store_url),
        shape=tuple(int(n) for n in amp.shape), bricks=tuple(int(n) for n in amp.chunks), trace_mask=mask,
        live_cells=table, clip=(float(pct["0.1"]), float(pct["99.9"])), mean=float(stats["mean"]),
        std=float(stats["std"]) or 1.0, scale=scale, offset=offset,
    )
    return info, amp


class Crop(NamedTuple):
    """Where sample ``i`` comes from. The source region is ``origin + extent`` of survey ``survey``;
    the crop is that region flipped along inline/crossline as drawn, then transposed if ``swap``."""

    survey: int
    origin: tuple[int, int, int]
    extent: tuple[int, int, int]
    flip_inline: bool = False
    flip_crossline: bool = False
    swap: bool = False

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
            when the crop's D == H, otherwise the crop's shape would change).
        client, retry_seconds: see :func:`open_survey_store`.
        brick_reader: read through :mod:`sfm.bricks` where the store layout allows (a third less CPU
            than zarr's read path); False: always through zarr.
        slab: ``(start, stop)``: read and return only rows ``[start, stop)`` of axis 0 of each crop
            as delivered (after flips and swap), [1, stop - start, H, W], fetching only the bricks
            those rows need. The crops themselves (``locate``) do not change, so the context-parallel
            ranks of a group, each with its own slab (:func:`sfm.context_parallel.crop_slab`), read
            disjoint parts of the same crops. None: the whole crop.
    """

    def __init__(self, store_urls: list[str], crop: tuple[int, int, int], seed: int = 0,
                 min_live_fraction: float = 0.5, read_threads: int = 8, *, epoch: int = 0, align: str = "voxel",
                 augment: Iterable[str] = (), client: str = "auto", retry_seconds: float = 120.0,
                 brick_reader: bool = True, slab: tuple[int, int] | None = None):
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
        self.client, self.retry_seconds = client, float(retry_seconds)
        self.brick_reader = bool(brick_reader)
        self._stores: list[ResilientStore] = []
        self._arrays: list[Any] = []
        infos = []
        for url in store_urls:
            store = open_survey_store(url, client, retry_seconds)
            info, amp = read_survey_info(url, store)
            infos.append(info)
            self._stores.append(store)
            self._arrays.append(amp)
        fits = [all(n >= c for n, c in zip(s.shape, self.crop)) for s in infos]
        if not any(fits):
            shapes = ", ".join(f"{s.store_url}: {s.shape}" for s in infos)
            raise SFMError(f"every survey is smaller than the crop {self.crop} ({shapes}); set data.crop smaller")
        self.surveys = [s for s, ok in zip(infos, fits) if ok]
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

    # ---- processes: the live handles are reopened in each process that reads ----------------
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_stores=[], _arrays=[], _readers=[], _pool=None, _lock=None, _pid=None)
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
                    self._arrays.append(zarr.open_group(store, mode="r")["amplitude"])
                except Exception as err:
                    raise SFMError(f"cannot reopen survey store {s.store_url}: {type(err).__name__}: {err}; check "
                                   "the S3 endpoint is reachable") from err
                self._stores.append(store)
            self._readers = self._brick_readers()
            self._pool = None
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

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    # ---- where sample i comes from -------------------------------------------------------------
    def locate(self, index: int) -> Crop:
        """The :class:`Crop` of sample ``index``: a pure function of (seed, epoch, index)."""
        rng = np.random.default_rng([self.seed, self.epoch, int(index)])
        k = int(rng.choice(len(self.surveys), p=self.weights))
        s, origins = self.surveys[k], self.origins[k]
        i0, j0 = origins.pick(int(rng.integers(0, origins.count)))
        a = self._step(s)[2]
        t0 = int(rng.integers(0, (s.shape[2] - self.crop[2]) // a + 1)) * a
        swap, flip_il, flip_xl = (bool(v) for v in rng.integers(0, 2, size=3))
        return Crop(k, (i0, j0, t0), self.crop, "flip_inline" in self.augment and flip_il,
                    "flip_crossline" in self.augment and flip_xl, self.swap_allowed and swap)

    def _step(self, s: SurveyInfo) -> tuple[int, int, int]:
        return s.bricks if self.align == "brick" else (1, 1, 1)

    # ---- reading -------------------------------------------------------------------------------
    def submit(self, index: int, out: np.ndarray) -> list[Future]:
        """Start reading sample ``index`` (its slab, if set) into ``out`` [1, *shape] (or ``shape``)
        float32; one future per tile."""
        c = self.locate(index)
        if self.slab is not None:
            c = c.slab(*self.slab)
        s = self.surveys[c.survey]
        if out.size != int(np.prod(self.shape)) or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"out must be contiguous float32 holding {self.shape}, got {out.dtype} {out.shape}")
        view = out.reshape(c.shape)  # a view, since out is contiguous
        if c.swap:  # view[i, j, t] addresses the source voxel (origin + (i, j, t))
            view = view.transpose(1, 0, 2)
        view = view[:: -1 if c.flip_inline else 1, :: -1 if c.flip_crossline else 1]
        full = s.live_traces(c.origin[0], c.origin[1], c.extent[0], c.extent[1]) == c.extent[0] * c.extent[1]
        pool = self.pool
        # a blocking range reader reads a tile's bricks one after another: one brick per tile keeps
        # read_threads requests in flight
        per_brick = self._stores[c.survey].range_reader is not None
        tiles = brick_tiles(c.origin, c.extent, s.bricks, int(np.prod(s.bricks)) if per_brick else None)
        return [pool.submit(self._read_tile, c, tile, view, full) for tile in tiles]

    def _read_tile(self, c: Crop, tile, view: np.ndarray, full: bool) -> None:
        s = self.surveys[c.survey]
        (a0, a1), (b0, b1), (t0, t1) = tile
        i0, j0, k0 = c.origin
        region = (slice(i0 + a0, i0 + a1), slice(j0 + b0, j0 + b1), slice(k0 + t0, k0 + t1))
        dst = view[a0:a1, b0:b1, t0:t1]
        reader = self._readers[c.survey]
        try:
            if reader is not None:
                reader.read_into(region, dst, s.normalise_into)
            else:
                s.normalise_into(self._arrays[c.survey][region], dst)
        except Exception as err:
            axes = ("inline", "crossline", "sample")
            where = ", ".join(f"{name} {r.start}:{r.stop}" for name, r in zip(axes, region))
            raise SFMError(f"reading survey {s.name} ({s.store_url}) region [{where}] (indices) failed: "
                           f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}; check the store "
                           f"is reachable (transient failures were retried for {self.retry_seconds:.0f} s)") from err
        if not full:
            dst *= s.trace_mask[i0 + a0 : i0 + a1, j0 + b0 : j0 + b1, None]

    def read(self, index: int, out: np.ndarray | None = None) -> np.ndarray:
        """Sample ``index`` as float32 [1, *shape] ([1, D, H, W] without a slab), normalised."""
        out = np.empty((1, *self.shape), dtype=np.float32) if out is None else out
        _wait(self.submit(index, out))
        return out

    def read_many(self, indices: list[int], out: np.ndarray | None = None) -> np.ndarray:
        """Samples [len(indices), 1, *shape], read concurrently."""
        out = np.empty((len(indices), 1, *self.shape), dtype=np.float32) if out is None else out
        _wait([f for n, i in enumerate(indices) for f in self.submit(i, out[n])])
        return out

    def close(self) -> None:
        """Stop reading: queued reads are dropped, running ones stop retrying."""
        for store in self._stores:
            store.closed = True
        if self._pool is not None and self._pid == os.getpid():
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = None


def _wait(futures: list[Future]) -> None:
    """Wait for all; on the first failure cancel the rest and raise it."""
    try:
        for f in futures:
            f.result()
    except BaseException:
        for f in futures:
            f.cancel()
        raise


# --------------------------------------------------------------------------------------------
# batches for one rank, split across DataLoader workers


class CropDataset(IterableDataset):
    """One rank's stream of batches, float32 tensors [B, 1, D, H, W] (use ``DataLoader(batch_size=None)``);
    [B, 1, stop - start, H, W] when the sampler reads a slab. ``rank`` and ``world_size`` are the
    data-parallel ones: the context-parallel ranks of a group share them and differ in the slab.

    Batch ``b`` holds samples ``(b * world_size + rank) * batch_size + [0, batch_size)`` of the
    sampler's ``(seed, epoch)`` stream. Iteration starts at ``start_batch`` and, if ``num_batches``
    is set, ends before batch ``num_batches`` (one epoch); otherwise it never ends. Under a DataLoader
    with ``n`` workers, worker ``w`` makes batches ``start_batch + w + k * n``; the DataLoader
    returns them in order, so the sequence is the same for any ``n``.

    Each worker keeps ``prefetch`` batches reading ahead of the one it hands over.
    """

    def __init__(self, sampler: CropSampler, batch_size: int, rank: int = 0, world_size: int = 1, *,
                 start_batch: int = 0, num_batches: int | None = None, prefetch: int = 2):
        super().__init__()
        if batch_size < 1:
            raise SFMError(f"data.batch_size = {batch_size} must be at least 1")
        if not 0 <= rank < world_size:
            raise SFMError(f"rank {rank} is outside a world of {world_size} processes")
        self.sampler = sampler
        self.batch_size, self.rank, self.world_size = int(batch_size), int(rank), int(world_size)
        self.start_batch = int(start_batch)
        self.num_batches = None if num_batches is None else int(num_batches)
        self.prefetch = max(0, int(prefetch))

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def sample_indices(self, batch: int) -> range:
        first = (batch * self.world_size + self.rank) * self.batch_size
        return range(first, first + self.batch_size)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.start_batch}

    def load_state_dict(self, state: dict) -> None:
        self.set_epoch(int(state.get("epoch", 0)))
        self.start_batch = int(state["batch"])

    def worker_batches(self, worker: int = 0, workers: int = 1) -> Iterable[int]:
        """The batch numbers DataLoader worker ``worker`` of ``workers`` makes, in order."""
        first = self.start_batch + worker
        if self.num_batches is None:
            return itertools.count(first, workers)
        return range(first, self.num_batches, workers)

    def _start(self, batch: int, buffers: "_BatchBuffers | None") -> tuple[torch.Tensor, list[Future]]:
        shape = (self.batch_size, 1, *self.sampler.shape)
        if buffers is None:  # a worker's batch goes to the main process by handle, not by copy
            out = _shared_empty(shape)
        else:
            out = torch.from_numpy(buffers.take())
        arr = out.numpy()
        futures = [f for n, i in enumerate(self.sample_indices(batch)) for f in self.sampler.submit(i, arr[n])]
        return out, futures

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        pending: collections.deque = collections.deque()
        buffers = None if info is not None else _BatchBuffers((self.batch_size, 1, *self.sampler.shape),
                                                              keep=self.prefetch + 4)
        try:
            for batch in self.worker_batches(worker, workers):
                pending.append(self._start(batch, buffers))
                if len(pending) > self.prefetch:
                    out, futures = pending.popleft()
                    _wait(futures)
                    yield out
            while pending:
                out, futures = pending.popleft()
                _wait(futures)
                yield out
        finally:
            for _, futures in pending:
                for f in futures:
                    f.cancel()


def _shared_empty(shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised float32 tensor in shared memory. ``torch.empty().share_memory_()`` would
    allocate private memory and copy it over: 2.3 against 1.5 s of CPU per GB in page faults."""
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
    if new_shared is None:
        return torch.empty(shape, dtype=torch.float32).share_memory_()
    return torch.empty(0, dtype=torch.float32).set_(new_shared(4 * int(np.prod(shape)))).view(shape)


class _BatchBuffers:
    """Batch arrays for one in-process stream, each reused once no tensor is left that uses it.

    A fresh 64 MB batch costs the kernel a page fault and a zeroed page per 4 KiB on first touch:
    0.75 s of CPU per GB delivered, a fifth of the loader's CPU (benchmarks/stream.py). A batch is
    handed out as ``torch.from_numpy(array)``: every tensor and view of it keeps the array alive
    through their shared storage, so the array's reference count says when it is free again. At
    most ``keep`` arrays are kept; past that (a consumer holding many batches) arrays are fresh.
    """

    def __init__(self, shape: tuple[int, ...], keep: int):
        self.shape, self.keep = shape, keep
        self.arrays: list[np.ndarray] = []

    def take(self) -> np.ndarray:
        for n in range(len(self.arrays)):
            if sys.getrefcount(self.arrays[n]) == 2:  # the list's reference and the call's: free
                return self.arrays[n]
        array = np.empty(self.shape, dtype=np.float32)
        if len(self.arrays) < self.keep:
            self.arrays.append(array)
        return array


# --------------------------------------------------------------------------------------------
# the loader a training loop consumes


class BatchStream:
    """``next(stream)`` -> float32 tensor [B, 1, D, H, W] ([B, 1, stop - start, H, W] for a slab),
    pinned when CUDA is present.

    A DataLoader over a :class:`CropDataset` with ``workers`` processes (0: read in this process on
    the sampler's threads). Workers are started with ``forkserver``: S3 clients (obstore's runtime,
    aiohttp sessions) do not survive a fork of a process that has used them.

    ``state_dict()`` is ``{"epoch", "batch", ...}``, the next batch this stream will return;
    ``load_state_dict`` continues from there, with exactly the batches an uninterrupted stream
    would have returned, whatever the number of workers.
    """

    def __init__(self, dataset: CropDataset, workers: int = 0, pin_memory: bool | None = None):
        self.dataset = dataset
        self.workers = max(0, int(workers))
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self.batch = dataset.start_batch
        self._iter = None

    @property
    def sampler(self) -> CropSampler:
        return self.dataset.sampler

    def _loader(self):
        kwargs: dict[str, Any] = {}
        if self.workers:
            import functools
            import multiprocessing

            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(["sfm.data"])
            kwargs = {"multiprocessing_context": ctx, "prefetch_factor": 2,
                      "worker_init_fn": functools.partial(_adopt_environment, dict(os.environ))}
        return torch.utils.data.DataLoader(self.dataset, batch_size=None, num_workers=self.workers,
                                           pin_memory=self.pin_memory, **kwargs)

    def __iter__(self) -> "BatchStream":
        return self

    def __next__(self) -> torch.Tensor:
        if self._iter is None:
            self.dataset.start_batch = self.batch
            self._iter = iter(self._loader())
        try:
            out = next(self._iter)
        except StopIteration:
            self._iter = None
            raise
        except SFMError as err:  # from a worker: the message carries the worker's traceback; keep the error
            raise SFMError(str(err).rsplit("SFMError: ", 1)[-1]) from None
        self.batch += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.dataset.epoch, "batch": self.batch, "seed": self.sampler.seed,
                "rank": self.dataset.rank, "world_size": self.dataset.world_size}

    def load_state_dict(self, state: dict) -> None:
        """Continue at ``state["batch"]`` of ``state["epoch"]`` (restarts the workers if running)."""
        if "seed" in state and int(state["seed"]) != self.sampler.seed:
            raise SFMError(f"the saved data position is for seed {state['seed']}, this stream has seed "
                           f"{self.sampler.seed}; resume with the same data.seed")
        self._shutdown()
        self.dataset.set_epoch(int(state.get("epoch", 0)))
        self.batch = int(state["batch"] if "batch" in state else state["step"])  # "step": older checkpoints

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` at its first batch."""
        self.load_state_dict({"epoch": epoch, "batch": 0})

    def _shutdown(self) -> None:
        it, self._iter = self._iter, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()

    def close(self) -> None:
        self._shutdown()
        self.sampler.close()


def _adopt_environment(environ: dict[str, str], worker_id: int) -> None:
    """Give a worker the environment of the process that started it (S3 endpoint, credentials), as a
    spawned process would have: forkserver children inherit the server's, fixed when it started."""
    os.environ.clear()
    os.environ.update(environ)


def training_stream(store_urls: list[str], data_cfg, rank: int = 0, world_size: int = 1,
                    start_batch: int = 0, slab: tuple[int, int] | None = None) -> BatchStream:
    """The :class:`BatchStream` data-parallel rank ``rank`` of ``world_size`` trains on, configured by
    ``JobConfig.data``. Under context parallelism every cp rank of a dp group passes the group's dp
    rank and its own ``slab`` (``(s.start, s.stop)`` of :func:`sfm.context_parallel.crop_slab`): the
    group trains on the same crops, each rank reading only its rows of them."""
    sampler = CropSampler(
        store_urls, tuple(data_cfg.crop), seed=data_cfg.seed, min_live_fraction=data_cfg.min_live_fraction,
        read_threads=data_cfg.read_threads, align=data_cfg.align,
        augment=[a.strip() for a in data_cfg.augment.split(",")], client=data_cfg.client,
        retry_seconds=data_cfg.retry_seconds, slab=slab,
    )
    dataset = CropDataset(sampler, data_cfg.batch_size, rank, world_size, start_batch=start_batch,
                          prefetch=data_cfg.prefetch)
    return BatchStream(dataset, workers=data_cfg.workers)
