"""Weak-scaling efficiency of the data-parallel strategies on this machine (issue 6).

    python benchmarks/scaling.py [--preset small] [--crop 128] [--batch 8] [--steps 3] [--warmup 1] [--rounds 3]

Efficiency = throughput of 2 ranks x 1 thread / (2 x throughput of 1 rank x 1 thread), with the
same per-rank batch, for ``ddp`` and ``fsdp2-zero2``. Every configuration runs full training steps
exactly as ``sfm.train.trainer`` runs them (``sfm.train.step.TrainStep`` on the model wrapped by
``sfm.distributed.strategies.apply_strategy``, gloo on loopback, global-norm clipping, fused AdamW), on random
volumes already in memory: the data loader is measured by benchmarks/stream.py, this measures what
the strategy adds (gradient all-reduce or reduce-scatter plus parameter all-gather). Each rank is
its own process with one compute thread (OMP_NUM_THREADS=1, OMP_WAIT_POLICY=PASSIVE as in training).

The machine is shared and noisy, so every 2-rank run is compared with the mean of the 1-rank runs
right before and right after it, each round's ratio is reported, and the figure is the median.
The last line is one JSON object with every throughput, the efficiencies and the goal (0.9).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from sfm.distributed import strategies as parallelize  # noqa: E402
from sfm.model import build_model, mae_config, param_count, train_flops_per_sample  # noqa: E402
from sfm.train.step import StepHooks, TrainStep, build_optimizer  # noqa: E402

GOAL = 0.9
STRATEGIES = ("ddp", "fsdp2-zero2")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, strategy: str, args: dict, out) -> None:
    """One rank: build, wrap, time ``steps`` training steps after ``warmup``; rank 0 reports."""
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    cfg = mae_config(args["preset"], crop=(args["crop"],) * 3)
    model = build_model(cfg)
    if world > 1:
        model = parallelize.apply_strategy(model, strategy)
    optimizer = build_optimizer(model, lr=1.5e-4, weight_decay=0.05)
    step = TrainStep(model, optimizer, grad_clip=1.0,
                     hooks=StepHooks(clip_grad_norm=lambda _p, max_norm: parallelize.clip_grad_norm(model, max_norm)),
                     generator=torch.Generator().manual_seed(rank))
    imgs = torch.randn(args["batch"], 1, *(args["crop"],) * 3)
    for _ in range(args["warmup"]):
        step(iter([imgs]), 1)
    if world > 1:
        dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args["steps"]):
        result = step(iter([imgs]), 1)
    if world > 1:
        dist.barrier()
    seconds = (time.perf_counter() - t0) / args["steps"]
    if rank == 0:
        out.put({"step_s": seconds, "samples_per_s": world * args["batch"] / seconds,
                 "loss": float(result.losses.mean())})
    if world > 1:
        dist.destroy_process_group()


def measure(world: int, strategy: str, args: dict) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, strategy, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    result = out.get(timeout=3600)
    for p in procs:
        p.join(timeout=600)
        if p.exitcode != 0:
            raise RuntimeError(f"{strategy} rank exited with {p.exitcode}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--crop", type=int, default=128, help="crop edge (the presets' default crop is 128)")
    parser.add_argument("--batch", type=int, default=8, help="per rank")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    a = parser.parse_args()
    args = vars(a)
    cfg = mae_config(a.preset, crop=(a.crop,) * 3)
    rounds: dict[str, list[dict]] = {s: [] for s in STRATEGIES}
    before = measure(1, "single", args)
    for r in range(a.rounds):
        # each 2-rank run is compared with the 1-rank runs right before and after it (the mean of
        # their throughputs): one baseline per strategy would carry the machine's drift into the ratio
        for strategy in STRATEGIES:
            two = measure(2, strategy, args)
            after = measure(1, "single", args)
            one_rate = (before["samples_per_s"] + after["samples_per_s"]) / 2
            eff = two["samples_per_s"] / (2 * one_rate)
            rounds[strategy].append({"one_rank_before": before, "two_ranks": two, "one_rank_after": after,
                                     "efficiency": eff})
            print(f"round {r + 1} {strategy}: 1 rank {before['step_s']:.2f} / {after['step_s']:.2f} s/step "
                  f"(before / after), 2 ranks {two['step_s']:.2f} s/step -> efficiency {eff:.3f}",
                  file=sys.stderr, flush=True)
            before = after
    efficiency = {s: statistics.median(x["efficiency"] for x in rounds[s]) for s in STRATEGIES}
    with open("/proc/loadavg") as fh:
        load = float(fh.read().split()[0])
    print(json.dumps({
        "preset": a.preset, "crop": a.crop, "batch_per_rank": a.batch, "steps": a.steps, "threads_per_rank": 1,
        "params_M": round(param_count(cfg) / 1e6, 2), "gradient_MB": round(param_count(cfg) * 4 / 1e6, 1),
        "flops_per_sample": train_flops_per_sample(cfg), "rounds": rounds,
        "efficiency": efficiency, "goal": GOAL, "goals_met": {s: e >= GOAL for s, e in efficiency.items()},
        "load_average_at_end": load,
    }))


if __name__ == "__main__":
    main()
