"""sfm.model.hardware.PeakFlops: the MFU denominator holds under a busy start-up (issue 46: a flow run
printed MFU 150 % after a single 0.3 s measurement taken while the cores were busy), and no figure above
100 % is ever reported.

The busy start-up is real: processes spinning on every core while the peak is measured, stopped before
the model trains. The training windows are real too: a tiny MAE's forward and backward, with the FLOPs
the trainer counts for it (sfm.model.flops)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest
import torch

from sfm.model.flops import train_flops_per_sample
from sfm.model.hardware import PeakFlops, matmul_flops
from sfm.model.presets import build_model, mae_config


@contextmanager
def cores_held(per_core: int = 3):
    """``per_core`` busy processes per core for the duration of the block."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(per_core * (os.cpu_count() or 1))]
    try:
        time.sleep(0.5)  # let them reach the scheduler
        yield
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, as the flow tests train (train.threads_per_process = 1): on a shared machine
    several threads spin against each other and the model's steps become mostly waiting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def training_windows(windows: int, seconds: float = 0.3) -> list[float]:
    """Achieved model FLOP/s of ``windows`` timed windows of tiny-MAE training steps."""
    torch.manual_seed(0)
    cfg = mae_config("tiny", crop=(16, 16, 32))
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randn(2, 1, *cfg.crop)
    flops = train_flops_per_sample(cfg) * batch.shape[0]
    rates = []
    for _ in range(windows):
        steps, t0 = 0, time.perf_counter()
        while steps == 0 or time.perf_counter() - t0 < seconds:
            loss = model(batch)[0]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps += 1
        rates.append(flops * steps / (time.perf_counter() - t0))
    return rates


def test_a_busy_start_up_never_yields_an_mfu_above_the_peak():
    with cores_held():
        peak = PeakFlops(torch.device("cpu"), torch.float32)
    busy = peak.flops
    idle = matmul_flops("cpu", torch.float32, peak.n, seconds=0.1, repeats=3)
    assert busy < idle, (busy, idle)  # the hogs did slow the start-up measurement down

    reported = []
    for rate in training_windows(4):
        reported.append(peak.checked(rate / peak.flops))
    assert all(m is None or 0 < m <= 1.0 for m in reported), reported
    assert sum(m is not None for m in reported) >= 3, reported  # the figures are reported, not just withheld
    assert peak.flops > busy  # the windows measured the peak again, now the cores were free


def test_a_figure_above_the_peak_is_measured_again_then_withheld():
    peak = PeakFlops(torch.device("cpu"), torch.float32, spread=0)
    before = peak.flops
    assert peak.checked(0.5) == 0.5 and peak.flops == before  # below the peak, past start-up: no measurement
    assert peak.checked(50.0) is None  # no re-measurement makes the cores 50x faster: a wrong figure
    assert peak.flops >= before  # a measurement only ever raises the peak

