"""Context parallelism: ring attention and the MAE step on a sequence-sharded volume equal the
single-rank computation, on real gloo process groups (2 and 3 processes on loopback)."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from sfm.distributed.context_parallel import (
    ContextParallelMAE,
    CPLoss,
    all_reduce_grads,
    apply_context_parallel,
    cp_forward_loss,
    cp_kept_tokens,
    crop_slab,
    mask_ratio_for_kept,
    remove_context_parallel,
)
from sfm.errors import SFMError
from sfm.distributed.launch import free_port
from sfm.model import build_model, mae_config
from sfm.distributed.ring_attention import RingAttention, even_split, ring_attention, shard_bounds
from sfm.train.step import TrainStep

TOL = 1e-5  # relative error, float32


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


# ---- geometry, no processes ------------------------------------------------------------------


def test_even_split_and_bounds():
    assert even_split(37, 2) == [19, 18] and even_split(36, 2) == [18, 18]
    assert even_split(38, 3) == [13, 13, 12]
    assert shard_bounds(37, 2) == [0, 19, 37]


@pytest.mark.parametrize("L", [48, 64, 65, 512, 4096])
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_kept_tokens_divide_evenly_and_stay_nearest(L, cp):
    want = max(1, int(L * 0.25))
    K = cp_kept_tokens(L, 0.75, cp)
    assert (K + 1) % cp == 0 and 1 <= K <= L
    assert abs(K - want) <= cp // 2  # the nearest multiple is never more than half a step away
    # random_masking turns mask_ratio_for_kept into exactly K
    model = build_model(mae_config("tiny"))
    kept, mask, _ = model.random_masking(torch.zeros(2, L, 1), mask_ratio_for_kept(L, K))
    assert kept.shape[1] == K and int(mask.sum()) == 2 * (L - K)


def test_kept_tokens_too_few_patches_is_a_user_error():
    with pytest.raises(SFMError, match="cp=8"):
        cp_kept_tokens(4, 0.75, 8)


@pytest.mark.parametrize("crop,cp", [((32, 32, 32), 2), ((24, 32, 16), 2), ((40, 16, 24), 3)])
def test_crop_slabs_tile_the_crop_and_hold_their_tokens(crop, cp):
    model = build_model(mae_config("tiny", crop=crop))
    vol = torch.randn(2, 1, *crop)
    patches = model.patchify(vol)
    slabs = [crop_slab(crop, (8, 8, 8), r, cp) for r in range(cp)]
    assert slabs[0].start == 0 and slabs[-1].stop == crop[0]
    assert all(a.stop == b.start and a.tokens[1] == b.tokens[0] for a, b in zip(slabs, slabs[1:]))
    assert torch.equal(torch.cat([s.of(vol) for s in slabs], dim=2), vol)
    for s in slabs:
        assert (s.stop - s.start) % 8 == 0 and s.stop > s.start
        assert torch.equal(model.patchify(s.of(vol)), patches[:, s.tokens[0]:s.tokens[1]])
    rows = [(s.stop - s.start) // 8 for s in slabs]
    assert max(rows) - min(rows) <= 1


def test_crop_slab_rejects_crops_thinner_than_cp():
    with pytest.raises(SFMError, match="inline crop of at least 32 voxels"):
        crop_slab((16, 64, 64), (8, 8, 8), 0, 4)
    with pytest.raises(SFMError, match="multiple of patch"):
        crop_slab((30, 32, 32), (8, 8, 8), 0, 2)


def test_apply_and_remove_swap_every_attention():
    model = build_model(mae_config("tiny"))
    apply_context_parallel(model, None)
    fns = [m.attn_fn for m in model.modules() if hasattr(m, "attn_fn")]
    assert len(fns) == 3 and all(isinstance(f, RingAttention) for f in fns)
    remove_context_parallel(model)
    assert all(m.attn_fn is F.scaled_dot_product_attention for m in model.modules() if hasattr(m, "attn_fn"))


# ---- real process groups -----------------------------------------------------------------------


def _attention_case(L: int, group) -> dict:
    """Ring attention on this rank's shard vs full SDPA on the whole sequence (same seed)."""
    me, cp = dist.get_rank(group), dist.get_world_size(group)
    g = torch.Generator().manual_seed(L)
    q, k, v, dout = (torch.randn(2, 3, L, 16, generator=g) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q, k, v)
    ref.backward(dout)
    a, b = shard_bounds(L, cp)[me:me + 2]
    ql, kl, vl = (t.detach()[:, :, a:b].clone().requires_grad_() for t in (q, k, v))
    out = ring_attention(ql, kl, vl, group)
    out.backward(dout[:, :, a:b])
    sl = slice(a, b)
    return {"shard": b - a, "out": rel(out, ref[:, :, sl]), "dq": rel(ql.grad, q.grad[:, :, sl]),
            "dk": rel(kl.grad, k.grad[:, :, sl]), "dv": rel(vl.grad, v.grad[:, :, sl])}


