"""Training health in real sfm.train.trainer processes, with failures injected through SFM_INJECT_FAILURES:

- NaN batches: each non-finite step is skipped (weights untouched); three in a row roll the run back
  to its last checkpoint; the run still finishes, with the counts in its summary and heartbeat;
  a run that keeps diverging after its rollbacks stops with one clear line;
- a hang: the watchdog dumps every thread's stack and ends the process within the step timeout; the
  restarted job resumes from its last checkpoint and finishes (the failure fires once per run).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.training import final_weights, make_job, make_survey_store, tensorboard_losses

from sfm.train import checkpoint
from sfm.train import health

pytestmark = pytest.mark.long(1)

PROJECT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def survey_store(tmp_path_factory) -> str:
    return make_survey_store(tmp_path_factory, seed=9)


def job_for(store: str, run_root: Path, steps: int, **health_cfg) -> dict:
    job = make_job(store, str(run_root))
    job["config"]["train"].update(max_steps=steps, checkpoint_every=5, log_every=5)
    job["config"]["health"] = {"heartbeat_every_s": 0, **health_cfg}
    return job


def start(job: dict, log: Path, failures: str) -> subprocess.Popen:
    job_path = log.with_suffix(".json")
    job_path.write_text(json.dumps(job))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SFM_INJECT_FAILURES": failures}
    with open(log, "wb") as fh:
        return subprocess.Popen([sys.executable, "-m", "sfm.train.trainer", str(job_path)], cwd=PROJECT, stdout=fh,
                                stderr=subprocess.STDOUT, env=env)


@pytest.mark.timeout(300)
def test_nan_steps_are_skipped_then_rolled_back_and_the_run_finishes(survey_store, tmp_path):
    job = job_for(survey_store, tmp_path / "run", 20, max_nonfinite_in_a_row=3, max_rollbacks=2)
    job["config"]["train"]["log_every"] = 1
    log = tmp_path / "nan.log"
    proc = start(job, log, "nan@8,nan@12,nan@13,nan@14")
    assert proc.wait(timeout=240) == 0, log.read_text()[-4000:]
    text = log.read_text()
    assert text.count("update skipped") == 3, text[-4000:]  # steps 8, 12, 13; the third in a row rolls back
    rollback_to = checkpoint.step_dir(str(tmp_path / "run" / "ckpt"), 10)
    assert f"rolled back to {rollback_to} after 3 non-finite steps in a row (rollback 1 of 2)" in text
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["health"] == {"skipped_nonfinite": 4, "rollbacks": 1}
    history = summary["history"]
    assert [h["step"] for h in history] == list(range(1, 21))
    # the history is the rolled-back run's: step 8's loss is missing, steps 11-20 are the retrained ones
    assert [h["step"] for h in history if h["loss"] is None] == [8]
    assert all(math.isfinite(h["loss"]) for h in history if h["step"] != 8)
    assert all(bool(v.isfinite().all()) for v in final_weights(str(tmp_path / "run")).values())
    # TensorBoard shows each step once: the rolled-back steps 11-13 as retrained (a new event file drops the first)
    shown = tensorboard_losses(tmp_path / "run" / "tensorboard" / "sfm-pretrain")
    assert [s for s, _ in shown] == list(range(1, 21))
    assert [v for s, v in shown if s != 8] == pytest.approx([h["loss"] for h in history if h["step"] != 8], rel=1e-6)
    beat = health.read_heartbeat(str(tmp_path / "run"))
    assert beat["status"] == "finished" and beat["step"] == 20
    assert (beat["skipped_nonfinite"], beat["rollbacks"]) == (4, 1)


@pytest.mark.timeout(300)
def test_a_run_that_keeps_diverging_stops_with_one_clear_line(survey_store, tmp_path):
    job = job_for(survey_store, tmp_path / "run", 20, max_nonfinite_in_a_row=2, max_rollbacks=0)
    log = tmp_path / "diverge.log"
    proc = start(job, log, "nan@6,nan@7")
    assert proc.wait(timeout=240) == 2
    text = log.read_text()
    assert "sfm train: error: training diverged: 2 non-finite steps in a row after 0 rollback(s)" in text
    assert "Traceback" not in text
    assert health.read_heartbeat(str(tmp_path / "run"))["status"] == "failed"


@pytest.mark.timeout(300)
def test_a_hang_fails_within_the_step_timeout_with_stacks_then_resumes(survey_store, tmp_path):
    timeout_s = 10
    job = job_for(survey_store, tmp_path / "run", 12, step_timeout_s=timeout_s, first_step_timeout_s=120)
    log = tmp_path / "hang.log"
    proc = start(job, log, "hang@8")
    hung_at = None
    while proc.poll() is None:
        if hung_at is None and "injected failure: the data stops before step 8" in log.read_text():
            hung_at = time.monotonic()
        time.sleep(0.05)
    assert hung_at is not None, log.read_text()[-3000:]
    waited = time.monotonic() - hung_at
    text = log.read_text()
    assert proc.returncode == health.HANG_EXIT_CODE, text[-3000:]
    assert waited < timeout_s + 10, f"the hung process lived {waited:.1f}s past the hang"
    assert f"training step made no progress for {timeout_s}s (after step 7)" in text
    assert "--- thread MainThread" in text and "in apply" in text  # the stack shows where it hung
    assert health.read_heartbeat(str(tmp_path / "run"))["status"] == "running"  # killed, not finished

    log2 = tmp_path / "resume.log"
    proc = start(job, log2, "hang@8")  # the same environment: the failure already fired in this run
    assert proc.wait(timeout=240) == 0, log2.read_text()[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 5 and summary["steps"] == 12
    assert "resumed from" in log2.read_text()
