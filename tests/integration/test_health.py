"""sfm.train.health: the hang watchdog (real hung processes), the non-finite guard (also across two gloo
ranks), the heartbeat and ``sfm status`` (local and on the loopback S3 server)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from sfm.train import health
from sfm.errors import SFMError

# ---- watchdog ------------------------------------------------------------------------------------------

_HUNG_SCRIPT = textwrap.dedent("""
    import subprocess, sys, threading, time
    from sfm.train.health import Watchdog

    def reader_blocked_on_s3(event):
        event.wait()

    def stuck_in_loader(event):
        event.wait()  # a data loader that never delivers the next batch

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print(f"CHILD {child.pid}", flush=True)
    blocker = threading.Event()
    threading.Thread(target=reader_blocked_on_s3, args=(blocker,), name="sfm-read-0", daemon=True).start()
    dog = Watchdog(timeout_s=float(sys.argv[1]), name="training step").start()
    for step in range(3):
        time.sleep(0.1)
        dog.progress(step)
    stuck_in_loader(blocker)
""")


def _run_hung(script: str, *args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - t0


def test_watchdog_fails_a_hung_process_with_every_stack_in_the_log():
    proc, seconds = _run_hung(_HUNG_SCRIPT, "2")
    assert proc.returncode == health.HANG_EXIT_CODE, proc.stderr
    assert seconds < 20, f"the hang was noticed after {seconds:.0f}s"
    err = proc.stderr
    assert "training step made no progress for 2s (after step 2)" in err
    assert "thread MainThread" in err and "stuck_in_loader" in err  # where the loop hangs
    assert "thread sfm-read-0" in err and "reader_blocked_on_s3" in err  # and every other thread
    assert "sfm health: end of stacks" in err
    child = int(next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("CHILD")))
    deadline = time.time() + 10
    while time.time() < deadline and os.path.exists(f"/proc/{child}") and \
            open(f"/proc/{child}/stat").read().split()[2] != "Z":
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split()[2] == "Z", \
        "the hung process's child (a loader worker) was left running"


_GIL_HOLDING_SCRIPT = textwrap.dedent("""
    import re, sys
    from sfm.train.health import Watchdog

    dog = Watchdog(timeout_s=1.0, backstop_grace_s=1.0).start()
    dog.progress(7)
    re.match(r"(a+)+$", "a" * 64 + "b")  # catastrophic backtracking in C, holding the GIL
