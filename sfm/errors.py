"""The one exception type for errors a user can cause, and what its messages may not carry.

Bad SEG-Y, a wrong byte location, an unreachable bucket, a missing survey: each is raised as
:class:`SFMError` with a message that names the input and says how to fix it. The CLI, the flows and the
training ranks print it on one line and exit non-zero (:func:`sfm.user_errors.describe_user_error`). Bugs stay
ordinary exceptions with tracebacks.

Messages are redacted as they are made (:func:`redact`): no credential reaches a log through them. This module
is the bottom of the package: it imports nothing from ``sfm``.
"""

from __future__ import annotations

import os
import re

MASK = "***"

# Environment variables whose values are secrets (or identify one) wherever they appear.
SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ACCESS_KEY_ID",
              "AWS_CONTAINER_AUTHORIZATION_TOKEN", "AWS_WEB_IDENTITY_TOKEN")
_SECRET_ENV_SUFFIXES = ("_SECRET", "_SECRET_KEY", "_SECRET_ACCESS_KEY", "_PASSWORD", "_TOKEN", "_ACCESS_KEY_ID",
                        "_API_KEY", "_AUTH_KEY")
_MIN_SECRET_LEN = 8  # shorter values ("1", "true") would redact ordinary words

_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^/?#@\s]+)@")
_SIGNED_QUERY = re.compile(
    r"(?P<key>\b(?:X-Amz-Signature|X-Amz-Credential|X-Amz-Security-Token|Signature|AWSAccessKeyId|"
    r"x-amz-security-token)=)(?P<value>[^&\s\"']+)", re.IGNORECASE)
_ACCESS_KEY_ID = re.compile(r"\b(?:AKIA|ASIA|AIDA|AROA)[A-Z0-9]{16}\b")
_AUTH_HEADER = re.compile(r"(?P<key>\b(?:Authorization|X-Amz-Security-Token)['\"]?\s*[:=]\s*['\"]?)(?P<value>[^'\"\n,}]+)",
                          re.IGNORECASE)


def _secret_values() -> list[str]:
    values = set()
    for name, value in os.environ.items():
        if name in SECRET_ENV or name.upper().endswith(_SECRET_ENV_SUFFIXES):
            if value and len(value) >= _MIN_SECRET_LEN:
                values.add(value)
    return sorted(values, key=len, reverse=True)  # longest first: a secret containing another is masked whole


def redact(text: str) -> str:
    """``text`` with credentials replaced by ``***``: userinfo in URLs (``scheme://user:pass@host``), presigned-URL
    signatures and tokens, AWS access key ids, and the values of the credential environment variables set in this
    process."""
    text = str(text)
    for value in _secret_values():
        if value in text:
            text = text.replace(value, MASK)
    text = _USERINFO.sub(lambda m: f"{m.group('scheme')}{MASK}@", text)
    text = _SIGNED_QUERY.sub(lambda m: f"{m.group('key')}{MASK}", text)
    text = _AUTH_HEADER.sub(lambda m: f"{m.group('key')}{MASK}", text)
    return _ACCESS_KEY_ID.sub(MASK, text)


class SFMError(Exception):
    """A problem with the user's input or environment, with a one-line message naming the fix."""

    def __init__(self, message: str):
        super().__init__(redact(" ".join(str(message).split())))
