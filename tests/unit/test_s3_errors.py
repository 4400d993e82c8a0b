"""S3 connection and credential failures reach the user as one line naming the endpoint or the
credential chain (sfm.storage.clients.user_error), from the CLI as from the flow's steps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import free_port
from sfm.storage.clients import user_error

PROJECT = Path(__file__).resolve().parents[2]


def run_ingest(tmp_path, **env):
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "SFM_S3_ENDPOINT_URL"}
    base.update(AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
                AWS_MAX_ATTEMPTS="1", AWS_EC2_METADATA_DISABLED="true", **env)
    return subprocess.run([sys.executable, "-m", "sfm.cli", "ingest", "s3://bucket/landing/a.sgy", "--data-root",
                           str(tmp_path / "out")], cwd=PROJECT, env=base, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(150)
def test_unreachable_endpoint_is_one_line_naming_it(tmp_path):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc = run_ingest(tmp_path, SFM_S3_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach the S3 endpoint" in lines[0] and endpoint in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(150)
def test_missing_credentials_are_one_line_naming_the_chain(tmp_path):
    proc = run_ingest(tmp_path, SFM_S3_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no AWS credentials" in lines[0] and "AWS_PROFILE" in lines[0], proc.stderr


def test_classification_by_type_and_error_code():
    import botocore.exceptions as bx

    wrapped = OSError("s3fs gave up")
    wrapped.__cause__ = bx.EndpointConnectionError(endpoint_url="http://x")
    assert "cannot reach" in str(user_error(wrapped))
    denied = bx.ClientError({"Error": {"Code": "InvalidAccessKeyId", "Message": "no"}}, "GetObject")
    assert "refused the credentials" in str(user_error(denied)) and "InvalidAccessKeyId" in str(user_error(denied))
    missing = bx.ClientError({"Error": {"Code": "NoSuchKey", "Message": "no"}}, "GetObject")
    assert user_error(missing) is None and user_error(ValueError("a bug")) is None
