"""Context parallelism on CPU: peak memory per rank of one MAE training step at cp=1 and cp=2, the
largest crop each trains at under a fixed memory cap, and the per-token memory that the H200
table in BENCHMARKS.md is computed from.

    python benchmarks/context.py

Model: an attention-heavy MAE (4^3-voxel patches, width 64, head dim 32, crops of 4,096-16,384
tokens: attention is ~L / (6 x width) = 10-40x the FLOPs of the rest of a block). cp=1 is the
plain model (``model(imgs)``); cp=2 is two gloo processes running ``cp_forward_loss`` on their
inline slabs. Every measurement is a fresh process per rank (forked from a server that imported
torch once), one thread each, and one full step: forward, backward, gradient all-reduce, AdamW.

Memory per rank = peak RSS during the step minus the RSS just before it, where "before" is after
imports, process-group set-up and a small warm-up step (lazy one-time allocations), and before
the model and data exist: ``/proc/self/clear_refs`` (5) resets the peak to the current RSS, then
``VmHWM - VmRSS`` from ``/proc/self/status``. So the figure is everything the step needs
(weights, gradients, optimiser state, data, activations, communication buffers) and nothing of
the interpreter. glibc's malloc is told to map every block over 64 KiB on its own
(``MALLOC_MMAP_THRESHOLD_``) so that freed tensors leave the RSS at once, as they leave a CUDA
caching allocator's "allocated" count; otherwise freed heap blocks linger in the RSS and the peak
depends on fragmentation. Linux only.

Prints one line per measurement and, last, one JSON object.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sfm.distributed.context_parallel import (  # noqa: E402
    all_reduce_grads,
    apply_context_parallel,
    cp_forward_loss,
    cp_kept_tokens,
    crop_slab,
    mask_ratio_for_kept,
)
from sfm.distributed.launch import free_port  # noqa: E402
from sfm.model import MAEConfig, build_model, mae_config, param_count, train_flops_per_sample  # noqa: E402

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # read by the measuring processes' malloc

MiB = 2**20
CAP_MIB = 72  # the fixed per-rank memory cap of the crop search
HW = (64, 64)  # crossline x sample voxels; crops grow along inline (D)
D_STEP = 32  # inline search step (voxels): 2,048 tokens
BENCH = dict(patch=(4, 4, 4), embed_dim=64, depth=2, num_heads=2, decoder_embed_dim=64, decoder_depth=2,
             decoder_num_heads=2, mask_ratio=0.75)


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as fh:
        return int(re.search(rf"^{key}:\s+(\d+)", fh.read(), re.M).group(1))


def _step(model, opt, data, crop, group, cp) -> float:
    """One training step; data is the crop at cp=1, this rank's slab of it at cp > 1."""
    if cp == 1:  # with the kept count cp=2 uses, so that both steps see the same mask and loss
        L = model.cfg.num_patches
        loss, _, _ = model(data, mask_ratio=mask_ratio_for_kept(L, cp_kept_tokens(L, model.cfg.mask_ratio, 2)))
        loss.backward()
    else:
        out = cp_forward_loss(model, data, crop, group)
        out.loss.backward()
        all_reduce_grads(model, group)
        loss = out.value
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _rank(rank: int, cp: int, port: int, spec: dict, out_dir: str) -> None:
    torch.set_num_threads(1)
    group = None
    if cp > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp)
    try:
        cfg = MAEConfig(**{**BENCH, **spec["model"], "crop": spec["crop"]})
        # warm-up on a small crop: one-time allocations (kernels, thread pools) happen here
        small = (cp * cfg.patch[0] * 2,) + tuple(cfg.crop[1:])
        warm = build_model(MAEConfig(**{**cfg.to_dict(), "crop": small}))
        warm.grad_checkpointing = cfg_ckpt = bool(spec.get("ckpt"))
        if cp > 1:
            apply_context_parallel(warm, group)
        warm_data = crop_slab(small, cfg.patch, rank, cp).of(torch.randn(1, 1, *small))
        _step(warm, torch.optim.AdamW(warm.parameters()), warm_data, small, group, cp)
        del warm

        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # peak RSS := current RSS
        base = _status_kib("VmRSS")
        torch.manual_seed(0)
        model = build_model(cfg)
        model.grad_checkpointing = cfg_ckpt
        if cp > 1:
            apply_context_parallel(model, group)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        # the same crop at every cp (so the losses agree); a cp rank keeps only its slab
        # (the whole crop exists for a moment here: 4 bytes/voxel, <2% of the step's memory)
        data = torch.randn(1, 1, *cfg.crop, generator=torch.Generator().manual_seed(1))
        if cp > 1:
            data = crop_slab(cfg.crop, cfg.patch, rank, cp).of(data).clone()
        t = time.perf_counter()
        loss = _step(model, opt, data, cfg.crop, group, cp)
        seconds = time.perf_counter() - t
        peak = _status_kib("VmHWM")
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump({"peak_MiB": (peak - base) / 1024, "seconds": seconds, "loss": loss}, fh)
    finally:
        if cp > 1:
            dist.destroy_process_group()


