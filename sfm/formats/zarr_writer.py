"""Writing a Zarr v3 survey store with few requests and little CPU: :class:`GroupWriter`, :class:`ShardWriter`.

:class:`GroupWriter` builds the group's metadata and small arrays in memory and puts them all at
once (a dozen concurrent PUTs on S3 instead of a hundred sequential requests), and writes the root
``zarr.json`` (attributes and consolidated metadata) last. It never deletes what an earlier attempt
with the same layout wrote: every attempt puts the same bytes under the same keys, each put atomic.

:class:`ShardWriter` writes whole shards of a sharded array, from many threads at once.

zarr-python treats every write into a sharded array as a partial update of the shard: it reads the
old shard, compares every brick with the fill value, copies each brick into a fresh buffer and
joins the encoded bricks (a large CPU cost even with no compression, BENCHMARKS.md "Ingest"). Ingest writes
each shard exactly once and whole, so it encodes shards itself, in the format of the Zarr v3
``sharding_indexed`` codec that zarr then reads:

    shard = index | brick | brick | ...        (index_location "start")
    index = [bricks per shard..., 2] uint64 little-endian (offset, nbytes), C order, then crc32c (4 bytes)

Bricks go through the array's own inner codecs (bytes little-endian, then Blosc), and bricks past
the array's end are marked empty (offset = nbytes = 2**64 - 1), so zarr reads them as fill value.
The array itself (shape, codecs, fill value, attributes) is created by zarr.

On a local file system every object is written under a temporary name (``<name>.sfm-<host>-<pid>-<id>.partial``)
and renamed into place, so readers see whole objects or none. A writer killed mid-object leaves its
temporary file behind; the next :meth:`GroupWriter.put` into the same store deletes those whose process
is gone (:func:`remove_stale_partials`).
"""

from __future__ import annotations

import ctypes
import itertools
import math
import os
import re
import socket
import time
import uuid
from pathlib import Path

import numpy as np

from sfm.storage.objects import process_alive

