"""Normalised bricks kept in memory: surveys that fit are decoded and normalised once per process.

A crop loader that streams from S3 reads each brick again whenever a crop touches it; when the
surveys fit in memory (a laptop's quality run, one survey fine-tuned on a node), that repeats the
fetch, the decode and the normalisation of the same bricks thousands of times. :class:`BrickCache`
keeps bricks as the crops take them (normalised, of the batch's value type) up to a byte budget,
least recently used out first. A crop cut from cached bricks holds exactly the values one read
from the store holds: normalisation is per voxel.

Cached arrays are read-only and shared by the reading threads; a brick evicted while a thread
still copies from it stays alive until that copy ends. Threads that want a brick another thread is
reading wait for it, so no brick is fetched twice at once.
"""

from __future__ import annotations

import collections
import itertools
import threading
from concurrent.futures import Future
from typing import Callable, Hashable

import numpy as np


class BrickCache:
    """At most ``limit_bytes`` of arrays by key, least recently used evicted first."""

    def __init__(self, limit_bytes: int):
        self.limit = int(limit_bytes)
        self._items: collections.OrderedDict[Hashable, np.ndarray] = collections.OrderedDict()
        self._building: dict[Hashable, Future] = {}  # keys one thread is building; the others wait for it
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: Hashable, build: Callable[[], np.ndarray]) -> np.ndarray:
        """The array cached under ``key``, else ``build()``'s, kept if it fits the budget. A key is built
        by one thread at a time: others asking for it meanwhile wait for that array (or its error)."""
        with self._lock:
            values = self._items.get(key)
            if values is not None:
                self._items.move_to_end(key)
                self.hits += 1
                return values
            pending = self._building.get(key)
            mine = pending is None
            if mine:
                pending = self._building[key] = Future()
                self.misses += 1
            else:
                self.hits += 1
        if not mine:
            return pending.result()
        try:
            values = build()
            values.flags.writeable = False
        except BaseException as err:
            with self._lock:
                del self._building[key]
            pending.set_exception(err)
            raise
        with self._lock:
            del self._building[key]
            if values.nbytes <= self.limit:
                self._items[key] = values
                self._bytes += values.nbytes
                while self._bytes > self.limit:
                    _, old = self._items.popitem(last=False)
                    self._bytes -= old.nbytes
        pending.set_result(values)
        return values

    def read_into(self, survey: Hashable, reader, shape: tuple[int, ...], region: tuple[slice, slice, slice],
                  dst: np.ndarray, fill: Callable[[np.ndarray, np.ndarray], None]) -> None:
        """``reader.read_into(region, dst, fill)`` (a :class:`sfm.data.bricks.BrickReader` of survey ``survey``,
        amplitude ``shape``) through the cache: each brick ``region`` touches is filled whole, once, into an
        array of ``dst``'s type kept under ``(survey, brick)``, and its part copied into ``dst``."""
        ranges = [range(r.start // n, (r.stop - 1) // n + 1) for r, n in zip(region, reader.bricks)]
        for brick in itertools.product(*ranges):
            box = tuple(slice(c * n, min((c + 1) * n, size)) for c, n, size in zip(brick, reader.bricks, shape))

            def build(box=box) -> np.ndarray:
                values = np.empty(tuple(b.stop - b.start for b in box), dtype=dst.dtype)
                reader.read_into(box, values, fill)
                return values

            values = self.get((survey, brick), build)
            part = tuple(slice(max(r.start, b.start), min(r.stop, b.stop)) for r, b in zip(region, box))
            np.copyto(dst[tuple(slice(p.start - r.start, p.stop - r.start) for p, r in zip(part, region))],
                      values[tuple(slice(p.start - b.start, p.stop - b.start) for p, b in zip(part, box))])

    @property
    def nbytes(self) -> int:
        """Bytes held now (at most ``limit``)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)