def measure(crop_d: int, cp: int, model: dict | None = None, ckpt: bool = False) -> dict:
    """One training step in fresh processes; the largest per-rank figures."""
    spec = {"crop": (crop_d,) + HW, "model": model or {}, "ckpt": ckpt}
    with tempfile.TemporaryDirectory(prefix="sfm-cp-bench-") as out:
        mp.start_processes(_rank, args=(cp, free_port(), spec, out), nprocs=cp, join=True,
                           start_method="forkserver")
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(cp)]
    cfg = MAEConfig(**{**BENCH, **spec["model"], "crop": spec["crop"]})
    row = {"crop": list(spec["crop"]), "tokens": cfg.num_patches, "cp": cp, "ckpt": ckpt, **(model or {}),
           "peak_MiB_per_rank": round(max(r["peak_MiB"] for r in ranks), 1),
           "step_s": round(max(r["seconds"] for r in ranks), 2), "loss": round(ranks[0]["loss"], 4)}
    print(json.dumps(row), flush=True)
    return row


_cache: dict[tuple, dict] = {}


def cached(crop_d: int, cp: int, **kw) -> dict:
    key = (crop_d, cp, json.dumps(kw, sort_keys=True))
    if key not in _cache:
        _cache[key] = measure(crop_d, cp, **kw)
    return _cache[key]


def largest_under_cap(cp: int, start: int) -> tuple[dict, dict]:
    """Walk the inline crop size up from a size that fits until one does not (measuring each):
    (largest row within CAP_MIB, the next size's row, which is over it)."""
    d = start
    while cached(d, cp)["peak_MiB_per_rank"] > CAP_MIB:
        d -= D_STEP
        if d < D_STEP:
            raise RuntimeError(f"no crop fits {CAP_MIB} MiB at cp={cp}")
    while True:
        nxt = cached(d + D_STEP, cp)
        if nxt["peak_MiB_per_rank"] > CAP_MIB:
            return cached(d, cp), nxt
        d += D_STEP


def bytes_per_token(a: dict, b: dict) -> float:
    """Slope of per-rank peak memory over a crop's token count, bytes per token."""
    return (b["peak_MiB_per_rank"] - a["peak_MiB_per_rank"]) * MiB / (b["tokens"] - a["tokens"])


