"""How fast the hardware can multiply matrices: the denominator of model-FLOPs utilisation (MFU).

Torch only, so the GPU benchmark can use it where nothing else of the pipeline is installed.
"""

from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger(__name__)

# Dense bf16 tensor-core peaks (no sparsity), FLOP/s, by device-name substring.
_GPU_BF16_PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def matmul_flops(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, n: int | None = None,
                 seconds: float = 0.3, repeats: int = 1) -> float:
    """Achieved FLOP/s of an n x n x n matmul on ``device`` now, with the current thread count: the best of
    ``repeats`` timings of ``seconds`` each (at least one product each), so a moment when something else
    held the cores counts less.

    n defaults to 2048 on CPU and 8192 on GPUs: large enough to run at the device's dense rate.
    Uses a generator of its own, so the global RNG (and hence a training run) is left untouched.
    """
    device = torch.device(device)
    n = n or (8192 if device.type == "cuda" else 2048)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        a @ b
    sync()
    best = 0.0
    for _ in range(repeats):
        iters, t0 = 0, time.perf_counter()
        while iters == 0 or time.perf_counter() - t0 < seconds:
            a @ b
            iters += 1
            if iters % 8 == 0:
                sync()  # keep the GPU's queue short, so the clock measures the GPU
        sync()
        best = max(best, 2 * n**3 * iters / (time.perf_counter() - t0))
    return best


def datasheet_peak_flops(device_name: str, dtype: torch.dtype) -> float | None:
    """The dense bf16 tensor-core peak of a known GPU (by name), else None."""
    if dtype != torch.bfloat16:
        return None
    return next((value for key, value in _GPU_BF16_PEAK.items() if key in device_name), None)


class PeakFlops:
    """The MFU denominator of one training process, and the rule that keeps MFU at or below 100 %.

    On a GPU the datasheet knows (bf16), its dense peak. Elsewhere (CPU, other GPUs and dtypes) the fastest
    matmul rate measured on this process's threads, a figure a busy moment can only lower, never raise:
    the best of ``probes`` short timings at start-up, then one more at each of the first ``spread``
    logged windows (the measurement spread over the run's first windows, so cores another process held while
    the run started are outvoted) and one whenever a window's utilisation comes out above the peak (the
    measured peak was too low). A figure still above 100 % is a wrong FLOP count or a wrong peak: it is
    logged once and not reported.

    A theoretical CPU peak (cores x vector lanes x FMA units x clock) is not used: the FMA units per
    core and the sustained all-core clock differ between parts of one family and are not visible
    inside a VM, and a peak set too low would be worse than a measured one.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype, *, probes: int = 3, spread: int = 3,
                 probe_s: float = 0.1):
        self.device, self.dtype, self.probe_s = torch.device(device), dtype, probe_s
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else ""
        datasheet = datasheet_peak_flops(name, dtype) if name else None
        self.measured = datasheet is None
        # on CPU 1024 (2048 past 16 threads): a few cores multiply it at their dense rate in milliseconds, so
        # each short timing holds several products; GPUs: matmul_flops' 8192
        self.n = (1024 if torch.get_num_threads() <= 16 else 2048) if self.device.type == "cpu" else None
        self.flops = datasheet or matmul_flops(self.device, dtype, self.n, seconds=probe_s, repeats=probes)
        self._spread_left = spread if self.measured else 0
        self._warned = False

    def checked(self, mfu: float) -> float | None:
        """A window's ``mfu``, computed against :attr:`flops`, against the peak as it stands after this
        window's measurement (if it takes one); None if it is still above 100 %."""
        before = self.flops
        if self.measured and (self._spread_left > 0 or mfu > 1.0):
            self._spread_left = max(0, self._spread_left - 1)
            self.flops = max(self.flops, matmul_flops(self.device, self.dtype, self.n, seconds=self.probe_s))
        mfu *= before / self.flops
        if mfu <= 1.0:
            return mfu
        if not self._warned:
            self._warned = True
            log.warning("MFU %.0f%% is above the peak of %.3g FLOP/s (%s) even after measuring it again: the "
                         "FLOP count or the peak is wrong; MFU is not reported while it is", 100 * mfu, self.flops,
                         "measured" if self.measured else "datasheet")
        return None
