"""Blocking ranged GETs of S3 objects straight into the caller's buffer: the loader's brick transport.

The crop loader reads each brick (a few MB) once and decodes it at once, on its own read thread.
General clients cost more than the bytes (BENCHMARKS.md "Streaming": s3fs spends its CPU in the
Python of aiobotocore and aiohttp, obstore allocates afresh per response, which the loader then
decodes from). Here each read is one ``http.client`` request on the thread's own keep-alive
connection, and the body goes from the socket into a buffer the thread reuses (``readinto``), so
most of the cost is the kernel's receive path. It also accepts what ``rclone serve s3`` answers to a
range, 200 with exactly the requested bytes, which obstore refuses.

Addressing and signing stay botocore's: a GET URL per object is presigned by a boto3 client built
as :mod:`sfm.storage.objects` builds every other (endpoint, region, path or virtual-host style, credentials
and session tokens from the usual chain), reused for :data:`URL_REUSE_S` and signed for longer. A
``Range`` header is not part of a presigned URL's signature, so one URL serves every range of its
object. Credentials never appear in errors (the query string is dropped from every message).

Not used behind an HTTP(S) proxy (``http.client`` does not go through one); the loader then reads
through obstore or s3fs (:func:`sfm.storage.resilient_store.open_survey_store`).
"""

from __future__ import annotations

import http.client
import os
import re
import ssl
import threading
import time
import urllib.parse
import urllib.request

import numpy as np

URL_TTL_S = 3600  # a presigned URL's validity
URL_REUSE_S = 900  # presign again after this long (credentials may have rotated meanwhile)
_CODE = re.compile(rb"<Code>([^<]{1,64})</Code>")


class RangeReadError(Exception):
    """An S3 answer that is not the requested bytes: its HTTP ``status`` and S3 error ``code`` (whether it is
    worth retrying: :func:`sfm.storage.retry.is_transient`)."""

    def __init__(self, message: str, status: int, code: str = ""):
        super().__init__(message)
        self.status, self.code = status, code


def reachable_directly(endpoint: str | None) -> bool:
    """False when requests to ``endpoint`` (None: AWS) would have to go through a proxy."""
    parts = urllib.parse.urlsplit(endpoint or "https://s3.amazonaws.com")
    return not urllib.request.getproxies().get(parts.scheme) or bool(urllib.request.proxy_bypass(parts.hostname or ""))


def range_size(start: int, end: int, out: np.ndarray) -> int:
    """How many bytes ``[start, end)`` holds (0 for an empty range), after checking that ``out`` is a
    uint8 buffer with room for them: the check every range reader's ``read_into`` makes first."""
    size = max(0, int(end) - int(start))
    if size and (out.dtype != np.uint8 or out.size < size):
        raise ValueError(f"out must be a uint8 buffer of at least {size} bytes")
    return size


