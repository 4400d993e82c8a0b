"""One rule for which storage failures are worth retrying, and one backoff: :func:`is_transient`, :class:`Backoff`.

Every retry loop of the pipeline asks these two: the loader's store wrapper
(:class:`sfm.storage.resilient_store.ResilientStore`) and the ranged reader ingest reads an ``s3://`` SEG-Y
through (:class:`sfm.storage.ranged_file.S3File`); :func:`retrying` is the loop for a blocking call.

Transient: an answer with HTTP status 5xx or 429, or an S3 code of throttling or a timeout
(:data:`TRANSIENT_CODES`, e.g. 503 SlowDown, 400 RequestTimeout), and every failure to get an answer at all
(a connection reset or refused, a timeout, a server restarting). Permanent: the other answers (403, 404,
416 range not satisfiable, a 200 to a ranged GET that a client refuses, ...), a code in
:data:`PERMANENT_CODES` whatever its status, and errors that say something is missing, denied, truncated or
a bug (:data:`PERMANENT_TYPES`, missing credentials).

An error is classified by the status and code of the answer where the client exposes them: botocore's
``ClientError`` (also inside s3fs's and aiobotocore's errors, found along ``__cause__``) and the loader's
own :class:`~sfm.storage.ranged_get.RangeReadError`. obstore gives them only in its message: that is read in
one place, :func:`_obstore_answer`.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
from typing import TypeVar

from sfm.errors import SFMError
from sfm.storage.clients import CREDENTIAL_CODES, obstore_available
from sfm.storage.ranged_get import RangeReadError

T = TypeVar("T")

TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "RequestTimeout",
                   "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable"}
PERMANENT_CODES = CREDENTIAL_CODES | {"NoSuchBucket", "NoSuchKey", "InvalidBucketName", "InvalidRange",
                                      "MethodNotAllowed", "NotImplemented", "NotPartial"}
PERMANENT_TYPES = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, EOFError, ValueError,
                   TypeError, KeyError, IndexError, AttributeError, NotImplementedError, MemoryError, SFMError)
FIRST_WAIT_S = 0.05  # the wait before the first retry; it doubles with every retry ...
LONGEST_WAIT_S = 5.0  # ... up to this


def is_transient(err: BaseException) -> bool:
    """True when retrying the operation that raised ``err`` may succeed (see the module docstring)."""
    if isinstance(err, PERMANENT_TYPES):
        return False
    answer = _answer(err)
    if answer is None:  # no answer came (a connection failed), or the client refused before asking
        return not _permanent_client_error(err)
    status, code = answer
    if code in PERMANENT_CODES:
        return False
    return code in TRANSIENT_CODES or status >= 500 or status == 429 or status == 0


def range_unsupported(err: BaseException) -> bool:
    """True when a client refused a server's answer to a ranged read: obstore rejects the 200 with exactly
    the requested bytes that ``rclone serve s3`` sends."""
    return (_answer(err) or (0, ""))[1] == "NotPartial"


def _answer(err: BaseException) -> tuple[int, str] | None:
    """(HTTP status, S3 error code) of the answer behind ``err`` or its ``__cause__`` chain; None when no
    client error with an answer is there."""
    import botocore.exceptions as bx

    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, RangeReadError):
            return err.status, err.code
        if isinstance(err, bx.ClientError):
            return (int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0),
                    err.response.get("Error", {}).get("Code", ""))
        answer = _obstore_answer(err)
        if answer is not None:
            return answer
        err = err.__cause__
    return None


_OBSTORE_STATUS = re.compile(r"status code: (\d{3})")
_S3_CODE = re.compile(r"<Code>([^<]{1,64})</Code>")


def _obstore_answer(err: BaseException) -> tuple[int, str] | None:
    """obstore's ``GenericError`` states the server's answer only in its text ("... non-2xx status code: 503
    Service Unavailable: <Error><Code>SlowDown</Code>..."), or that it refused a 200 to a ranged read
    ("non-partial response"); status 0 when it names none (the request failed before an answer came)."""
    if not obstore_available():
        return None
    import obstore.exceptions as ox

    if not isinstance(err, ox.GenericError):
        return None
    text = str(err)
    if "non-partial response" in text or "NotPartial" in text:
        return 200, "NotPartial"
    status, code = _OBSTORE_STATUS.search(text), _S3_CODE.search(text)
    return (int(status.group(1)) if status else 0), (code.group(1) if code else "")


def _permanent_client_error(err: BaseException) -> bool:
    """True for botocore's and obstore's error types that retrying cannot fix: no credentials, invalid
    parameters, paths or settings, and the answers obstore names by type (not found, denied)."""
    import botocore.exceptions as bx

    if isinstance(err, (bx.NoCredentialsError, bx.PartialCredentialsError, bx.ParamValidationError)):
        return True
    if obstore_available():
        import obstore.exceptions as ox

        return isinstance(err, (ox.PermissionDeniedError, ox.UnauthenticatedError, ox.InvalidPathError,
                                ox.NotSupportedError, ox.UnknownConfigurationKeyError, ox.NotFoundError))
    return False


class Backoff:
    """The waits between attempts at one operation: exponential from :data:`FIRST_WAIT_S` to at most
    :data:`LONGEST_WAIT_S`, each times a random factor in [0.5, 1] (readers that fail together do not all
    retry together), for up to ``seconds`` from the first attempt; ``stopped()`` (optional) ends them early."""

    def __init__(self, seconds: float, stopped: Callable[[], bool] | None = None):
        self.deadline = time.monotonic() + float(seconds)
        self.stopped = stopped
        self.retries = 0

    def wait(self, err: Exception) -> float:
        """Seconds to wait before trying again after ``err``; re-raises ``err`` when it is permanent
        (:func:`is_transient`), the time is up or the operation was stopped."""
        now = time.monotonic()
        if not is_transient(err) or now >= self.deadline or (self.stopped is not None and self.stopped()):
            raise err
        self.retries += 1
        wait = min(LONGEST_WAIT_S, FIRST_WAIT_S * 2 ** (self.retries - 1)) * random.uniform(0.5, 1.0)
        return min(wait, max(0.0, self.deadline - now))


def retrying(call: Callable[[], T], seconds: float, on_retry: Callable[[Exception, Backoff], None] | None = None,
             stopped: Callable[[], bool] | None = None) -> T:
    """``call()``, tried again after each transient failure with :class:`Backoff` (``seconds``, ``stopped``) until
    it succeeds; the last failure is raised. ``on_retry(err, backoff)`` is told of each retry before its wait."""
    backoff = Backoff(seconds, stopped)
    while True:
        try:
            return call()
        except Exception as err:  # noqa: BLE001  (classified by is_transient; permanent ones re-raised)
            wait = backoff.wait(err)
            if on_retry is not None:
                on_retry(err, backoff)
            time.sleep(wait)
