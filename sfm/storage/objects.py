"""One storage abstraction for every URL the pipeline touches: a local path or ``s3://bucket/prefix``.

Everything above this module speaks URLs. The S3 clients it uses (and every other S3 client of the
pipeline) are built in :mod:`sfm.storage.clients`, from the environment, so the same code runs on a
laptop, in CI against a loopback S3 server, and on a cluster. Credentials are never logged here, never
part of a URL (an ``s3://`` URL with ``user:pass@`` is refused), redacted from every error message.

Security rules (:mod:`sfm.storage.security`) are enforced here, where URLs and paths are built:

- the endpoint must be ``https://`` unless it is on loopback or ``SFM_ALLOW_INSECURE_S3=1`` is set;
- names that come from outside (landing file names, survey ids, model and run names) enter a path
  only through :func:`safe_join`, and :func:`join` never climbs out of its base with ``..``.

Atomicity: :func:`write_bytes` publishes an object in one step (a single S3 PUT, or a local write to
a temporary name followed by ``os.replace``), so a reader sees either nothing or the whole object.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import fsspec

from sfm.errors import SFMError
from sfm.storage.clients import ENDPOINT_ENV, boto_client, s3_endpoint_url, s3_filesystem, s3fs_options  # noqa: F401
from sfm.storage.security import name_problem, redact


def is_s3(url: str) -> bool:
    return str(url).startswith("s3://")


def check_s3_url(url: str) -> str:
    """``url`` itself; refused when it carries credentials (``s3://key:secret@bucket``)."""
    bucket = url[len("s3://"):].split("/", 1)[0]
    if "@" in bucket:
        raise SFMError(f"{redact(url)} carries credentials in the URL; remove them and use the AWS credential "
                       "chain (environment, profile, instance or pod role)")
    return url


def normalize(url: str | os.PathLike) -> str:
    """A canonical URL: s3 URLs unchanged (minus trailing slash), local paths made absolute."""
    url = str(url)
    if is_s3(url):
        return check_s3_url(url).rstrip("/")
    if url.startswith("file://"):
        url = url[len("file://") :]
    return str(Path(url).expanduser().absolute())


def join(url: str, *parts: str) -> str:
    """``url/part/...`` for parts the code itself chose; a ``..`` segment or NUL is refused.

    Names that come from outside go through :func:`safe_join` instead.
    """
    url = str(url).rstrip("/")
    for part in parts:
        part = str(part).strip("/")
        if "\0" in part or ".." in part.split("/"):
            raise SFMError(f"path part {part!r} would leave {redact(url)}; pass a plain name without '..'")
        if part:
            url = f"{url}/{part}"
    return url


def safe_join(url: str, *names: str, what: str = "name") -> str:
    """``url/name/...`` where each name came from outside and must be one plain path component.

    ``what`` says in the error what the name is (e.g. "landing file name", "run name"). The result
    always lies under ``url``: see :func:`sfm.storage.security.name_problem` for what is refused.
    """
    for name in names:
        problem = name_problem(name)
        if problem:
            raise SFMError(f"{what} {name!r} cannot be used in a storage path: {problem}; "
                           "rename it using letters, digits, spaces, '.', '_' or '-'")
    return join(url, *names)


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem for ``url`` and the path inside it."""
    url = str(url)
    if is_s3(url):
        fs = s3_filesystem()
        return fs, check_s3_url(url)[len("s3://") :].rstrip("/")
    return fsspec.filesystem("file"), normalize(url)


def _wrap(url: str, err: Exception) -> SFMError:
    return SFMError(redact(f"cannot access {url}: {type(err).__name__}: {err}. "
                           "Check the URL, the S3 endpoint and credentials."))


def exists(url: str) -> bool:
    fs, path = filesystem(url)
    try:
        return fs.exists(path)
    except (OSError, PermissionError) as err:
        raise _wrap(url, err) from err


def read_bytes(url: str) -> bytes:
    fs, path = filesystem(url)
    try:
        return fs.cat_file(path)
    except FileNotFoundError as err:
        raise SFMError(f"{url} does not exist. Check the path or URL.") from err


def write_bytes(url: str, data: bytes) -> None:
    """Publish ``data`` at ``url`` in one atomic step."""
    fs, path = filesystem(url)
    if is_s3(url):
        fs.pipe_file(path, data)
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_bytes_if_absent(url: str, data: bytes) -> bool:
    """Create ``url`` with ``data`` only if nothing is there yet; True if this call created it.

    Used to allocate names (registry versions) safely when several writers race. Local files use
    ``O_EXCL`` on a link; S3 uses a conditional PUT (``If-None-Match: *``).
    """
    fs, path = filesystem(url)
    if is_s3(url):
        import botocore.exceptions

        bucket, key = path.split("/", 1)
        client = boto_client()
        try:
            client.put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
        except botocore.exceptions.ClientError as err:
            code = err.response.get("Error", {}).get("Code", "")
            if code in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
                return False
            raise
        return True
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "wb") as fh:
        fh.write(data)
    try:
        os.link(tmp, path)  # atomic, fails if path exists
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    return True


def list_dir(url: str) -> list[str]:
    """Names (not URLs) directly under ``url``; empty if it does not exist."""
    fs, path = filesystem(url)
    try:
        entries = fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
    return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != path})


def list_tree(url: str) -> list[tuple[str, int]]:
    """Every object below ``url`` as sorted (key relative to ``url``, size in bytes); one listing (on S3, paged
    ListObjectsV2), no object read. Empty if nothing is there."""
    fs, path = filesystem(url)
    try:
        found = fs.find(path, detail=True)
    except FileNotFoundError:
        return []
    except (OSError, PermissionError) as err:
        raise _wrap(url, err) from err
    root = path.rstrip("/") + "/"
    return sorted((name[len(root):], int(info.get("size") or 0)) for name, info in found.items()
                  if name.startswith(root) and info.get("type", "file") != "directory")


def upload(local_path: str | os.PathLike, url: str) -> None:
    """Copy a local file or directory tree to ``url``. Files appear whole (see :func:`write_bytes`)."""
    local_path = Path(local_path)
    if local_path.is_dir():
        for child in sorted(local_path.rglob("*")):
            if child.is_file():
                upload(child, join(url, child.relative_to(local_path).as_posix()))
        return
    fs, path = filesystem(url)
    if is_s3(url):
        fs.put_file(str(local_path), path)
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    shutil.copyfile(local_path, tmp)
    os.replace(tmp, path)


def upload_grown(local_path: str | os.PathLike, url: str, copied: int = 0) -> None:
    """Bring ``url``, a copy of a local file that only grows (an event log) whose first ``copied`` bytes it
    holds, up to the file's current bytes: on S3 one whole-object PUT (objects cannot be appended to); locally the
    new bytes appended in place (the whole file written when the copy is not ``copied`` long), so that a reader
    following the file, like TensorBoard, sees it grow as it would the original, and no temporary name appears
    beside it."""
    if is_s3(url):
        upload(local_path, url)
        return
    _, path = filesystem(url)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    if not (copied and os.path.exists(path) and os.path.getsize(path) == copied):
        copied = 0
    with open(local_path, "rb") as src, open(path, "r+b" if copied else "wb") as dst:
        src.seek(copied)
        dst.seek(copied)
        shutil.copyfileobj(src, dst)
        dst.truncate()


def download(url: str, local_path: str | os.PathLike) -> None:
    """Copy the object (or every object under the prefix) at ``url`` to ``local_path``.

    A prefix holding keys with ``..`` segments is refused: they would land outside ``local_path``.
    """
    fs, path = filesystem(url)
    try:
        fs.get(path, str(local_path), recursive=fs.isdir(path))
    except FileNotFoundError as err:
        raise SFMError(f"{url} does not exist. Check the path or URL.") from err
    except ValueError as err:  # fsspec's check that every copied name stays inside the destination
        if "outside the destination" not in str(err):
            raise
        raise SFMError(f"{url} holds object names with '..' that would be copied outside {local_path}; "
                       "rename those objects") from err


def remove(url: str) -> None:
    fs, path = filesystem(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def local_copy(url: str, workdir: str | os.PathLike) -> str:
    """A local file path holding the object at ``url`` (the path itself when it is local)."""
    if not is_s3(url):
        path = normalize(url)
        if not os.path.exists(path):
            raise SFMError(f"{url} does not exist. Check the path.")
        return path
    name = url.rsplit("/", 1)[-1]
    if name_problem(name):  # keep the object's name only where it is a plain local file name too
        name = "source.sgy" if name.lower().endswith((".sgy", ".segy")) else "source"
    target = Path(tempfile.mkdtemp(dir=workdir)) / name
    download(url, target)
    return str(target)


def zarr_store(url: str, read_only: bool = False):
    """A zarr v3 store for ``url`` (LocalStore or FsspecStore over s3fs with async I/O)."""
    import zarr.storage

    if is_s3(url):
        return zarr.storage.FsspecStore.from_url(check_s3_url(url), storage_options=s3fs_options(),
                                                 read_only=read_only)
    return zarr.storage.LocalStore(normalize(url), read_only=read_only)


def read_head(url: str, nbytes: int) -> tuple[bytes, int]:
    """The first ``nbytes`` of the object at ``url`` and its total size, without reading the rest."""
    fs, path = filesystem(url)
    try:
        size = int(fs.size(path))
        if fs.isdir(path):
            raise SFMError(f"{url} is a directory, not a file; name the file itself")
        return fs.cat_file(path, start=0, end=min(nbytes, size)), size
    except FileNotFoundError as err:
        raise SFMError(f"{url} does not exist. Check the path or URL.") from err


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (one of another user counts as alive): what decides if a
    local file a process left (a temporary object, a lock) is still its writer's."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def split_urls(text: str) -> list[str]:
    """The URLs of a ``--surveys`` / ``--held-out`` value: comma-separated, or a JSON list (for names
    that contain commas; :func:`join_urls` writes one when needed)."""
    text = str(text or "").strip()
    if text.startswith("["):
        try:
            urls = json.loads(text)
        except ValueError:
            urls = None
        if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
            raise SFMError(f"survey list {text[:80]!r} starts with '[' but is not a JSON list of URLs; "
                           "give comma-separated URLs or a JSON list of strings")
        return [u.strip() for u in urls if u.strip()]
    return [part.strip() for part in text.split(",") if part.strip()]


def join_urls(urls: list[str]) -> str:
    """The inverse of :func:`split_urls`: comma-separated, or a JSON list if a URL contains a comma."""
    return json.dumps(list(urls)) if any("," in u for u in urls) else ",".join(urls)
