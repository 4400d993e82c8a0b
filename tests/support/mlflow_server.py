"""A real `mlflow server` on loopback: a sqlite backend and the artifacts it serves in a temporary folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import free_port, wait_until_serving


class MLflowServer:
    """`mlflow server` on 127.0.0.1:port, started in its own process group (the server starts uvicorn as a child).
    Job execution is off: its worker pool (huey consumers) costs seconds of CPU to start and nothing here runs a
    job."""

    def __init__(self, tmp: Path, timeout_s: float = 180.0):
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp / "mlflow_server.log", "wb")
        cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{tmp / 'mlflow.db'}",
               "--artifacts-destination", str(tmp / "artifacts"), "--host", "127.0.0.1", "--port", str(self.port),
               "--workers", "1"]
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        start = time.monotonic()
        if not wait_until_serving(self.uri + "/health", self.proc, timeout_s):
            self.stop()
            raise RuntimeError(f"mlflow server did not start; see {self.log.name}")
        self.started_s = time.monotonic() - start  # wall time: the machine's load decides most of it

    def client(self):
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the group this server started: it and its uvicorn
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