""")


def test_watchdog_backstop_fires_when_the_hang_holds_the_gil():
    proc, seconds = _run_hung(_GIL_HOLDING_SCRIPT)
    assert proc.returncode == 1, proc.stderr  # faulthandler's exit
    assert seconds < 20
    assert "Timeout (0:00:02)!" in proc.stderr and "line 7" in proc.stderr  # the C-level dump names the line


def test_watchdog_quiet_while_progress_continues_then_fires_once():
    reports = []
    with health.Watchdog(timeout_s=0.6, on_hang=reports.append) as dog:
        for step in range(12):  # 1.2 s of steady progress, twice the timeout
            time.sleep(0.1)
            dog.progress(step)
        assert not reports
        deadline = time.monotonic() + 10
        while not reports and time.monotonic() < deadline:
            time.sleep(0.05)
    assert len(reports) == 1 and dog.fired
    assert "after step 11" in reports[0] and "test_watchdog_quiet_while_progress_continues" in reports[0]


def test_watchdog_rejects_a_nonpositive_timeout():
    with pytest.raises(SFMError, match="must be positive"):
        health.Watchdog(timeout_s=0)


# ---- non-finite guard ------------------------------------------------------------------------------------

def test_guard_skips_then_rolls_back_then_declares_divergence():
    guard = health.NonFiniteGuard(max_consecutive=3, max_rollbacks=1)
    seq = [True, False, False, True, False, False, False]
    assert [guard.observe(f) for f in seq] == ["ok", "skip", "skip", "ok", "skip", "skip", "rollback"]
    assert guard.skipped == 5 and guard.consecutive == 3
    guard.rolled_back()
    restored = health.NonFiniteGuard(max_consecutive=3, max_rollbacks=1)
    restored.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    assert [restored.observe(f) for f in (False, False)] == ["skip", "skip"]
    with pytest.raises(SFMError, match="training diverged: 3 non-finite steps in a row after 1 rollback"):
        restored.observe(False)


def test_all_ranks_finite_on_one_process():
    one = torch.tensor(1.0)
    assert health.all_ranks_finite(one, torch.tensor(0.5))
    assert not health.all_ranks_finite(torch.tensor(float("nan")), one)
    assert not health.all_ranks_finite(one, torch.tensor(float("inf")))
    assert health.all_ranks_finite(one, None)


def _finite_worker(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)

    def reduce_sum(t):
        dist.all_reduce(t)  # SUM of the ranks' non-finite counts
        return t

    loss = torch.tensor(float("nan") if rank == 1 else 0.3)  # only rank 1 sees a NaN
    verdicts = [health.all_ranks_finite(loss, torch.tensor(1.0), reduce=reduce_sum),
                health.all_ranks_finite(torch.tensor(0.3), torch.tensor(1.0), reduce=reduce_sum)]
    with open(f"{out}.{rank}", "w") as fh:
        json.dump(verdicts, fh)
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_all_ranks_finite_agrees_across_gloo_ranks(tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "verdict")
    mp.spawn(_finite_worker, args=(2, f"file://{tmp_path / 'rdzv'}", out), nprocs=2, join=True)
    assert [json.load(open(f"{out}.{r}")) for r in range(2)] == [[False, True], [False, True]]


# ---- heartbeat and sfm status ----------------------------------------------------------------------------

class FakeClock:
    def __init__(self, t: float = 1_700_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_heartbeat_is_throttled_and_json_safe(tmp_path):
    clock = FakeClock()
    run_root = str(tmp_path / "checkpoints" / "PretrainFlow-1")
    beat = health.Heartbeat(run_root, every_s=30, max_steps=100, clock=clock)
    assert beat.beat(1, loss=0.9, samples_per_s=12.5)
    clock.t += 10
    assert not beat.beat(2, loss=0.8)  # within every_s: not written
    assert health.read_heartbeat(run_root)["step"] == 1
    clock.t += 25
    assert beat.beat(3, loss=float("nan"), samples_per_s=torch.tensor(11.0), skipped_nonfinite=1)
    record = health.read_heartbeat(run_root)
    assert record["step"] == 3 and record["loss"] is None and record["samples_per_s"] == 11.0
    assert record["skipped_nonfinite"] == 1 and record["max_steps"] == 100 and record["status"] == "running"
    clock.t += 1
    assert beat.finish(100, loss=0.5)
    assert health.read_heartbeat(run_root)["status"] == "finished"
    assert not health.Heartbeat(run_root, enabled=False).beat(5, force=True)  # ranks > 0 never write
    assert [p.name for p in (tmp_path / "checkpoints" / "PretrainFlow-1").iterdir()] == ["heartbeat.json"]

    info = health.describe(health.read_heartbeat(run_root), now=clock.t + 5)
    assert info["state"] == "finished" and info["age_s"] == 5.0
    stale = health.describe({**record, "status": "running"}, now=record["unix_time"] + 601, stale_after_s=600)
    assert stale["state"] == "stale"
    assert "stale: step 3/100, loss n/a, 11.0 samples/s, skipped 1 non-finite" in health.summary_line(stale)


def _sfm(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sfm.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


@pytest.mark.timeout(180)
def test_sfm_status_reads_the_heartbeat_on_s3(s3_env):
    bucket = s3_env.make_bucket("sfm-status")
    data_root = f"{bucket}/data"
    run_root = f"{data_root}/checkpoints/PretrainFlow-42"
    beat = health.Heartbeat(run_root, max_steps=200, world_size=2)
    beat.beat(57, loss=0.4321, samples_per_s=33.3, rollbacks=1)

    by_name = _sfm("status", "PretrainFlow/42", "--data-root", data_root)
    assert by_name.returncode == 0, by_name.stderr
    assert by_name.stdout.startswith(f"{run_root}: running: step 57/200, loss 0.4321, 33.3 samples/s, 1 rollback(s)")
    by_url = _sfm("status", run_root, "--json")
    assert by_url.returncode == 0 and json.loads(by_url.stdout)["world_size"] == 2

    time.sleep(1.2)
    stale = _sfm("status", run_root, "--stale-after", "1")
    assert stale.returncode == 1 and "stale: step 57/200" in stale.stdout

    for bad, why in [("PretrainFlow-43", "no heartbeat at"), ("..%2f..%2fetc", "cannot be used in a storage path"),
                     ("PretrainFlow-1\nx", "cannot be used in a storage path")]:
        proc = _sfm("status", bad, "--data-root", data_root)
        assert proc.returncode == 2 and why in proc.stderr, (bad, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1
    assert s3_env.keys("sfm-status") == ["data/checkpoints/PretrainFlow-42/heartbeat.json"]


def test_resolve_run_root_forms(tmp_path):
    assert health.resolve_run_root("s3://b/d/checkpoints/R") == "s3://b/d/checkpoints/R"
    assert health.resolve_run_root("PretrainFlow/9", "s3://b/d") == "s3://b/d/checkpoints/PretrainFlow-9"
    assert health.resolve_run_root(str(tmp_path)) == str(tmp_path)
    with pytest.raises(SFMError, match="also pass --data-root"):
        health.resolve_run_root("PretrainFlow-9")
    assert math.isclose(health.describe({"unix_time": 100.0}, now=130.0)["age_s"], 30.0)
