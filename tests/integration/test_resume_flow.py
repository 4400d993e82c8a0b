"""The pretrain step of ``flows/pretrain_flow.py`` survives being killed.

Its training processes (torchrun and the rank it runs) are SIGKILLed as soon as a checkpoint exists;
``@retry`` starts the step again and it continues from that checkpoint; that attempt is killed too,
the run fails, and ``python flows/pretrain_flow.py resume`` finishes it from the newest checkpoint.
The final weights equal those of the same job trained without interruption.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
from support.flowrun import client_view, fast_job_toml, run_flow
from safetensors.torch import load_file
from support.training import Killer, assert_close, run_killed_twice, training_processes

from sfm.train import checkpoint

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

    run_root = Path(summary["model_url"]).parent
    job = {"config": json.loads((run_root / "job_config.json").read_text()), "surveys": view["train_stores"],
           "run_root": str(tmp_path / "reference")}
    launch_node(job, nodes=1, procs_per_node=1, node_rank=0, main_addr="127.0.0.1", main_port=free_port())
    ref = load_file(tmp_path / "reference" / "final" / "model.safetensors")
    got = load_file(run_root / "final" / "model.safetensors")
    assert got.keys() == ref.keys()
    for name in ref:
        assert_close(got[name], ref[name], name)
    ref_history = json.loads((tmp_path / "reference" / "summary.json").read_text())["history"]
    assert [h["loss"] for h in summary["history"]] == pytest.approx([h["loss"] for h in ref_history],
                                                                    rel=1e-5, abs=1e-6)
