"""Opening a survey's zarr store for reading, local or s3://: :class:`ResilientStore` and :func:`open_survey_store`.

:class:`ResilientStore` wraps the zarr store of a survey (obstore or s3fs on S3, the local filesystem
otherwise): transient failures (connection reset or refused, 5xx, throttling, timeouts:
:func:`sfm.storage.retry.is_transient`) are retried with :class:`sfm.storage.retry.Backoff` for up to
``retry_seconds``; it counts the bytes and requests it fetched. Nothing is copied to local disk. Bricks
of sharded stores are read on the loader's own threads, by ranged GETs on S3 (:mod:`sfm.storage.ranged_get`)
and ``os.preadv`` on a file system (:class:`sfm.storage.ranged_file.LocalRangeReader`); the rest goes
through zarr.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading

import numpy as np
from zarr.storage import WrapperStore

from sfm.config import CLIENTS
from sfm.errors import SFMError
from sfm.storage import clients, objects
from sfm.storage.ranged_file import LocalRangeReader
from sfm.storage.ranged_get import S3RangeReader, reachable_directly
from sfm.storage.retry import Backoff, range_unsupported, retrying


log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# the store: retries, byte counts, the S3 client


_SMALL_READS_KEPT = 4096
_SMALL_READ_BYTES = 64 << 10


def _index_sized(byte_range) -> bool:
    """True for a range read the size of a shard index: at most 64 KiB, at the start or the end."""
    from zarr.abc.store import RangeByteRequest, SuffixByteRequest

    if isinstance(byte_range, RangeByteRequest):
        return byte_range.start == 0 and byte_range.end <= _SMALL_READ_BYTES
    return isinstance(byte_range, SuffixByteRequest) and byte_range.suffix <= _SMALL_READ_BYTES


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
        self.closed = False  # set when the reader closes (Surveys.retrying): reads still running stop retrying
        self._count_lock = threading.Lock()
        # bricks: blocking ranged reads on the reading thread (S3: sfm.storage.ranged_get; a file system:
        # LocalRangeReader), keys under range_prefix; None: every read goes through the zarr store
        self.range_reader: S3RangeReader | LocalRangeReader | None = None
        self.range_prefix = ""
        # shard indexes (a small range at the start or end of a shard object): published stores never
        # change, so each is fetched once instead of once per crop
        self._small_reads: collections.OrderedDict = collections.OrderedDict()

    def _with_store(self, store):
        clone = type(self)(store, self.label, self.retry_seconds, self.fallback)
        clone.range_reader, clone.range_prefix = self.range_reader, self.range_prefix
        return clone

    async def _retrying(self, call):
        backoff = Backoff(self.retry_seconds, lambda: self.closed)
        while True:
            store = self._store
            try:
                return await call(store)
            except Exception as err:
                if range_unsupported(err) and (store is not self._store or self.fallback is not None):
                    if store is self._store:  # the first read to find out switches; the others just retry
                        log.warning("%s: the server cannot serve byte ranges to this client (%s); reading "
                                    "through the fallback client", self.label, type(store).__name__)
                        self._store, self.fallback = self.fallback(), None
                    continue
                wait = backoff.wait(err)
                self._retried(err, backoff)
                await asyncio.sleep(wait)

    def _retried(self, err: Exception, backoff: Backoff) -> None:
        """Count a retry of a read; the first of an operation is logged."""
        self.retries += 1
        if backoff.retries == 1:
            log.warning("%s: transient read failure (%s: %s); retrying for up to %.0f s", self.label,
                        type(err).__name__, str(err).splitlines()[0][:600] if str(err) else "", self.retry_seconds)

    def read_range_into(self, key: str, start: int, end: int, out: np.ndarray) -> np.ndarray | None:
        """Blocking, on the calling thread: bytes ``[start, end)`` of ``key`` (relative to this store) as
        a view of the uint8 buffer ``out`` through :attr:`range_reader`; None when the object does not
        exist. Retried and counted like :meth:`get`."""
        got = retrying(lambda: self.range_reader.read_into(self.range_prefix + key, start, end, out),
                       self.retry_seconds, self._retried, lambda: self.closed)
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


def open_survey_store(store_url: str, client: str = "auto", retry_seconds: float = 120.0) -> ResilientStore:
    """The zarr store to read survey ``store_url`` through (see :class:`ResilientStore`).

    ``client`` (S3 only; local paths ignore it):

    - "http": bricks by :class:`sfm.storage.ranged_get.S3RangeReader` (ranged GETs into the reading thread's
      buffer: the least CPU per GB), metadata and shard indexes as "auto" reads them;
    - "obstore" (Rust) or "fsspec" (s3fs): everything through that client;
    - "auto": "http" unless a proxy is configured for the endpoint; the rest through obstore when
      installed, falling back to s3fs when the server cannot serve byte ranges to obstore.
    """
    if client not in CLIENTS:
        raise SFMError(f"data.client = {client!r} is not a client; use one of {', '.join(CLIENTS)}")
    url = objects.normalize(store_url)
    if not objects.is_s3(url):
        store = ResilientStore(objects.zarr_store(url, read_only=True), url, retry_seconds)
        store.range_reader, store.range_prefix = LocalRangeReader(), url.rstrip("/") + "/"
        return store
    if client == "obstore" and not clients.obstore_available():
        raise SFMError("data.client = 'obstore' but obstore is not installed; pip install obstore or use 'auto'")
    if client == "fsspec" or (client != "obstore" and not clients.obstore_available()):
        store = ResilientStore(clients.s3fs_zarr_store(url, short_retries=True), url, retry_seconds)
    else:
        fallback = (lambda: clients.s3fs_zarr_store(url, short_retries=True)) if client != "obstore" else None
        store = ResilientStore(clients.obstore_zarr_store(url), url, retry_seconds, fallback)
    if client == "http" or (client == "auto" and reachable_directly(clients.s3_endpoint_url())):
        bucket, _, prefix = url[len("s3://"):].partition("/")
        store.range_reader = clients.range_reader(bucket)
        store.range_prefix = prefix.rstrip("/") + "/" if prefix else ""
    return store