def _grad_errors(model, ref_model) -> dict:
    grads = dict(model.named_parameters())
    flat_cp, flat_ref, worst = [], [], 0.0
    total = torch.cat([p.grad.flatten() for p in ref_model.parameters()]).norm()
    for name, p in ref_model.named_parameters():
        got = grads[name].grad
        flat_cp.append(got.flatten())
        flat_ref.append(p.grad.flatten())
        # per tensor, relative to its own norm, floored at 1e-3 of the whole gradient's norm
        worst = max(worst, float((got - p.grad).norm() / max(p.grad.norm(), 1e-3 * total)))
    return {"grad": rel(torch.cat(flat_cp), torch.cat(flat_ref)), "grad_worst_tensor": worst}


def _mae_case(crop, group, checkpointing=False, ddp_group=None, generator=False) -> dict:
    """One MAE step at cp vs the single-rank model on the same crops and mask."""
    me, cp = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(0)
    ref_model = build_model(mae_config("tiny", crop=crop))
    model = copy.deepcopy(ref_model)
    ref_model.grad_checkpointing = model.grad_checkpointing = checkpointing
    imgs = torch.randn(2, 1, *crop, generator=torch.Generator().manual_seed(1))
    L = ref_model.cfg.num_patches
    K = cp_kept_tokens(L, ref_model.cfg.mask_ratio, cp)

    # the mask's noise: the global RNG or a generator; only cp rank 0's counts (it is broadcast)
    torch.manual_seed(123)
    gen = torch.Generator().manual_seed(7) if generator else None
    ref_loss, _, ref_mask = ref_model(imgs, mask_ratio=mask_ratio_for_kept(L, K), generator=gen)
    ref_loss.backward()

    slab = crop_slab(crop, ref_model.cfg.patch, me, cp).of(imgs)
    torch.manual_seed(123 + 1000 * me)
    gen = torch.Generator().manual_seed(7 + 1000 * me) if generator else None
    if ddp_group is not None:  # the training loop's own step on DDP(ContextParallelMAE), fed slabs
        wrapped = torch.nn.parallel.DistributedDataParallel(ContextParallelMAE(model, group, crop),
                                                            process_group=ddp_group)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        grads = {}
        opt.register_step_pre_hook(lambda *_: grads.update({n: p.grad.clone() for n, p in model.named_parameters()}))
        losses = TrainStep(wrapped, opt, generator=gen)([slab], 1).losses  # DDP averages over both ranks
        for name, p in model.named_parameters():
            p.grad = grads[name]
        out = CPLoss(None, losses[0], K, 1 - K / L)  # (kept and ratio are checked in the other cases)
    else:
        out = cp_forward_loss(apply_context_parallel(model, group), slab, crop, group, generator=gen)
        out.loss.backward()
        all_reduce_grads(model, group)
    return {"loss": rel(out.value, ref_loss), "kept": out.kept, "mask_ratio": out.mask_ratio,
            "ref_mask_ratio": float(ref_mask.mean()), **_grad_errors(model, ref_model)}


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Rank 0-2: ring attention over all three ranks; ranks 0-1 then run the cp=2 cases."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        trio = dist.new_group([0, 1, 2])
        pair = dist.new_group([0, 1])  # the cp group
        ddp_group = dist.new_group([0, 1])  # DDP's own communicator, apart from cp's
        res = {"cp3": {f"attn_{L}": _attention_case(L, trio) for L in (36, 37, 38, 64)}}
        if rank < 2:
            res["cp2"] = {f"attn_{L}": _attention_case(L, pair) for L in (36, 37)}
            res["cp2"]["mae_32"] = _mae_case((32, 32, 32), pair)  # slabs = decoder shards (4 rows over 2)
            res["cp2"]["mae_24"] = _mae_case((24, 32, 32), pair, generator=True)  # 3 rows over 2: rows move
            res["cp2"]["mae_24_ckpt"] = _mae_case((24, 32, 32), pair, checkpointing=True)
            res["cp2"]["mae_32_ddp"] = _mae_case((32, 32, 32), pair, ddp_group=ddp_group, generator=True)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump(res, fh)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Three real processes on a loopback gloo group; each rank's results."""
    out = tmp_path_factory.mktemp("cp")
    # children fork from a server that imported torch once (a fresh interpreter per rank costs
    # seconds of imports each on a busy machine)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "pytest", "sfm.model", "sfm.distributed.context_parallel"])
    mp.start_processes(_worker, args=(3, free_port(), str(out)), nprocs=3, join=True, start_method="forkserver")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]


