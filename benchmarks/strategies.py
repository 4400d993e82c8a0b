"""The data-parallel strategies side by side on this machine (issue 48): the reference's table (DeepSpeed ZeRO-2,
FSDP2, ZeRO-3 on 16 nodes x 8 H200) measured with 2 gloo ranks.

    python benchmarks/strategies.py [--preset small] [--crop 64] [--batch 4] [--steps 5] [--warmup 2] [--rounds 3]

``ddp``, ``fsdp2-zero2``, ``fsdp2-full``, ``deepspeed-zero2`` and ``deepspeed-zero3``, each in fresh processes
(2 ranks x 1 thread, gloo on loopback, OMP_WAIT_POLICY=PASSIVE as in training), the same model (seed 0) and the same
global batch: full training steps as ``sfm.train.trainer`` runs them (``sfm.train.step.TrainStep`` with the strategy's
hooks: ``sfm.distributed.strategies.apply_strategy``, or the DeepSpeed engine ``sfm.distributed.deepspeed_zero`` builds
from a job's config; fused AdamW; global-norm clipping at 1.0) on random volumes already in memory. Per strategy:

- ``samples_per_s``: samples of all ranks per second over the timed steps (after the warm-up, barriers around),
  the median of ``--rounds`` runs taken in turn (the machine is shared; every round's figure is in the JSON);
- ``state_bytes_per_rank``: parameters + gradients + optimiser state one rank holds, counted from the tensors: the
  distinct storages reachable from the model's parameters (their gradients, FSDP2's local shards, ZeRO-3's
  partitions) and from the optimiser (for DeepSpeed its ZeRO optimiser: float32 masters, AdamW state, gradient
  partitions and buckets), just before the optimiser step of the last warm-up step (gradients present, AdamW's
  moments allocated); the largest over the ranks. Buffers a strategy keeps in Python objects count (DeepSpeed's
  buckets), DDP's reducer buckets (C++) do not;
- ``peak_rss_mb``: the largest resident set of a rank (``ru_maxrss``), the process's imports included.

``benchmarks/gpu_strategies.py`` measures the same at world size 1 on one GPU, with this file's code. The last
line is one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import resource
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from sfm.config import STRATEGIES, JobConfig  # noqa: E402
from sfm.distributed import strategies  # noqa: E402
from sfm.model import build_model, mae_config, param_count  # noqa: E402
from sfm.train.step import StepHooks, TrainStep, build_optimizer  # noqa: E402

# the reference system's table: samples/s on 16 nodes x 8 H200 (issue 48)
REFERENCE_16X8_H200 = {"deepspeed-zero2": 1974, "fsdp2": 1833, "deepspeed-zero3": 869}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tensors_in(obj, seen: set[int], depth: int = 0):
    """Every tensor reachable from ``obj`` through containers, optimisers and DeepSpeed's runtime objects (a
    parameter's gradient and ZeRO-3 partition too); a DTensor stands for its local shard."""
    if depth > 8 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj.to_local() if hasattr(obj, "to_local") else obj
        for extra in ("grad", "ds_tensor"):
            t = getattr(obj, extra, None)
            if isinstance(t, torch.Tensor):
                yield from tensors_in(t, seen, depth + 1)
    elif isinstance(obj, dict):
        for value in list(obj.values()):
            yield from tensors_in(value, seen, depth + 1)
    elif isinstance(obj, (list, tuple, set)):
        for value in list(obj):
            yield from tensors_in(value, seen, depth + 1)
    elif isinstance(obj, torch.optim.Optimizer) or type(obj).__module__.startswith("deepspeed.runtime"):
        for value in list(vars(obj).values()):
            yield from tensors_in(value, seen, depth + 1)


def held_bytes(*roots) -> int:
    """Bytes of the distinct storages of every tensor reachable from ``roots``."""
    storages: dict[tuple[str, int], int] = {}
    seen: set[int] = set()
    for root in roots:
        for t in tensors_in(root, seen):
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            storages[key] = max(storages.get(key, 0), storage.nbytes())
    return sum(storages.values())


