"""The pool of decoded regions the processes of a node share: :class:`RegionPool`.

The pool is a directory in shared memory (``/dev/shm``) with one file per decoded region,
``<name>.region``, named by a digest of the survey's identity, the region's draw and box and the value
type (:meth:`RegionPool.name`). A file is a 4 KiB header (magic, then the region's name) followed by
the region's values. A process that needs a region that is not there takes its lock file
(``O_EXCL``), builds the region under a temporary name and renames it into place; the others wait for
it. A lock whose process died, or that is held past ``wait_seconds``, is taken over.

Past the budget, the oldest file is *recycled*, not deleted: renamed to the builder's temporary name,
its header's name cleared, the new region written over the old one and the new name set last. Its
pages stay allocated, so building a region costs no page faults (a fresh tmpfs page costs about as
much as normalising the voxels it holds), and each process keeps its maps of the pool's files by
inode, so reading a recycled file costs none either. A reader copies out of a region and then checks
the header still holds the region's name (a sequence lock: the builder clears the name before it
writes and sets it after, and x86 keeps stores in order); if not, the region was recycled under it,
and it reads again, rebuilding the region if need be. So a reader never uses a half-written or
recycled region, and since every file is a pure function of its name, no reader can tell who built it.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import mmap
import os
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable, TypeVar

import numpy as np

from sfm.data.regions import Region
from sfm.errors import SFMError
from sfm.storage.objects import process_alive

log = logging.getLogger(__name__)

POOL_VERSION = 2  # part of every region's name: a new pool layout never reads an old file
HEADER = 4096  # bytes before a region's values: page aligned
MAGIC = b"SFMREG02"
NAME_BYTES = 32
T = TypeVar("T")


def default_pool_dir() -> str:
    """``/dev/shm/sfm-regions`` where shared memory is mounted, else under the temp dir."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return str(base / "sfm-regions")


def region_bytes(extent, dtype) -> int:
    return int(np.prod(extent)) * np.dtype(dtype).itemsize


class _Mapped:
    """One pool file mapped into this process (kept by inode)."""

    def __init__(self, fd: int, size: int):
        self.size = size
        self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)

    def name(self) -> bytes:
        return self.map[len(MAGIC):len(MAGIC) + NAME_BYTES] if self.map[:len(MAGIC)] == MAGIC else b""

    def set_name(self, name: bytes) -> None:
        self.map[:len(MAGIC) + NAME_BYTES] = MAGIC + name.ljust(NAME_BYTES, b"\0")

    def array(self, shape, dtype) -> np.ndarray:
        return np.frombuffer(self.map, dtype=dtype, count=int(np.prod(shape)), offset=HEADER).reshape(shape)