@pytest.fixture(scope="module")
def two_ranks(ranks):
    return [r["cp2"] for r in ranks[:2]]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("L", [36, 37])
def test_ring_attention_equals_single_rank_on_two_ranks(two_ranks, L):
    shards = [r[f"attn_{L}"]["shard"] for r in two_ranks]
    assert shards == even_split(L, 2)  # odd L: 19 + 18
    for r in two_ranks:
        case = r[f"attn_{L}"]
        for key in ("out", "dq", "dk", "dv"):
            assert case[key] < TOL, (L, key, case)


@pytest.mark.timeout(180)
def test_ring_attention_equals_single_rank_on_three_ranks(ranks):
    # with three ranks the ring's next and previous neighbours differ
    for r in ranks:
        for L in (36, 37, 38, 64):
            case = r["cp3"][f"attn_{L}"]
            assert all(case[key] < TOL for key in ("out", "dq", "dk", "dv")), (L, case)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", ["mae_32", "mae_24", "mae_24_ckpt", "mae_32_ddp"])
def test_mae_step_at_cp2_equals_cp1(two_ranks, case):
    for r in two_ranks:
        got = r[case]
        assert got["loss"] < TOL and got["grad"] < TOL and got["grad_worst_tensor"] < 1e-4, got
        assert (got["kept"] + 1) % 2 == 0
        assert math.isclose(got["mask_ratio"], got["ref_mask_ratio"], abs_tol=1e-6)


# ---- the GPU benchmark's CPU smoke mode ----------------------------------------------------------


@pytest.mark.timeout(240)
def test_gpu_context_benchmark_smoke_runs_on_cpu_with_torch_only():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project
    heavy = ("metaflow", "zarr", "segyio", "boto3", "fsspec", "s3fs", "accelerate")
    code = ("import json, runpy, sys; sys.argv = ['gpu_context.py', '--smoke']; "
            "runpy.run_path('benchmarks/gpu_context.py', run_name='__main__'); "
            f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r})))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    *_, result, imported = proc.stdout.strip().splitlines()
    assert json.loads(imported) == []
    res = json.loads(result)
    assert res["measured"] and res["smoke"] and [r["tokens"] for r in res["attention"]] == [256, 512]
    for check in res["block_check"]:  # the block kernels, merged as the ring merges them
        assert all(check[k] < TOL for k in ("out", "dq", "dk", "dv")), check
    assert res["ring_emulation"]["block_efficiency"] > 0
