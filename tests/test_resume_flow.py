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
from flowrun import client_view, run_flow
from safetensors.torch import load_file
from test_train_resume import assert_close

from sfm.train import checkpoint

MAX_STEPS, EVERY = 60, 5
JOB_TOML = f"""
[data]
batch_size = 4
[train]
max_steps = {MAX_STEPS}
checkpoint_every = {EVERY}
log_every = 10
warmup_steps = 5
keep_checkpoints = 2
threads_per_process = 1
[eval]
crops = 4
batch_size = 4
downstream = false
"""


def training_processes(data_root: Path) -> list[int]:
    """PIDs of the torchrun launchers and ranks training a job whose run root is under data_root
    (found through the job file on their command lines; other people's runs are left alone)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"sfm.train.trainer" not in args:
            continue
        try:
            job = json.loads(Path(args[args.index(b"sfm.train.trainer") + 1].decode()).read_text())
        except (OSError, ValueError, IndexError):
            continue
        if str(job.get("run_root", "")).startswith(str(data_root)):
            pids.append(int(entry.name))
    return pids


class Killer(threading.Thread):
    """Kills the training processes twice: once a first checkpoint exists, and again once the
    retried attempt has written a newer one. Records what it saw. ``pick`` chooses which of the
    run's training processes to kill (default: all of them)."""

    def __init__(self, data_root: Path, pick: Callable[[list[int]], list[int]] = lambda pids: pids):
        super().__init__(daemon=True)
        self.data_root = data_root
        self.pick = pick
        self.kills: list[dict] = []
        self.error: str | None = None
        self.stop = threading.Event()

    def ckpt_root(self) -> str | None:
        roots = list(self.data_root.glob("checkpoints/*/ckpt"))
        return str(roots[0]) if roots else None

    def run(self):
        try:
            newer_than = 0
            for _ in range(2):
                while not self.stop.is_set():
                    root = self.ckpt_root()
                    steps = checkpoint.complete_steps(root) if root else []
                    pids = self.pick(training_processes(self.data_root))
                    if steps and steps[-1] > newer_than and pids:
                        for pid in pids:
                            os.kill(pid, signal.SIGKILL)
                        self.kills.append({"steps": checkpoint.complete_steps(root), "pids": pids,
                                           "at": time.monotonic()})
                        newer_than = self.kills[-1]["steps"][-1]
                        break
                    time.sleep(0.02)
        except Exception as err:  # reported by the test
            self.error = repr(err)


def run_killed_twice(killer: Killer, env: dict, tmp_path: Path, top: dict, *, last_step: int = MAX_STEPS, **params):
    """Run the flow while ``killer`` kills its training twice; the run must fail after two kills at
    increasing checkpoints before ``last_step``. Returns the failed run, the two checkpoint steps and
    when the run ended."""
    killer.start()
    failed = run_flow(env, cwd=str(tmp_path), top_level=top, **params)
    ended = time.monotonic()
    killer.stop.set()
    killer.join(10)
    assert killer.error is None, killer.error
    assert failed.status == "failed", "the run should fail after its retry was killed too"
    assert len(killer.kills) == 2, killer.kills
    first, second = (k["steps"][-1] for k in killer.kills)
    assert 0 < first < second < last_step, killer.kills
    return failed, first, second, ended


@pytest.mark.timeout(900)
def test_killed_pretrain_retries_then_resumes_to_the_uninterrupted_weights(tmp_path, metaflow_env):
    data_root = tmp_path / "data"
    config = tmp_path / "job.toml"
    config.write_text(JOB_TOML)
    top = {"config": [("config", str(config))]}

    killer = Killer(data_root)
    failed, first, second, _ = run_killed_twice(killer, metaflow_env, tmp_path, top, data_root=str(data_root))
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
