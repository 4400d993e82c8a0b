"""The pretrain step of ``flows/pretrain_flow.py`` survives being killed.

Its training processes (torchrun and the rank it runs) are SIGKILLed as soon as a checkpoint exists;
``@retry`` starts the step again and it continues from that checkpoint; that attempt is killed too,
the run fails, and ``python flows/pretrain_flow.py resume`` finishes it from the newest checkpoint.
The final weights and the loss history equal those of the same job trained without interruption, bit for
bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.flowrun import client_view, fast_job_toml, run_flow
from support.training import Killer, assert_same_run, run_killed_twice

MAX_STEPS, EVERY = 60, 5
JOB_TOML = fast_job_toml(train={"max_steps": MAX_STEPS, "checkpoint_every": EVERY, "log_every": 10})





@pytest.mark.timeout(900)
def test_killed_pretrain_retries_then_resumes_to_the_uninterrupted_weights(tmp_path, metaflow_env):
    data_root = tmp_path / "data"
    config = tmp_path / "job.toml"
    config.write_text(JOB_TOML)
    top = {"config": [("config", str(config))]}

    killer = Killer(data_root)
    failed, first, second, _ = run_killed_twice(killer, metaflow_env, tmp_path, top, last_step=MAX_STEPS,
                                                data_root=str(data_root))
    logs = failed.stdout + failed.stderr
    # attempt 1 (the @retry) continued from a checkpoint of attempt 0, it did not start over
    assert "Task is starting (retry)" in logs
    assert "resumed from" in logs and f"at step {first}" in logs, logs[-4000:]
    view = client_view(failed.pathspec, metaflow_env, cwd=str(tmp_path))
    assert view["steps"]["pretrain"] == [False]

    resumed = run_flow(metaflow_env, cwd=str(tmp_path), resume=True)  # resume reuses the run's config
    assert resumed.status == "successful", resumed.stderr[-4000:]
    view = client_view(resumed.pathspec, metaflow_env, cwd=str(tmp_path))
    summary = view["train_summary"]
    assert second <= summary["resumed_from_step"] < MAX_STEPS, (summary["resumed_from_step"], killer.kills)
    assert summary["steps"] == MAX_STEPS
    assert [h["step"] for h in summary["history"]] == list(range(1, MAX_STEPS + 1))

    # the same job, uninterrupted, through the same launcher
    from sfm.distributed.launch import free_port, launch_node

    run_root = Path(view["run_root"])  # the pretrain step's artifact
    assert summary["model_url"] == str(run_root / "final")
    job = {"config": json.loads((run_root / "job_config.json").read_text()), "surveys": view["train_stores"],
           "run_root": str(tmp_path / "reference")}
    launch_node(job, nodes=1, procs_per_node=1, node_rank=0, main_addr="127.0.0.1", main_port=free_port())
    assert_same_run(str(run_root), str(tmp_path / "reference"))  # bit for bit
