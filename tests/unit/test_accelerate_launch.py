"""Accelerate as the launcher: the command and launch config sfm starts a node with are what Accelerate reads
them as (its own parsing, nothing started), and a training process refuses in one line an ``accelerate
launch`` environment that disagrees with its job (the environments made by Accelerate's own code)."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import free_port
from support.accelerate_files import FSDP2, ZERO2, launch_arguments, launch_environment, write_config, write_json

from sfm.config import JobConfig
from sfm.distributed import launch
from sfm.distributed.accelerate_launch import SWITCHES, check_environment
from sfm.distributed.job import NodeLaunch, TrainJob
from sfm.errors import SFMError


def accelerate_job(**dist: object) -> TrainJob:
    return TrainJob(JobConfig().override(launcher="accelerate", **dist), [], "/tmp/unused")


def test_a_node_is_launched_as_accelerate_reads_its_launch_config(tmp_path):
    port = free_port()
    for nodes, procs, rank in ((2, 1, 1), (1, 4, 0), (1, 1, 0)):
        node = NodeLaunch(nodes, procs, rank, "10.1.2.3" if nodes > 1 else "127.0.0.1", port)
        command = launch.node_command(accelerate_job(), node, str(tmp_path))
        assert command[:4] == [sys.executable, "-m", "sfm.distributed.rank_launcher", "accelerate"]
        assert command[-3:] == ["-m", "sfm.train.trainer", str(tmp_path / "job.json")]
        assert TrainJob.read(str(tmp_path / "job.json")) == accelerate_job()
        args = launch_arguments(command)
        assert (args.num_machines, args.num_processes, args.machine_rank, args.max_restarts, args.module,
                args.training_script, args.training_script_args) == \
            (nodes, nodes * procs, rank, 0, True, "sfm.train.trainer", [str(tmp_path / "job.json")])
        assert (args.multi_gpu, args.use_fsdp, args.use_deepspeed, args.mixed_precision) == \
            (nodes * procs > 1, False, False, "no")
        if nodes > 1:  # what torchrun gets: this node's rank, the main node's address, the port
            assert (args.nnodes, args.nproc_per_node, args.node_rank, args.master_addr, args.master_port) == \
                ("2", "1", 1, "10.1.2.3", str(port))
        elif procs > 1:
            assert (args.nproc_per_node, args.master_port) == ("4", str(port))
        if args.multi_gpu:  # the processes' environment passes the trainer's check, whatever the strategy
            for strategy in ("ddp", "fsdp2-full"):
                environ = {k: v for k, v in args.environment.items() if k.startswith(("ACCELERATE_", "FSDP_"))}
                check_environment(JobConfig.from_dict({"dist": {"strategy": strategy}}), environ, cuda=False,
                                  precision="no")


def test_torchrun_stays_the_default_launcher(tmp_path):
    node = NodeLaunch(2, 8, 1, "10.1.2.3", 29400)
    command = launch.node_command(TrainJob(JobConfig()), node, str(tmp_path))
    assert command[1:4] == ["-m", "sfm.distributed.rank_launcher", "torchrun"] and "--nnodes=2" in command and \
        "--node-rank=1" in command and "--master-addr=10.1.2.3" in command and "--nproc-per-node=8" in command


def job_with(**settings: object) -> JobConfig:
    cfg = JobConfig()
    for key, value in settings.items():
        cfg.set(key.replace("__", "."), value)  # deepspeed-* set directly: valid once the DeepSpeed branch lands
    return cfg


def test_an_agreeing_environment_passes_and_loses_the_plugin_switches(tmp_path):
    environ = launch_environment("--config_file", write_config(tmp_path / "fsdp.yaml", "FSDP", fsdp_config=FSDP2))
    assert environ["ACCELERATE_USE_FSDP"] == "true"
    check_environment(job_with(dist__strategy="fsdp2-full"), environ, cuda=False, precision="no")
    assert not set(SWITCHES) & set(environ)  # Accelerator then sees a plain multi-process launch
    environ = launch_environment("--config_file", write_config(tmp_path / "z2.yaml", "DEEPSPEED",
                                                               deepspeed_config=ZERO2))
    check_environment(job_with(dist__strategy="deepspeed-zero2"), environ, cuda=False, precision="no")
    assert "ACCELERATE_USE_DEEPSPEED" not in environ
    environ = {}  # torchrun: nothing to check
    check_environment(job_with(), environ, cuda=False, precision="no")


@pytest.mark.parametrize("case", ["fsdp-under-ddp", "fsdp1", "deepspeed-under-fsdp", "precision", "cpu-on-gpu",
                                  "deepspeed-json-batch"])
def test_a_disagreeing_environment_is_refused_in_one_line(case, tmp_path):
    yaml = tmp_path / "accel.yaml"
    cuda, precision = False, "no"
    if case == "fsdp-under-ddp":
        environ, job, words = (launch_environment("--config_file", write_config(yaml, "FSDP", fsdp_config=FSDP2)),
                               job_with(), "FSDP_RESHARD_AFTER_FORWARD=true means dist.strategy = 'fsdp2-full', but "
                               "the job has dist.strategy = 'ddp'")
    elif case == "fsdp1":
        environ, job, words = (launch_environment("--use_fsdp", "--num_processes", "2"),
                               job_with(dist__strategy="fsdp2-full"), "FSDP_VERSION=1 is FSDP1")
    elif case == "deepspeed-under-fsdp":
        environ, job, words = (launch_environment("--config_file", write_config(yaml, "DEEPSPEED",
                                                                                deepspeed_config=ZERO2)),
                               job_with(dist__strategy="fsdp2-zero2"),
                               "ACCELERATE_DEEPSPEED_ZERO_STAGE=2 means dist.strategy = 'deepspeed-zero2'")
    elif case == "precision":
        environ, job, words = (launch_environment("--multi_gpu", "--num_processes", "2", "--mixed_precision",
                                                  "bf16"),
                               job_with(), "ACCELERATE_MIXED_PRECISION=bf16 means train.mixed_precision = 'bf16', "
                               "but the job has train.mixed_precision = 'no'")
    elif case == "cpu-on-gpu":
        cuda, precision = True, "bf16"
        environ, job, words = ({"ACCELERATE_USE_CPU": "True", "ACCELERATE_MIXED_PRECISION": "bf16"}, job_with(),
                               "ACCELERATE_USE_CPU=True, but the trainer trains on this node's GPUs")
    else:
        json_path = write_json(tmp_path / "ds.json", {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8,
                                                      "zero_optimization": {"stage": 3}})
        environ, job, words = (launch_environment("--config_file", write_config(
            yaml, "DEEPSPEED", mixed_precision=None, deepspeed_config={"deepspeed_config_file": json_path})),
            job_with(dist__strategy="deepspeed-zero3", dist__procs_per_node=2),
            "train_batch_size: 64 must equal data.batch_size x train.grad_accum x data-parallel ranks")
    with pytest.raises(SFMError) as err:
        check_environment(job, environ, cuda=cuda, precision=precision)
    message = str(err.value)
    assert "\n" not in message and message.startswith("the accelerate launch environment") and words in message, \
        message


def test_the_trainer_refuses_before_it_starts(tmp_path, monkeypatch, capsys):
    """`accelerate launch --config_file fsdp.yaml -m sfm.train.trainer job.json` with a DDP job: one line."""
    from sfm.train import trainer

    environ = launch_environment("--config_file", write_config(tmp_path / "fsdp.yaml", "FSDP", fsdp_config=FSDP2))
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"config": {}, "surveys": [], "run_root": str(tmp_path / "run")}))
    assert trainer.main([str(job)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("sfm train: error: the accelerate launch environment: ") and \
        "dist.strategy = 'ddp'" in err and not (tmp_path / "run").exists(), err
