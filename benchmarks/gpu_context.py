"""Attention at long sequence lengths on one GPU: the kernels ring attention runs per block, to
anchor the H200 context-parallel table in BENCHMARKS.md.

    python benchmarks/gpu_context.py          # CUDA; under 8 minutes on one H200
    python benchmarks/gpu_context.py --smoke  # CPU, small sizes, seconds (a test runs this)

Three parts, side by side in one run:

1. throughput and memory: bf16 ``F.scaled_dot_product_attention`` (flash backend) forward and
   forward + backward at 16k-256k tokens (512k for the decoder), heads x head_dim of the presets'
   encoders (base 12x64, large 16x64, huge 16x80) and of the decoder (16x32). Model TFLOP/s count
   4 L^2 h d per forward and 3x that per training step (the usual MFU convention; flash's
   recomputation is not counted). Memory: peak allocated bytes above the inputs, per token.
2. block check: attention split into key/value blocks with ``sfm.distributed.ring_attention``'s block kernels
   (flash/efficient with log-sum-exp), merged and differentiated as the ring does, against SDPA
   on the whole sequence: the CUDA path that the CPU tests cannot reach.
3. ring emulation: one ring rank's work at cp = 8 (8 blocks of L/8 queries x L/8 keys, merged)
   against 1/8 of the full-sequence kernel time: what blocking costs, communication left out.

Imports torch and ``sfm.distributed.ring_attention`` (torch only). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sfm.distributed.ring_attention import block_backward, block_forward, merge_blocks  # noqa: E402

DEADLINE_S = 420  # stop starting new measurements after 7 minutes


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device, iters: int) -> float:
    fn()  # warm-up
    _sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - t) / iters


def _sdpa_context(device, dtype):
    """Flash attention for half precision on CUDA; PyTorch's own choice otherwise."""
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.FLASH_ATTENTION])
    return contextlib.nullcontext()


def attention_row(name, heads, head_dim, L, device, dtype, iters) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, heads, L, head_dim, device=device, dtype=dtype, generator=g).requires_grad_()
               for _ in range(3))
    dout = torch.randn_like(q)
    flops_fwd = 4.0 * L * L * heads * head_dim
    with _sdpa_context(device, dtype):
        t_fwd = _timed(lambda: F.scaled_dot_product_attention(q, k, v), device, iters)

        def step():
            F.scaled_dot_product_attention(q, k, v).backward(dout)

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        t_step = _timed(step, device, iters)
        peak = torch.cuda.max_memory_allocated() - before if device.type == "cuda" else None
    row = {"config": name, "heads": heads, "head_dim": head_dim, "tokens": L,
           "fwd_s": round(t_fwd, 5), "fwd_bwd_s": round(t_step, 5),
           "fwd_TFLOPs": round(flops_fwd / t_fwd / 1e12, 4),
           "fwd_bwd_TFLOPs": round(3 * flops_fwd / t_step / 1e12, 4)}
    if peak is not None:
        row["peak_bytes_per_token"] = round(peak / L)
    print(json.dumps(row), flush=True)
    return row


