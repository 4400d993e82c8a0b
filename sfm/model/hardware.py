"""How fast the hardware can multiply matrices: the denominator of model-FLOPs utilisation (MFU).

Torch only, so the GPU benchmark can use it where nothing else of the pipeline is installed.
"""

from __future__ import annotations

import functools
import time

import torch

# Dense bf16 tensor-core peaks (no sparsity), FLOP/s, by device-name substring.
_GPU_BF16_PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def matmul_flops(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, n: int | None = None,
                 seconds: float = 0.3) -> float:
    """Achieved FLOP/s of an n x n x n matmul on ``device`` now, with the current thread count.

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
    iters, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        iters += 1
        if iters % 8 == 0:
            sync()  # keep the GPU's queue short, so the clock measures the GPU
    sync()
    return 2 * n**3 * iters / (time.perf_counter() - t0)


@functools.cache
def measured_matmul_flops(device: str = "cpu", dtype: torch.dtype = torch.float32) -> float:
    """:func:`matmul_flops`, measured once per process (a training run's MFU denominator)."""
    return matmul_flops(device, dtype)


def datasheet_peak_flops(device_name: str, dtype: torch.dtype) -> float | None:
    """The dense bf16 tensor-core peak of a known GPU (by name), else None."""
    if dtype != torch.bfloat16:
        return None
    return next((value for key, value in _GPU_BF16_PEAK.items() if key in device_name), None)


def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Datasheet peak on known GPUs, else the measured matmul rate (CPU and unknown devices)."""
    if device.type == "cuda":
        peak = datasheet_peak_flops(torch.cuda.get_device_name(device), dtype)
        if peak:
            return peak
    return measured_matmul_flops(str(device), dtype)