EMPTY = np.uint64(2**64 - 1)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def keep_freed_memory(mmap_threshold: int = 32 << 20, trim_threshold: int = 512 << 20) -> bool:
    """Have glibc serve allocations below ``mmap_threshold`` from its heaps and keep freed memory.

    The codec allocates a fresh output buffer per brick (MBs); by default glibc maps each one
    anew and unmaps it when freed, and touching that fresh memory page by page costs system time
    (BENCHMARKS.md "Ingest"). Process-wide and harmless elsewhere: memory is reused instead of returned. False off glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold))
    except (OSError, AttributeError):
        return False


HOST = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "host"
PARTIAL = re.compile(r"\.sfm-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{8}\.partial$")
UNTAGGED_PARTIAL_AGE_S = 600  # zarr's own temporaries (no writer named): stale after this long


PUT_ATTEMPTS = 3  # a PUT that does not answer in time is abandoned and sent again, this many times in all
PUT_SECONDS_BASE, PUT_BYTES_PER_S = 60.0, 1e6  # a PUT's deadline: base + its size at this slowest rate


async def put_with_deadline(store, key: str, value) -> None:
    """``store.set(key, value)`` (a remote store's PUT), abandoned and sent again when it does not answer
    within :data:`PUT_SECONDS_BASE` plus its size at :data:`PUT_BYTES_PER_S`: a server that accepts a request
    and never answers would otherwise hang the ingest for ever. The client's own retries (transient
    errors, throttling: :func:`sfm.storage.clients.s3fs_options`) run inside each attempt. Every attempt
    puts the same bytes under the same key, so repeating one is harmless."""
    import asyncio

    from sfm.errors import SFMError

    seconds = PUT_SECONDS_BASE + len(value) / PUT_BYTES_PER_S
    for _ in range(PUT_ATTEMPTS):
        try:
            return await asyncio.wait_for(store.set(key, value), seconds)
        except asyncio.TimeoutError:
            continue
    raise SFMError(f"the S3 server did not answer a PUT of {key} ({len(value)} bytes) within {seconds:.0f} s, "
                   f"{PUT_ATTEMPTS} times; check the S3 endpoint (SFM_S3_ENDPOINT_URL) and rerun the ingest")


class _AtomicFile:
    """A file that appears at ``path`` whole or not at all: written under a temporary name that names
    this host and process (see :func:`remove_stale_partials`), renamed into place on success."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.tmp = self.path.with_name(f"{self.path.name}.sfm-{HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}.partial")
        self.fd = -1

    def __enter__(self) -> "_AtomicFile":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        return self

    def pwrite(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        while view:
            written = os.pwrite(self.fd, view, offset)
            view, offset = view[written:], offset + written

    def __exit__(self, kind, *exc) -> None:
        os.close(self.fd)
        if kind is None:
            os.replace(self.tmp, self.path)
        else:
            self.tmp.unlink(missing_ok=True)


def _write_file_atomically(path: Path, parts: list) -> None:
    """``parts`` (bytes-like) one after the other into the file ``path``, which appears whole or not at all."""
    with _AtomicFile(path) as f:
        offset = 0
        for part in parts:
            f.pwrite(part, offset)
            offset += memoryview(part).nbytes


def remove_stale_partials(root: Path) -> int:
    """Delete the temporary files killed writers left under ``root``; returns how many.

    Ours name their host and process: removed when the process is gone from this host (a live one,
    e.g. a concurrent ingest of the same file, keeps its own). zarr's own (``*.<uuid>.partial``)
    name no writer: removed once older than :data:`UNTAGGED_PARTIAL_AGE_S`. Temporary files are never
    zarr keys, so readers never see them either way.
    """
    removed = 0
    for path in Path(root).rglob("*.partial"):
        tagged = PARTIAL.search(path.name)
        try:
            if tagged:
                if tagged["host"] != HOST or process_alive(int(tagged["pid"])):
                    continue
            elif time.time() - path.stat().st_mtime < UNTAGGED_PARTIAL_AGE_S:
                continue
            path.unlink()
            removed += 1
        except FileNotFoundError:  # renamed or removed meanwhile by its writer
            continue
    return removed


class ShardWriter:
    """Stores whole shards of ``array`` (a zarr v3 Array with one sharding codec, index at the start)
    into ``store`` (default: the array's own store) under the array's path."""

    def __init__(self, array, store=None):
        import numcodecs
        from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ShardingCodec

        meta = array.metadata
        codecs = list(meta.codecs)
        if len(codecs) != 1 or not isinstance(codecs[0], ShardingCodec):
            raise ValueError(f"{array.path}: ShardWriter needs an array with one sharding codec, got {codecs}")
        sharding = codecs[0]
        inner = list(sharding.codecs)
        index = list(sharding.index_codecs)
        if (sharding.index_location.value != "start" or len(inner) != 2 or not isinstance(inner[0], BytesCodec)
                or not isinstance(inner[1], BloscCodec) or len(index) != 2 or not isinstance(index[1], Crc32cCodec)):
            raise ValueError(f"{array.path}: ShardWriter writes bytes+blosc bricks with the index at the start")
        if meta.dtype.to_native_dtype().byteorder == ">":
            raise ValueError("ShardWriter writes little-endian bricks only")
        blosc = inner[1]
        self.array = array
        self.store = store if store is not None else array.store_path.store
        self.dtype = meta.dtype.to_native_dtype()
        self.fill = self.dtype.type(meta.fill_value)
        self.shape = tuple(array.shape)
        self.brick = tuple(sharding.chunk_shape)
        self.shard = tuple(meta.chunk_grid.chunk_shape)
        self.per_shard = tuple(s // b for s, b in zip(self.shard, self.brick))
        shuffle = {"noshuffle": numcodecs.Blosc.NOSHUFFLE, "shuffle": numcodecs.Blosc.SHUFFLE,
                   "bitshuffle": numcodecs.Blosc.BITSHUFFLE}[blosc.shuffle.value]
        self.codec = numcodecs.Blosc(cname=blosc.cname.value, clevel=blosc.clevel, shuffle=shuffle,
                                     blocksize=blosc.blocksize)
        keep_freed_memory()

    def write(self, coords: tuple[int, ...], data: np.ndarray) -> int:
        """Encode and store shard ``coords`` from ``data``: the array's values in that shard (clipped at
        the array's end), any layout. Returns the stored size in bytes. Thread-safe."""
        origin = [c * s for c, s in zip(coords, self.shard)]
        expected = tuple(min(s, n - o) for s, n, o in zip(self.shard, self.shape, origin))
        if data.shape != expected:
            raise ValueError(f"shard {coords} of {self.array.path} holds {expected}, got {data.shape}")
        bricks: list[np.ndarray | None] = []
        for inner in itertools.product(*(range(n) for n in self.per_shard)):
            lo = [q * b for q, b in zip(inner, self.brick)]
            if any(start >= extent for start, extent in zip(lo, expected)):
                bricks.append(None)  # past the array's end: empty
                continue
            part = data[tuple(slice(start, start + b) for start, b in zip(lo, self.brick))]
            if part.shape == self.brick:
                brick = np.ascontiguousarray(part, dtype=self.dtype)
            else:  # an edge brick: stored full size, padded with the fill value
                brick = np.full(self.brick, self.fill, dtype=self.dtype)
                brick[tuple(slice(0, n) for n in part.shape)] = part
            bricks.append(brick)
        return self.write_bricks(coords, bricks)

    def write_bricks(self, coords: tuple[int, ...], bricks: list) -> int:
        """Encode and store shard ``coords`` from ``bricks``: for every brick position of the shard, in C
        order, a full-size C-contiguous brick of the array's dtype (where the array ends inside it,
        padded with the fill value), or None past the array's end. Returns the stored size. Thread-safe.

        On a local file system each brick is written as soon as it is encoded (memory holds one encoded
        brick per thread, not a shard) and the index last, at the start of the file; elsewhere the shard
        is sent in one PUT.
        """
        from google_crc32c import value as crc32c
        from zarr.core.buffer.cpu import Buffer
        from zarr.core.sync import sync
        from zarr.storage import LocalStore

        positions = list(itertools.product(*(range(n) for n in self.per_shard)))
        if len(bricks) != len(positions):
            raise ValueError(f"shard {coords} of {self.array.path} has {len(positions)} bricks, got {len(bricks)}")
        for brick in bricks:
            if brick is not None and (brick.shape != self.brick or brick.dtype != self.dtype):
                raise ValueError(f"bricks of {self.array.path} are {self.brick} {self.dtype}, got {brick.shape} {brick.dtype}")
        index = np.full((*self.per_shard, 2), EMPTY, dtype="<u8")
        key = f"{self.array.path}/{self.array.metadata.encode_chunk_key(tuple(coords))}"
        offset = index.nbytes + 4

        def head() -> bytes:
            raw = index.tobytes()
            return raw + np.uint32(crc32c(raw)).astype("<u4").tobytes()

        if isinstance(self.store, LocalStore):
            with _AtomicFile(self.store.root / key) as f:
                for pos, brick in zip(positions, bricks):
                    if brick is not None:
                        blob = self.codec.encode(brick)
                        f.pwrite(blob, offset)
                        index[pos] = (offset, len(blob))
                        offset += len(blob)
                f.pwrite(head(), 0)
            return offset
        encoded: list[bytes] = []
        for pos, brick in zip(positions, bricks):
            if brick is not None:
                encoded.append(self.codec.encode(brick))
                index[pos] = (offset, len(encoded[-1]))
                offset += len(encoded[-1])
        sync(put_with_deadline(self.store, key, Buffer.from_bytes(b"".join([head(), *encoded]))))
        return offset

    @property
    def shards_per_column(self) -> int:
        """Shards along the last axis."""
        return math.ceil(self.shape[-1] / self.shard[-1])


class GroupWriter:
    """A Zarr v3 group at ``store_url``: arrays are created in memory, :meth:`put` sends their metadata
    and small arrays concurrently, :meth:`shards` writes a big array's shards, :meth:`finish` writes
    the attributes and consolidated metadata last."""

    def __init__(self, store_url: str):
        import zarr

        from sfm import storage

        self.url = store_url
        self.target = storage.zarr_store(store_url)
        self.memory = zarr.storage.MemoryStore()
        self.root = zarr.create_group(self.memory, zarr_format=3)
        local = isinstance(self.target, zarr.storage.LocalStore)
        self._local_root = Path(self.target.root) if local else None

    def create_array(self, name: str, values: np.ndarray | None = None, **spec):
        """A new array in memory (``spec`` as for ``zarr.create_array``), holding ``values`` if given."""
        arr = self.root.create_array(name, **spec)
        if values is not None:
            arr[...] = values
        return arr

    def put(self, layout_of: list[str]) -> None:
        """Send everything made so far but the root ``zarr.json``. If the target already holds one of the
        arrays ``layout_of`` with different metadata (an interrupted attempt with other options), the
        target is cleared first; with the same metadata its objects are simply overwritten."""
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        from sfm import storage

        async def get(store, key):
            return await store.get(key, prototype=default_buffer_prototype())

        for name in layout_of:
            old = sync(get(self.target, f"{name}/zarr.json"))
            new = sync(get(self.memory, f"{name}/zarr.json"))
            if old is not None and old.to_bytes() != new.to_bytes():
                storage.remove(self.url)
                break
        if self._local_root is not None and self._local_root.exists():
            remove_stale_partials(self._local_root)  # what a killed attempt was writing
        self._copy([k for k in self._keys() if k != "zarr.json"])

    def metadata(self) -> dict[str, str]:
        """Every ``zarr.json`` made so far (in the order made): what :meth:`from_metadata` needs to write
        shards and :meth:`finish` the group in another process."""
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        async def collect():
            keys = [key async for key in self.memory.list()]
            return {key: (await self.memory.get(key, prototype=default_buffer_prototype())).to_bytes().decode()
                    for key in keys if key.rsplit("/", 1)[-1] == "zarr.json"}

        return sync(collect())

    @classmethod
    def from_metadata(cls, store_url: str, metadata: dict[str, str]) -> "GroupWriter":
        """The writer of a group whose arrays another process created (:meth:`metadata`, :meth:`put`)."""
        import zarr
        from zarr.core.buffer.cpu import Buffer
        from zarr.core.sync import sync

        writer = cls(store_url)
        writer.memory = zarr.storage.MemoryStore()

        async def fill():
            for key, text in metadata.items():
                await writer.memory.set(key, Buffer.from_bytes(text.encode()))

        sync(fill())
        writer.root = zarr.open_group(writer.memory, mode="r+", zarr_format=3)
        return writer

    def shards(self, name: str) -> ShardWriter:
        return ShardWriter(self.root[name], self.target)

    def write_chunk(self, name: str, origin: tuple[int, ...], values: np.ndarray) -> None:
        """Store the one chunk of the unsharded array ``name`` that starts at ``origin`` (a chunk corner):
        ``values`` (clipped at the array's end), encoded by zarr in memory, then put like any other object
        (a chunk equal to the fill value is not stored, as zarr does). Thread-safe."""
        from zarr.core.sync import sync

        array = self.root[name]
        chunks = array.metadata.chunk_grid.chunk_shape
        coords = tuple(o // c for o, c in zip(origin, chunks))
        if any(o % c for o, c in zip(origin, chunks)):
            raise ValueError(f"{name}: {origin} is not a chunk corner of chunks {chunks}")
        array[tuple(slice(o, o + n) for o, n in zip(origin, values.shape))] = values
        key = f"{name}/{array.metadata.encode_chunk_key(coords)}"
        if sync(self.memory.exists(key)):
            self._copy([key])
            sync(self.memory.delete(key))

    def update_attributes(self, name: str, attributes: dict) -> None:
        """Add ``attributes`` to array ``name`` and put its ``zarr.json`` again (before :meth:`finish`)."""
        self.root[name].attrs.update(attributes)
        self._copy([f"{name}/zarr.json"])

    def finish(self, attributes: dict) -> None:
        """Write the group's attributes and consolidated metadata (the root ``zarr.json``), last."""
        import warnings

        import zarr

        self.root.attrs.put(attributes)
        with warnings.catch_warnings():  # consolidated metadata is a zarr-python extension to v3; xarray uses it
            warnings.simplefilter("ignore", category=UserWarning)
            # as are the structured and string types of the MDIO layout's headers (sfm.formats.mdio_layout)
            warnings.simplefilter("ignore", category=zarr.errors.UnstableSpecificationWarning)
            zarr.consolidate_metadata(self.memory)
        self._copy(["zarr.json"])

    def _keys(self) -> list[str]:
        from zarr.core.sync import sync

        async def collect():
            return [key async for key in self.memory.list()]

        return sorted(sync(collect()))

    def _copy(self, keys: list[str]) -> None:
        """Put ``keys`` from memory into the target, all requests in flight at once."""
        import asyncio

        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        async def copy_all():
            async def one(key):
                value = await self.memory.get(key, prototype=default_buffer_prototype())
                if self._local_root is not None:  # our own atomic write: its temporary names this process
                    _write_file_atomically(self._local_root / key, [value.as_buffer_like()])
                else:
                    await put_with_deadline(self.target, key, value)

            await asyncio.gather(*(one(key) for key in keys))

        sync(copy_all())