def per_token_model(s: dict, width: int = 64) -> dict:
    """Split measured slopes (bytes per crop token, cp=1, float32) into per-layer and other parts.

    s["A"]: the bench model (encoder 2 + decoder 2 layers of width 64, 4^3 = 64-voxel patches);
    s["B"]: decoder 6 layers; s["C"]: 4x8x8 = 256-voxel patches; "_ckpt": with activation
    checkpointing. The encoder sees (K+1)/L ~ 1/4 of the tokens.
    """
    enc_frac = 1 - BENCH["mask_ratio"]
    layers_a = BENCH["depth"] * enc_frac + BENCH["decoder_depth"]  # token-layers per crop token
    alpha = (s["B"] - s["A"]) / (4 * width)  # bytes / token / layer / channel
    alpha_ckpt = (s["B_ckpt"] - s["A_ckpt"]) / (4 * width)
    beta = (s["C"] - s["A"]) / (256 - 64)  # bytes / token / patch voxel (data, targets, prediction)
    gamma = s["A"] - 64 * beta - alpha * width * layers_a  # bytes / token, other width-sized tensors
    rest_ckpt = s["A_ckpt"] - 64 * beta - alpha_ckpt * width * layers_a  # + one block recomputed
    return {"alpha_fp32": alpha, "alpha_ckpt_fp32": alpha_ckpt, "beta_per_voxel": beta,
            "gamma_per_channel_fp32": gamma / width, "rest_ckpt_per_channel_fp32": rest_ckpt / width}


H200_BYTES = 141e9
USABLE = 0.9  # of HBM for the step: CUDA context, NCCL buffers, fragmentation take the rest
BYTES_PER_PARAM = 16  # fp32 weights + gradients + AdamW moments, replicated on every cp rank
H200_PEAK = 989e12  # dense bf16 FLOP/s
MFU = 0.4  # assumed for the step-time column (attention-bound steps; see benchmarks/gpu_context.py)
REFERENCE_TOKENS = 1_170_000
GOAL_TOKENS = 2_000_000


def token_bytes(preset: str, m: dict, ckpt: bool, cp_factor: float) -> float:
    """Activation + data bytes per crop token for a preset in bf16 (per-layer terms halved from
    the float32 measurement; data terms kept at 4 bytes), times the measured cp overhead."""
    cfg = mae_config(preset)
    layer_channels = cfg.depth * cfg.embed_dim * (1 - cfg.mask_ratio) + cfg.decoder_depth * cfg.decoder_embed_dim
    width = max(cfg.embed_dim, cfg.decoder_embed_dim)
    per_voxel = m["beta_per_voxel"] * math.prod(cfg.patch)
    if ckpt:
        act = m["alpha_ckpt_fp32"] * layer_channels + m["rest_ckpt_per_channel_fp32"] * width
    else:
        act = m["alpha_fp32"] * layer_channels + m["gamma_per_channel_fp32"] * width
    return cp_factor * (per_voxel + 0.5 * act)


def h200_table(m: dict, cp_factor: float) -> list[dict]:
    """Largest volume per preset on G H200 as one cp group (dp = 1, one volume per step):
    L_max = (USABLE * 141 GB - 16 B * params) * G / bytes_per_token. The step time is the
    analytic training FLOPs of a 3:3:4 volume of that size (4/3 of it with recomputation) at
    MFU on G GPUs: a scale, not a measurement."""
    rows = []
    for preset in ("base", "large", "huge"):
        static = BYTES_PER_PARAM * param_count(mae_config(preset))
        for ckpt in (False, True):
            b = token_bytes(preset, m, ckpt, cp_factor)
            for gpus in (8, 16, 128):
                tokens = int((USABLE * H200_BYTES - static) * gpus / b)
                shape = _volume_shape(tokens)
                flops = train_flops_per_sample(mae_config(preset, crop=tuple(shape)))
                rows.append({"preset": preset, "ckpt": ckpt, "gpus": gpus, "bytes_per_token": round(b),
                             "static_GB": round(static / 1e9, 1), "max_tokens": tokens,
                             "max_voxels": tokens * 16**3, "example_shape": shape,
                             "example_tokens": math.prod(shape) // 16**3,
                             "x_reference": round(tokens / REFERENCE_TOKENS, 2),
                             "step_s_at_40pct_mfu": round(flops * (4 / 3 if ckpt else 1) / (gpus * MFU * H200_PEAK), 1)})
    return rows


