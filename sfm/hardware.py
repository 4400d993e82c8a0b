"""How fast the hardware can multiply matrices: the denominator of model-FLOPs utilisation (MFU)."""

from __future__ import annotations

import functools
import time

import torch

# Dense bf16 tensor-core peaks (no sparsity), FLOP/s, by device-name substring.
_GPU_BF16_PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


@functools.cache
def measured_matmul_flops(device: str = "cpu", dtype: torch.dtype = torch.float32, n: int = 1024,
                          seconds: float = 0.3) -> float:
    """Achieved FLOP/s of an n x n x n matmul on ``device`` with the current thread count."""
    gen = torch.Generator(device=device).manual_seed(0)  # its own: never moves the global RNG
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(2):
        a @ b
    sync()
    iters, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        iters += 1
    sync()
    return 2 * n**3 * iters / (time.perf_counter() - t0)


def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Datasheet peak on known GPUs, else the measured matmul rate (CPU and unknown devices)."""
    if device.type == "cuda" and dtype == torch.bfloat16:
        name = torch.cuda.get_device_name(device)
        for key, value in _GPU_BF16_PEAK.items():
            if key in name:
                return value
    return measured_matmul_flops(str(device), dtype)
