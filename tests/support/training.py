"""Helpers of the training, resume and flow-kill tests: small survey stores and jobs, the exported
weights, tolerant comparisons, and finding and killing a run's training processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load as load_safetensors

from sfm import storage
from sfm.train import checkpoint
from support.flowrun import run_flow

PROJECT = Path(__file__).resolve().parents[2]


def make_survey_store(tmp_path_factory, seed: int) -> str:
    """One small synthetic survey (48 x 48 x 64), ingested into a Zarr store of 32^3 bricks."""
    from sfm.ingest.survey import ingest_survey
    from sfm.synth.survey import synth_survey

    tmp = tmp_path_factory.mktemp("survey")
    synth_survey(str(tmp / "s.sgy"), shape=(48, 48, 64), seed=seed)
    return ingest_survey(str(tmp / "s.sgy"), str(tmp / "root"), chunk=32)["store_url"]



def make_job(store: str, run_root: str, max_steps: int = 40, every: int = 5) -> dict:
    """A one-survey training job of ``max_steps`` steps, checkpointed every ``every``."""
    config = {
        "data": {"batch_size": 4, "crop": [32, 32, 32]},
        "train": {"max_steps": max_steps, "checkpoint_every": every, "log_every": 10, "warmup_steps": 5,
                  "keep_checkpoints": 2, "threads_per_process": 1},
    }
    return {"config": config, "surveys": [store], "run_root": run_root}



def start_ranks(job: dict, procs: int, log: Path, env: dict | None = None) -> subprocess.Popen:
    """``sfm.train.trainer`` on ``procs`` gloo ranks under torchrun on this machine (its job file next
    to ``log``); stdout and stderr go to ``log``."""
    from sfm.distributed.launch import free_port

    job_path = log.with_suffix(".json")
    job_path.write_text(json.dumps(job))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={procs}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", "--max-restarts=0",
           "-m", "sfm.train.trainer", str(job_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log, "wb") as fh:
        return subprocess.Popen(cmd, cwd=PROJECT, stdout=fh, stderr=subprocess.STDOUT, env=env)


def children(pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


def kill_tree(pid: int) -> None:
    """SIGKILL torchrun and every rank (torchrun starts each rank in a session of its own)."""
    for p in [pid, *children(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def assert_same_run(root: str, ref_root: str) -> None:
    """Bit for bit the run of ``ref_root``: the final weights, and the step, the loss and nothing else
    missing at every step of the history (speed figures aside), and the health counts."""
    weights, ref_weights = final_weights(root), final_weights(ref_root)
    assert weights.keys() == ref_weights.keys()
    differ = [name for name in ref_weights if not torch.equal(weights[name], ref_weights[name])]
    assert not differ, f"weights differ: {differ}"
    got, ref = (json.loads(storage.read_bytes(storage.join(r, "summary.json"))) for r in (root, ref_root))
    assert [(h["step"], h["loss"]) for h in got["history"]] == [(h["step"], h["loss"]) for h in ref["history"]]
    assert got["health"] == ref["health"]


def assert_close(got: torch.Tensor, ref: torch.Tensor, name: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Elementwise |got - ref| <= atol + rtol * |ref| (not torch.testing: after metaflow is imported,
    its lazy import of torch.distributed.tensor trips over metaflow's vendored typing_extensions)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, name
    excess = ((got - ref).abs() - (atol + rtol * ref.abs())).max().item()
    assert excess <= 0, f"{name}: max |diff| {(got - ref).abs().max().item():.3g} beyond tolerance"



def tensorboard_losses(events: str | Path) -> list[tuple[int, float]]:
    """(step, loss) of every loss event TensorBoard shows for ``events``: an event file, or a folder (its event files
    in order, where a file's purge step drops what earlier files logged from that step on: sfm.train.trackers)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("loss")] if "loss" in acc.Tags()["scalars"] else []


def final_weights(run_root: str) -> dict[str, torch.Tensor]:
    return load_safetensors(storage.read_bytes(storage.join(run_root, "final", "model.safetensors")))



def env_of(pid: int) -> dict[str, str]:
    """The environment process ``pid`` started with ({} once it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if b"=" in item)



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



def run_killed_twice(killer: Killer, env: dict, tmp_path: Path, top: dict, *, last_step: int, **params):
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
    # the run's own log tail says why it ended early when a kill is missing (a retry that failed by itself)
    assert len(killer.kills) == 2, (killer.kills, (failed.stdout + failed.stderr)[-6000:])
    first, second = (k["steps"][-1] for k in killer.kills)
    assert 0 < first < second < last_step, killer.kills
    return failed, first, second, ended
