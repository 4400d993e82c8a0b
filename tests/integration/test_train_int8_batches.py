"""Training on int8 batches (``data.batch_dtype = "int8"``, what the cluster config ships): the trainer
normalises each batch on its device and trains exactly as on float32 batches of the same int8 store,
with the region pool and a DataLoader worker."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from support.training import make_job


@pytest.fixture(scope="module")
def int8_store(tmp_path_factory) -> str:
    from sfm.ingest.survey import ingest_survey
    from sfm.synth.survey import synth_survey

    tmp = tmp_path_factory.mktemp("int8-train")
    synth_survey(str(tmp / "s.sgy"), shape=(48, 48, 64), seed=4)
    return ingest_survey(str(tmp / "s.sgy"), str(tmp / "root"), chunk=16, dtype="int8")["store_url"]


@pytest.mark.timeout(600)
def test_int8_batches_train_as_float32_batches_of_the_same_store(int8_store, tmp_path, monkeypatch):
    # the trainers' temp dir: nothing of theirs may stay behind in it. A short path under /tmp, not tmp_path: the
    # DataLoader's forkserver binds a Unix socket in it, and socket paths stop at 107 bytes
    scratch = Path(tempfile.mkdtemp(prefix="sfm-i8-", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(scratch))
    try:
        _train_both(int8_store, tmp_path, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _train_both(int8_store: str, tmp_path: Path, scratch: Path) -> None:
    from sfm.distributed.job import NodeLaunch, TrainJob
    from sfm.distributed.launch import free_port, launch_node

    histories = {}
    for dtype in ("float32", "int8"):
        run_root = tmp_path / dtype
        job = make_job(int8_store, str(run_root), max_steps=8, every=8)
        job["config"]["data"].update(batch_dtype=dtype, crops_per_region=4, workers=1,
                                     pool_dir=str(tmp_path / f"pool-{dtype}"))
        job["config"]["train"]["log_every"] = 1
        launch_node(TrainJob.from_dict(job), NodeLaunch(1, 1, 0, "127.0.0.1", free_port()))
        histories[dtype] = [h["loss"] for h in json.loads((run_root / "summary.json").read_text())["history"]]
    assert len(histories["int8"]) == 8
    assert histories["int8"] == pytest.approx(histories["float32"], rel=1e-4)
    assert any((tmp_path / "int8" / "tensorboard").rglob("events.out.tfevents*"))  # the logs went to the run root
    assert not list(scratch.glob("sfm-tb-*"))
