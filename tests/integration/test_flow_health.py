"""Training health through the flow: NaN batches and a hung loader injected into the pretrain step.

Three NaN steps in a row (12, 13, 14) roll the run back to its step-10 checkpoint; the hang at step
17 makes the watchdog dump every thread's stack and fail the step within the configured timeout;
``@retry`` starts it again, it resumes from the step-15 checkpoint (the injected failures fired once) and the
run finishes, with the health counters in the training summary and the heartbeat.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.flowrun import client_view, fast_job_toml, run_flow

from sfm.train import health

pytestmark = pytest.mark.long(1)

STEP_TIMEOUT_S = 15
JOB_TOML = fast_job_toml(
    train={"max_steps": 25, "checkpoint_every": 5},
    health={"max_nonfinite_in_a_row": 3, "max_rollbacks": 1, "step_timeout_s": STEP_TIMEOUT_S,
            "first_step_timeout_s": 300, "heartbeat_every_s": 0})


@pytest.mark.timeout(900)
def test_nan_rollback_and_hang_in_the_pretrain_step_then_retry_finishes(tmp_path, metaflow_env):
    data_root = tmp_path / "data"
    config = tmp_path / "job.toml"
    config.write_text(JOB_TOML)
    env = {**metaflow_env, "SFM_INJECT_FAILURES": "nan@12,nan@13,nan@14,hang@17"}
    result = run_flow(env, cwd=str(tmp_path), top_level={"config": [("config", str(config))]},
                      data_root=str(data_root))
    logs = result.stdout + result.stderr
    assert result.status == "successful", logs[-4000:]
    assert logs.count("update skipped") == 2 and "after 3 non-finite steps in a row (rollback 1 of 1)" in logs
    assert f"training step made no progress for {STEP_TIMEOUT_S}s (after step 16)" in logs, logs[-4000:]
    assert "--- thread MainThread" in logs and "sfm health: end of stacks" in logs
    assert "Task is starting (retry)" in logs and "at step 15" in logs

    view = client_view(result.pathspec, env, cwd=str(tmp_path))
    summary = view["train_summary"]
    assert summary["resumed_from_step"] == 15 and summary["steps"] == 25
    assert summary["health"] == {"skipped_nonfinite": 3, "rollbacks": 1}
    assert [h["step"] for h in summary["history"]] == list(range(1, 26))
    run_root = Path(view["run_root"])  # the pretrain step's artifact
    assert summary["model_url"] == str(run_root / "final")
    beat = health.read_heartbeat(str(run_root))
    assert beat["status"] == "finished" and beat["step"] == 25 and beat["rollbacks"] == 1
    assert json.loads((run_root / "summary.json").read_text())["health"]["rollbacks"] == 1
