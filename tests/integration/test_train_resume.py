"""sfm.train.trainer in real processes: a run killed with SIGKILL partway and started again continues from
its last checkpoint and ends bit for bit with the weights, loss history and health counts of an
uninterrupted run: in one process with the run root on local disk or on an S3 server (moto_server
over HTTP), and on two ranks with ddp and with fsdp2 (sharded checkpoints), where injected NaN steps
and a rollback before the kill show the guard, the history and the data position come back through
the Checkpointer. An unreadable latest checkpoint makes the restarted run fall back to the one
before, and it still ends where the uninterrupted run did."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sfm import storage
from sfm.train import checkpoint
from support.training import assert_same_run, final_weights, kill_tree, make_job, make_survey_store, start_ranks

pytestmark = pytest.mark.long(4)

MAX_STEPS, EVERY = 40, 5
PROJECT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def survey_store(tmp_path_factory) -> str:
    return make_survey_store(tmp_path_factory, seed=3)


def start_training(job: dict, workdir: Path, name: str) -> tuple[subprocess.Popen, Path]:
    """``python -m sfm.train.trainer JOB.json`` as its own process (one rank); returns it and its log file."""
    job_path = workdir / f"{name}.json"
    job_path.write_text(json.dumps(job))
    log = workdir / f"{name}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "sfm.train.trainer", str(job_path)], cwd=PROJECT,
                                stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, log


def run_training(job: dict, workdir: Path, name: str) -> dict:
    proc, log = start_training(job, workdir, name)
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    return {"summary": json.loads(storage.read_bytes(storage.join(job["run_root"], "summary.json"))),
            "log": log.read_text()}


def kill_after_first_checkpoint(proc: subprocess.Popen, ckpt_root: str, log: Path) -> list[int]:
    """SIGKILL the training process as soon as a complete checkpoint exists; returns the complete
    checkpoints at that moment. Fails if the process ended by itself first."""
    deadline = time.monotonic() + 300
    while not checkpoint.complete_steps(ckpt_root):
        assert proc.poll() is None, f"training ended before its first checkpoint:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"process was not killed (exit {proc.returncode})"
    steps = checkpoint.complete_steps(ckpt_root)
    assert steps and steps[-1] < MAX_STEPS, f"killed too late to test anything: checkpoints {steps}"
    return steps



@pytest.fixture(scope="module")
def reference(survey_store, tmp_path_factory) -> dict:
    """The uninterrupted run every interrupted one must match."""
    tmp = tmp_path_factory.mktemp("reference")
    job = make_job(survey_store, str(tmp / "run"))
    result = run_training(job, tmp, "reference")
    assert result["summary"]["resumed_from_step"] == 0
    return {**result, "root": job["run_root"], "tmp": tmp}


def kill_and_resume(run_root: str, survey_store: str, tmp_path: Path) -> tuple[dict, list[int]]:
    job = make_job(survey_store, run_root)
    proc, log = start_training(job, tmp_path, "attempt0")
    at_kill = kill_after_first_checkpoint(proc, storage.join(run_root, "ckpt"), log)
    assert not storage.exists(storage.join(run_root, "final", "config.json"))
    resumed = run_training(job, tmp_path, "attempt1")
    return resumed, at_kill


@pytest.mark.timeout(400)
def test_sigkilled_run_resumes_exactly_local(survey_store, reference, tmp_path):
    run_root = str(tmp_path / "run")
    resumed, at_kill = kill_and_resume(run_root, survey_store, tmp_path)
    start = resumed["summary"]["resumed_from_step"]
    assert start in at_kill and 0 < start < MAX_STEPS, (start, at_kill)
    assert f"resumed from {checkpoint.step_dir(storage.join(run_root, 'ckpt'), start)}" in resumed["log"]
    assert resumed["summary"]["steps_this_attempt"] == MAX_STEPS - start
    assert_same_run(run_root, reference["root"])
    # the resolved config was written once, by the first attempt, next to the outputs
    assert json.loads(Path(run_root, "job_config.json").read_text())["train"]["max_steps"] == MAX_STEPS
    assert checkpoint.complete_steps(storage.join(run_root, "ckpt")) == [MAX_STEPS - EVERY, MAX_STEPS]


@pytest.mark.timeout(400)
def test_sigkilled_run_resumes_exactly_on_s3(survey_store, reference, tmp_path, s3_env):
    bucket = s3_env.make_bucket("sfm-resume")
    run_root = storage.join(bucket, "checkpoints", "run")
    resumed, at_kill = kill_and_resume(run_root, survey_store, tmp_path)
    start = resumed["summary"]["resumed_from_step"]
    assert start in at_kill and 0 < start < MAX_STEPS, (start, at_kill)
    assert_same_run(run_root, reference["root"])
    keys = s3_env.keys("sfm-resume")
    last = f"checkpoints/run/ckpt/step-{MAX_STEPS:06d}/"
    assert {last + p for p in ("model.safetensors", "optimizer.pt", "rank0.pt", "state.json")} <= set(keys)
    assert "checkpoints/run/final/model.safetensors" in keys and "checkpoints/run/job_config.json" in keys


@pytest.mark.timeout(400)
def test_sigkilled_muon_run_resumes_exactly(survey_store, reference, tmp_path):
    """train.optimizer = muon: its momentum buffers and AdamW moments are checkpointed like AdamW's (and
    it is Muon that trained: the same job with AdamW, ``reference``, has other losses)."""
    def muon_job(run_root: str) -> dict:
        job = make_job(survey_store, run_root)
        job["config"]["train"].update(optimizer="muon", muon_lr=3e-3)
        return job

    ref_root = str(tmp_path / "reference")
    ref = run_training(muon_job(ref_root), tmp_path, "muon-reference")
    run_root = str(tmp_path / "run")
    proc, log = start_training(muon_job(run_root), tmp_path, "muon-attempt0")
    at_kill = kill_after_first_checkpoint(proc, storage.join(run_root, "ckpt"), log)
    resumed = run_training(muon_job(run_root), tmp_path, "muon-attempt1")
    assert resumed["summary"]["resumed_from_step"] in at_kill
    assert_same_run(run_root, ref_root)
    assert json.loads(Path(run_root, "job_config.json").read_text())["train"]["optimizer"] == "muon"
    adamw_losses = [h["loss"] for h in reference["summary"]["history"]]
    assert [h["loss"] for h in ref["summary"]["history"]][1:] != pytest.approx(adamw_losses[1:], rel=1e-3)


@pytest.mark.timeout(400)
def test_unreadable_latest_checkpoint_falls_back_and_still_ends_exactly(reference, survey_store, tmp_path):
    run_root = tmp_path / "run"
    shutil.copytree(Path(reference["root"]) / "ckpt", run_root / "ckpt")
    shutil.copy(Path(reference["root"]) / "job_config.json", run_root / "job_config.json")
    latest = run_root / "ckpt" / f"step-{MAX_STEPS:06d}" / "model.safetensors"
    latest.write_bytes(latest.read_bytes()[:1000])  # a torn write
    result = run_training(make_job(survey_store, str(run_root)), tmp_path, "fallback")
    assert "unreadable" in result["log"] and "falling back" in result["log"]
    assert result["summary"]["resumed_from_step"] == MAX_STEPS - EVERY
    assert_same_run(str(run_root), reference["root"])


@pytest.mark.timeout(400)
def test_two_ranks_resume_together_when_one_cannot_read_the_latest(survey_store, tmp_path):
    """Two gloo ranks under torchrun. Rank 1's part of the newest checkpoint is unreadable: rank 1
    falls back, rank 0 could read it, and both continue from the older one (never out of step),
    ending with the weights of the uninterrupted two-rank run."""
    from sfm.distributed.job import NodeLaunch, TrainJob
    from sfm.distributed.launch import free_port, launch_node

    run_root = tmp_path / "run"
    job = make_job(survey_store, str(run_root))
    job["config"]["train"]["max_steps"] = 2 * EVERY
    job["config"]["dist"] = {"procs_per_node": 2}
    launch_node(TrainJob.from_dict(job), NodeLaunch(1, 2, 0, "127.0.0.1", free_port()))
    uninterrupted = final_weights(str(run_root))
    assert checkpoint.complete_steps(str(run_root / "ckpt")) == [EVERY, 2 * EVERY]
    rank1 = run_root / "ckpt" / f"step-{2 * EVERY:06d}" / "rank1.pt"
    rank1.write_bytes(rank1.read_bytes()[:100])
    (run_root / "final" / "model.safetensors").unlink()

    log = tmp_path / "restart.log"
    with open(log, "w") as fh:
        proc = subprocess.run([sys.executable, "-c", "import json, sys; from sfm.distributed.launch import launch_node; "
                               "from sfm.distributed.job import NodeLaunch, TrainJob; launch_node(TrainJob.from_dict("
                               f"json.loads(sys.argv[1])), NodeLaunch(1, 2, 0, '127.0.0.1', {free_port()}))",
                               json.dumps(job)], cwd=PROJECT, stdout=fh, stderr=subprocess.STDOUT, timeout=380)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "[rank 1] checkpoint" in text and "unreadable" in text
    assert f"all ranks continue from step {EVERY}" in text
    summary = json.loads((run_root / "summary.json").read_text())
    assert summary["resumed_from_step"] == EVERY and summary["world_size"] == 2
    resumed = final_weights(str(run_root))
    assert all(torch.equal(resumed[name], ref) for name, ref in uninterrupted.items())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2-full"])
def test_sigkilled_two_rank_run_resumes_bit_for_bit(strategy, survey_store, tmp_path):
    """Two gloo ranks. NaN batches at steps 6-8 are skipped and the third rolls the run back to step 5;
    the run is SIGKILLed (torchrun and both ranks) once a checkpoint after the rollback exists, and
    started again: it ends with the uninterrupted run's weights, history and health counts, bit for bit."""
    def job(run_root: Path) -> dict:
        job = make_job(survey_store, str(run_root), max_steps=25)
        job["config"]["data"]["batch_size"] = 2
        job["config"]["dist"] = {"procs_per_node": 2, "strategy": strategy, "timeout_s": 60}
        job["config"]["health"] = {"max_nonfinite_in_a_row": 3, "max_rollbacks": 1}
        return job

    nan = {"SFM_INJECT_FAILURES": "nan@6,nan@7,nan@8"}
    ref = start_ranks(job(tmp_path / "reference"), 2, tmp_path / "reference.log", nan)
    assert ref.wait(timeout=300) == 0, (tmp_path / "reference.log").read_text()[-3000:]
    reference = json.loads((tmp_path / "reference" / "summary.json").read_text())
    assert reference["health"] == {"skipped_nonfinite": 3, "rollbacks": 1}

    run_root = tmp_path / "run"
    proc = start_ranks(job(run_root), 2, tmp_path / "attempt0.log", nan)
    ckpt = str(run_root / "ckpt")
    deadline = time.monotonic() + 300
    while not [s for s in checkpoint.complete_steps(ckpt) if s >= 10]:
        assert proc.poll() is None, (tmp_path / "attempt0.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint after the rollback within 300 s"
        time.sleep(0.02)
    kill_tree(proc.pid)
    proc.wait(timeout=60)
    at_kill = checkpoint.complete_steps(ckpt)
    assert at_kill[-1] < 25, f"killed too late: {at_kill}"
    if strategy.startswith("fsdp2"):
        assert (Path(checkpoint.shards_url(ckpt, at_kill[-1])) / ".metadata").exists()
    step = checkpoint.step_dir(ckpt, at_kill[-1])
    assert {checkpoint.rank_file(r) for r in (0, 1)} <= set(storage.list_dir(step))  # each rank's RNG states
    again = start_ranks(job(run_root), 2, tmp_path / "attempt1.log", nan)
    assert again.wait(timeout=300) == 0, (tmp_path / "attempt1.log").read_text()[-3000:]
    summary = json.loads((run_root / "summary.json").read_text())
    assert summary["resumed_from_step"] in at_kill and summary["resumed_from_step"] >= 10
    assert_same_run(str(run_root), str(tmp_path / "reference"))


@pytest.mark.timeout(600)
def test_a_sharded_run_resumes_on_another_world_size(survey_store, tmp_path):
    """fsdp2-full on two ranks (NaN steps 6-8 roll it back to step 5, so its data stream runs 3 batches
    ahead of its step), then continued on three from its sharded checkpoint: the shards are resharded
    on load, the third rank (no part of its own in the checkpoint) keeps its RNG states, the data
    stream starts where the restored step's batches of three ranks begin (the two-rank position does
    not fit), and the history and the guard's counts go on from the two-rank run's."""
    job = make_job(survey_store, str(tmp_path / "run"), max_steps=2 * EVERY)
    job["config"]["data"]["batch_size"] = 2
    job["config"]["dist"] = {"procs_per_node": 2, "strategy": "fsdp2-full", "timeout_s": 60}
    job["config"]["health"] = {"max_nonfinite_in_a_row": 3, "max_rollbacks": 1}
    first = start_ranks(job, 2, tmp_path / "two.log", {"SFM_INJECT_FAILURES": "nan@6,nan@7,nan@8"})
    assert first.wait(timeout=300) == 0, (tmp_path / "two.log").read_text()[-3000:]
    two = json.loads((tmp_path / "run" / "summary.json").read_text())

    job["config"]["train"]["max_steps"] = 3 * EVERY
    job["config"]["dist"]["procs_per_node"] = 3
    again = start_ranks(job, 3, tmp_path / "three.log")
    assert again.wait(timeout=300) == 0, (tmp_path / "three.log").read_text()[-3000:]
    three = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (three["resumed_from_step"], three["world_size"], three["steps"]) == (2 * EVERY, 3, 3 * EVERY)
    assert [h["step"] for h in three["history"]] == list(range(1, 3 * EVERY + 1))
    assert [h["loss"] for h in three["history"][:2 * EVERY]] == [h["loss"] for h in two["history"]]
    assert all(math.isfinite(h["loss"]) for h in three["history"])
    assert two["health"] == three["health"] == {"skipped_nonfinite": 3, "rollbacks": 1}
    ckpt = tmp_path / "run" / "ckpt"
    assert json.loads((ckpt / f"step-{2 * EVERY:06d}" / "state.json").read_text())["data"]["batch"] == 2 * EVERY + 3
    state = json.loads((ckpt / f"step-{3 * EVERY:06d}" / "state.json").read_text())
    assert state["sharded"] and state["train"]["world_size"] == 3
    assert state["data"]["world_size"] == 3 and state["data"]["batch"] == 3 * EVERY  # from step 10's batch, 5 on
