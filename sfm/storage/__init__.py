"""Everything that touches bytes in a store: URLs (a local path or ``s3://bucket/prefix``) and S3.

- :mod:`sfm.storage.objects`: the URL layer every other module speaks (join, read, write, list,
  create-if-absent, zarr stores, uploads and downloads). ``from sfm import storage`` gives its
  functions, e.g. ``storage.read_bytes(url)``.
- :mod:`sfm.storage.retry`: which failures are worth retrying (:func:`~sfm.storage.retry.is_transient`) and
  the one backoff every retry loop waits by.
- :mod:`sfm.storage.resilient_store`: a survey's zarr store for reading (:func:`open_survey_store`), retried
  and counted.
- :mod:`sfm.storage.ranged_get`: the loader's blocking ranged GETs into a caller's buffer.
- :mod:`sfm.storage.ranged_file`: one file's bytes by offset, local (preadv, mmap) or S3 (those ranged
  GETs, retried, fetched ahead): what ingest reads a SEG-Y through, without a local copy.
- :mod:`sfm.storage.security`: redaction and endpoint / name rules (pure, no I/O).
- :mod:`sfm.storage.iam`: the least-privilege IAM policy per component.

The face is lazy so that the pure modules (security) import without fsspec.
"""

from __future__ import annotations

__all__ = ["is_s3", "ENDPOINT_ENV", "s3_endpoint_url", "s3fs_options", "normalize", "join", "safe_join",
           "filesystem", "exists", "read_bytes", "write_bytes", "write_bytes_if_absent", "boto_client", "list_dir",
           "list_tree", "upload", "upload_grown", "download", "remove", "local_copy", "zarr_store", "read_head",
           "process_alive", "split_urls", "join_urls"]


def __getattr__(name: str):
    if name in __all__:
        from sfm.storage import objects

        return getattr(objects, name)
    raise AttributeError(f"module 'sfm.storage' has no attribute {name!r}")