def _split_attention(q, k, v, blocks: int):
    """Forward and backward over ``blocks`` key/value blocks, as one ring rank does them."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    ks, vs = k.chunk(blocks, dim=2), v.chunk(blocks, dim=2)
    out = lse = None
    extras = []
    for kb, vb in zip(ks, vs):
        o, l_, ex = block_forward(q, kb.contiguous(), vb.contiguous(), scale)
        out, lse = merge_blocks(out, lse, o, l_)
        extras.append(ex)
    out = out.to(q.dtype)
    return out, lse, ks, vs, extras, scale


def block_check(L, heads, head_dim, blocks, device, dtype) -> dict:
    g = torch.Generator(device=device).manual_seed(1)
    q, k, v, dout = (torch.randn(1, heads, L, head_dim, device=device, dtype=dtype, generator=g) for _ in range(4))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    with _sdpa_context(device, dtype):
        ref = F.scaled_dot_product_attention(qr, kr, vr)
    ref.backward(dout)
    out, lse, ks, vs, extras, scale = _split_attention(q, k, v, blocks)
    dq = torch.zeros_like(q, dtype=torch.float32)
    dks, dvs = [], []
    for kb, vb, ex in zip(ks, vs, extras):
        a, b, c = block_backward(dout, q, kb.contiguous(), vb.contiguous(), out, lse, scale, ex)
        dq += a
        dks.append(b)
        dvs.append(c)

    def rel(a, b):
        a, b = a.detach().float(), b.detach().float()
        return float((a - b).norm() / b.norm())

    return {"dtype": str(dtype).replace("torch.", ""), "tokens": L, "blocks": blocks,
            "out": rel(out, ref), "dq": rel(dq, qr.grad), "dk": rel(torch.cat(dks, 2), kr.grad),
            "dv": rel(torch.cat(dvs, 2), vr.grad)}


def ring_emulation(L, heads, head_dim, cp, device, dtype, iters) -> dict:
    """One rank's blocks (L/cp queries against cp blocks of L/cp keys) vs 1/cp of the full kernel."""
    g = torch.Generator(device=device).manual_seed(2)
    q, k, v = (torch.randn(1, heads, L, head_dim, device=device, dtype=dtype, generator=g) for _ in range(3))
    q_local = q[:, :, : L // cp].contiguous()
    with _sdpa_context(device, dtype):
        t_full = _timed(lambda: F.scaled_dot_product_attention(q, k, v), device, iters)
    t_rank = _timed(lambda: _split_attention(q_local, k, v, cp), device, iters)
    return {"tokens": L, "cp": cp, "heads": heads, "head_dim": head_dim, "full_fwd_s": round(t_full, 5),
            "rank_fwd_s": round(t_rank, 5), "block_efficiency": round(t_full / cp / t_rank, 3)}


def main(smoke: bool) -> dict:
    t0 = time.perf_counter()
    cuda = torch.cuda.is_available() and not smoke
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda and not smoke:
        return {"measured": False, "reason": "no CUDA device; run with --smoke for the CPU check"}
    if smoke:
        dtype, iters = torch.float32, 1
        configs = [("smoke", 2, 16)]
        lengths = {"smoke": [256, 512]}
    else:
        dtype, iters = torch.bfloat16, 3
        configs = [("base-encoder", 12, 64), ("large-encoder", 16, 64), ("huge-encoder", 16, 80),
                   ("decoder", 16, 32)]
        base = [16384, 32768, 65536, 131072, 262144]
        lengths = {name: base + ([524288] if name == "decoder" else []) for name, _, _ in configs}
    rows, skipped = [], []
    for name, heads, head_dim in configs:
        for L in lengths[name]:
            if time.perf_counter() - t0 > DEADLINE_S:
                skipped.append([name, L])
                continue
            rows.append(attention_row(name, heads, head_dim, L, device, dtype, iters))
    checks = [block_check(96 if smoke else 4096, 2 if smoke else 16, 16 if smoke else 64, 3 if smoke else 4,
                          device, torch.float32)]
    if cuda:
        checks.append(block_check(4096, 16, 64, 4, device, torch.bfloat16))
    ring = ring_emulation(512 if smoke else 131072, 2 if smoke else 16, 16 if smoke else 64, 2 if smoke else 8,
                          device, dtype, iters)
    return {
        "measured": True, "smoke": smoke, "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""),
        "attention": rows, "skipped_for_time": skipped, "block_check": checks, "ring_emulation": ring,
        "max_fwd_bwd_TFLOPs": max(r["fwd_bwd_TFLOPs"] for r in rows),
        "seconds": round(time.perf_counter() - t0, 1),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, small sizes: checks the script runs")
    print(json.dumps(main(parser.parse_args().smoke)))