def _volume_shape(tokens: int) -> list[int]:
    """A 3 : 3 : 4 (inline, crossline, sample) volume of 16^3 patches with at most ``tokens``."""
    k = int((tokens / 36) ** (1 / 3))  # patches (3k, 3k, 4k)
    while 36 * (k + 1) ** 3 <= tokens:
        k += 1
    return [48 * k, 48 * k, 64 * k]


def main() -> dict:
    t0 = time.perf_counter()
    side = [(cached(d, 1), cached(d, 2)) for d in (64, 128)]
    ratios = [round(b["peak_MiB_per_rank"] / a["peak_MiB_per_rank"], 3) for a, b in side]
    fit1, over1 = largest_under_cap(1, 64)
    fit2, over2 = largest_under_cap(2, 128)
    slopes = {
        "A": bytes_per_token(*[cached(d, 1) for d in (64, 128)]),
        "B": bytes_per_token(*[cached(d, 1, model={"decoder_depth": 6}) for d in (32, 96)]),
        "C": bytes_per_token(*[cached(d, 1, model={"patch": (4, 8, 8)}) for d in (64, 256)]),
        "A_ckpt": bytes_per_token(*[cached(d, 1, ckpt=True) for d in (32, 96)]),
        "B_ckpt": bytes_per_token(*[cached(d, 1, model={"decoder_depth": 6}, ckpt=True) for d in (32, 96)]),
    }
    cp2_slope = bytes_per_token(*[cached(d, 2) for d in (64, 128)])
    cp_factor = max(1.0, 2 * cp2_slope / slopes["A"])  # per-rank bytes per token at cp=2 vs half of cp=1
    model = per_token_model(slopes)
    table = h200_table(model, cp_factor)
    best = max(table, key=lambda r: r["max_tokens"])
    return {
        "bench_model": {**BENCH, "crossline_sample": list(HW)},
        "side_by_side": [{"tokens": a["tokens"], "crop": a["crop"], "cp1_peak_MiB": a["peak_MiB_per_rank"],
                          "cp2_peak_MiB_per_rank": b["peak_MiB_per_rank"], "ratio_cp2_over_cp1": r,
                          "cp1_step_s": a["step_s"], "cp2_step_s": b["step_s"],
                          "cp1_loss": a["loss"], "cp2_loss": b["loss"]}
                         for (a, b), r in zip(side, ratios)],
        "ratio_cp2_over_cp1": ratios[-1], "goal_ratio": 0.6, "goal_met": all(r <= 0.6 for r in ratios),
        "cap_MiB_per_rank": CAP_MIB,
        "largest_crop_cp1": fit1["crop"], "largest_tokens_cp1": fit1["tokens"], "peak_MiB_cp1": fit1["peak_MiB_per_rank"],
        "next_crop_cp1_MiB": over1["peak_MiB_per_rank"],
        "largest_crop_cp2": fit2["crop"], "largest_tokens_cp2": fit2["tokens"], "peak_MiB_cp2": fit2["peak_MiB_per_rank"],
        "next_crop_cp2_MiB": over2["peak_MiB_per_rank"],
        "largest_tokens_ratio_cp2_over_cp1": round(fit2["tokens"] / fit1["tokens"], 2),
        "bytes_per_token_fp32": {k: round(v) for k, v in slopes.items()},
        "cp2_bytes_per_token_per_rank": round(cp2_slope), "cp_overhead_factor": round(cp_factor, 3),
        "per_token_model": {k: round(v, 2) for k, v in model.items()},
        "h200_table": table,
        "best_h200": {k: best[k] for k in ("preset", "ckpt", "gpus", "max_tokens")},
        "reference_tokens": REFERENCE_TOKENS, "goal_tokens": GOAL_TOKENS,
        "goal_tokens_met": any(r["max_tokens"] >= GOAL_TOKENS for r in table),
        "seconds": round(time.perf_counter() - t0, 1),
    }


if __name__ == "__main__":
    print(json.dumps(main()))