class S3RangeReader:
    """Ranged GETs of one bucket's objects, one keep-alive connection per calling thread.

    Args:
        bucket: the bucket every key is in.
        timeout_s: connect and per-read socket timeout.
    """

    def __init__(self, bucket: str, timeout_s: float = 30.0):
        self.bucket = bucket
        self.timeout_s = float(timeout_s)
        self._urls: dict[str, tuple[float, urllib.parse.SplitResult]] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._client = None
        self._ssl: ssl.SSLContext | None = None

    def __getstate__(self):
        raise TypeError("S3RangeReader holds connections; make one per process")

    # ---- URLs and connections ------------------------------------------------------------------
    def _presigner(self):
        with self._lock:
            if self._client is None:
                from sfm import storage

                self._client = storage.boto_client(signature_version="s3v4")
            return self._client

    def _url(self, key: str, fresh: bool = False) -> urllib.parse.SplitResult:
        now = time.monotonic()
        hit = self._urls.get(key)
        if hit is not None and not fresh and now - hit[0] < URL_REUSE_S:
            return hit[1]
        url = self._presigner().generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=URL_TTL_S)
        parts = urllib.parse.urlsplit(url)
        self._urls[key] = (now, parts)
        return parts

    def _connection(self, parts: urllib.parse.SplitResult) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection to the URL's host, and whether it was used before."""
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        where = (parts.scheme, parts.hostname, parts.port)
        conn = conns.get(where)
        if conn is not None:
            return conn, True
        if parts.scheme == "https":
            conn = http.client.HTTPSConnection(parts.hostname, parts.port, timeout=self.timeout_s,
                                               context=self._ssl_context())
        else:
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=self.timeout_s)
        conns[where] = conn
        return conn, False

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            bundle = os.environ.get("AWS_CA_BUNDLE")
            if not bundle:
                from botocore.httpsession import get_cert_path

                bundle = get_cert_path(True)
            self._ssl = ssl.create_default_context(cafile=bundle if isinstance(bundle, str) else None)
        return self._ssl

    def _drop(self, parts: urllib.parse.SplitResult) -> None:
        conn = getattr(self._local, "conns", {}).pop((parts.scheme, parts.hostname, parts.port), None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Close this thread's connections (others close theirs when their thread ends)."""
        for conn in getattr(self._local, "conns", {}).values():
            conn.close()
        self._local.conns = {}

    # ---- reading ----------------------------------------------------------------------------------
    def read_into(self, key: str, start: int, end: int, out: np.ndarray) -> np.ndarray | None:
        """Bytes ``[start, end)`` of object ``key`` as a view of ``out`` (uint8, at least ``end - start``
        long); None when there is no such object.

        Raises :class:`RangeReadError` for an answer that is not those bytes (its status and S3 error
        code), and OSError / ``http.client.HTTPException`` when the connection fails; a failed connection
        is closed, so the next call opens a new one.
        """
        size = range_size(start, end, out)
        if size == 0:
            return out[:0]
        presigned_again = False
        while True:
            parts = self._url(key, fresh=presigned_again)
            conn, reused = self._connection(parts)
            try:
                conn.request("GET", f"{parts.path}?{parts.query}", headers={"Range": f"bytes={start}-{end - 1}"})
                resp = conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self._drop(parts)
                if reused:  # the server closed the idle keep-alive connection: try once on a new one
                    continue
                raise
            except BaseException:
                self._drop(parts)
                raise
            try:
                if resp.status in (200, 206):
                    return self._body(resp, key, int(start), size, out)
                body = resp.read(64 << 10)
            except BaseException:
                self._drop(parts)
                raise
            if resp.will_close:
                self._drop(parts)
            match = _CODE.search(body)
            code = match.group(1).decode("ascii", "replace") if match else ""
            if resp.status == 404 and code in ("NoSuchKey", ""):
                return None
            if resp.status == 403 and not presigned_again:  # expired URL or rotated keys: presign again, once
                presigned_again = True
                continue
            wrong_region = resp.status in (301, 307) or code in ("PermanentRedirect", "AuthorizationHeaderMalformed")
            hint = "; set AWS_REGION to the bucket's region" if wrong_region else ""
            raise RangeReadError(f"GET s3://{self.bucket}/{key} bytes {start}-{end - 1}: HTTP {resp.status} "
                                 f"{code or resp.reason}{hint}", resp.status, code)

    def _body(self, resp: http.client.HTTPResponse, key: str, start: int, size: int, out: np.ndarray) -> np.ndarray:
        """Read exactly the requested range's bytes into ``out``, after checking the answer is that range."""
        length = resp.getheader("Content-Length")
        content_range = resp.getheader("Content-Range") or ""
        got_start = re.match(r"bytes (\d+)-", content_range)
        if (length is None or int(length) != size or (got_start and int(got_start.group(1)) != start)
                or (resp.status == 206 and not got_start)):
            resp.close()
            raise RangeReadError(f"GET s3://{self.bucket}/{key} bytes {start}-{start + size - 1}: the server "
                                 f"answered {resp.status} with {length} bytes ({content_range or 'no Content-Range'})"
                                 ", not the requested range", resp.status)
        view = memoryview(out)[:size]
        done = 0
        while done < size:
            n = resp.readinto(view[done:])
            if not n:
                raise http.client.IncompleteRead(bytes(0), size - done)
            done += n
        return out[:size]
