"""The one exception type for errors a user can cause.

Bad SEG-Y, a wrong byte location, an unreachable bucket, a missing survey: each is raised as
:class:`SFMError` with a message that names the input and says how to fix it. The CLI and the flow
print it on one line and exit non-zero. Bugs stay ordinary exceptions with tracebacks.
Messages are redacted (:func:`sfm.storage.security.redact`): no credential reaches a log through them.
"""

import contextlib
from typing import Iterator

from sfm.storage.security import redact


class SFMError(Exception):
    """A problem with the user's input or environment, with a one-line message naming the fix."""

    def __init__(self, message: str):
        super().__init__(redact(" ".join(str(message).split())))


@contextlib.contextmanager
def reported_as(kind: type[Exception]) -> Iterator[None]:
    """Re-raise the errors a user can fix as ``kind`` (a flow's one-line input error) with their message and no
    traceback: an :class:`SFMError`, or an unreachable S3 endpoint or missing credentials
    (:func:`sfm.storage.clients.user_error`). Bugs keep theirs."""
    try:
        yield
    except SFMError as err:
        raise kind(str(err)) from None
    except Exception as err:
        from sfm.storage.clients import user_error

        problem = user_error(err)
        if problem is None:
            raise
        raise kind(str(problem)) from None
