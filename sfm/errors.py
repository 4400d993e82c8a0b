"""The one exception type for errors a user can cause.

Bad SEG-Y, a wrong byte location, an unreachable bucket, a missing survey: each is raised as
:class:`SFMError` with a message that names the input and says how to fix it. The CLI and the flow
print it on one line and exit non-zero. Bugs stay ordinary exceptions with tracebacks.
Messages are redacted (:func:`sfm.storage.security.redact`): no credential reaches a log through them.
"""

from sfm.storage.security import redact


class SFMError(Exception):
    """A problem with the user's input or environment, with a one-line message naming the fix."""

    def __init__(self, message: str):
        super().__init__(redact(" ".join(str(message).split())))