class RegionPool:
    """Decoded regions shared by the processes of a node (see the module docstring).

    Args:
        directory: the pool's directory (created); "" for :func:`default_pool_dir`.
        budget_bytes: past this, building a region recycles the oldest file.
        wait_seconds: how long a lock may be held before another process takes it over.
    """

    def __init__(self, directory: str, budget_bytes: int, wait_seconds: float = 300.0):
        self.directory = Path(directory or default_pool_dir())
        self.budget_bytes = int(budget_bytes)
        self.wait_seconds = float(wait_seconds)
        self.built = 0  # regions this process built (fetched)
        self.reused = 0  # regions found in the pool (each counted once per process while it keeps them)
        self.keep = 64  # files this process keeps mapped
        self._by_inode: OrderedDict[int, _Mapped] = OrderedDict()
        self._by_name: dict[str, int] = {}  # name -> inode of its file, as last seen
        self._lock = threading.Lock()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise SFMError(f"cannot create the region pool {self.directory}: {err}; set data.pool_dir to a "
                           "writable directory (shared memory: /dev/shm)") from err

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_by_inode=OrderedDict(), _by_name={}, _lock=None, built=0, reused=0)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @staticmethod
    def name(identity: str, region: Region, dtype) -> str:
        """The name of ``region`` of the survey ``identity`` decoded as ``dtype``. It includes the draw:
        two anchors that happen to draw one box fetch it twice (rare on a survey of many regions), so a
        region's fetches are exactly the plan's, whatever the survey's size."""
        text = f"v{POOL_VERSION}|{identity}|{region.draw}|{region.origin}|{region.extent}|{np.dtype(dtype).str}"
        return hashlib.sha256(text.encode()).hexdigest()[:NAME_BYTES]

    def use(self, name: str, shape: tuple[int, ...], dtype, build: Callable[[np.ndarray], None],
            read: Callable[[np.ndarray], T]) -> T:
        """``read(region)`` on the region ``name`` [*shape] of ``dtype``; ``build(array)`` fills the region
        first when no process has it. ``read`` may run again if the region is recycled meanwhile; its
        result is from a region that was whole throughout."""
        key = name.encode()
        recycled = 0
        while recycled < 100:
            mapped = self._find(name, key)
            if mapped is None:
                mapped = self._claim(name, key, shape, dtype, build)  # waits while another process builds it
                if isinstance(mapped, np.ndarray):  # built in private memory: the pool had no room
                    return read(mapped)
                if mapped is None:
                    continue
            out = read(mapped.array(shape, dtype))
            if mapped.name() == key:  # still this region: nothing was recycled under the read
                return out
            recycled += 1
        raise SFMError(f"region pool {self.directory}: region {name} was recycled under every read; raise "
                       "data.pool_mb")

    # ---- finding -----------------------------------------------------------------------------------
    def _find(self, name: str, key: bytes) -> _Mapped | None:
        path = self.directory / f"{name}.region"
        with self._lock:
            inode = self._by_name.get(name)
            mapped = self._by_inode.get(inode) if inode is not None else None
            if mapped is not None and mapped.name() == key:
                self._by_inode.move_to_end(inode)
                _touch(path)
                return mapped
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return None
        try:
            mapped, inode = self._map(fd)
        finally:
            os.close(fd)
        if mapped is None or mapped.name() != key:
            return None
        with self._lock:
            self.reused += name not in self._by_name
            self._by_name[name] = inode
        _touch(path)
        return mapped

    def _map(self, fd: int) -> tuple[_Mapped | None, int]:
        """The file ``fd`` mapped (this process's map of its inode if it has one), and its inode."""
        st = os.fstat(fd)
        with self._lock:
            mapped = self._by_inode.get(st.st_ino)
            if mapped is not None and mapped.size == st.st_size:
                self._by_inode.move_to_end(st.st_ino)
                return mapped, st.st_ino
        if st.st_size < HEADER:
            return None, st.st_ino
        mapped = _Mapped(fd, st.st_size)
        with self._lock:
            self._by_inode[st.st_ino] = mapped
            while len(self._by_inode) > self.keep:
                self._by_inode.popitem(last=False)
        return mapped, st.st_ino

    # ---- building ----------------------------------------------------------------------------------
    def _claim(self, name: str, key: bytes, shape, dtype, build) -> "_Mapped | np.ndarray | None":
        """Build region ``name`` under its lock, or wait for the process that holds it; None: look again."""
        lock = self.directory / f"{name}.lock"
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if self._stale(lock):
                _unlink(lock)
            else:
                time.sleep(0.002)
            return None
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()} {time.time():.3f}")
        try:
            found = self._find(name, key)  # built by the previous holder between our look and our lock
            return found if found is not None else self._build(name, key, shape, dtype, build)
        finally:
            _unlink(lock)

    def _build(self, name: str, key: bytes, shape, dtype, build) -> "_Mapped | np.ndarray":
        size = HEADER + region_bytes(shape, dtype)
        tmp = self.directory / f"{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            self._recycle_into(tmp, size)
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if os.fstat(fd).st_size != size:
                    os.ftruncate(fd, size)
                mapped, inode = self._map(fd)
            finally:
                os.close(fd)
            mapped.set_name(b"")  # readers of the file's previous region see it gone before it changes
            build(mapped.array(shape, dtype))
            mapped.set_name(key)
            os.replace(tmp, self.directory / f"{name}.region")
        except OSError as err:
            _unlink(tmp)
            if err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM, errno.EBUSY):
                raise
            log.warning("region pool %s is full (%s); decoding regions in private memory. Give the node more "
                        "shared memory or lower data.pool_mb", self.directory, err)
            array = np.empty(shape, dtype=dtype)
            build(array)
            self.built += 1
            return array
        except BaseException:
            _unlink(tmp)
            raise
        with self._lock:
            self._by_name[name] = inode
        self.built += 1
        return mapped

    def _recycle_into(self, tmp: Path, size: int) -> None:
        """Past the budget, rename the oldest region file (of ``size`` bytes, if any) to ``tmp``; delete
        older ones of other sizes and temporary files of dead builders."""
        entries, now = [], time.time()
        try:
            scan = list(os.scandir(self.directory))
        except OSError:
            return
        for entry in scan:
            try:
                st = entry.stat()
            except OSError:
                continue
            if entry.name.endswith(".tmp") and _builder_gone(entry.name, now - st.st_mtime):
                _unlink(Path(entry.path))
            elif entry.name.endswith(".region"):
                entries.append((st.st_mtime, st.st_size, entry.path))
        total = sum(s for _, s, _ in entries) + size
        for _, file_size, path in sorted(entries):
            if total <= self.budget_bytes:
                return
            if file_size == size:
                try:
                    os.rename(path, tmp)  # claimed: no other builder can take it now
                    return
                except FileNotFoundError:
                    continue
            _unlink(Path(path))
            total -= file_size

    def _stale(self, lock: Path) -> bool:
        """True when the lock's process is gone, or it has held the lock past ``wait_seconds``."""
        try:
            text = lock.read_text().split()
            pid, since = int(text[0]), float(text[1])
        except (OSError, ValueError, IndexError):
            try:
                return time.time() - lock.stat().st_mtime > 5.0  # unreadable for 5 s: its writer died
            except OSError:
                return False
        if time.time() - since > self.wait_seconds:
            log.warning("region pool: %s has been held for over %.0f s; taking it over", lock, self.wait_seconds)
            return True
        return not process_alive(pid)


def _builder_gone(tmp_name: str, age_seconds: float) -> bool:
    """Whether the temporary file ``<region>.<pid>.<thread>.tmp`` was left by a builder that died. Its age
    cannot tell: a recycled region file keeps the modification time of its last use, so a live builder's
    file may look hours old."""
    try:
        pid = int(tmp_name.split(".")[-3])
    except (IndexError, ValueError):
        return age_seconds > 600  # not named by a builder of this pool version
    return not process_alive(pid)


def _touch(path: Path) -> None:
    try:
        os.utime(path)  # recently used: recycled last
    except OSError:
        pass


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
