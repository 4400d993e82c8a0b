"""Accelerate as the launcher, on gloo ranks in real processes.

- The flow's ``@parallel`` pretrain step, asked for ``--launcher accelerate`` on 2 nodes x 1 process,
  starts each node with ``accelerate launch`` and registers a model; the same job started on 2 nodes by
  torchrun (``sfm.distributed.launch``, the code the nodes run) trains to the same losses and final weights,
  bit for bit.
- The flow refuses an Accelerate config that conflicts with the job in ``start``, in one line, before
  any survey is generated or ingested.
- ``sfm slurm-script --launcher accelerate --accelerate-config`` writes a script whose nodes launch through
  Accelerate with the file's settings (its dry run on a fake 2-node allocation); ``sfm slurm-script`` and
  ``sfm train`` refuse a conflicting file in one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

import pytest
import yaml
from conftest import free_port
from support.accelerate_files import FSDP2, write_config
from support.flowrun import client_view, fast_job_toml, run_flow
from support.training import assert_same_run, make_survey_store

from sfm.distributed.job import NodeLaunch, TrainJob
from sfm.distributed.launch import launch_node

pytestmark = pytest.mark.long(1)


def sfm_cli(capsys, *args: str) -> tuple[int, str]:
    """``sfm ARGS`` in this process (its exit status and stderr): these commands start no training."""
    from sfm import cli

    status = cli.main(list(args))
    return status, capsys.readouterr().err


def launch_two_nodes(job: dict) -> None:
    """``job`` on 2 nodes x 1 process of this machine, each node launched as the flow's nodes are."""
    port, errors = free_port(), []

    def node(rank: int) -> None:
        try:
            launch_node(TrainJob.from_dict(job), NodeLaunch(2, 1, rank, "127.0.0.1", port), timeout_s=300)
        except Exception as err:  # reported below
            errors.append(repr(err))

    threads = [threading.Thread(target=node, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.timeout(900)
def test_flow_pretrains_through_accelerate_launch_as_torchrun_does(tmp_path, metaflow_env):
    config = tmp_path / "job.toml"
    config.write_text(fast_job_toml(train={"max_steps": 6, "checkpoint_every": 3, "log_every": 1},
                                    synth={"shape": [48, 48, 64], "train_surveys": 1, "held_out_surveys": 1}))
    result = run_flow(metaflow_env, cwd=str(tmp_path), top_level={"config": [("config", str(config))]},
                      data_root=str(tmp_path / "data"), nodes=2, procs_per_node=1, launcher="accelerate")
    assert result.status == "successful", (result.stdout + result.stderr)[-4000:]
    logs = result.stdout + result.stderr
    for rank in (0, 1):
        assert f"sfm: node {rank} of 2 starts 1 process(es) with accelerate: " in logs, logs[-4000:]
    assert "-m sfm.distributed.rank_launcher accelerate --config_file" in logs and " torchrun " not in logs
    view = client_view(result.pathspec, metaflow_env, cwd=str(tmp_path))
    summary = view["train_summary"]
    assert (summary["world_size"], summary["steps"], view["model_version"]) == (2, 6, 1)

    # the same job, each node started by torchrun
    run_root = Path(view["run_root"])
    job_config = json.loads((run_root / "job_config.json").read_text())
    assert job_config["dist"]["launcher"] == "accelerate"
    job_config["dist"]["launcher"] = "torchrun"
    reference = tmp_path / "torchrun"
    launch_two_nodes({"config": job_config, "surveys": view["train_stores"], "run_root": str(reference)})
    assert_same_run(str(run_root), str(reference))


@pytest.mark.timeout(300)
def test_flow_refuses_a_conflicting_accelerate_config_in_start(tmp_path, metaflow_env):
    accel = write_config(tmp_path / "fsdp.yaml", "FSDP", fsdp_config=FSDP2, num_machines=1, num_processes=2)
    data_root = tmp_path / "data"
    result = run_flow(metaflow_env, cwd=str(tmp_path), data_root=str(data_root), nodes=2, accelerate_config=accel)
    assert result.status == "failed"
    output = result.stdout + result.stderr
    lines = [line for line in output.splitlines()
             if accel in line and "num_machines: 1 means dist.nodes = 1, but the job has dist.nodes = 2" in line]
    assert len(lines) == 1, output[-3000:]
    assert "Traceback" not in output and "/scan/" not in output and "/ingest/" not in output, output[-3000:]
    assert output.count("/start/1 ") and "Retrying" not in output
    assert not data_root.exists() or not any(data_root.iterdir())  # no survey generated, nothing ingested


@pytest.mark.timeout(400)
def test_slurm_script_launches_its_nodes_through_accelerate(tmp_path, tmp_path_factory, capsys):
    store = make_survey_store(tmp_path_factory, seed=3)
    accel = write_config(tmp_path / "fsdp.yaml", "FSDP", fsdp_config=FSDP2, num_machines=2, num_processes=4,
                         mixed_precision="bf16")
    common = ["--surveys", store, "--run-root", str(tmp_path / "run"), "--accelerate-config", accel]
    script = tmp_path / "pretrain.sbatch"
    status, err = sfm_cli(capsys, "slurm-script", *common, "--launcher", "accelerate", "--out", str(script))
    assert status == 0, err
    text = script.read_text()
    assert f"# Accelerate config {accel}: its settings are in the job config below" in text
    assert "#SBATCH --nodes=2" in text and 'launcher = "accelerate"' in text and 'accelerate_config = ""' in text

    port = 20000 + (777 * 16) % 20000
    env = {**os.environ, "SFM_DRY_RUN": "1", "SLURM_JOB_ID": "777", "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "hp-[07-08]"}
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plans = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [p["launch_node"]["node_rank"] for p in plans] == [0, 1]
    for rank, plan in enumerate(plans):
        assert plan["command"][1:5] == ["-m", "sfm.distributed.rank_launcher", "accelerate",
                                        "--config_file"] and "--same_network" in plan["command"]
        launch_config = yaml.safe_load(plan["launch_files"]["accelerate_launch.yaml"])
        assert {k: launch_config[k] for k in ("distributed_type", "num_machines", "num_processes", "machine_rank",
                                              "main_process_ip", "main_process_port", "mixed_precision")} == \
            {"distributed_type": "MULTI_GPU", "num_machines": 2, "num_processes": 4, "machine_rank": rank,
             "main_process_ip": "hp-07", "main_process_port": port, "mixed_precision": "bf16"}
        dist = plan["job"]["config"]["dist"]
        assert (dist["strategy"], dist["nodes"], dist["procs_per_node"], dist["launcher"]) == \
            ("fsdp2-full", 2, 2, "accelerate")

    # a conflicting file is refused in one line before anything is written or launched
    for command, extra, words in (("slurm-script", ["--nodes", "3", "--out", str(tmp_path / "x.sbatch")],
                                   "num_machines: 2 means dist.nodes = 2, but the job has dist.nodes = 3"),
                                  ("train", ["--strategy", "fsdp2-zero2"],
                                   "fsdp_config.fsdp_reshard_after_forward: true means dist.strategy = 'fsdp2-full'")):
        status, err = sfm_cli(capsys, command, *common, *extra)
        assert status == 2 and err.strip().count("\n") == 0 and accel in err and words in err, err
    assert not (tmp_path / "x.sbatch").exists() and not (tmp_path / "run").exists()
