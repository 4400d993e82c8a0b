"""Many crops per fetched region: the region plan (:class:`RegionPlan`) and the node's pool of decoded
regions (:class:`RegionPool`).

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

The pool is a directory in shared memory (``/dev/shm``): one ``.npy`` file per decoded region, named by
a digest of the survey's identity, the region's draw and box, and the value type. A process that needs a region
that is not there takes its lock file (``O_EXCL``), builds the region in a temporary file and renames
it into place; the others wait for it. A lock whose process died is taken over; files are evicted
oldest first past ``data.pool_mb``. A region is never seen half-written, and since every file is a
pure function of its name, a reader cannot tell who built it.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from sfm.errors import SFMError

log = logging.getLogger(__name__)

POOL_VERSION = 1  # part of every region's file name: a new pool layout never reads an old file


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
        window = self.allowed[lo_i:hi_i, lo_j:hi_j]
        flat = np.flatnonzero(window)
        r = int(flat[rng.integers(0, flat.size)])
        i, j = divmod(r, window.shape[1])
        a_t = self.step[2]
        t_lo = -(-region.origin[2] // a_t)
        t_hi = (region.origin[2] + region.extent[2] - self.crop[2]) // a_t
        t = int(rng.integers(t_lo, t_hi + 1)) * a_t
        return (int(lo_i + i) * self.step[0], int(lo_j + j) * self.step[1], t)


class RegionPlan:
    """Which region, and where in it, each sample comes from (see the module docstring).

    Args:
        surveys: the sampler's :class:`sfm.data.survey.SurveyInfo` list; ``origins``: their allowed crop
            origins (:class:`sfm.data.survey.CropOrigins`), ``weights``: survey probabilities.
        crop: (D, H, W); ``step``: the crop-origin grid along each axis (1s, or the bricks when aligned).
        crops_per_region: k >= 2; ``region_bricks``: the region in bricks; ``lanes``: regions in flight.
        batch_size, world_size: the data-parallel geometry the sample indices are laid out for.
    """

    def __init__(self, surveys, origins, weights, crop, steps, crops_per_region: int, region_bricks,
                 lanes: int, batch_size: int, world_size: int):
        self.k = int(crops_per_region)
        self.batch_size, self.world_size = int(batch_size), int(world_size)
        self.lanes = max(int(lanes) or self.batch_size, self.batch_size)
        self.weights = weights
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
        """The region named by ``anchor``: a survey by weight, then a box within it."""
        rng = np.random.default_rng([seed, epoch, int(anchor)])
        survey = int(rng.choice(len(self.grids), p=self.weights))
        origin, extent = self.grids[survey].draw(rng)
        return Region(survey, origin, extent, (int(seed), int(epoch), int(anchor)))


def region_bytes(extent, dtype) -> int:
    return int(np.prod(extent)) * np.dtype(dtype).itemsize


def default_pool_dir() -> str:
    """``/dev/shm/sfm-regions`` where shared memory is mounted, else under the temp dir."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return str(base / "sfm-regions")


