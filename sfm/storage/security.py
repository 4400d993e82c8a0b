"""Security rules of the storage layer: vet S3 endpoints and outside names (credentials are taken out of any
text by :func:`sfm.errors.redact`).

Pure functions without I/O or heavy imports, so :mod:`sfm.storage.objects` can enforce the rules where URLs and
paths are built:

- :func:`endpoint_problem` says why an S3 endpoint URL must not be used: plain HTTP is allowed only on
  loopback (``127.0.0.0/8``, ``::1``, ``localhost``) or with ``SFM_ALLOW_INSECURE_S3=1``; an endpoint
  never carries credentials.
- :func:`name_problem` says why a name that came from outside (a landing file name, a survey id, a
  model or run name) cannot be one component of a storage path.
"""

from __future__ import annotations

import ipaddress
import os
import unicodedata
from urllib.parse import unquote, urlsplit

from sfm.errors import redact

INSECURE_ENV = "SFM_ALLOW_INSECURE_S3"


def insecure_allowed() -> bool:
    return os.environ.get(INSECURE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def is_loopback_host(host: str | None) -> bool:
    """True for ``localhost`` and loopback IP literals (127.0.0.0/8, ::1, ::ffff:127.x); no DNS lookup."""
    if not host:
        return False
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or bool(mapped and mapped.is_loopback)


def endpoint_problem(url: str, *, allow_insecure: bool | None = None) -> str | None:
    """Why the S3 endpoint ``url`` must not be used (one line), or None when it may."""
    allow_insecure = insecure_allowed() if allow_insecure is None else allow_insecure
    shown = redact(url)
    try:
        parts = urlsplit(str(url).strip())
        host = parts.hostname
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError as err:
        return f"S3 endpoint {shown!r} is not a valid URL ({err}); use https://HOST[:PORT]"
    if parts.scheme not in ("http", "https") or not host:
        return f"S3 endpoint {shown!r} is not an http(s) URL; use https://HOST[:PORT]"
    if parts.username is not None or parts.password is not None:
        return (f"S3 endpoint {shown} carries credentials in the URL; remove them and use the AWS credential "
                "chain (environment, profile, instance or pod role)")
    if parts.scheme == "http" and not is_loopback_host(host) and not allow_insecure:
        return (f"S3 endpoint {shown} is plain http on a non-loopback host, so credentials and data would cross "
                f"the network unencrypted; use https:// (or, on a trusted network only, set {INSECURE_ENV}=1 "
                "or pass --allow-insecure-s3)")
    return None


_BAD_CATEGORIES = {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"}  # controls, format (bidi overrides), separators
MAX_NAME_CHARS = 200


def _component_problem(name: str) -> str | None:
    if not name:
        return "it is empty"
    if len(name) > MAX_NAME_CHARS:
        return f"it is longer than {MAX_NAME_CHARS} characters"
    if "/" in name or "\\" in name:
        return "it contains a path separator"
    if name.startswith(".."):
        return "it starts with '..', which climbs out of its folder"
    if name.startswith("."):
        return "it starts with '.' (hidden names are reserved)"
    for ch in name:
        if unicodedata.category(ch) in _BAD_CATEGORIES:
            return f"it contains the control or invisible character U+{ord(ch):04X}"
    return None


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be one component of a storage path, or None when it can.

    Letters (any script), digits, spaces and punctuation are fine. Refused: empty or very long names,
    path separators, leading dots (``..``, hidden names), control and invisible characters (newline,
    NUL, bidi overrides), and anything that turns into one of those after percent-decoding or Unicode
    NFKC folding (``%2e%2e``, ``%2F``, fullwidth dots and slashes), since other tools apply both.
    """
    if not isinstance(name, str):
        return "it is not a string"
    seen = set()
    pending = [name]
    while pending:
        candidate = pending.pop()
        if candidate in seen:
            continue
        seen.add(candidate)
        problem = _component_problem(candidate)
        if problem:
            return problem if candidate == name else f"{problem} once decoded ({candidate!r})"
        pending.extend({unquote(candidate), unicodedata.normalize("NFKC", candidate)} - seen)
        if len(seen) > 8:
            break
    return None


__all__ = ["endpoint_problem", "name_problem", "is_loopback_host", "insecure_allowed", "INSECURE_ENV"]
