"""Every S3 client the pipeline uses is built here, from the environment, with one policy.

Clients: botocore/boto3 (:func:`boto_client`: manifest and registry writes, presigned URLs),
s3fs (:func:`s3fs_options`, :func:`s3fs_zarr_store`: fsspec, zarr, xarray and torch's distributed
checkpoints), obstore (:func:`obstore_zarr_store`: the loader's metadata reads) and the loader's own
ranged-GET transport (:mod:`sfm.storage.ranged_get`, which signs through :func:`boto_client`).

One set of settings for all of them:

- endpoint (:func:`s3_endpoint_url`): ``SFM_S3_ENDPOINT_URL``, else ``AWS_ENDPOINT_URL_S3`` /
  ``AWS_ENDPOINT_URL``, else ``METAFLOW_S3_ENDPOINT_URL`` (one setting serves both the data root and
  Metaflow's datastore), else the AWS config file's; refused unless https, loopback or opted in;
- region (:func:`s3_region`): ``AWS_REGION``, then ``AWS_DEFAULT_REGION``, then us-east-1;
- credentials: the usual AWS chain (environment, profile, instance or pod role);
- checksums: computed and validated only when an operation requires them (non-AWS servers break
  botocore's defaults on ranged reads);
- retries (:func:`retries`): clients used directly make ``AWS_MAX_ATTEMPTS`` (default 10) attempts;
  clients under the loader's :class:`sfm.storage.resilient_store.ResilientStore` (which retries for
  ``data.retry_seconds`` itself, :mod:`sfm.storage.retry`) make only ``WRAPPED_RETRIES`` quick attempts,
  so retries never multiply.
"""

from __future__ import annotations

import datetime as dt
import functools
import os
from typing import Any

from sfm.errors import SFMError
from sfm.storage.security import endpoint_problem

RETRIES = 10  # attempts of a client used directly (adaptive backoff); AWS_MAX_ATTEMPTS overrides it


