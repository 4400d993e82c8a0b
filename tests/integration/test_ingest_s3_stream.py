"""Ingest of an ``s3://`` SEG-Y without a local copy (issue 18): ``sfm ingest`` from ``rclone serve s3``
with TMPDIR on a 64 MB tmpfs, into a local and into an S3 store, each equal to a local ingest of the
same file; and a read through a connection that keeps failing (resets, refusals, 503 SlowDown, the
server restarted) still gives exactly the same store."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support import ingest_cases as cases
from support.s3_rclone import FaultProxy, rclone_s3  # noqa: F401  (fixture)

from sfm.ingest.survey import ingest_survey

PROJECT = Path(__file__).resolve().parents[2]
SHAPE = (48, 160, 2000)  # 7680 traces of 2000 samples: a 63 MB file, several scan windows and shard rows
TMPFS_BYTES = 64 << 20
MAX_LOCAL_BYTES = 4 << 20  # "a few MB": what an S3 ingest may put on local disk at most


@pytest.fixture(scope="module")
def big_segy(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("src") / "stream.sgy"
    return cases.write(path, cases.volume(SHAPE, seed=11))


@pytest.fixture(scope="module")
def landed(big_segy, rclone_s3) -> str:  # noqa: F811
    """The file in the module's one bucket (rclone serve s3 lists its buckets once: the first one it is asked
    for is the one it knows); returns the bucket URL."""
    bucket = rclone_s3.make_bucket("stream")
    rclone_s3.local_path(f"{bucket}/landing").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(big_segy, rclone_s3.local_path(f"{bucket}/landing/stream.sgy"))
    return bucket


@contextlib.contextmanager
def small_tmpdir(tmp_path: Path):
    """A 64 MB tmpfs (root may mount one), else an ordinary empty folder; yields (path, used bytes now)."""
    where = tmp_path / "tmpfs"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(where)],
                             capture_output=True).returncode == 0

    def used() -> int:
        if mounted:
            st = os.statvfs(where)
            return (st.f_blocks - st.f_bfree) * st.f_frsize
        return sum(p.stat().st_size for p in where.rglob("*") if p.is_file())

    try:
        yield where, used
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(where)], check=False)


def watch_peak(used, stop: threading.Event, peak: list[int]) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], used())
        time.sleep(0.02)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("store_on", ["local", "s3"])
def test_sfm_ingest_from_s3_uses_no_local_disk_and_equals_a_local_ingest(store_on, big_segy, landed, tmp_path,
                                                                         rclone_s3):  # noqa: F811
    bucket = landed
    out = str(tmp_path / "root") if store_on == "local" else f"{bucket}/root-{store_on}"
    with small_tmpdir(tmp_path) as (tmpdir, used):
        env = {**os.environ, **rclone_s3.env(), "TMPDIR": str(tmpdir), "PYTHONPATH": str(PROJECT)}
        before, peak, stop = used(), [0], threading.Event()
        watcher = threading.Thread(target=watch_peak, args=(used, stop, peak), daemon=True)
        watcher.start()
        proc = subprocess.run([sys.executable, "-m", "sfm.cli", "ingest", f"{bucket}/landing/stream.sgy", "--data-root",
                               out, "--chunk", "32"], cwd=PROJECT, env=env, capture_output=True, text=True, timeout=500)
        stop.set()
        watcher.join()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert peak[0] - before <= MAX_LOCAL_BYTES, f"an S3 ingest put {peak[0] - before} bytes into TMPDIR"

    local = ingest_survey(str(big_segy), str(tmp_path / "local-root"), chunk=32)
    store = Path(local["store_url"])
    streamed = (tmp_path / "root" if store_on == "local" else rclone_s3.local_path(out)) / "surveys" / store.name
    assert cases.store_digests(streamed, True) == cases.store_digests(store, True)
    assert json.loads((streamed / "zarr.json").read_bytes())["attributes"]["source_url"] == \
        f"{bucket}/landing/stream.sgy"


@pytest.mark.timeout(600)
def test_s3_read_that_keeps_failing_is_retried_into_the_same_store(big_segy, landed, tmp_path, rclone_s3,  # noqa: F811
                                                                   monkeypatch):
    """Connections reset and throttled (503 SlowDown) again and again while the file is read, and
    the server itself restarted now and then: every range is retried until it arrives whole."""
    bucket = landed
    proxy = FaultProxy(rclone_s3.port)
    for key, value in {**rclone_s3.env(), "SFM_S3_ENDPOINT_URL": proxy.endpoint}.items():
        monkeypatch.setenv(key, value)
    stop = threading.Event()

    def misbehave() -> None:  # for 12 s at most: a slow machine gets more faults, not endless ones
        modes = ["reset", "throttle", "restart"]  # (the restart refuses connections meanwhile)
        for k in range(30):
            if stop.wait(0.4):
                return
            mode = modes[k % len(modes)]
            if mode == "restart":
                rclone_s3.restart(0.3)  # the server goes away: connections reset, then refused, then it is back
            else:
                proxy.faults_for(mode, 0.15)

    thread = threading.Thread(target=misbehave, daemon=True)
    thread.start()
    try:
        streamed = ingest_survey(f"{bucket}/landing/stream.sgy", str(tmp_path / "root"), chunk=32)
    finally:
        stop.set()
        thread.join()
        proxy.close()
    assert proxy.faults > 0
    local = ingest_survey(str(big_segy), str(tmp_path / "local-root"), chunk=32)
    assert streamed["survey_id"] == local["survey_id"]
    assert cases.store_digests(Path(streamed["store_url"]), True) == cases.store_digests(Path(local["store_url"]), True)


@pytest.mark.timeout(120)
def test_a_put_the_server_never_answers_is_abandoned_with_one_line(monkeypatch):
    """A server that takes the request and never answers (seen from rclone under load): the writer's PUT
    gives up after its deadline, tries again, then fails naming the key, instead of hanging for ever."""
    import socket

    from zarr.core.buffer.cpu import Buffer
    from zarr.core.sync import sync

    from sfm import storage
    from sfm.errors import SFMError
    from sfm.formats import zarr_writer

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []

    def swallow() -> None:  # accept and read, never answer
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)
            threading.Thread(target=lambda c=conn: [None for _ in iter(lambda: c.recv(1 << 16), b"")],
                             daemon=True).start()

    threading.Thread(target=swallow, daemon=True).start()
    monkeypatch.setenv("SFM_S3_ENDPOINT_URL", f"http://127.0.0.1:{listener.getsockname()[1]}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    monkeypatch.setattr(zarr_writer, "PUT_SECONDS_BASE", 1.0)
    store = storage.zarr_store("s3://hang/store.zarr")
    t0 = time.monotonic()
    try:
        with pytest.raises(SFMError, match=r"did not answer a PUT of amplitude/c/0/0/0 .* 3 times; check the S3 endpoint"):
            sync(zarr_writer.put_with_deadline(store, "amplitude/c/0/0/0", Buffer.from_bytes(b"x" * 1000)))
    finally:
        listener.close()
        for conn in held:
            conn.close()
    assert time.monotonic() - t0 < 30