def wrap(model: torch.nn.Module, strategy: str, settings: dict, world: int):
    """What the trainer trains for ``strategy``: (step model, optimiser, hooks, the objects whose tensors are the
    rank's state: the parameters and the optimiser that holds the rest)."""
    autocast = functools.partial(torch.autocast, next(model.parameters()).device.type, torch.bfloat16,
                                 enabled=settings["bf16"])
    if strategy.startswith("deepspeed"):
        from sfm.distributed import deepspeed_zero

        optimizer = build_optimizer(model, lr=1.5e-4, weight_decay=0.05)
        job = JobConfig.from_dict({"dist": {"strategy": strategy}, "data": {"batch_size": settings["batch"]},
                                   "train": {"grad_clip": 1.0}})
        config = deepspeed_zero.engine_config(job, world, params=param_count(model.cfg), bf16=settings["bf16"])
        engine = deepspeed_zero.initialize(model, optimizer, config)
        hooks = StepHooks(autocast=autocast, backward=functools.partial(deepspeed_zero.backward, engine),
                          update=functools.partial(deepspeed_zero.step, engine))
        return engine, optimizer, hooks, [*engine.module.parameters(), engine.optimizer]
    step_model = strategies.apply_strategy(model, strategy)
    optimizer = build_optimizer(step_model, lr=1.5e-4, weight_decay=0.05)
    hooks = StepHooks(autocast=autocast,
                      clip_grad_norm=lambda _p, max_norm: strategies.clip_grad_norm(step_model, max_norm))
    return step_model, optimizer, hooks, [*model.parameters(), optimizer]


