"""One survey ingested by many tasks (issue 18): the part functions on their own (split, scan parts,
write parts in any order, publish; a missing part refused), and the flow with one survey in 4 parts,
one part killed twice and the run resumed, reusing the other parts."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import blake3
import pytest
from support import ingest_cases as cases
from support.flowrun import client_view, fast_job_toml, run_flow, task_view

from sfm.config import IngestConfig
from sfm.errors import SFMError
from sfm.formats import manifest, segy
from sfm.formats.store_layout import split_runs
from sfm.ingest import parts
from sfm.ingest.survey import ingest_survey


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_parts_written_in_any_order_publish_the_one_task_store(dtype, tmp_path, monkeypatch):
    """4 scan parts (1 MiB pieces here, so a small file has several) and 4 write parts, written out of
    order: the same store, byte for byte, as one task writes; the identity is the pieces' digest, whatever
    the number of parts; a part missing makes the publish refuse, and nothing is visible until it is done."""
    monkeypatch.setattr(segy, "PIECE_BYTES", 1 << 20)
    src = cases.write(tmp_path / "parts.sgy", cases.volume((64, 40, 600), seed=5))  # 6.3 MB: 7 pieces
    cfg = IngestConfig(chunk=16, dtype=dtype)
    one = ingest_survey(str(src), str(tmp_path / "one"), cfg)

    data = src.read_bytes()
    pieces = [blake3.blake3(data[i : i + (1 << 20)]).digest() for i in range(0, len(data), 1 << 20)]
    assert one["survey_id"] == blake3.blake3(b"".join(pieces)).hexdigest()[:16]
    assert one["checksum"].startswith("blake3-4GiB-pieces:")

    root = str(tmp_path / "parts")
    scans = parts.plan_scans(str(src), "key", root, cfg, parts=4)
    assert [(s["start"], s["stop"]) for s in scans] == [(0, 1 << 20), (1 << 20, 3 << 20), (3 << 20, 5 << 20),
                                                         (5 << 20, len(data))]
    scanned = [parts.scan_part(s, cfg) for s in reversed(scans)]
    writes = parts.plan_writes(scanned, root, cfg)
    assert [w["rows"] for w in writes] == [[0, 1], [1, 2], [2, 3], [3, 4]]  # 64 inlines: 4 rows of 16-inline shards
    for k in (3, 0, 1):
        parts.write_part(writes[k], cfg)
    with pytest.raises(SFMError, match=r"parts\.sgy: part 3 of 4 was not written .*resume"):
        parts.publish_parts(writes, root)
    assert manifest.read(root).empty  # not published
    parts.write_part(writes[2], cfg)
    row = parts.publish_parts(writes, root)
    assert row["status"] == "ingested" and row["survey_id"] == one["survey_id"]
    assert cases.store_digests(Path(row["store_url"])) == cases.store_digests(Path(one["store_url"]))
    assert manifest.get_row(root, row["survey_id"])["stats_json"] == one["stats_json"]
    assert sorted(os.listdir(Path(root) / "surveys")) == [f"{row['survey_id']}.zarr"]  # staging removed

    again = parts.plan_writes(scanned, root, cfg)  # published before: one part that writes nothing
    assert [w["rows"] for w in again] == [None]
    assert parts.publish_parts(again, root)["status"] == "exists"


def test_split_and_part_count():
    assert split_runs(5, 4) == [(0, 1), (1, 2), (2, 3), (3, 5)]
    assert split_runs(2, 4) == [(0, 1), (1, 2)]  # never more parts than items
    cfg = IngestConfig(part_gb=10.0)
    assert parts.part_count(25e9, cfg) == 3 and parts.part_count(1e6, cfg) == 1
    assert parts.part_count(25e9, cfg, parts=8) == 8 and parts.part_count(25e9, IngestConfig(parts=2)) == 2


# ------------------------------------------------------------------------------------------------
# the flow


def ingest_processes(split_index: int) -> list[tuple[int, int]]:
    """(pid, retry count) of the local Metaflow tasks of step ``ingest`` at ``split_index``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = [a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\0")]
        except OSError:
            continue
        if "step" in args and "ingest" in args and "--split-index" in args and "--retry-count" in args:
            at = args.index("step")
            if args[at + 1] == "ingest" and args[args.index("--split-index") + 1] == str(split_index):
                found.append((int(entry.name), int(args[args.index("--retry-count") + 1])))
    return found


class PartKiller(threading.Thread):
    """Kills both attempts of one write part: the first as soon as it runs, the retry once every other
    write part has finished (it is stopped meanwhile), so the run fails with those parts done."""

    def __init__(self, split_index: int, others: int):
        super().__init__(daemon=True)
        self.split_index, self.others = split_index, others
        self.killed: list[int] = []
        self.done = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + 600
        while len(self.killed) < 2 and time.monotonic() < deadline and not self.done.is_set():
            for pid, attempt in ingest_processes(self.split_index):
                if attempt in self.killed:
                    continue
                if attempt == 1:
                    os.kill(pid, signal.SIGSTOP)
                    while any(ingest_processes(k) for k in range(self.others + 1) if k != self.split_index):
                        time.sleep(0.1)
                os.kill(pid, signal.SIGKILL)
                self.killed.append(attempt)
            time.sleep(0.05)


@pytest.mark.timeout(1500)
def test_flow_ingests_one_survey_in_4_parts_and_resumes_only_the_killed_part(tmp_path, metaflow_env):
    survey = cases.write(tmp_path / "big.sgy", cases.volume((64, 40, 48), seed=1))  # 4 rows of 16-inline shards
    held = cases.write(tmp_path / "held.sgy", cases.volume((32, 32, 40), seed=2))  # 2 rows
    config = tmp_path / "job.toml"
    config.write_text(fast_job_toml(ingest={"chunk": 16}, train={"max_steps": 2}))
    top = {"config": [("config", str(config))]}
    data_root = tmp_path / "data"
    params = {"surveys": str(survey), "held_out": str(held), "data_root": str(data_root), "ingest_parts": 4}

    killer = PartKiller(split_index=2, others=5)
    killer.start()
    try:
        failed = run_flow(metaflow_env, top_level=top, cwd=str(tmp_path), **params)
    finally:
        killer.done.set()
        killer.join()
    assert failed.status == "failed" and killer.killed == [0, 1], (killer.killed, failed.stderr[-3000:])
    first = task_view(failed.pathspec, metaflow_env, "ingest", cwd=str(tmp_path))
    assert sorted(t["successful"] for t in first) == [False] + [True] * 5
    assert manifest.read(str(data_root)).empty  # nothing half-published

    resumed = run_flow(metaflow_env, cwd=str(tmp_path), resume=True)
    assert resumed.status == "successful", resumed.stderr[-4000:]
    tasks = task_view(resumed.pathspec, metaflow_env, "ingest", cwd=str(tmp_path))
    mine = [t for t in tasks if t["part"]["survey"] == 0]
    assert len(mine) == 4 and all(t["successful"] for t in tasks)  # one survey, 4 write tasks
    assert sorted(t["part"]["part"] for t in mine) == [0, 1, 2, 3]
    rerun = [t for t in tasks if t["origin"] is None]
    assert [(t["part"]["survey"], t["part"]["part"]) for t in rerun] == [(0, 2)]  # the others were cloned
    scans = task_view(resumed.pathspec, metaflow_env, "scan", cwd=str(tmp_path))
    assert all(t["origin"] is not None for t in scans)

    view = client_view(resumed.pathspec, metaflow_env, cwd=str(tmp_path))
    one = ingest_survey(str(survey), str(tmp_path / "one"), chunk=16)
    assert view["train_stores"] == [str(data_root / "surveys" / Path(one["store_url"]).name)]
    assert cases.store_digests(Path(view["train_stores"][0])) == cases.store_digests(Path(one["store_url"]))
    assert sorted(os.listdir(data_root / "surveys")) == sorted(Path(u).name for u in
                                                               view["train_stores"] + view["held_out_stores"])
