"""DeepSpeed ZeRO-2 and ZeRO-3 (``sfm.distributed.deepspeed_zero``) under ``sfm.train.trainer`` on 2 gloo ranks,
as the flow's pretrain step runs them.

Each stage trains 20 steps of 2 accumulated micro-batches, clipped at 0.1 (active in the first steps), in
which NaN batches at steps 6-8 are skipped and the third rolls the run back to its step-5 checkpoint, with the
run root on an S3 server (moto_server over HTTP): the losses at every step, the snapshot at step 10 and the
final weights follow one process trained on the same global batch with the same injected failures; the
checkpoints hold every rank's DeepSpeed files under the run root, the exports are the plain model's
safetensors, the heartbeat says finished, and no extension was compiled. Killed-and-resumed runs equal
uninterrupted ones bit for bit in test_resume_flow.py (the flow with --nodes 2, each stage; ZeRO-3 in bf16).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load as load_safetensors
from support.training import assert_close, make_job, make_survey_store, start_ranks

from sfm import storage

pytestmark = pytest.mark.long(1)

STEPS, EVERY = 20, 5
NAN = {"SFM_INJECT_FAILURES": "nan@6,nan@7,nan@8"}  # rank 0's batch: skipped, skipped, then a rollback to step 5


@pytest.fixture(scope="module")
def survey_store(tmp_path_factory) -> str:
    return make_survey_store(tmp_path_factory, seed=5)


def job_for(store: str, run_root: str, *, procs: int, batch: int, strategy: str = "ddp") -> dict:
    job = make_job(store, run_root, max_steps=STEPS, every=EVERY)
    job["config"]["data"]["batch_size"] = batch
    job["config"]["train"].update(grad_accum=2, grad_clip=0.1, snapshots=[0.5])
    job["config"]["dist"] = {"procs_per_node": procs, "strategy": strategy, "timeout_s": 60}
    job["config"]["health"] = {"max_nonfinite_in_a_row": 3, "max_rollbacks": 1}
    return job


def run(job: dict, procs: int, log: Path, env: dict) -> dict:
    proc = start_ranks(job, procs, log, env)
    assert proc.wait(timeout=400) == 0, log.read_text()[-4000:]
    return json.loads(storage.read_bytes(storage.join(job["run_root"], "summary.json")))


@pytest.fixture(scope="module")
def single(survey_store, tmp_path_factory) -> dict:
    """One process, global batch 8, the same failures: the run each stage must follow."""
    tmp = tmp_path_factory.mktemp("single")
    summary = run(job_for(survey_store, str(tmp / "run"), procs=1, batch=4), 1, tmp / "single.log", NAN)
    assert summary["health"] == {"skipped_nonfinite": 3, "rollbacks": 1}
    return {"summary": summary, "root": str(tmp / "run")}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["deepspeed-zero2", "deepspeed-zero3"])
def test_two_ranks_follow_one_process_through_skipped_steps_and_a_rollback(strategy, single, survey_store, tmp_path,
                                                                          s3_env):
    bucket = s3_env.make_bucket(strategy)
    run_root = storage.join(bucket, "run")
    extensions = tmp_path / "torch_extensions"  # DeepSpeed would JIT-build its CPU shared-memory op here
    log = tmp_path / "run.log"
    summary = run(job_for(survey_store, run_root, procs=2, batch=2, strategy=strategy), 2, log,
                  {**NAN, "TORCH_EXTENSIONS_DIR": str(extensions)})
    assert (summary["strategy"], summary["world_size"], summary["dp"]) == (strategy, 2, 2)
    assert summary["health"] == {"skipped_nonfinite": 3, "rollbacks": 1}
    text = log.read_text()
    assert "step 6: non-finite loss" in text and f"rolled back to {run_root}/ckpt/step-000005" in text, text[-3000:]
    assert not extensions.exists(), "DeepSpeed compiled an extension"

    # the same curve as one process through the skips and the rollback (fp32: differences are summation order)
    history, ref = summary["history"], single["summary"]["history"]
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    assert [h["loss"] for h in history] == pytest.approx([h["loss"] for h in ref], rel=1e-5, abs=1e-7)
    for export in ("final", "snapshots/step-000010"):
        got, want = (load_safetensors(storage.read_bytes(storage.join(root, export, "model.safetensors")))
                     for root in (run_root, single["root"]))
        assert got.keys() == want.keys()  # the plain model's safetensors, whatever the strategy
        for name in want:  # tolerance: see test_train_distributed.py::assert_same_weights
            assert_close(got[name], want[name], f"{export}: {name}", rtol=1e-4, atol=2e-4)
    assert summary["snapshots"] == {"10": storage.join(run_root, "snapshots", "step-000010")}
    heartbeat = json.loads(storage.read_bytes(storage.join(run_root, "heartbeat.json")))
    assert (heartbeat["status"], heartbeat["step"]) == ("finished", STEPS)
    digests = summary["rank_weight_digests"]  # ZeRO-2 keeps whole weights on every rank; ZeRO-3 does not
    assert (len(set(digests)) == 1 and len(digests) == 2) if strategy == "deepspeed-zero2" else digests is None

    # each rank's part of every checkpoint under the run root, the marker naming who wrote it
    last = f"run/ckpt/step-{STEPS:06d}/"
    keys = {k.removeprefix(last) for k in s3_env.keys(strategy) if k.startswith(last)}
    own = {f"shards/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)}
    own |= {"shards/mp_rank_00_model_states.pt"} if strategy == "deepspeed-zero2" else \
        {f"shards/zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)}
    assert own | {"state.json", "optimizer.pt", "rank0.pt", "rank1.pt"} <= keys, sorted(keys)
    marker = json.loads(storage.read_bytes(storage.join(run_root, "ckpt", f"step-{STEPS:06d}", "state.json")))
    assert marker["sharded"] == {"kind": "deepspeed", "world_size": 2}