def retries() -> int:
    """Attempts of a client used directly: AWS_MAX_ATTEMPTS when set, else :data:`RETRIES`."""
    value = os.environ.get("AWS_MAX_ATTEMPTS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else RETRIES
WRAPPED_RETRIES = 2  # attempts of a client under ResilientStore, whose own retries span minutes

_CHECKSUM_ENV = {
    "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
    "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",
}


ENDPOINT_ENV = ("SFM_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "METAFLOW_S3_ENDPOINT_URL")


def s3_endpoint_url() -> str | None:
    """The S3 endpoint from the environment (None: AWS); refused unless https, loopback or opted in.

    Every endpoint variable that is set is checked, not only the one used here, so an insecure
    ``METAFLOW_S3_ENDPOINT_URL`` (Metaflow's own datastore) is refused as soon as sfm touches S3.
    """
    chosen = None
    for name in ENDPOINT_ENV:
        value = os.environ.get(name, "").strip()
        if value:
            problem = endpoint_problem(value)
            if problem:
                raise SFMError(f"{problem} (from ${name})")
            chosen = chosen or value
    if chosen is None:
        configured = _config_file_endpoint(*(os.environ.get(k, "") for k in _AWS_CONFIG_ENV))
        problem = configured and endpoint_problem(configured)
        if problem:
            raise SFMError(f"{problem} (from endpoint_url in the AWS config file of profile "
                           f"{os.environ.get('AWS_PROFILE') or os.environ.get('AWS_DEFAULT_PROFILE') or 'default'})")
    return chosen


# what decides which endpoint_url botocore takes from the AWS config file
_AWS_CONFIG_ENV = ("AWS_CONFIG_FILE", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS")


@functools.lru_cache(maxsize=8)
def _config_file_endpoint(*_env: str) -> str | None:
    """The S3 endpoint botocore resolves without an endpoint variable: AWS's own, or an ``endpoint_url``
    from the AWS config file (top level of the profile or its ``services`` section), which boto3 and
    s3fs would use. Cached per value of the variables that decide it (``_env``)."""
    import botocore.session
    from botocore import UNSIGNED
    from botocore.config import Config

    try:
        client = botocore.session.Session().create_client(
            "s3", region_name=s3_region(),
            config=Config(signature_version=UNSIGNED))
    except Exception:  # an unreadable config or unknown profile: boto3 reports it on first use
        return None
    return client.meta.endpoint_url


def s3fs_options() -> dict[str, Any]:
    """Keyword arguments for ``s3fs.S3FileSystem`` (and zarr's FsspecStore) from the environment."""
    for key, value in _CHECKSUM_ENV.items():
        os.environ.setdefault(key, value)
    options: dict[str, Any] = {
        "use_listings_cache": False,
        "config_kwargs": {
            "request_checksum_calculation": "when_required",
            "response_checksum_validation": "when_required",
            "retries": {"max_attempts": retries(), "mode": "adaptive"},
        },
    }
    endpoint = s3_endpoint_url()
    if endpoint:
        options["client_kwargs"] = {"endpoint_url": endpoint}
    return options


def s3_region() -> str:
    """The region every client signs for: AWS_REGION, then AWS_DEFAULT_REGION, then us-east-1."""
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"


def boto_client(**config: Any):
    """A boto3 S3 client for this environment's endpoint and credentials; ``config``: more
    ``botocore.config.Config`` options (e.g. ``signature_version``)."""
    import boto3
    from botocore.config import Config

    for key, value in _CHECKSUM_ENV.items():
        os.environ.setdefault(key, value)
    return boto3.client(
        "s3",
        endpoint_url=s3_endpoint_url(),
        config=Config(
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            retries={"max_attempts": retries(), "mode": "adaptive"},
            **config,
        ),
    )


def obstore_available() -> bool:
    try:
        import obstore  # noqa: F401
    except ImportError:
        return False
    return True


def obstore_zarr_store(url: str):
    """A read-only zarr ObjectStore over obstore's S3Store for ``s3://bucket/prefix`` (under
    ResilientStore: ``WRAPPED_RETRIES`` quick attempts)."""
    import zarr.storage
    from obstore.store import S3Store

    bucket, _, prefix = url[len("s3://"):].partition("/")
    endpoint = s3_endpoint_url()
    config: dict[str, Any] = {"region": s3_region()}
    client: dict[str, Any] = {"connect_timeout": "5s", "timeout": "30s", "pool_idle_timeout": "20s"}
    if endpoint:
        config["endpoint"] = endpoint
        client["allow_http"] = endpoint.startswith("http://")
    provider = None
    if not os.environ.get("AWS_ACCESS_KEY_ID") and (os.environ.get("AWS_PROFILE") or
                                                     os.path.exists(os.path.expanduser("~/.aws/credentials"))):
        from obstore.auth.boto3 import Boto3CredentialProvider  # profiles: obstore's own chain lacks them

        provider = Boto3CredentialProvider()
    retry = {"max_retries": WRAPPED_RETRIES, "retry_timeout": dt.timedelta(seconds=10),
             "backoff": {"init_backoff": dt.timedelta(milliseconds=50), "max_backoff": dt.timedelta(seconds=1)}}
    s3 = S3Store(bucket, prefix=prefix or None, config=config, client_options=client, retry_config=retry,
                 credential_provider=provider)
    return zarr.storage.ObjectStore(s3, read_only=True)


def s3fs_zarr_store(url: str, read_only: bool = True, short_retries: bool = False):
    """A zarr FsspecStore over s3fs; ``short_retries`` for one under ResilientStore."""
    import zarr.storage

    options = s3fs_options()
    if short_retries:
        options["config_kwargs"] = {**options["config_kwargs"],
                                    "retries": {"max_attempts": WRAPPED_RETRIES, "mode": "standard"}}
    store = zarr.storage.FsspecStore.from_url(url, storage_options=options, read_only=read_only)
    if short_retries:
        store.fs.retries = 1  # s3fs's own retry loop (a class attribute; this instance is ours: its options differ)
    return store


def s3_filesystem():
    """An ``s3fs.S3FileSystem`` (through fsspec) with :func:`s3fs_options`."""
    import fsspec

    return fsspec.filesystem("s3", **s3fs_options())


def range_reader(bucket: str):
    """The loader's ranged-GET transport for ``bucket`` (:class:`sfm.storage.ranged_get.S3RangeReader`),
    which presigns each GET with :func:`boto_client`."""
    from sfm.storage.ranged_get import S3RangeReader

    return S3RangeReader(bucket)


CREDENTIAL_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                    "AccessDenied", "AllAccessDisabled"}


def user_error(err: BaseException) -> SFMError | None:
    """The one-line error a user can act on for an S3 client failure (unreachable endpoint, no or
    wrong credentials), classified by exception type and S3 error code; None for anything else."""
    try:
        import botocore.exceptions as bx
    except ImportError:  # pragma: no cover - botocore is a dependency
        return None
    endpoint = s3_endpoint_url() or "AWS S3"
    seen: set[int] = set()
    while err is not None and id(err) not in seen:  # s3fs and aiobotocore wrap the botocore error
        seen.add(id(err))
        if isinstance(err, (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ProxyConnectionError)):
            return SFMError(f"cannot reach the S3 endpoint {endpoint}; check SFM_S3_ENDPOINT_URL (or "
                            "AWS_ENDPOINT_URL) and that the server is up")
        if isinstance(err, (bx.NoCredentialsError, bx.PartialCredentialsError)):
            return SFMError(f"no AWS credentials for {endpoint}: the credential chain (AWS_ACCESS_KEY_ID/"
                            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws/credentials, instance or pod role) "
                            "found none; set one of them")
        if isinstance(err, bx.ClientError):
            code = err.response.get("Error", {}).get("Code", "")
            if code in CREDENTIAL_CODES:
                return SFMError(f"S3 at {endpoint} refused the credentials from the AWS credential chain ({code}); "
                                "check the key, the secret and the bucket policy")
        err = err.__cause__ or err.__context__
    return None
