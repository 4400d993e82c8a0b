"""One file's bytes by offset, local or ``s3://``, without a local copy: :func:`open_ranged`.

Ingest reads a SEG-Y file through this: the file header, the whole file once in order (digest and
trace headers, :meth:`RangedFile.windows`) and runs of traces from many threads
(:meth:`RangedFile.read_into`). Two kinds, one face:

- :class:`LocalFile`: ``os.preadv`` into the caller's buffer; windows are ``mmap`` views (no copy out of
  the page cache);
- :class:`S3File`: ranged GETs by :class:`sfm.storage.ranged_get.S3RangeReader` (the loader's transport:
  one keep-alive connection per thread, the body received straight into the caller's buffer); windows
  are fetched ahead by a small thread pool into a ring of :data:`PREFETCH_WINDOWS` + 1 buffers, so
  receiving overlaps the consumer's work and memory stays at those buffers whatever the file size.
  Transient failures (connection reset or refused, timeouts, 5xx, throttling: a server restarting;
  :func:`sfm.storage.retry.is_transient`) are retried with :class:`sfm.storage.retry.Backoff` for up to
  :data:`RETRY_SECONDS`; a range is only ever accepted whole and exactly
  as asked (``S3RangeReader`` checks the answer's length and ``Content-Range``), so a retried read
  never leaves a gap or a shifted byte.

Nothing is written to local disk.

:class:`LocalRangeReader` is the crop loader's face of the same ``os.preadv``: byte ranges of any file by
path, as :class:`sfm.storage.ranged_get.S3RangeReader` reads them from S3
(:func:`sfm.storage.resilient_store.open_survey_store`).
"""

from __future__ import annotations

import mmap
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from sfm.errors import SFMError
from sfm.storage.ranged_get import range_size
from sfm.storage.retry import retrying

PREFETCH_WINDOWS = 4  # S3 windows in flight ahead of the consumer
RETRY_SECONDS = 120.0  # how long one S3 range may keep failing transiently before the error is raised


class RangedFile:
    """A file's bytes by offset. ``url``: as given; ``size``: bytes; ``name``: the last path component."""

    url: str
    size: int

    @property
    def name(self) -> str:
        return str(self.url).rstrip("/").rsplit("/", 1)[-1]

    def read_into(self, offset: int, buf) -> int:
        """Fill ``buf`` (a writable bytes-like) with the bytes at ``offset``; returns how many there were
        (fewer than ``len(buf)`` only past the file's end). Thread-safe."""
        raise NotImplementedError

    def read(self, offset: int, nbytes: int) -> bytes:
        """Up to ``nbytes`` bytes at ``offset`` (fewer past the file's end)."""
        buf = bytearray(max(0, min(nbytes, self.size - offset)))
        got = self.read_into(offset, buf)
        return bytes(buf[:got])

    def windows(self, start: int, stop: int, window: int) -> Iterator[tuple[int, memoryview]]:
        """Bytes ``[start, stop)`` in consecutive windows of ``window`` bytes, in order, as (offset, view);
        a view is valid until the next one is asked for."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> "RangedFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _pread_full(fd: int, view, offset: int) -> int:
    """Read into ``view`` (writable, byte-addressed) from ``offset`` of ``fd`` until it is full or the
    file ends; returns the bytes read."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


