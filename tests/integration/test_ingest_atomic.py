"""Ingest publication (issue 3): idempotent, atomic, safe under SIGKILL and concurrent ingests, on local disk
and on a moto_server S3; and the `sfm ingest` command line."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from support import ingest_cases as cases
import numpy as np
import pytest
from support.ingest_cases import Backend, backend  # noqa: F401  (the local/S3 fixture)

from sfm.formats import manifest
from sfm.ingest.survey import ingest_survey

pytestmark = pytest.mark.long(1)

PROJECT = Path(__file__).resolve().parents[2]


def store_keys(b: Backend, root: str | None = None) -> list[str]:
    """Every object under ``<root>/surveys/`` (zarr's temporary ``*.partial`` files excluded)."""
    root = root or b.root
    if b.kind == "s3":
        bucket, prefix = root[len("s3://"):].split("/", 1)
        return [k for k in b.s3.keys(bucket, f"{prefix}/surveys/") if not k.endswith(".partial")]
    base = Path(root) / "surveys"
    return [str(p) for p in base.rglob("*") if p.is_file() and ".partial" not in p.name] if base.exists() else []


def store_objects(b: Backend, root: str | None = None) -> dict[str, str]:
    """Every object under ``<root>/surveys/`` -> sha256 of its bytes."""
    root = root or b.root
    if b.kind == "s3":
        client, bucket = b.s3.client(), root[len("s3://"):].split("/", 1)[0]
        read = lambda key: client.get_object(Bucket=bucket, Key=key)["Body"].read()  # noqa: E731
    else:
        read = lambda key: Path(key).read_bytes()  # noqa: E731
    return {key.split("/surveys/", 1)[1]: hashlib.sha256(read(key)).hexdigest() for key in store_keys(b, root)}


def sfm_ingest(*args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sfm.cli", "ingest", *args], cwd=PROJECT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def test_same_content_twice_is_a_no_op_that_says_so(backend, tmp_path, segy_dir):  # noqa: F811
    first = ingest_survey(backend.source(segy_dir / "small.sgy"), backend.root)
    before = store_objects(backend)
    copy = tmp_path / "renamed-copy.sgy"  # same bytes under another name: the same survey
    copy.write_bytes((segy_dir / "small.sgy").read_bytes())
    again = ingest_survey(backend.source(copy), backend.root)
    assert again["status"] == "exists" and again["survey_id"] == first["survey_id"]
    assert "nothing to do" in again["message"] and first["survey_id"] in again["message"]
    assert again["store_url"] == first["store_url"] and again["ingested_at"] == first["ingested_at"]
    assert store_objects(backend) == before
    assert backend.published() == [first["survey_id"]]


@pytest.mark.timeout(300)
def test_sigkill_mid_file_leaves_no_row_and_the_rerun_matches(backend, tmp_path):  # noqa: F811
    amplitude = cases.volume((96, 96, 384), seed=7)  # 144 brick columns of 8 x 8 traces: time to kill it
    source = backend.source(cases.write(tmp_path / "kill.sgy", amplitude))
    args = [source, "--data-root", backend.root, "--chunk", "8"]
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the killed process cannot remove its download of an S3 source
    proc = sfm_ingest(*args, env=env)
    deadline = time.monotonic() + 180
    while not any("/amplitude/c/" in key for key in store_keys(backend)):  # the first shard is written
        assert proc.poll() is None, f"ingest ended before it could be killed: {proc.communicate()}"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    shards = [k for k in store_keys(backend) if "/amplitude/c/" in k]
    assert 0 < len(shards) < 144, "the kill must land mid-file"
    assert backend.published() == []

    rerun = sfm_ingest(*args)
    out, err = rerun.communicate(timeout=240)
    assert rerun.returncode == 0, err
    row = json.loads(out.splitlines()[0])
    assert row["status"] == "ingested" and backend.published() == [row["survey_id"]]
    if backend.kind == "local":  # whatever the killed process was writing went with the rerun
        assert not list((Path(backend.root) / "surveys").rglob("*.partial"))
    clean_root = f"{backend.root}-clean"  # an uninterrupted ingest of the same source
    reference = ingest_survey(source, clean_root, chunk=8)
    assert reference["survey_id"] == row["survey_id"]
    assert store_objects(backend) == store_objects(backend, clean_root)  # byte for byte: the same survey
    assert np.array_equal(backend.group(row["store_url"])["amplitude"][...], amplitude)


@pytest.mark.timeout(300)
def test_concurrent_ingests_into_one_root_all_publish(backend, tmp_path):  # noqa: F811
    paths = [cases.write(tmp_path / f"c{k}.sgy", cases.volume((24, 24, 128), seed=10 + k)) for k in range(2)]
    sources = [backend.source(p) for p in paths]
    procs = [sfm_ingest(src, "--data-root", backend.root, "--chunk", "8") for src in sources + sources[:1]]
    results = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1] for r in results]
    rows = [json.loads(out.splitlines()[0]) for out, _ in results]
    assert sorted(backend.published()) == sorted({r["survey_id"] for r in rows}) and len(backend.published()) == 2
    assert rows[0]["survey_id"] == rows[2]["survey_id"]  # the same file twice at once: one survey
    assert {rows[0]["status"], rows[2]["status"]} <= {"ingested", "exists"}
    for k, row in enumerate(rows[:2]):
        assert np.array_equal(backend.group(row["store_url"])["amplitude"][...], cases.volume((24, 24, 128), seed=10 + k))