class RegionPool:
    """Decoded regions as read-only arrays shared by the processes of a node (see the module docstring).

    Args:
        directory: the pool's directory (created); "" for :func:`default_pool_dir`.
        budget_bytes: files are evicted, oldest first, while the pool holds more than this.
        wait_seconds: how long to wait for another process building a region before building it here.
    """

    def __init__(self, directory: str, budget_bytes: int, wait_seconds: float = 300.0):
        self.directory = Path(directory or default_pool_dir())
        self.budget_bytes = int(budget_bytes)
        self.wait_seconds = float(wait_seconds)
        self.built = 0  # regions this process built (fetched)
        self.reused = 0  # regions found in the pool (each counted once per process while mapped here)
        self._mapped: OrderedDict[str, np.ndarray] = OrderedDict()  # this process's open maps
        self._keep = 64
        self._lock = threading.Lock()
        self._warned = False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise SFMError(f"cannot create the region pool {self.directory}: {err}; set data.pool_dir to a "
                           "writable directory (shared memory: /dev/shm)") from err

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_mapped=OrderedDict(), _lock=None, built=0, reused=0)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @staticmethod
    def name(identity: str, region: Region, dtype) -> str:
        """The file name of ``region`` of the survey ``identity`` decoded as ``dtype``. It includes the
        draw: two anchors that happen to draw one box fetch it twice (rare on a survey of many regions),
        so a region's fetches are exactly the plan's, whatever the survey's size."""
        text = f"v{POOL_VERSION}|{identity}|{region.draw}|{region.origin}|{region.extent}|{np.dtype(dtype).str}"
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def get(self, name: str, shape: tuple[int, ...], dtype, build: Callable[[np.ndarray], None]) -> np.ndarray:
        """The region file ``name`` as a read-only array [*shape]; ``build(array)`` fills it when no
        process has: called here at most once, in a private array when the pool has no room."""
        with self._lock:
            hit = self._mapped.get(name)
            if hit is not None:
                self._mapped.move_to_end(name)
                return hit
        ready = self.directory / f"{name}.npy"
        lock = self.directory / f"{name}.lock"
        waited_since = None
        while True:
            array = self._open(ready)
            if array is not None:
                return self._remember(name, array, reused=True)
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if self._stale(lock):
                    _unlink(lock)
                    continue
                waited_since = waited_since or time.monotonic()
                if time.monotonic() - waited_since > self.wait_seconds:
                    log.warning("region pool: %s has been locked for %.0f s; building it in this process",
                                lock, self.wait_seconds)
                    return self._private(shape, dtype, build)
                time.sleep(0.002)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(f"{os.getpid()} {time.time():.3f}")
            try:
                array = self._open(ready)  # built by the previous holder between our look and our lock
                if array is not None:
                    return self._remember(name, array, reused=True)
                return self._remember(name, self._build(name, ready, shape, dtype, build))
            finally:
                _unlink(lock)

    def _build(self, name, ready: Path, shape, dtype, build) -> np.ndarray:
        nbytes = region_bytes(shape, dtype)
        self._make_room(nbytes)
        tmp = self.directory / f"{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            array = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=tuple(shape))
            build(array)
            array.flush()
            os.replace(tmp, ready)
        except OSError as err:
            _unlink(tmp)
            if err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM):
                raise
            if not self._warned:
                self._warned = True
                log.warning("region pool %s is full (%s); regions are decoded per process. Give the node "
                            "more shared memory or set data.pool_dir / data.pool_mb", self.directory, err)
            return self._private(shape, dtype, build)
        except BaseException:
            _unlink(tmp)
            raise
        self.built += 1
        array.flags.writeable = False
        return array

    def _private(self, shape, dtype, build) -> np.ndarray:
        array = np.empty(shape, dtype=dtype)
        build(array)
        self.built += 1
        array.flags.writeable = False
        return array

    def _open(self, ready: Path) -> np.ndarray | None:
        try:
            array = np.load(ready, mmap_mode="r")
        except (FileNotFoundError, ValueError, OSError):
            return None
        try:
            os.utime(ready)  # recently used: evicted last
        except OSError:
            pass
        return array

    def _remember(self, name: str, array: np.ndarray, reused: bool = False) -> np.ndarray:
        with self._lock:
            if name in self._mapped:  # another thread of this process opened it meanwhile
                return self._mapped[name]
            self.reused += reused
            self._mapped[name] = array
            while len(self._mapped) > self._keep:
                self._mapped.popitem(last=False)
        return array

    def _stale(self, lock: Path) -> bool:
        """True when the lock's process is gone (or the lock is older than ``wait_seconds``)."""
        try:
            text = lock.read_text().split()
            pid, since = int(text[0]), float(text[1])
        except (OSError, ValueError, IndexError):
            try:
                return time.time() - lock.stat().st_mtime > 5.0  # unreadable for 5 s: its writer died
            except OSError:
                return False
        if time.time() - since > self.wait_seconds:
            return True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def _make_room(self, nbytes: int) -> None:
        """Evict the oldest regions while the pool would hold more than its budget; remove temporary
        files left by dead builders."""
        entries = []
        now = time.time()
        try:
            scan = list(os.scandir(self.directory))
        except OSError:
            return
        for entry in scan:
            try:
                st = entry.stat()
            except OSError:
                continue
            if entry.name.endswith(".tmp") and now - st.st_mtime > 600:
                _unlink(Path(entry.path))
            elif entry.name.endswith(".npy"):
                entries.append((st.st_mtime, st.st_size, entry.path))
        total = sum(size for _, size, _ in entries) + nbytes
        for _, size, path in sorted(entries):
            if total <= self.budget_bytes:
                break
            _unlink(Path(path))  # maps open elsewhere stay valid until closed
            total -= size


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


@dataclass
class RegionSettings:
    """The region-pool part of ``JobConfig.data`` that :class:`sfm.data.crops.CropSampler` takes."""

    crops_per_region: int = 1
    region_bricks: tuple[int, int, int] = (2, 2, 2)
    regions_in_flight: int = 0
    pool_dir: str = ""
    pool_mb: int = 0

    def check(self) -> None:
        if int(self.crops_per_region) < 1:
            raise SFMError(f"data.crops_per_region = {self.crops_per_region} must be at least 1 (1: a fetch per crop)")
        if len(self.region_bricks) != 3 or min(int(b) for b in self.region_bricks) < 1:
            raise SFMError(f"data.region_bricks = {list(self.region_bricks)} must be 3 positive brick counts, "
                           "e.g. [2, 2, 2]")
        if int(self.regions_in_flight) < 0 or int(self.pool_mb) < 0:
            raise SFMError("data.regions_in_flight and data.pool_mb must be >= 0 (0: automatic)")
