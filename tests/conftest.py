"""Shared fixtures: real SEG-Y test files, an S3 server on loopback, an isolated Metaflow home."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

# Two xdist workers share the cores, so a test's torch threads are nearly always oversubscribed, and GNU
# OpenMP's threads spin at each barrier while the thread they wait for is descheduled, which makes
# torch-heavy tests several times slower (measured in benchmarks/history/ci.md). Set before torch
# loads OpenMP here, and inherited by every process a test starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# torch must be imported before metaflow.Runner loads the flow in this process: Metaflow's vendored
# typing_extensions changes typing's generics in a way torch's import then trips over. That holds
# for torch's lazily imported modules too (torch.testing pulls in torch.distributed.tensor).
import torch  # noqa: F401
import torch._dynamo  # noqa: F401  (optimisers import it lazily, on their first construction)
import torch.distributed.tensor  # noqa: F401

PROJECT = Path(__file__).resolve().parents[1]
SEGY_DIR = PROJECT.parent / "shared" / "data" / "segy"
FLOW = PROJECT / "flows" / "pretrain_flow.py"

# Test-only credentials for the loopback S3 server; recognisable so leak scans can look for them.
TEST_ACCESS_KEY = "sfmtestaccesskey0001"
TEST_SECRET_KEY = "sfmtestsecretkey0001verysecretvalue"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_serving(url: str, proc: subprocess.Popen, timeout_s: float) -> bool:
    """Whether ``url`` answered before ``proc`` (the server's process) exited or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=1)
            return True
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.2)


@pytest.fixture(scope="session")
def segy_dir() -> Path:
    if not SEGY_DIR.is_dir():
        pytest.fail(f"real SEG-Y test files missing: {SEGY_DIR} (the shared/ folder beside the project)")
    return SEGY_DIR


class S3Server:
    """A moto_server process speaking the S3 HTTP API on 127.0.0.1:port."""

    def __init__(self, tmp: Path):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp / "moto_server.log", "wb")
        exe = shutil.which("moto_server") or sys.executable
        cmd = [exe, "-H", "127.0.0.1", "-p", str(self.port)] if exe != sys.executable else \
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        if not wait_until_serving(self.endpoint + "/moto-api/", self.proc, timeout_s=30):
            raise RuntimeError(f"moto_server did not start; see {self.log.name}")

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": TEST_ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": TEST_SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
            "SFM_S3_ENDPOINT_URL": self.endpoint,
            "METAFLOW_S3_ENDPOINT_URL": self.endpoint,
            "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
            "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",
        }

    def client(self):
        import boto3
        from botocore.config import Config

        env = self.env()
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                            config=Config(request_checksum_calculation="when_required",
                                          response_checksum_validation="when_required"))

    def make_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}"

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        paginator = self.client().get_paginator("list_objects_v2")
        return [o["Key"] for page in paginator.paginate(Bucket=bucket, Prefix=prefix) for o in page.get("Contents", [])]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    server = S3Server(tmp_path_factory.mktemp("moto"))
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """Point this process (and the processes it starts) at the loopback S3 server."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    return s3_server


@pytest.fixture
def metaflow_env(tmp_path, monkeypatch):
    """An isolated Metaflow home and local datastore for one test; returns the env dict for Runner."""
    env = {
        "METAFLOW_USER": "sfm-test",
        "METAFLOW_HOME": str(tmp_path / "mfhome"),
        "METAFLOW_DEFAULT_DATASTORE": "local",
        "METAFLOW_DATASTORE_SYSROOT_LOCAL": str(tmp_path / "mfroot"),
        "METAFLOW_DEFAULT_METADATA": "local",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def pytest_collection_modifyitems(config, items):
    """Tests under tests/integration/ (flows, several processes, S3 servers) carry the ``integration``
    marker: ``pytest -m "not integration"`` runs the unit tests alone, in a few minutes.

    Files marked ``long(minutes)`` run first, the longest first (a stable sort keeps the order otherwise):
    the xdist workers take files in this order (``--no-loadscope-reorder``), so the long ones start early and
    the short ones fill the end, instead of a long file starting last while the other workers idle."""
    for item in items:
        if "integration" in Path(str(item.fspath)).parts:
            item.add_marker(pytest.mark.integration)

    def minutes(item) -> float:
        mark = item.get_closest_marker("long")
        return mark.args[0] if mark else 0

    items.sort(key=lambda item: -minutes(item))


@pytest.fixture(scope="session")
def mdio_stores(tmp_path_factory, segy_dir):
    """Stores written by the real MDIO library (tests/support/mdio_env.py) and the SEG-Y they came from:
    ``f3`` (the shared F3 crop, time, MDIO's 128^3 chunks) and ``holes`` (a generated survey with 30
    traces missing, depth, 16 x 16 x 32 chunks so reads cross chunks). {name: (mdio path, segy path)}."""
    import numpy as np
    from support import ingest_cases as cases
    from support.mdio_env import segy_to_mdio

    root = tmp_path_factory.mktemp("mdio")
    holes = cases.write(root / "holes.sgy", cases.volume((40, 36, 70), seed=11))
    keep = np.ones(40 * 36, dtype=bool)
    keep[np.random.default_rng(3).choice(keep.size, 30, replace=False)] = False
    cases.drop_traces(holes, 70, keep)
    return {
        "f3": (segy_to_mdio(segy_dir / "f3.sgy", root / "f3.mdio"), segy_dir / "f3.sgy"),
        "holes": (segy_to_mdio(holes, root / "holes.mdio", domain="depth", chunks=(16, 16, 32)), holes),
    }