def test_cli_prints_a_line_per_survey_and_an_error_per_bad_file(tmp_path, segy_dir):
    root = tmp_path / "root"
    proc = sfm_ingest(str(segy_dir / "small.sgy"), str(segy_dir / "broken.sgy"), str(segy_dir / "tiny.sgy"),
                      "--data-root", str(root), "--dtype", "float16", "--chunk", "8")
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 2
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["name"] for line in lines] == ["small", "tiny"]
    assert all(line["dtype"] == "float16" and line["stats"]["count"] > 0 for line in lines)
    assert {"survey_id", "store_url", "shape", "sample_format", "stats", "status"} <= set(lines[0])
    errors = [line for line in err.splitlines() if "error" in line]
    assert any("broken.sgy is truncated" in line for line in errors), err
    assert "Traceback" not in err
    assert any(line.startswith("sfm ingest: 2 of 3 survey(s)") and "MB/s" in line for line in err.splitlines()), err
    again = sfm_ingest(str(segy_dir / "small.sgy"), "--data-root", str(root))
    out, err = again.communicate(timeout=240)
    assert again.returncode == 0 and json.loads(out)["status"] == "exists"
    missing = sfm_ingest(str(tmp_path / "nope.sgy"), "--data-root", str(root), "--refuse-nonfinite",
                         "--max-sparsity", "4")
    out, err = missing.communicate(timeout=240)
    assert missing.returncode == 2 and err.strip().splitlines()[-1].startswith("sfm ingest: error:") and "does not exist" in err
    assert os.listdir(root / "manifest" / "rows") and len(manifest.read(str(root))) == 2


def test_a_rerun_removes_what_killed_writers_left_and_keeps_live_ones(tmp_path):
    from sfm.formats.zarr_writer import HOST

    source = cases.write(tmp_path / "s.sgy", cases.volume((20, 20, 40), seed=3))
    done = ingest_survey(str(source), str(tmp_path / "done"), chunk=8)
    root = tmp_path / "root"  # the same store, unpublished, as an interrupted ingest leaves it
    store = root / "surveys" / Path(done["store_url"]).name
    shutil.copytree(done["store_url"], store)
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()  # its pid now names a process that is gone
    shard = next(p for p in store.rglob("*") if p.is_file() and "/amplitude/c/" in str(p))
    killed = shard.with_name(f"{shard.name}.sfm-{HOST}-{child.pid}-0123abcd.partial")
    live = shard.with_name(f"{shard.name}.sfm-{HOST}-{os.getpid()}-4567cdef.partial")  # e.g. a concurrent ingest
    for p in (killed, live):
        p.write_bytes(b"half a shard")
    assert manifest.read(str(root)).empty  # unpublished: no reader sees the store, whole or not
    row = ingest_survey(str(source), str(root), chunk=8)
    assert row["status"] == "ingested" and not killed.exists() and live.exists()
    live.unlink()
    keys = lambda r: sorted(str(p.relative_to(r)) for p in r.rglob("*") if p.is_file())  # noqa: E731
    assert keys(store) == keys(Path(done["store_url"]))


def test_a_process_that_read_a_manifest_row_exits_cleanly(tmp_path, segy_dir):
    """Reading a row with Arrow's thread pools made about two exits in three abort once the read was the
    process's last work (std::terminate on a live pool thread), so the losing ingest of a race failed at
    random. Ten fresh processes whose last work is reading a published row must all exit 0."""
    row = ingest_survey(str(segy_dir / "small.sgy"), str(tmp_path / "root"))
    script = ("import sys; from pathlib import Path; from sfm.formats import manifest; "
              "data = Path(sys.argv[1]).read_bytes(); print(manifest.decode_row(data)['survey_id'])")
    path = manifest.row_url(str(tmp_path / "root"), row["survey_id"])
    for _ in range(10):
        run = subprocess.run([sys.executable, "-c", script, path], capture_output=True, text=True, cwd=PROJECT)
        assert (run.returncode, run.stdout.strip()) == (0, row["survey_id"]), run.stderr
