"""Reading a region of a survey's amplitude brick by brick, normalising each brick into place.

zarr's own read path (``array[region]``) allocates the output, fills it, and for sharded arrays
decodes into a per-shard buffer that is copied again: CPU on top of the codec itself that a crop
loader cannot afford (BENCHMARKS.md "Streaming"). This
module reads the layouts sfm.ingest.survey writes, per the Zarr v3 spec, with one decode into a reused
buffer and one pass from there into the destination:

- a regular chunk grid, optionally sharded (``sharding_indexed``, index at the start or the end,
  index codecs ``bytes`` little-endian + ``crc32c``);
- brick codecs ``bytes`` (little-endian) followed by at most one compressor that numcodecs decodes
  from its own header (blosc, zstd, gzip);
- float32, float16 or int8 values; with a NaN fill value (MDIO stores), NaN and inf read as 0.

Bricks that lie next to each other in a shard (consecutive along the sample axis, as the ingest writes
them) are fetched by one ranged GET and decoded from their slices of it. The CPU time of each phase
(receive, decode, normalise) is added to :attr:`BrickReader.cpu` for the loader's accounting.

:meth:`BrickReader.for_array` returns None for anything else, and the caller reads through zarr.
Fetches go through the array's store (so :class:`sfm.storage.resilient_store.ResilientStore` retries and counts them):
when the store has a blocking range reader (:mod:`sfm.storage.ranged_get`), each brick of a sharded array
is read on the calling thread into that thread's reused buffer; otherwise all bricks of a region
are fetched at once on zarr's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import sys
import threading
import time
from typing import Callable

import numpy as np

_EMPTY = np.uint64(2**64 - 1)  # shard index entry of a brick that was never written
_COMPRESSORS = ("blosc", "zstd", "gzip")
_DTYPES = (np.dtype("float32"), np.dtype("float16"), np.dtype("int8"))
_RUN_BYTES = 64 << 20  # the most one coalesced GET fetches


def _numcodecs_decoder(name: str):
    import numcodecs

    return {"blosc": numcodecs.Blosc, "zstd": numcodecs.Zstd, "gzip": numcodecs.GZip}[name]()


class BrickReader:
    """Reads regions of one zarr v3 array of a layout it knows (see the module docstring)."""

    def __init__(self, amp, bricks, shard_shape, index_at_start: bool | None, compressor: str | None, dtype):
        self.amp = amp
        self.store = amp.store_path.store
        self.prefix = amp.store_path.path
        self.bricks = tuple(int(b) for b in bricks)  # the read unit (inner chunk when sharded)
        self.shard_shape = None if shard_shape is None else tuple(int(s) for s in shard_shape)
        self.index_at_start = index_at_start
        self.compressor = compressor
        self.dtype = np.dtype(dtype)
        self.fill_value = float(amp.metadata.fill_value)
        # NaN fill (MDIO stores): dead traces and never-written bricks are NaN there; they read as 0
        self.nan_holes = not np.isfinite(self.fill_value)
        if self.nan_holes:
            self.fill_value = 0.0
        self.per_shard = None if shard_shape is None else tuple(s // b for s, b in zip(self.shard_shape, self.bricks))
        self._local = threading.local()  # per thread: decoder, brick buffer, encoded-bytes buffer
        self._indexes: dict[tuple[int, ...], np.ndarray | None] = {}  # shard -> index (see _shard_index)
        self.cpu: collections.Counter = collections.Counter()  # thread CPU seconds per phase, all threads
        self._cpu_lock = threading.Lock()

    @classmethod
    def for_array(cls, amp) -> "BrickReader | None":
        """A reader for ``amp`` (a zarr.Array), or None when its layout is not one this module reads."""
        from zarr.codecs import BytesCodec, Crc32cCodec, ShardingCodec
        from zarr.core.chunk_grids import RegularChunkGrid

        meta = amp.metadata
        if getattr(meta, "zarr_format", None) != 3 or not isinstance(meta.chunk_grid, RegularChunkGrid):
            return None
        if np.dtype(amp.dtype) not in _DTYPES or sys.byteorder != "little":
            return None
        codecs = tuple(meta.codecs)
        shard_shape, index_at_start = None, None
        if len(codecs) == 1 and isinstance(codecs[0], ShardingCodec):
            sharding = codecs[0]
            index_codecs = tuple(sharding.index_codecs)
            if not (len(index_codecs) == 2 and isinstance(index_codecs[0], BytesCodec)
                    and _little(index_codecs[0]) and isinstance(index_codecs[1], Crc32cCodec)):
                return None
            shard_shape, bricks = meta.chunk_grid.chunk_shape, sharding.chunk_shape
            if any(s % b for s, b in zip(shard_shape, bricks)):
                return None
            index_at_start = str(getattr(sharding.index_location, "value", sharding.index_location)) == "start"
            codecs = tuple(sharding.codecs)
        else:
            bricks = meta.chunk_grid.chunk_shape
        if not codecs or not isinstance(codecs[0], BytesCodec) or not _little(codecs[0]) or len(codecs) > 2:
            return None
        compressor = None
        if len(codecs) == 2:
            compressor = codecs[1].to_dict().get("name")
            if compressor not in _COMPRESSORS:
                return None
        return cls(amp, bricks, shard_shape, index_at_start, compressor, amp.dtype)

    # ---- reading --------------------------------------------------------------------------------
    def read_into(self, region: tuple[slice, slice, slice], dst: np.ndarray,
                  normalise: Callable[[np.ndarray, np.ndarray], None]) -> None:
        """``normalise(stored brick part, dst part)`` for every brick ``region`` touches.

        ``dst`` is any (strided) view shaped like ``region``; ``normalise`` writes all of its
        destination (e.g. :meth:`sfm.data.survey.SurveyInfo.normalise_into`).
        """
        from zarr.core.sync import sync

        starts = [r.start for r in region]
        ranges = [range(r.start // b, (r.stop - 1) // b + 1) for r, b in zip(region, self.bricks)]
        coords = [(i, j, k) for i in ranges[0] for j in ranges[1] for k in ranges[2]]
        spent = collections.Counter()
        clock = time.thread_time()
        if getattr(self.store, "range_reader", None) is not None and self.shard_shape is not None:
            payloads = self._read_bricks(coords)  # one coalesced GET at a time, into one buffer
        else:
            payloads = iter(sync(self._fetch(coords)))
        for brick, payload in payloads:
            now = time.thread_time()
            spent["receive"] += now - clock
            stored = self._decode(payload)
            clock, now = now, time.thread_time()
            spent["decode"] += now - clock
            src, out = [], []
            for axis, (c, b) in enumerate(zip(brick, self.bricks)):
                lo = max(region[axis].start, c * b)
                hi = min(region[axis].stop, (c + 1) * b)
                src.append(slice(lo - c * b, hi - c * b))
                out.append(slice(lo - starts[axis], hi - starts[axis]))
            normalise(stored[tuple(src)], dst[tuple(out)])
            clock = time.thread_time()
            spent["normalise"] += clock - now
        with self._cpu_lock:
            self.cpu.update(spent)

    def _runs(self, coords, indexes) -> tuple[list, list]:
        """Group the bricks ``coords`` into GETs: ``(key, start, end, [(brick, offset, nbytes), ...])`` for
        bricks stored back to back in one shard (at most ``_RUN_BYTES`` a GET), and the bricks never
        written."""
        located, missing = [], []
        for brick in coords:
            where = self._locate(brick, indexes[self._shard_of(brick)])
            if where is None:
                missing.append(brick)
            else:
                located.append((*where, brick))
        located.sort(key=lambda x: (x[0], x[1]))
        runs: list = []
        for key, start, end, brick in located:
            run = runs[-1] if runs else None
            if run is not None and run[0] == key and run[2] == start and end - run[1] <= _RUN_BYTES:
                run[2] = end
                run[3].append((brick, start - run[1], end - start))
            else:
                runs.append([key, start, end, [(brick, 0, end - start)]])
        return runs, missing

    async def _fetch(self, coords: list[tuple[int, int, int]]) -> list:
        """``(brick, encoded bytes or None: never written)`` for each brick, fetched concurrently,
        bricks stored back to back by one GET."""
        from zarr.abc.store import RangeByteRequest
        from zarr.core.buffer import default_buffer_prototype

        proto = default_buffer_prototype()
        if self.shard_shape is None:
            got = await asyncio.gather(*(self.store.get(self._key(c), proto) for c in coords))
            return list(zip(coords, got))
        shards = {self._shard_of(brick) for brick in coords}
        indexes = dict(zip(shards, await asyncio.gather(*(self._shard_index(s, proto) for s in shards))))
        runs, missing = self._runs(coords, indexes)
        bufs = await asyncio.gather(*(self.store.get(key, proto, RangeByteRequest(start, end))
                                      for key, start, end, _ in runs))
        out: list = [(brick, None) for brick in missing]
        for (key, _, _, parts), buf in zip(runs, bufs):
            if buf is None:
                raise FileNotFoundError(f"shard {key} vanished while being read")
            raw = buf.as_numpy_array()
            out += [(brick, raw[at:at + n]) for brick, at, n in parts]
        return out

    def _read_bricks(self, coords: list[tuple[int, int, int]]):
        """Yield ``(brick, encoded bytes or None)`` for each brick, each run of back-to-back bricks read
        by one blocking ranged GET (:meth:`sfm.storage.resilient_store.ResilientStore.read_range_into`) into this
        thread's reused buffer; valid until the next item."""
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        shards = {self._shard_of(brick) for brick in coords}
        for shard in shards:
            if self._indexes.get(shard, False) is False:  # not read yet: the only hop to the event loop
                sync(self._shard_index(shard, default_buffer_prototype()))
        runs, missing = self._runs(coords, self._indexes)
        for brick in missing:
            yield brick, None
        local = self._local
        for key, start, end, parts in runs:
            if getattr(local, "payload", None) is None or local.payload.size < end - start:
                brick_bytes = int(np.prod(self.bricks)) * self.dtype.itemsize + 4096
                local.payload = np.empty(max(end - start, brick_bytes), np.uint8)
            got = self.store.read_range_into(key, start, end, local.payload)
            if got is None:
                raise FileNotFoundError(f"shard {key} vanished while being read")
            for brick, at, n in parts:
                yield brick, got[at:at + n]

    def _shard_of(self, brick) -> tuple[int, ...]:
        return tuple(c // n for c, n in zip(brick, self.per_shard))

    def _locate(self, brick, index: np.ndarray | None) -> tuple[str, int, int] | None:
        """(shard key, start, end) of ``brick``'s encoded bytes, from its shard's ``index``; None: never
        written (no shard, or an empty index entry)."""
        if index is None:
            return None
        offset, nbytes = (int(v) for v in index[tuple(c % n for c, n in zip(brick, self.per_shard))])
        if offset == int(_EMPTY) and nbytes == int(_EMPTY):
            return None
        return self._key(self._shard_of(brick)), offset, offset + nbytes

    async def _shard_index(self, shard, proto) -> np.ndarray | None:
        """[*per_shard, 2] uint64 (offset, nbytes) of each brick in the shard; None if no shard. Read
        once per shard and kept in ``_indexes``: published stores never change."""
        from numcodecs.checksum32 import CRC32C
        from zarr.abc.store import RangeByteRequest, SuffixByteRequest

        index = self._indexes.get(shard, False)
        if index is not False:
            return index
        size = 16 * int(np.prod(self.per_shard)) + 4
        byte_range = RangeByteRequest(0, size) if self.index_at_start else SuffixByteRequest(size)
        buf = await self.store.get(self._key(shard), proto, byte_range)
        if buf is not None:
            raw = CRC32C().decode(buf.as_numpy_array())  # raises if the index is corrupt
            index = np.frombuffer(raw, dtype="<u8").reshape(*self.per_shard, 2)
        else:
            index = None
        self._indexes[shard] = index
        return index

    def _key(self, coords) -> str:
        key = self.amp.metadata.encode_chunk_key(tuple(int(c) for c in coords))
        return f"{self.prefix}/{key}" if self.prefix else key

    def _decode(self, payload) -> np.ndarray:
        """One brick as a [*bricks] array of the stored dtype, in this thread's reused buffer."""
        local = self._local
        if getattr(local, "buffer", None) is None:
            local.buffer = np.empty(self.bricks, dtype=self.dtype)
            local.decoder = _numcodecs_decoder(self.compressor) if self.compressor else None
        if payload is None:
            local.buffer.fill(self.fill_value)
            return local.buffer
        encoded = payload if isinstance(payload, np.ndarray) else payload.as_numpy_array()
        if local.decoder is None:
            local.buffer.reshape(-1).view(np.uint8)[:] = encoded
        else:
            local.decoder.decode(encoded, out=local.buffer)
        if self.nan_holes:
            zero_nonfinite(local.buffer)
        return local.buffer


def zero_nonfinite(values: np.ndarray) -> np.ndarray:
    """``values`` with NaN and inf replaced by 0, in place (float arrays; others are returned as they are)."""
    if values.dtype.kind == "f":
        # one masked copy: np.nan_to_num(copy=False) makes several passes over the brick
        np.copyto(values, 0, where=~np.isfinite(values))
    return values


def _little(codec) -> bool:
    endian = getattr(codec, "endian", None)
    return endian is None or str(getattr(endian, "value", endian)) == "little"
