"""sfm.train.trainer on several gloo ranks under torchrun, as the flow's pretrain step runs it.

- ddp on 2 ranks equals one process with the same global batch (loss at every step, final
  weights), and both ranks end with identical weights;
- fsdp2-zero2 and fsdp2-full train to the same curve, write sharded checkpoints, and a run killed
  after its first checkpoint resumes to the one process's weights (bit for bit against an
  uninterrupted run of the same strategy: test_train_resume.py);
- dp=1 x cp=2 (context parallelism) equals one process on the same crops and masks, and resumes;
- a rank killed mid-training fails the whole job within the collective timeout instead of hanging.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support.training import (assert_close, children, env_of, final_weights, kill_tree, make_job, make_survey_store,
                              start_ranks)

from sfm.train import checkpoint

pytestmark = pytest.mark.long(3)

STEPS, EVERY = 10, 5
# 32^3 crops of 8^3 patches: 64 tokens; 15 kept (+ cls = 16) divides by cp = 2, so cp leaves the mask ratio as is
MASK_RATIO = 0.765625


@pytest.fixture(scope="module")
def survey_store(tmp_path_factory) -> str:
    return make_survey_store(tmp_path_factory, seed=5)


def job_for(store: str, run_root: Path, *, procs: int, batch: int, strategy: str = "ddp", cp: int = 1) -> dict:
    job = make_job(store, str(run_root))
    job["config"]["data"]["batch_size"] = batch
    job["config"]["model"] = {"mask_ratio": MASK_RATIO}
    job["config"]["train"].update(max_steps=STEPS, checkpoint_every=EVERY, log_every=5)
    job["config"]["dist"] = {"procs_per_node": procs, "strategy": strategy, "cp": cp, "timeout_s": 30}
    return job


def run(job: dict, procs: int, log: Path) -> dict:
    proc = start_ranks(job, procs, log)
    assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]
    return json.loads((Path(job["run_root"]) / "summary.json").read_text())


def losses(summary: dict) -> list[float]:
    assert [h["step"] for h in summary["history"]] == list(range(1, STEPS + 1))
    return [h["loss"] for h in summary["history"]]


def assert_same_weights(root: Path, ref_root: Path, rtol: float = 1e-4, atol: float = 2e-4) -> None:
    """Equal to float tolerance. Summation order differs between layouts (gradients reduced across
    ranks, or attention merged across the ring), and Adam divides each gradient by its running RMS,
    which turns rounding in near-zero gradients into steps of up to ~lr: over 10 steps at lr 1.5e-3
    that is ~1e-4 at most, while any real difference in the data, masks or reduction moves weights by
    ~lr x steps (1e-2)."""
    got, ref = final_weights(str(root)), final_weights(str(ref_root))
    assert got.keys() == ref.keys()
    for name in ref:
        assert_close(got[name], ref[name], name, rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def single(survey_store, tmp_path_factory) -> dict:
    """One process, global batch 8: the run every parallel layout must reproduce."""
    tmp = tmp_path_factory.mktemp("single")
    job = job_for(survey_store, tmp / "run", procs=1, batch=8)
    return {"summary": run(job, 1, tmp / "single.log"), "root": tmp / "run"}


@pytest.mark.timeout(400)
def test_ddp_two_ranks_equal_one_process_with_the_same_global_batch(survey_store, single, tmp_path):
    summary = run(job_for(survey_store, tmp_path / "run", procs=2, batch=4), 2, tmp_path / "ddp.log")
    assert summary["world_size"] == 2 and summary["strategy"] == "ddp" and summary["dp"] == 2
    assert losses(summary) == pytest.approx(losses(single["summary"]), rel=1e-4, abs=1e-6)
    assert_same_weights(tmp_path / "run", single["root"])
    digests = summary["rank_weight_digests"]
    assert len(digests) == 2 and digests[0] == digests[1], digests


@pytest.mark.timeout(400)
def test_muon_ddp_two_ranks_stay_identical_and_train_like_one_process(survey_store, tmp_path):
    """train.optimizer = muon under DDP: every rank orthogonalises the same all-reduced gradient, so the
    ranks end bit-identical, and train as one process with the same global batch does: the same losses;
    the weights to a looser tolerance than AdamW's, since Newton-Schulz runs in bf16, where the rounding of
    the reduction order moves single weights by up to ~1.5e-3 over 10 steps."""
    runs = {}
    for procs, batch in ((1, 8), (2, 4)):
        job = job_for(survey_store, tmp_path / f"run{procs}", procs=procs, batch=batch)
        job["config"]["train"].update(optimizer="muon", muon_lr=3e-3)
        runs[procs] = run(job, procs, tmp_path / f"muon{procs}.log")
    digests = runs[2]["rank_weight_digests"]
    assert len(digests) == 2 and digests[0] == digests[1], digests
    assert losses(runs[2]) == pytest.approx(losses(runs[1]), rel=1e-4, abs=1e-6)
    assert_same_weights(tmp_path / "run2", tmp_path / "run1", rtol=1e-2, atol=2e-3)


def kill_after_first_checkpoint(proc: subprocess.Popen, run_root: Path, log: Path) -> int:
    ckpt = str(run_root / "ckpt")
    deadline = time.monotonic() + 240
    while not checkpoint.complete_steps(ckpt):
        assert proc.poll() is None, f"ended before its first checkpoint:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "no checkpoint within 240 s"
        time.sleep(0.02)
    kill_tree(proc.pid)
    proc.wait(timeout=60)
    steps = checkpoint.complete_steps(ckpt)
    assert steps[-1] < STEPS, f"killed too late: {steps}"
    return steps[-1]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["fsdp2-zero2", "fsdp2-full"])
def test_fsdp2_trains_like_one_process_and_resumes_from_sharded_checkpoints(strategy, survey_store, single,
                                                                            tmp_path):
    job = job_for(survey_store, tmp_path / "run", procs=2, batch=4, strategy=strategy)
    proc = start_ranks(job, 2, tmp_path / "attempt0.log")
    at_kill = kill_after_first_checkpoint(proc, tmp_path / "run", tmp_path / "attempt0.log")
    shards = checkpoint.shards_url(str(tmp_path / "run" / "ckpt"), at_kill)
    assert (Path(shards) / ".metadata").exists() and not (Path(shards).parent / "model.safetensors").exists()
    summary = run(job, 2, tmp_path / "attempt1.log")
    assert summary["strategy"] == strategy and summary["resumed_from_step"] == at_kill
    assert f"resumed from {checkpoint.step_dir(str(tmp_path / 'run' / 'ckpt'), at_kill)}" in \
        (tmp_path / "attempt1.log").read_text()
    assert losses(summary) == pytest.approx(losses(single["summary"]), rel=1e-4, abs=1e-6)
    assert_same_weights(tmp_path / "run", single["root"])


@pytest.mark.timeout(600)
def test_context_parallel_two_ranks_equal_one_process_and_resume(survey_store, single, tmp_path):
    """dp=1 x cp=2: both ranks train on the same crops (global batch 8), each reading half of each
    crop; the run equals the one-process run, and a killed run resumes to the same weights."""
    job = job_for(survey_store, tmp_path / "run", procs=2, batch=8, cp=2)
    proc = start_ranks(job, 2, tmp_path / "attempt0.log")
    at_kill = kill_after_first_checkpoint(proc, tmp_path / "run", tmp_path / "attempt0.log")
    summary = run(job, 2, tmp_path / "attempt1.log")
    assert (summary["dp"], summary["cp"], summary["resumed_from_step"]) == (1, 2, at_kill)
    log = (tmp_path / "attempt0.log").read_text()
    assert "dp 1 x cp 2" in log and "inline voxels [0, 16)" in log and "effective mask ratio 0.7656" in log
    assert losses(summary) == pytest.approx(losses(single["summary"]), rel=1e-4, abs=1e-6)
    assert_same_weights(tmp_path / "run", single["root"])


@pytest.mark.timeout(300)
def test_a_killed_rank_fails_the_job_within_the_collective_timeout(survey_store, tmp_path):
    job = job_for(survey_store, tmp_path / "run", procs=2, batch=4)
    job["config"]["train"]["max_steps"] = 100_000
    log = tmp_path / "run.log"
    proc = start_ranks(job, 2, log)
    ckpt = str(tmp_path / "run" / "ckpt")
    deadline = time.monotonic() + 240
    while not checkpoint.complete_steps(ckpt):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    rank1 = [pid for pid in children(proc.pid) if env_of(pid).get("RANK") == "1"]
    assert len(rank1) == 1, rank1
    os.kill(rank1[0], signal.SIGKILL)
    killed_at = time.monotonic()
    code = proc.wait(timeout=120)
    assert code != 0
    assert time.monotonic() - killed_at < job["config"]["dist"]["timeout_s"] + 30, "the job outlived the timeout"