def measure(strategy: str, settings: dict, device: torch.device, rank: int, world: int) -> dict:
    """One rank: build, wrap, warm up (counting the state on the last warm-up step), time the steps."""
    torch.manual_seed(0)
    model = build_model(mae_config(settings["preset"], crop=(settings["crop"],) * 3)).to(device)
    step_model, optimizer, hooks, roots = wrap(model, strategy, settings, world)
    held = {"count": False, "bytes": 0}

    def counted(update):  # the state just before the update, gradients present
        def run(*args):
            if held["count"]:
                held["bytes"] = held_bytes(*roots)
            return update(*args)
        return run

    if hooks.update is not None:
        hooks = hooks._replace(update=counted(hooks.update))
    else:
        hooks = hooks._replace(clip_grad_norm=counted(hooks.clip_grad_norm))
    step = TrainStep(step_model, optimizer, grad_clip=1.0, hooks=hooks,
                     generator=torch.Generator(device=device).manual_seed(rank))
    imgs = torch.randn(settings["batch"], 1, *(settings["crop"],) * 3, device=device)
    for i in range(settings["warmup"]):
        held["count"] = i == settings["warmup"] - 1
        step(iter([imgs]), 1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(settings["steps"]):
        result = step(iter([imgs]), 1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    seconds = (time.perf_counter() - t0) / settings["steps"]
    return {"step_s": seconds, "samples_per_s": world * settings["batch"] / seconds,
            "state_bytes": held["bytes"], "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "loss": float(result.losses.mean()), "applied": result.applied,
            "peak_mem_GiB": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}


def _worker(rank: int, world: int, port: int, strategy: str, settings: dict, out) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # as torchrun sets them (DeepSpeed reads them)
    torch.set_num_threads(settings["threads"])
    cuda = settings["device"] == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True  # the float32 parts (loss, targets) on tensor cores
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        mine = measure(strategy, settings, device, rank, world)
        ranks: list[dict | None] = [None] * world
        dist.all_gather_object(ranks, mine)
        if rank == 0:
            out.put({"step_s": ranks[0]["step_s"], "samples_per_s": ranks[0]["samples_per_s"],
                     "state_bytes_per_rank": max(r["state_bytes"] for r in ranks),
                     "state_bytes_by_rank": [r["state_bytes"] for r in ranks],
                     "peak_rss_mb": round(max(r["rss_mb"] for r in ranks), 1),
                     "peak_mem_GiB": ranks[0]["peak_mem_GiB"], "loss": ranks[0]["loss"],
                     "applied": all(r["applied"] for r in ranks)})
    finally:
        gc.collect()  # an FSDP2 model outlives its last reference (its hooks form cycles): free it while the group is up
        dist.destroy_process_group()


def run_strategy(strategy: str, world: int, settings: dict) -> dict:
    """``strategy`` on ``world`` fresh processes; rank 0's report. A DeepSpeed strategy where DeepSpeed is not
    installed is reported as skipped."""
    if strategy.startswith("deepspeed"):
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            return {"skipped": "deepspeed is not installed (pip install 'sfm[deepspeed]')"}
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, strategy, settings, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        result = out.get(timeout=settings["timeout_s"])
    finally:
        for p in procs:
            p.join(timeout=120)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"{strategy}: a rank exited with {[p.exitcode for p in procs]}")
    return result


def compare(settings: dict, world: int, names: list[str], rounds: int = 1) -> dict:
    """Every strategy in ``names`` on ``world`` ranks with ``settings``, ``rounds`` times in turn (a shared
    machine's load drifts: each strategy's run of median speed is reported, with every round's samples/s);
    the JSON object the scripts print."""
    with open("/proc/loadavg") as fh:
        load_start = float(fh.read().split()[0])
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names:
            runs[name].append(row := run_strategy(name, world, settings))
            line = row.get("skipped") or (f"{row['samples_per_s']:.2f} samples/s, "
                                          f"{row['state_bytes_per_rank'] / 1e6:.1f} MB state per rank, "
                                          f"peak RSS {row['peak_rss_mb']:.0f} MB")
            print(f"round {r + 1} {name}: {line}", file=sys.stderr, flush=True)
    results = {}
    for name, rows in runs.items():
        middle = sorted(rows, key=lambda row: row.get("samples_per_s", 0.0))[len(rows) // 2]
        results[name] = {**middle, "samples_per_s_rounds": [row.get("samples_per_s") for row in rows]}
    with open("/proc/loadavg") as fh:
        load_end = float(fh.read().split()[0])
    state = [results.get(n, {}).get("state_bytes_per_rank") for n in ("deepspeed-zero3", "deepspeed-zero2", "ddp")]
    order = None if world == 1 or None in state else state[0] < state[1] < state[2]  # sharding needs 2 ranks
    cfg = mae_config(settings["preset"], crop=(settings["crop"],) * 3)
    return {
        "benchmark": "strategies", "world_size": world, **{k: settings[k] for k in ("device", "preset", "crop")},
        "batch_per_rank": settings["batch"], "global_batch": world * settings["batch"], "bf16": settings["bf16"],
        "steps": settings["steps"], "warmup": settings["warmup"], "rounds": rounds,
        "threads_per_rank": settings["threads"],
        "params": param_count(cfg), "params_M": round(param_count(cfg) / 1e6, 3), "torch": torch.__version__,
        "strategies": results, "state_order_zero3_lt_zero2_lt_ddp": order,
        "reference_samples_per_s_16x8_H200": REFERENCE_16X8_H200, "load_average": [load_start, load_end],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--crop", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="per rank (the global batch is twice this)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per strategy")
    parser.add_argument("--warmup", type=int, default=2, help="steps before timing (at least 2: AdamW's state)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each strategy, in turn; the median is reported")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    a = parser.parse_args()
    settings = {"preset": a.preset, "crop": a.crop, "batch": a.batch, "steps": a.steps, "warmup": max(2, a.warmup),
                "threads": 1, "device": "cpu", "bf16": False, "timeout_s": 3600}
    print(json.dumps(compare(settings, 2, a.strategies.split(","), rounds=a.rounds)))


if __name__ == "__main__":
    main()
