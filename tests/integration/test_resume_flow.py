"""The pretrain step of ``flows/pretrain_flow.py`` survives being killed, with each DeepSpeed stage on 2 nodes x
1 process (``--strategy deepspeed-zero2|deepspeed-zero3 --nodes 2``). One process on one node is not run here:
its ``@retry`` resuming from a checkpoint is test_flow_health.py's, ``resume`` on one node is
test_flow_parallel.py's (1 node x 2 processes), and a killed single process resuming bit for bit is
test_train_resume.py's.

Its training processes (torchrun and the ranks it runs, on every node) are SIGKILLed as soon as a
checkpoint exists; ``@retry`` starts the step again and it continues from that checkpoint; that attempt is
killed too, the run fails, and ``python flows/pretrain_flow.py resume`` finishes it from the newest
checkpoint and registers the model. The final weights, the registered weights and the loss history equal
those of the same job trained without interruption (on as many ranks), bit for bit. ZeRO-3 trains in bf16
(DeepSpeed's bf16 parameters beside float32 masters, under autocast), the path a GPU takes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors
from support.flowrun import client_view, fast_job_toml, run_flow
from support.training import Killer, assert_same_run, final_weights, run_killed_twice

from sfm.model import registry

pytestmark = pytest.mark.long(3)

MAX_STEPS, EVERY = 40, 5
NODES = 2  # x 1 process each


def job_toml(precision: str) -> str:
    """The fast job on 2 nodes: the same global batch (8) and one training survey (a short ingest)."""
    train = {"max_steps": MAX_STEPS, "checkpoint_every": EVERY, "log_every": 10, "mixed_precision": precision}
    return fast_job_toml(train=train, data={"batch_size": 4}, dist={"timeout_s": 60},
                         synth={"train_surveys": 1, "shape": [48, 48, 64]})


@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy,precision", [("deepspeed-zero2", "auto"), ("deepspeed-zero3", "bf16")])
def test_killed_pretrain_retries_then_resumes_to_the_uninterrupted_weights(strategy, precision, tmp_path,
                                                                          metaflow_env):
    data_root = tmp_path / "data"
    config = tmp_path / "job.toml"
    config.write_text(job_toml(precision))
    top = {"config": [("config", str(config))]}

    killer = Killer(data_root)  # every node's torchrun and ranks
    failed, first, second, _ = run_killed_twice(killer, metaflow_env, tmp_path, top, last_step=MAX_STEPS,
                                                data_root=str(data_root), strategy=strategy, nodes=NODES)
    logs = failed.stdout + failed.stderr
    # attempt 1 (the @retry) continued from a checkpoint of attempt 0, it did not start over
    assert "Task is starting (retry)" in logs
    assert "resumed from" in logs and f"at step {first}" in logs, logs[-4000:]
    view = client_view(failed.pathspec, metaflow_env, cwd=str(tmp_path))
    assert view["steps"]["pretrain"] == [False] * NODES  # one task per node

    resumed = run_flow(metaflow_env, cwd=str(tmp_path), resume=True)  # resume reuses the run's config
    assert resumed.status == "successful", resumed.stderr[-4000:]
    view = client_view(resumed.pathspec, metaflow_env, cwd=str(tmp_path))
    summary = view["train_summary"]
    assert second <= summary["resumed_from_step"] < MAX_STEPS, (summary["resumed_from_step"], killer.kills)
    assert summary["steps"] == MAX_STEPS and (summary["world_size"], summary["strategy"]) == \
        (NODES, strategy)
    assert [h["step"] for h in summary["history"]] == list(range(1, MAX_STEPS + 1))

    # the same job, uninterrupted, through the same launcher, on as many ranks (one node)
    from sfm.distributed.job import NodeLaunch, TrainJob
    from sfm.distributed.launch import free_port, launch_node

    run_root = Path(view["run_root"])  # the pretrain step's artifact
    assert summary["model_url"] == str(run_root / "final")
    job = {"config": json.loads((run_root / "job_config.json").read_text()), "surveys": view["train_stores"],
           "run_root": str(tmp_path / "reference")}
    launch_node(TrainJob.from_dict(job), NodeLaunch(1, NODES, 0, "127.0.0.1", free_port()))
    assert_same_run(str(run_root), str(tmp_path / "reference"))  # bit for bit
    registered = registry.verified_files(str(data_root), view["model_name"], view["model_version"])
    reference = final_weights(str(tmp_path / "reference"))
    weights = load_safetensors(registered["model.safetensors"])
    assert weights.keys() == reference.keys() and all(torch.equal(weights[k], reference[k]) for k in reference)
