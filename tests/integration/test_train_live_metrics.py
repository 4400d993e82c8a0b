"""Training figures reach the run root while the run runs (sfm.train.trackers): a run SIGKILLed mid-way keeps
its TensorBoard curves up to the kill, and the resumed run continues them with every step once; on an S3 run
root (moto_server) with MLflow beside TensorBoard, both get the same figures and the run's config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sfm import storage
from sfm.train import checkpoint, failure_injection
from support.training import kill_tree, make_job, make_survey_store, start_ranks
from support.training import tensorboard_losses as losses

pytestmark = pytest.mark.long(1)

PROJECT = Path(__file__).resolve().parents[2]
MAX_STEPS, EVERY, HANG_AT = 30, 10, 16


@pytest.fixture(scope="module")
def survey_store(tmp_path_factory) -> str:
    return make_survey_store(tmp_path_factory, seed=3)


def live_job(store: str, run_root: str, max_steps: int, every: int) -> dict:
    """``make_job``, every step logged, the trackers' files copied to the run root five times a second."""
    job = make_job(store, run_root, max_steps=max_steps, every=every)
    job["config"]["train"].update(log_every=1, tracker_sync_s=0.2)
    return job


def event_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if "tfevents" in p.name) if folder.exists() else []


def history(run_root: str) -> dict[int, float]:
    summary = json.loads(storage.read_bytes(storage.join(run_root, "summary.json")))
    return {h["step"]: h["loss"] for h in summary["history"]}


@pytest.mark.timeout(400)
def test_a_killed_run_keeps_its_curves_and_the_resumed_run_continues_them(survey_store, tmp_path):
    """Steps 1-15 run, the checkpoint at step 10; the data then stops (an injected hang) while the copy thread goes
    on, and the whole process tree is SIGKILLed once the run root shows step 15. The restarted run resumes from
    step 10: its event file drops the killed attempt's steps 11-15 and logs them again, so that TensorBoard shows
    every step 1-30 once, each loss the run's own."""
    run_root = tmp_path / "run"
    folder = run_root / "tensorboard" / "sfm-pretrain"
    job = live_job(survey_store, str(run_root), MAX_STEPS, EVERY)
    proc = start_ranks(job, 1, tmp_path / "attempt0.log", env={failure_injection.ENV: f"hang@{HANG_AT}"})
    try:
        deadline = time.monotonic() + 240
        while max((s for s, _ in losses(str(folder))), default=0) < HANG_AT - 1 if event_files(folder) else True:
            assert proc.poll() is None, (tmp_path / "attempt0.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"the run root never showed step {HANG_AT - 1}"
            time.sleep(0.2)
    finally:
        kill_tree(proc.pid)
        proc.wait(60)
    assert checkpoint.complete_steps(str(run_root / "ckpt")) == [EVERY]
    killed = losses(str(folder))
    assert [s for s, _ in killed] == list(range(1, HANG_AT)), "the killed run's steps, each once"
    assert len(event_files(folder)) == 1

    resumed = start_ranks(job, 1, tmp_path / "attempt1.log")
    assert resumed.wait(300) == 0, (tmp_path / "attempt1.log").read_text()[-3000:]
    ref = history(str(run_root))
    assert json.loads((run_root / "summary.json").read_text())["resumed_from_step"] == EVERY
    shown = losses(str(folder))
    assert [s for s, _ in shown] == list(range(1, MAX_STEPS + 1)), "every step once across the files"
    assert [v for _, v in shown] == pytest.approx([ref[s] for s, _ in shown], rel=1e-6)
    first, second = event_files(folder)  # the killed attempt's file is kept; the resumed run's starts anew
    assert [s for s, _ in losses(str(first))] == list(range(1, HANG_AT))
    assert [s for s, _ in losses(str(second))] == list(range(EVERY + 1, MAX_STEPS + 1))
    assert killed == pytest.approx(shown[:HANG_AT - 1], rel=1e-6)  # the exact resume: the same losses again


@pytest.mark.timeout(300)
def test_an_s3_run_root_gets_the_event_files_and_mlflow_the_same_figures(survey_store, tmp_path, s3_env):
    """trackers = ["tensorboard", "mlflow"]: TensorBoard's files land under the S3 run root, MLflow (a sqlite
    backend, named by MLFLOW_TRACKING_URI) gets a run with the same loss at every step and the job config."""
    from mlflow import MlflowClient

    bucket = s3_env.make_bucket("sfm-live")
    run_root = storage.join(bucket, "runs", "live")
    job = live_job(survey_store, run_root, 6, 6)
    job["config"]["train"]["trackers"] = ["tensorboard", "mlflow"]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job_path = tmp_path / "job.json"
    job_path.write_text(json.dumps(job))
    log = tmp_path / "train.log"
    with open(log, "wb") as fh:
        code = subprocess.call([sys.executable, "-m", "sfm.train.trainer", str(job_path)], cwd=PROJECT, stdout=fh,
                               stderr=subprocess.STDOUT, env={**os.environ, "MLFLOW_TRACKING_URI": uri,
                                                              "OMP_NUM_THREADS": "1"}, timeout=280)
    assert code == 0, log.read_text()[-3000:]
    ref = history(run_root)
    keys = s3_env.keys("sfm-live", "runs/live/tensorboard/sfm-pretrain/")
    assert any("tfevents" in k for k in keys), keys
    storage.download(storage.join(run_root, "tensorboard"), tmp_path / "tb")
    shown = losses(str(tmp_path / "tb" / "sfm-pretrain"))
    assert [s for s, _ in shown] == list(range(1, 7))
    assert [v for _, v in shown] == pytest.approx([ref[s] for s in range(1, 7)], rel=1e-6)

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("sfm-pretrain").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED" and runs[0].info.run_name == "live"
    run = runs[0]
    logged = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss"))
    assert [s for s, _ in logged] == list(range(1, 7))
    assert [v for _, v in logged] == pytest.approx([ref[s] for s in range(1, 7)], rel=1e-6)
    assert run.data.params["train.max_steps"] == "6" and run.data.params["world_size"] == "1"
    assert run.data.tags["sfm.run_root"] == run_root
    assert {"lr", "samples_per_s"} <= set(run.data.metrics)
