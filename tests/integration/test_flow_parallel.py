"""The flow's pretrain step on several ranks: 2 nodes x 1 process (dp=2 x cp=1) and 1 node x 2
processes with context parallelism (dp=1 x cp=2).

One rank's process is SIGKILLed once a checkpoint exists: the step fails (within the collective
timeout, not hanging), ``@retry`` starts it again from that checkpoint, the same rank is killed
again, the run fails, and ``resume`` finishes it. The finished run equals a single process trained
on the same global batch with the same seed: the loss at every step and the final weights, and
every rank ends with identical weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.flowrun import client_view, fast_job_toml, run_flow
from safetensors.torch import load_file
from support.training import Killer, assert_close, env_of, run_killed_twice

pytestmark = pytest.mark.long(3)

MAX_STEPS, EVERY, TIMEOUT_S = 30, 5, 30
MASK_RATIO = 0.765625  # 32^3 crops of 8^3 patches keep 15 tokens (+ cls = 16): cp = 2 leaves it unchanged


def job_toml(batch: int) -> str:
    return fast_job_toml(data={"batch_size": batch}, model={"mask_ratio": MASK_RATIO},
                         train={"max_steps": MAX_STEPS, "checkpoint_every": EVERY}, dist={"timeout_s": TIMEOUT_S})


def rank1(pids: list[int]) -> list[int]:
    """The rank-1 training process among ``pids`` (torchrun's workers carry RANK in their environment)."""
    for pid in pids:
        env = env_of(pid)
        if "TORCHELASTIC_RUN_ID" in env and env.get("RANK") == "1":  # a worker, not the torchrun launcher
            return [pid]
    return []


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("nodes,procs,cp", [(2, 1, 1), (1, 2, 2)], ids=["2nodes-dp2", "1node-dp1xcp2"])
def test_parallel_pretrain_survives_a_killed_rank_and_equals_one_process(nodes, procs, cp, tmp_path, metaflow_env):
    data_root = tmp_path / "data"
    dp = nodes * procs // cp
    config = tmp_path / "job.toml"
    config.write_text(job_toml(batch=8 // dp))  # global batch 8 in both layouts
    top = {"config": [("config", str(config))]}

    killer = Killer(data_root, pick=rank1)  # one rank of the job, twice
    failed, first, second, ended = run_killed_twice(killer, metaflow_env, tmp_path, top, last_step=MAX_STEPS,
                                                    data_root=str(data_root), nodes=nodes, procs_per_node=procs,
                                                    cp=cp)
    # the second attempt failed, and the run ended, within the collective timeout of the kill
    # (plus the time Metaflow takes to record the failure)
    assert ended - killer.kills[1]["at"] < TIMEOUT_S + 60, ended - killer.kills[1]["at"]
    logs = failed.stdout + failed.stderr
    assert "Task is starting (retry)" in logs and f"at step {first}" in logs, logs[-4000:]

    resumed = run_flow(metaflow_env, cwd=str(tmp_path), resume=True)
    assert resumed.status == "successful", resumed.stderr[-4000:]
    view = client_view(resumed.pathspec, metaflow_env, cwd=str(tmp_path))
    summary = view["train_summary"]
    assert (summary["world_size"], summary["dp"], summary["cp"]) == (nodes * procs, dp, cp)
    assert second <= summary["resumed_from_step"] < MAX_STEPS, (summary["resumed_from_step"], killer.kills)
    assert [h["step"] for h in summary["history"]] == list(range(1, MAX_STEPS + 1))
    digests = summary["rank_weight_digests"]
    assert len(digests) == nodes * procs and len(set(digests)) == 1, digests

    # one process, the same global batch and seed, uninterrupted
    from sfm.distributed.job import NodeLaunch, TrainJob
    from sfm.distributed.launch import free_port, launch_node

    run_root = Path(view["run_root"])  # the pretrain step's artifact
    assert summary["model_url"] == str(run_root / "final")
    ref_config = json.loads((run_root / "job_config.json").read_text())
    ref_config["data"]["batch_size"] = 8
    ref_config["dist"].update(nodes=1, procs_per_node=1, cp=1)
    ref_root = tmp_path / "reference"
    launch_node(TrainJob.from_dict({"config": ref_config, "surveys": view["train_stores"], "run_root": str(ref_root)}),
                NodeLaunch(1, 1, 0, "127.0.0.1", free_port()))
    ref_history = json.loads((ref_root / "summary.json").read_text())["history"]
    assert [h["loss"] for h in summary["history"]] == pytest.approx([h["loss"] for h in ref_history],
                                                                    rel=1e-4, abs=1e-6)
    got, ref = load_file(run_root / "final" / "model.safetensors"), load_file(ref_root / "final" / "model.safetensors")
    assert got.keys() == ref.keys()
    for name in ref:  # tolerance: see tests/test_train_distributed.py::assert_same_weights
        assert_close(got[name], ref[name], name, rtol=1e-4, atol=5e-4)
