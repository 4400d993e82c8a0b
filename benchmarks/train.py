"""CPU model-FLOPs utilisation of a full MAE training step (issue 5).

    python benchmarks/train.py [--steps 3] [--threads 0] [--configs small:64:32,small:128:4,base:64:16,base:128:2]

For each preset:crop:batch, times full training steps exactly as ``sfm.train.trainer`` runs them (forward,
backward, gradient clipping, fused AdamW step; float32 on CPU) through ``sfm.train.step.TrainStep``
on random volumes, and divides the achieved FLOP/s (analytic FLOPs per sample from
``sfm.model.flops`` / measured step time) by the FLOP/s of a dense 2048^3 float32 matmul measured
with the same thread count *right before that step*. The machine is shared, so every step is
paired with its own matmul measurement and the median of the per-step ratios is reported.
OMP_WAIT_POLICY defaults to PASSIVE, as for training runs (see sfm.distributed.launch); set it to compare.

The last line is one JSON object: per config the step time, samples/s, voxels/s, achieved and
matmul GFLOP/s and the ratio (MFU); ``min_mfu`` over the configs against the goal of 0.5.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# As sfm.distributed.launch does for training: idle OpenMP threads sleep instead of spinning. On a shared
# machine spinning threads take the cores their siblings need, and a training step (thousands of
# short parallel regions) suffers far more than one long matmul. Must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from sfm.model.hardware import matmul_flops  # noqa: E402
from sfm.model import build_model, mae_config, param_count, train_flops_per_sample  # noqa: E402
from sfm.train.step import TrainStep, build_optimizer  # noqa: E402

GOAL = 0.5
DEFAULT_CONFIGS = "small:64:32,small:128:4,base:64:16,base:128:2"


def matmul_rate(seconds: float) -> float:
    """Dense float32 matmul FLOP/s now (not cached: the machine's load changes)."""
    return matmul_flops("cpu", torch.float32, n=2048, seconds=seconds)


def bench(preset: str, crop: int, batch: int, steps: int, probe_s: float) -> dict:
    torch.manual_seed(0)
    cfg = mae_config(preset, crop=(crop, crop, crop))
    model = build_model(cfg)
    optimizer = build_optimizer(model, lr=1.5e-4, weight_decay=0.05)
    train_step = TrainStep(model, optimizer, grad_clip=1.0, generator=torch.Generator().manual_seed(1))
    imgs = torch.randn(batch, 1, crop, crop, crop)
    flops = train_flops_per_sample(cfg) * batch
    train_step(iter([imgs]), 1)  # warm-up: allocator, optimizer state
    times, rates, ratios = [], [], []
    for _ in range(steps):
        rate = matmul_rate(probe_s)
        t0 = time.perf_counter()
        train_step(iter([imgs]), 1)
        dt = time.perf_counter() - t0
        times.append(dt)
        rates.append(rate)
        ratios.append(flops / dt / rate)
    step_s = statistics.median(times)
    row = {
        "preset": preset, "crop": crop, "batch": batch, "params_M": round(param_count(cfg) / 1e6, 1),
        "train_GFLOP_per_step": round(flops / 1e9, 1), "step_s": round(step_s, 3),
        "samples_per_s": round(batch / step_s, 3), "voxels_per_s": round(batch * crop**3 / step_s),
        "achieved_GFLOPs": round(flops / step_s / 1e9, 2), "matmul_GFLOPs": round(statistics.median(rates) / 1e9, 2),
        "mfu": round(statistics.median(ratios), 3), "mfu_per_step": [round(r, 3) for r in ratios],
    }
    print(f"{preset:>5} {crop}^3 batch {batch:>2}: step {step_s:6.2f} s, {row['achieved_GFLOPs']:6.1f} GFLOP/s "
          f"vs matmul {row['matmul_GFLOPs']:6.1f} -> MFU {row['mfu']:.2f}", file=sys.stderr, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per config (after one warm-up)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="preset:crop:batch list")
    parser.add_argument("--probe-seconds", type=float, default=1.0, help="matmul measurement before each step")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    t0 = time.perf_counter()
    for item in args.configs.split(","):
        preset, crop, batch = item.split(":")
        rows.append(bench(preset, int(crop), int(batch), args.steps, args.probe_seconds))
    result = {
        "benchmark": "train_cpu_mfu", "dtype": "float32", "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
        "torch": torch.__version__, "steps_per_config": args.steps, "configs": rows,
        "min_mfu": min(r["mfu"] for r in rows), "goal_mfu": GOAL,
        "meets_goal": all(r["mfu"] >= GOAL for r in rows), "seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
