"""bf16 model-FLOPs utilisation of MAE pretraining on one GPU (issue 5).

    python benchmarks/gpu_train.py                 # on a GPU machine (H100/H200 class): < 8 minutes
    python benchmarks/gpu_train.py --smoke         # CPU, tiny shapes: checks the script runs at all

Needs only torch and the model / training-step modules of ``sfm`` (``sfm.model``,
``sfm.train.step``, ``sfm.model.hardware``): no metaflow, zarr, segyio, boto3 or fsspec, so it runs
wherever torch is installed (``pip install torch safetensors`` plus this checkout on PYTHONPATH).

For presets base and large at 128^3 and 256^3 crops, it times full training steps exactly as
``sfm.train.trainer`` runs them (``sfm.train.step.TrainStep``: bf16 autocast, forward, backward, gradient
clipping, fused AdamW) on random volumes, first eager, then with each transformer block compiled
(``torch.compile``) while the time budget allows. MFU = analytic FLOPs per step
(``sfm.model.flops``) / step time / the dense bf16 matmul rate this script measures on the same GPU
(the best of 4096^3 and 8192^3); MFU against the datasheet peak is reported too. Goal: >= 0.45.

The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

T0 = time.perf_counter()  # the time budget counts the imports too
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from sfm.model.hardware import datasheet_peak_flops, matmul_flops  # noqa: E402
from sfm.model import build_model, mae_config, param_count, train_flops_per_sample  # noqa: E402
from sfm.train.step import StepHooks, TrainStep, apply_training_options, build_optimizer, throughput  # noqa: E402

GOAL = 0.45
# preset:crop:batch; batches sized for ~0.1-0.3 s steps and well under 141 GB (halved on OOM)
GPU_CONFIGS = "base:128:128,base:256:16,large:128:64,large:256:16"
SMOKE_CONFIGS = "tiny:32:2,tiny:64:1"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(preset: str, crop: int, batch: int, *, device: torch.device, compile: bool, warmup: int,
               steps: int, dtype: torch.dtype) -> dict:
    """Median step time of ``steps`` training steps after ``warmup`` ones (compilation happens there)."""
    torch.manual_seed(0)
    cfg = mae_config(preset, crop=(crop, crop, crop))
    model = build_model(cfg).to(device)
    apply_training_options(model, compile=compile)
    optimizer = build_optimizer(model, lr=1.5e-4, weight_decay=0.05)
    autocast = lambda: torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)  # noqa: E731
    step = TrainStep(model, optimizer, grad_clip=1.0, hooks=StepHooks(autocast=autocast),
                     generator=torch.Generator(device=device).manual_seed(1))
    imgs = torch.randn(batch, 1, crop, crop, crop, device=device)
    t0 = time.perf_counter()
    for _ in range(warmup):
        step(iter([imgs]), 1)
    sync(device)
    warmup_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses = step(iter([imgs]), 1).losses
        sync(device)
        times.append(time.perf_counter() - t0)
    assert torch.isfinite(losses).all(), f"non-finite loss for {preset} {crop}^3"
    peak_mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"step_s": statistics.median(times), "warmup_s": warmup_s, "peak_mem_GiB": peak_mem,
            "flops_per_sample": train_flops_per_sample(cfg), "params_M": param_count(cfg) / 1e6}


def run_config(preset: str, crop: int, batch: int, *, compile: bool, **kw) -> dict:
    """time_steps, halving the batch on out-of-memory."""
    device = kw["device"]
    while True:
        try:
            return {"batch": batch, **time_steps(preset, crop, batch, compile=compile, **kw)}
        except torch.OutOfMemoryError:
            if batch == 1:
                raise
            batch //= 2
            print(f"  out of memory: retrying {preset} {crop}^3 with batch {batch}", file=sys.stderr, flush=True)
        finally:
            if compile:
                torch._dynamo.reset()  # next config compiles for its own static shapes
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, float32, tiny shapes, no compile: check it runs")
    parser.add_argument("--configs", default=None, help=f"preset:crop:batch list (default {GPU_CONFIGS})")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per config")
    parser.add_argument("--budget-s", type=float, default=440.0,
                        help="a compiled run starts only if it is expected to end within this many seconds of "
                             "the start (expected: the longest compiled run so far, at least 90 s); total < 8 min")
    parser.add_argument("--no-compile", action="store_true", help="eager only")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0: default; --smoke: 1)")
    args = parser.parse_args()
    if args.threads or args.smoke:
        torch.set_num_threads(args.threads or 1)

    t_start = T0
    if args.smoke:
        # float32: CPUs without bf16 units emulate it very slowly; the smoke run checks plumbing only
        device, dtype = torch.device("cpu"), torch.float32
        configs, steps, warmup, sizes, probe_s = args.configs or SMOKE_CONFIGS, args.steps or 1, 1, [512], 0.2
        compile_too = False
    else:
        if not torch.cuda.is_available():
            sys.exit("gpu_train.py: no CUDA device; run on a GPU machine, or pass --smoke for a CPU check")
        device, dtype = torch.device("cuda", 0), torch.bfloat16
        configs, steps, warmup, sizes, probe_s = args.configs or GPU_CONFIGS, args.steps or 10, 3, [4096, 8192], 1.0
        compile_too = not args.no_compile
        torch.backends.cuda.matmul.allow_tf32 = True  # the fp32 parts (loss, targets) on tensor cores
        torch.backends.cudnn.allow_tf32 = True
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    by_size = {str(n): matmul_flops(device, dtype, n=n, seconds=probe_s) for n in sizes}
    matmul = {"best": max(by_size.values()), "by_size": by_size}
    datasheet = datasheet_peak_flops(name, dtype)
    print(f"{name}: dense {dtype} matmul {matmul['best'] / 1e12:.2f} TFLOP/s measured"
          + (f", datasheet {datasheet / 1e12:.0f}" if datasheet else ""), file=sys.stderr, flush=True)

    plan = [(p, int(c), int(b)) for p, c, b in (item.split(":") for item in configs.split(","))]
    rows, errors, longest_compiled_s = [], [], 90.0
    for compiled in ([False, True] if compile_too else [False]):
        for preset, crop, batch in plan:
            if compiled and time.perf_counter() - t_start + longest_compiled_s > args.budget_s:
                print(f"  skipping compiled {preset} {crop}^3: it would not end within --budget-s",
                      file=sys.stderr, flush=True)
                continue
            t_run = time.perf_counter()
            try:
                r = run_config(preset, crop, batch, compile=compiled, device=device, warmup=warmup, steps=steps,
                               dtype=dtype)
            except Exception as err:  # a compiler failure must not lose the eager figures
                if not compiled:
                    raise
                errors.append(f"compiled {preset} {crop}^3: {type(err).__name__}: {str(err)[:300]}")
                print(f"  {errors[-1]}", file=sys.stderr, flush=True)
                continue
            if compiled:
                longest_compiled_s = max(longest_compiled_s, time.perf_counter() - t_run)
            speed = throughput(samples=r["batch"], seconds=r["step_s"], flops_per_sample=r["flops_per_sample"],
                               voxels_per_sample=crop**3, peak_flops=matmul["best"])
            row = {
                "preset": preset, "crop": crop, "batch": r["batch"], "compiled": compiled,
                "params_M": round(r["params_M"], 1), "step_ms": round(r["step_s"] * 1e3, 2),
                "warmup_s": round(r["warmup_s"], 1), "samples_per_s": round(speed["samples_per_s"], 2),
                "voxels_per_s": round(speed["voxels_per_s"]),
                "achieved_TFLOPs": round(r["flops_per_sample"] * speed["samples_per_s"] / 1e12, 3),
                "mfu": round(speed["mfu"], 4),
                "mfu_datasheet": round(speed["mfu"] * matmul["best"] / datasheet, 4) if datasheet else None,
                "peak_mem_GiB": round(r["peak_mem_GiB"], 1) if r["peak_mem_GiB"] is not None else None,
            }
            rows.append(row)
            print(f"  {preset:>5} {crop}^3 batch {row['batch']:>3} {'compiled' if compiled else 'eager   '}: "
                  f"{row['step_ms']:8.1f} ms/step, {row['achieved_TFLOPs']:7.1f} TFLOP/s, MFU {row['mfu']:.3f}",
                  file=sys.stderr, flush=True)

    best = {}
    for row in rows:  # per config, the better of eager and compiled
        key = f"{row['preset']}:{row['crop']}"
        if key not in best or row["mfu"] > best[key]["mfu"]:
            best[key] = row
    result = {
        "benchmark": "gpu_train_mfu", "smoke": args.smoke, "device": name, "dtype": str(dtype).replace("torch.", ""),
        "torch": torch.__version__, "matmul_TFLOPs_measured": round(matmul["best"] / 1e12, 2),
        "matmul_TFLOPs_by_size": {k: round(v / 1e12, 2) for k, v in matmul["by_size"].items()},
        "datasheet_TFLOPs": datasheet / 1e12 if datasheet else None, "runs": rows,
        "mfu": {k: v["mfu"] for k, v in best.items()},
        "min_mfu": min(v["mfu"] for v in best.values()), "goal_mfu": GOAL,
        "meets_goal": all(v["mfu"] >= GOAL for v in best.values()), "errors": errors,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