class LocalFile(RangedFile):
    def __init__(self, path: str):
        if os.path.isdir(path):
            raise SFMError(f"{path} is a directory, not a SEG-Y file; name the .sgy file itself")
        if not os.path.exists(path):
            raise SFMError(f"{path} does not exist. Check the path.")
        self.url = path
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size

    def read_into(self, offset: int, buf) -> int:
        return _pread_full(self.fd, memoryview(buf).cast("B"), offset)

    def windows(self, start: int, stop: int, window: int) -> Iterator[tuple[int, memoryview]]:
        for offset in range(start, stop, window):
            # a mapped window, not a read: no copy out of the page cache, and RSS stays at the window in use
            # (mmap offsets must be page aligned: the caller's windows start at multiples of the page size)
            with mmap.mmap(self.fd, min(window, stop - offset), offset=offset, access=mmap.ACCESS_READ) as mapped:
                view = memoryview(mapped)
                try:
                    yield offset, view
                finally:
                    view.release()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class LocalRangeReader:
    """Byte ranges of local files straight into the caller's buffer, on the calling thread: the loader's
    brick transport for stores on a local or mounted file system (NVMe, FSx for Lustre), with the face of
    :class:`sfm.storage.ranged_get.S3RangeReader` (``key`` is the file's path). zarr's own local reads hop
    to its event loop and from there to a thread per read; this is one ``os.preadv`` per range."""

    def read_into(self, key: str, start: int, end: int, out: np.ndarray) -> np.ndarray | None:
        """Bytes ``[start, end)`` of file ``key`` as a view of ``out`` (uint8, at least ``end - start``
        long); None when there is no such file. A file that ends before ``end`` raises EOFError (a
        truncated store: retrying cannot help)."""
        size = range_size(start, end, out)
        if size == 0:
            return out[:0]
        try:
            fd = os.open(key, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            done = _pread_full(fd, out[:size], int(start))
        finally:
            os.close(fd)
        if done < size:
            raise EOFError(f"{key} ends at byte {int(start) + done}, before {int(end)}: the store is truncated")
        return out[:size]


class S3File(RangedFile):
    """An S3 object read by ranged GETs (see the module docstring). Its size is read once, at open."""

    def __init__(self, url: str, retry_seconds: float = RETRY_SECONDS):
        from sfm.storage import clients
        from sfm.storage.objects import check_s3_url

        self.url = check_s3_url(url)
        self.bucket, _, self.key = url[len("s3://"):].partition("/")
        if not self.key or self.key.endswith("/"):
            raise SFMError(f"{url} names a bucket or folder, not a SEG-Y file; name the .sgy object itself")
        self.retry_seconds = float(retry_seconds)
        self.retries = 0  # transient failures retried so far
        self.reader = clients.range_reader(self.bucket)
        self.size = self._size(clients.boto_client())

    def _size(self, client) -> int:
        import botocore.exceptions

        try:
            return int(client.head_object(Bucket=self.bucket, Key=self.key)["ContentLength"])
        except botocore.exceptions.ClientError as err:
            status = int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            if status != 404:
                raise
        try:
            listed = client.list_objects_v2(Bucket=self.bucket, Prefix=self.key.rstrip("/") + "/", MaxKeys=1)
        except botocore.exceptions.ClientError:  # no such bucket, or no right to list it
            listed = {}
        if listed.get("KeyCount"):
            raise SFMError(f"{self.url} is a directory, not a SEG-Y file; name the .sgy file itself")
        raise SFMError(f"{self.url} does not exist. Check the path or URL.")

    def read_into(self, offset: int, buf) -> int:
        nbytes = max(0, min(len(memoryview(buf).cast("B")), self.size - offset))
        if nbytes == 0:
            return 0
        out = np.frombuffer(buf, dtype=np.uint8, count=nbytes)
        got = retrying(lambda: self.reader.read_into(self.key, offset, offset + nbytes, out), self.retry_seconds,
                       self._retried)
        if got is None:
            raise SFMError(f"{self.url} disappeared while it was read; ingest a file that is not being replaced")
        return nbytes

    def windows(self, start: int, stop: int, window: int) -> Iterator[tuple[int, memoryview]]:
        offsets = list(range(start, stop, window))
        ring = [bytearray(min(window, stop - start)) for _ in range(min(PREFETCH_WINDOWS + 1, len(offsets)))]

        def fetch(i: int) -> memoryview:
            view = memoryview(ring[i % len(ring)])[: min(window, stop - offsets[i])]
            if self.read_into(offsets[i], view) < len(view):
                raise SFMError(f"{self.url} is shorter than it was when opened; ingest a file that is not "
                               "being written")
            return view

        with ThreadPoolExecutor(max_workers=max(1, len(ring)), thread_name_prefix="sfm-prefetch") as pool:
            pending: deque = deque()
            submitted = 0
            try:
                for i, offset in enumerate(offsets):
                    # windows [i, submitted) hold a buffer each: window i's consumer is done with window i - 1
                    while submitted < min(len(offsets), i + len(ring)):
                        pending.append(pool.submit(fetch, submitted))
                        submitted += 1
                    yield offset, pending.popleft().result()
            finally:
                for future in pending:
                    future.cancel()

    def _retried(self, err: Exception, backoff) -> None:
        self.retries += 1

    def close(self) -> None:
        self.reader.close()


def open_ranged(url: str) -> RangedFile:
    """The file at ``url`` (a local path or ``s3://bucket/key``) for reading by offset; SFMError when it
    does not exist or is a directory."""
    from sfm.storage.objects import is_s3, normalize

    return S3File(url) if is_s3(url) else LocalFile(normalize(url))
