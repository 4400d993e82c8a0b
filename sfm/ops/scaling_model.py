"""A model of one data-parallel training step on N nodes x 8 GPUs, predicting parallel efficiency.

    python -m sfm.ops.scaling_model            # markdown table, then one JSON line with every figure

Per optimiser step (micro-batch ``b`` samples per GPU, ``k`` micro-batches, ``n = 8 N`` GPUs):

- compute: ``k b F / (MFU x peak)`` with F = :func:`sfm.model.train_flops_per_sample`, split into
  forward (F_fwd = :func:`sfm.model.flops.forward_flops_per_sample`) and backward (F - F_fwd).
- traffic, by strategy (P parameters; gradients reduced in float32, parameters gathered in bf16):
  ``ddp`` all-reduces the gradients once per step: 2(n-1)/n x 4P bytes per GPU, in 25 MB buckets;
  ``fsdp2-zero2`` all-gathers the parameters once per micro-batch forward ((n-1)/n x 2P) and keeps
  them for backward, then reduce-scatters the gradients once ((n-1)/n x 4P);
  ``fsdp2-full`` also all-gathers the parameters again in each backward.
- bandwidth: a ring collective runs at the bus bandwidth of its slowest hop: NVLink inside a node
  (900 GB/s per H200, i.e. 450 GB/s each way), and between nodes the node's EFA (3200 Gbps =
  400 GB/s per node, shared by its 8 GPUs' rings), both at ``LINK_EFFICIENCY`` of the line rate;
  plus a latency per collective (tree across nodes).
- overlap: gradient reduction runs under the backward of the last micro-batch and parameter
  gathers under forward (prefetch), except a tail that cannot overlap (the last bucket or the first
  and last sharding unit); while communication overlaps, compute runs ``OVERLAP_SLOWDOWN`` slower
  (NCCL kernels take SMs and memory bandwidth). What does not fit in the window is exposed.
- optimiser: AdamW is memory-bound, 28 bytes per (local) parameter at 70 % of 4.8 TB/s HBM.

Parallel efficiency = per-GPU throughput on N nodes / per-GPU throughput on 1 node (the reference's
"1 -> 16 nodes"); ``vs_1gpu`` also charges the single node's own NVLink traffic.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, field

from sfm.model import mae_config, param_count, train_flops_per_sample
from sfm.model.flops import forward_flops_per_sample

GPUS_PER_NODE = 8
PEAK_BF16 = 989e12  # H200 dense bf16 FLOP/s
NVLINK_ONE_WAY = 450e9  # bytes/s per GPU (900 GB/s bidirectional)
EFA_PER_NODE = 3200e9 / 8  # bytes/s per node
LINK_EFFICIENCY = 0.8  # bus bandwidth NCCL reaches, as a fraction of the line rate
LATENCY_INTRA = 10e-6  # s per collective inside a node
LATENCY_NET_HOP = 15e-6  # s per tree level across nodes
OVERLAP_SLOWDOWN = 0.10  # compute slowdown while communication overlaps it
DDP_BUCKET = 25e6  # bytes
HBM = 4.8e12 * 0.7  # bytes/s the optimiser step reaches
ADAM_BYTES_PER_PARAM = 28  # read p, g, m, v (fp32) and write p, m, v
INPUT_BYTES = 4  # float32 voxels read per crop (a float16 store halves it)
STRATEGIES = ("ddp", "fsdp2-zero2", "fsdp2-full")
NODES = (1, 2, 4, 8, 16)


@dataclass
class Setup:
    preset: str = "large"
    strategy: str = "ddp"
    nodes: int = 1
    micro_batch: int = 32  # samples per GPU per micro-batch
    grad_accum: int = 1
    mfu: float = 0.40  # of PEAK_BF16, for the compute alone
    crop: tuple[int, int, int] = (128, 128, 128)
    grad_bytes: int = 4  # float32 gradient reduction (2: bf16)
    param_bytes: int = 2  # bf16 parameter all-gather (FSDP2)
    extra: dict = field(default_factory=dict)


def _overlap(comm: float, window: float, tail: float) -> tuple[float, float]:
    """(exposed seconds, compute slowdown seconds) of ``comm`` run under a compute ``window``, of
    which ``tail`` cannot overlap."""
    hidden = min(max(comm - tail, 0.0), window)
    return comm - hidden, OVERLAP_SLOWDOWN * hidden


@functools.cache
def model_numbers(preset: str, crop: tuple[int, int, int]) -> tuple[float, float, int, int]:
    """(train FLOPs per sample, forward FLOPs per sample, parameters, FSDP2 sharding units)."""
    cfg = mae_config(preset, crop=crop)
    return (train_flops_per_sample(cfg), sum(forward_flops_per_sample(cfg).values()), param_count(cfg),
            cfg.depth + cfg.decoder_depth)


def step_time(s: Setup) -> dict[str, float]:
    """Seconds of one optimiser step, by part, and the resulting throughput."""
    flops, fwd, params, units = model_numbers(s.preset, tuple(s.crop))
    rate = s.mfu * PEAK_BF16
    t_fwd = s.grad_accum * s.micro_batch * fwd / rate
    t_bwd = s.grad_accum * s.micro_batch * (flops - fwd) / rate
    t_bwd_last = t_bwd / s.grad_accum  # only the last micro-batch's backward carries the reduction

    n = s.nodes * GPUS_PER_NODE
    busbw = LINK_EFFICIENCY * (NVLINK_ONE_WAY if s.nodes == 1 else min(NVLINK_ONE_WAY, EFA_PER_NODE))
    latency = LATENCY_INTRA + (2 * math.ceil(math.log2(s.nodes)) * LATENCY_NET_HOP if s.nodes > 1 else 0.0)
    frac = (n - 1) / n
    grads, weights = params * s.grad_bytes, params * s.param_bytes

    exposed = slowdown = 0.0
    if s.strategy == "ddp":
        buckets = math.ceil(grads / DDP_BUCKET)
        comm = 2 * frac * grads / busbw + buckets * latency
        exposed, slowdown = _overlap(comm, t_bwd_last, tail=comm / buckets)
        local_params = params
    elif s.strategy in ("fsdp2-zero2", "fsdp2-full"):
        gather = frac * weights / busbw + units * latency  # one all-gather of all parameters
        scatter = frac * grads / busbw + units * latency
        e1, s1 = _overlap(s.grad_accum * gather, t_fwd, tail=gather / units)
        bwd_comm = scatter + (s.grad_accum * gather if s.strategy == "fsdp2-full" else 0.0)
        e2, s2 = _overlap(bwd_comm, t_bwd if s.strategy == "fsdp2-full" else t_bwd_last, tail=scatter / units)
        exposed, slowdown = e1 + e2, s1 + s2
        comm = s.grad_accum * gather + bwd_comm
        local_params = params / n
    else:
        raise ValueError(f"unknown strategy {s.strategy!r}; valid: {', '.join(STRATEGIES)}")
    t_opt = ADAM_BYTES_PER_PARAM * local_params / HBM
    total = t_fwd + t_bwd + exposed + slowdown + t_opt
    samples = n * s.grad_accum * s.micro_batch
    return {"compute_s": t_fwd + t_bwd, "comm_s": comm, "exposed_comm_s": exposed, "overlap_slowdown_s": slowdown,
            "optimizer_s": t_opt, "step_s": total, "samples_per_s": samples / total,
            "params_M": params / 1e6, "train_GFLOP_per_sample": flops / 1e9}


def single_gpu_samples_per_s(s: Setup) -> float:
    """Throughput of one GPU alone: no communication, the full optimiser step."""
    flops, _, params, _ = model_numbers(s.preset, tuple(s.crop))
    t = s.grad_accum * s.micro_batch * flops / (s.mfu * PEAK_BF16) + ADAM_BYTES_PER_PARAM * params / HBM
    return s.grad_accum * s.micro_batch / t


def efficiency(s: Setup) -> dict[str, float]:
    """Parallel efficiency on ``s.nodes`` nodes vs 1 node (and vs 1 GPU) at the same per-GPU batch."""
    here = step_time(s)
    one_node = step_time(Setup(**{**asdict(s), "nodes": 1}))
    per_gpu = here["samples_per_s"] / (s.nodes * GPUS_PER_NODE)
    return {**here, "efficiency": per_gpu / (one_node["samples_per_s"] / GPUS_PER_NODE),
            "vs_1gpu": per_gpu / single_gpu_samples_per_s(s)}


def table(presets=("base", "large", "huge"), micro_batch: int = 32, mfu: float = 0.40) -> list[dict]:
    rows = []
    for preset in presets:
        for strategy in STRATEGIES:
            for nodes in NODES:
                s = Setup(preset=preset, strategy=strategy, nodes=nodes, micro_batch=micro_batch, mfu=mfu)
                r = efficiency(s)
                rows.append({"preset": preset, "strategy": strategy, "nodes": nodes, "gpus": nodes * GPUS_PER_NODE,
                             "micro_batch": micro_batch, "step_ms": 1e3 * r["step_s"],
                             "comm_ms": 1e3 * r["comm_s"], "exposed_ms": 1e3 * r["exposed_comm_s"],
                             "samples_per_s": r["samples_per_s"], "efficiency": r["efficiency"],
                             "vs_1gpu": r["vs_1gpu"],
                             "input_GBps_per_node": r["samples_per_s"] / nodes * math.prod(s.crop) * INPUT_BYTES / 1e9})
    return rows


def markdown(rows: list[dict]) -> str:
    """One line per preset and strategy: efficiency at each node count (and samples/s at 16 nodes)."""
    out = ["| preset | strategy | " + " | ".join(f"{n} node{'s' * (n > 1)}" for n in NODES) +
           " | samples/s at 16 nodes | comm / exposed per step | input per node |",
           "|---|---|" + "---:|" * (len(NODES) + 3)]
    for preset in dict.fromkeys(r["preset"] for r in rows):
        for strategy in STRATEGIES:
            mine = [r for r in rows if r["preset"] == preset and r["strategy"] == strategy]
            last = mine[-1]
            out.append(f"| {preset} | {strategy} | " + " | ".join(f"{r['efficiency']:.1%}" for r in mine) +
                       f" | {last['samples_per_s']:,.0f} | {last['comm_ms']:.1f} / {last['exposed_ms']:.2f} ms"
                       f" | {last['input_GBps_per_node']:.0f} GB/s |")
    return "\n".join(out)


def main() -> None:
    mfu = Setup().mfu
    rows = table(micro_batch=32, mfu=mfu)
    small = table(micro_batch=4, mfu=mfu)
    fast = table(micro_batch=32, mfu=0.6)
    print(f"Predicted parallel efficiency vs 1 node, 8 x H200 per node, 128^3 crops, MFU {mfu:.0%}, "
          "micro-batch 32 per GPU (comm/exposed and input per node at 16 nodes):\n")
    print(markdown(rows))
    print("\nThe same at micro-batch 4 per GPU (less compute to hide the traffic under):\n")
    print(markdown(small))
    goal = [r for r in rows if r["nodes"] == 16 and r["efficiency"] >= 0.95]
    best = max((r for r in rows if r["nodes"] == 16), key=lambda r: r["efficiency"])
    print(json.dumps({
        "assumptions": {"mfu": mfu, "peak_bf16_flops": PEAK_BF16, "nvlink_one_way_GBps": NVLINK_ONE_WAY / 1e9,
                        "efa_per_node_GBps": EFA_PER_NODE / 1e9, "link_efficiency": LINK_EFFICIENCY,
                        "overlap_slowdown": OVERLAP_SLOWDOWN, "latency_intra_us": LATENCY_INTRA * 1e6,
                        "latency_net_hop_us": LATENCY_NET_HOP * 1e6, "grad_bytes": 4, "param_bytes": 2},
        "reference_efficiency": [0.90, 0.95],
        "efficiency_16_nodes": {f"{r['preset']}/{r['strategy']}": round(r["efficiency"], 4)
                                for r in rows if r["nodes"] == 16},
        "efficiency_16_nodes_micro_batch_4": {f"{r['preset']}/{r['strategy']}": round(r["efficiency"], 4)
                                              for r in small if r["nodes"] == 16},
        "efficiency_16_nodes_mfu_60pct": {f"{r['preset']}/{r['strategy']}": round(r["efficiency"], 4)
                                          for r in fast if r["nodes"] == 16},
        "configs_at_or_above_95pct_16_nodes": [f"{r['preset']}/{r['strategy']}/b{r['micro_batch']}" for r in goal],
        "best_16_nodes": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in best.items()},
    }))


if __name__ == "__main__":
    main()
