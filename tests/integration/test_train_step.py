"""sfm.train.step (the torch-only training step), sfm.model.hardware, the one-call model loader, and the
GPU benchmark's CPU smoke mode (which must not import metaflow, zarr, segyio, boto3 or fsspec)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sfm.model.hardware import datasheet_peak_flops, matmul_flops
from sfm.model import build_model, mae_config
from sfm.train.step import StepHooks, TrainStep, apply_training_options, build_optimizer, lr_at, throughput

PROJECT = Path(__file__).resolve().parents[2]
torch.set_num_threads(1)


def volumes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 1, 32, 32, 32, generator=torch.Generator().manual_seed(seed))


def tiny(seed: int = 0):
    torch.manual_seed(seed)
    return build_model(mae_config("tiny"))


def max_abs_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_lr_warms_up_then_decays_to_min():
    kw = dict(lr=1e-3, min_lr=1e-5, warmup_steps=10, max_steps=110)
    lrs = [lr_at(s, **kw) for s in range(120)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a < b for a, b in zip(lrs[:9], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[10:110], lrs[11:111]))
    assert lrs[60] == pytest.approx(1e-5 + 0.5 * (1e-3 - 1e-5))  # half way: the cosine's midpoint
    assert lrs[110] == lrs[119] == pytest.approx(1e-5)


def test_optimizer_is_fused_and_spares_norms_biases_tokens():
    model = tiny()
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.05)
    assert all(g["fused"] for g in opt.param_groups)
    decay, no_decay = opt.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert {names[id(p)] for p in no_decay["params"]} >= {"cls_token", "mask_token", "norm.weight", "norm.bias",
                                                          "patch_embed.bias", "blocks.0.attn.qkv.bias"}
    assert all(p.ndim >= 2 for p in decay["params"]) and "patch_embed.weight" in {names[id(p)] for p in decay["params"]}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_step_trains_clips_and_schedules():
    model = tiny()
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, lr=1.0, min_lr=0.0, warmup_steps=2, max_steps=4))
    norms = []

    def clip(params, max_norm):
        norms.append(torch.nn.utils.clip_grad_norm_(params, max_norm))
        return norms[-1]

    step = TrainStep(model, opt, sched, grad_clip=0.5, hooks=StepHooks(clip_grad_norm=clip))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = step(iter([volumes(2)]), 1)
    assert result.losses.shape == (1,) and torch.isfinite(result.losses).all() and result.applied
    assert result.grad_norm.item() == pytest.approx(norms[0].item())
    assert len(norms) == 1 and max_abs_diff(model.state_dict(), before) > 0
    assert all(p.grad is None for p in model.parameters())  # zeroed (set to None) after the step
    assert sched.last_epoch == 1 and opt.param_groups[0]["lr"] == pytest.approx(1e-3)


def test_accumulating_micro_batches_equals_one_big_batch():
    """Two micro-batches of 2 give the gradient of one batch of 4: the per-micro-batch losses are
    means over the same number of masked patches, and the masks come from one generator stream."""
    x = volumes(4)
    results = []
    for chunks in (1, 2):
        model = tiny()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = TrainStep(model, opt, generator=torch.Generator().manual_seed(3))
        losses = step(iter(x.chunk(chunks)), chunks).losses
        results.append((losses.mean(), {k: v.clone() for k, v in model.state_dict().items()}))
    (loss1, w1), (loss2, w2) = results
    assert loss1.item() == pytest.approx(loss2.item(), rel=1e-5)
    assert max_abs_diff(w1, w2) < 1e-6


def test_masks_come_from_the_step_generator_not_the_global_rng():
    x = volumes(2)
    runs = []
    for global_seed in (0, 1):
        model = tiny()
        torch.manual_seed(global_seed)  # whatever else draws from the global RNG does not matter
        step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), generator=torch.Generator().manual_seed(7))
        runs.append([step(iter([x]), 1).losses.item() for _ in range(2)])
    assert runs[0] == runs[1]
    model = tiny()
    other = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), generator=torch.Generator().manual_seed(8))
    assert other(iter([x]), 1).losses.item() != runs[0][0]


def test_a_non_finite_step_is_skipped_and_the_schedule_still_advances():
    """check_finite sees the losses and the gradient norm; a NaN batch leaves weights and optimiser
    state untouched, drops the gradients, and the next finite step trains as usual."""
    model = tiny()
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    seen = []

    def check(losses, norm):
        seen.append((losses.clone(), norm.clone()))
        return bool(torch.isfinite(losses).all() and torch.isfinite(norm))

    step = TrainStep(model, opt, sched, grad_clip=1.0, hooks=StepHooks(check_finite=check))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = volumes(2)
    bad[0, 0, 0, 0, 0] = float("nan")
    result = step(iter([bad]), 1)
    assert not result.applied and not torch.isfinite(result.grad_norm)
    assert max_abs_diff(model.state_dict(), before) == 0 and not opt.state
    assert all(p.grad is None for p in model.parameters()) and sched.last_epoch == 1
    result = step(iter([volumes(2)]), 1)
    assert result.applied and torch.isfinite(result.grad_norm) and max_abs_diff(model.state_dict(), before) > 0
    assert len(seen) == 2


@pytest.mark.timeout(300)
def test_compiled_and_checkpointed_blocks_match_eager():
    """apply_training_options compiles each block in place (same parameter names) and turns on
    activation checkpointing; loss and gradients match the eager model. (aot_eager: the graph
    capture and autograd of torch.compile without inductor's C++ build, which is slow on CPU.)"""
    x = volumes(2)

    def loss_and_grads(model):
        loss = model(x, generator=torch.Generator().manual_seed(5))[0]
        loss.backward()
        return loss.item(), {n: p.grad for n, p in model.named_parameters()}

    ref_loss, ref_grads = loss_and_grads(tiny())
    model = apply_training_options(tiny(), grad_checkpointing=True, compile=True, compile_backend="aot_eager")
    assert model.grad_checkpointing
    assert list(model.state_dict()) == list(tiny().state_dict())
    loss, grads = loss_and_grads(model)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert max_abs_diff(grads, ref_grads) < 1e-5


def test_throughput_and_peaks():
    speed = throughput(samples=64, seconds=2.0, flops_per_sample=1e12, voxels_per_sample=128**3,
                       peak_flops=1e15, devices=4)
    assert speed["samples_per_s"] == 32 and speed["voxels_per_s"] == 32 * 128**3
    assert speed["mfu"] == pytest.approx(1e12 * 32 / 4 / 1e15)
    assert datasheet_peak_flops("NVIDIA H200", torch.bfloat16) == 989e12
    assert datasheet_peak_flops("NVIDIA H200", torch.float32) is None
    assert datasheet_peak_flops("Some GPU", torch.bfloat16) is None
    rng = torch.get_rng_state()
    rate = matmul_flops("cpu", torch.float32, n=256, seconds=0.05)
    assert math.isfinite(rate) and rate > 1e8
    assert torch.equal(torch.get_rng_state(), rng), "measuring the matmul rate moved the global RNG"


@pytest.mark.parametrize("where", ["local", "s3"])
def test_load_is_one_call_and_needs_no_pickle(where, tmp_path, request):
    import sfm.model
    from sfm import storage

    if where == "s3":
        url = storage.join(request.getfixturevalue("s3_env").make_bucket("sfm-export"), "models", "m1")
    else:
        url = str(tmp_path / "export")
    model = tiny(seed=4)
    sfm.model.save(model, url, {"note": "test"})
    assert sorted(storage.list_dir(url)) == ["config.json", "model.safetensors"]
    assert json.loads(storage.read_bytes(storage.join(url, "config.json")))["note"] == "test"
    loaded = sfm.model.load(url)
    assert loaded.cfg == model.cfg
    assert max_abs_diff(loaded.state_dict(), model.state_dict()) == 0


@pytest.mark.timeout(300)
def test_gpu_benchmark_smoke_runs_with_torch_and_sfm_model_only():
    code = (
        "import runpy, sys\n"
        "sys.argv = ['benchmarks/gpu_train.py', '--smoke', '--configs', 'tiny:32:2']\n"
        "runpy.run_path('benchmarks/gpu_train.py', run_name='__main__')\n"
        "bad = [m for m in ('metaflow', 'zarr', 'segyio', 'boto3', 'botocore', 'fsspec', 's3fs', 'accelerate',"
        " 'sfm.data', 'sfm.storage.objects') if m in sys.modules]\n"
        "print('IMPORTED:' + ','.join(bad))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=PROJECT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == "IMPORTED:", lines[-1]
    result = json.loads(lines[-2])
    assert result["smoke"] and result["runs"][0]["preset"] == "tiny" and result["runs"][0]["step_ms"] > 0
    assert 0 < result["mfu"]["tiny:32"] and result["goal_mfu"] == 0.45


def test_muon_steps_the_block_matrices_as_torch_muon_and_the_rest_as_adamw():
    """build_optimizer(algorithm="muon") = torch.optim.Muon (Moonshot's RMS matching) on the blocks' 2-D
    weights beside torch's AdamW on everything else, step for step, with the schedule scaling both rates."""
    x = volumes(2)
    model, ref = tiny(), tiny()
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.05, algorithm="muon", muon_lr=3e-3)
    names = {id(p): n for n, p in model.named_parameters()}
    matrices = [g for g in opt.param_groups if g["muon"]]
    assert len(matrices) == 1 and matrices[0]["lr"] == 3e-3
    muon_names = {names[id(p)] for p in matrices[0]["params"]}
    assert "blocks.0.attn.qkv.weight" in muon_names and "decoder_blocks.0.mlp.fc1.weight" in muon_names
    assert not muon_names & {"patch_embed.weight", "decoder_pred.weight", "decoder_embed.weight", "cls_token"}
    by_name = dict(ref.named_parameters())
    ref_muon = torch.optim.Muon([by_name[n] for n in sorted(muon_names)], lr=3e-3, weight_decay=0.05,
                                adjust_lr_fn="match_rms_adamw")
    rest = [(n, p) for n, p in ref.named_parameters() if n not in muon_names]
    ref_adamw = torch.optim.AdamW(
        [{"params": [p for n, p in rest if p.ndim >= 2 and not n.endswith("_token")], "weight_decay": 0.05},
         {"params": [p for n, p in rest if p.ndim < 2 or n.endswith("_token")], "weight_decay": 0.0}],
        lr=1e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    for step in range(3):  # the same gradients into both, so only the optimisers' arithmetic differs
        torch.manual_seed(step)
        model(x)[0].backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = p.grad.clone()
        opt.step()
        sched.step()
        for o, peak in ((ref_muon, 3e-3), (ref_adamw, 1e-3)):
            for g in o.param_groups:
                g["lr"] = peak * 0.5 ** step
            o.step()
        for o in (opt, ref_muon, ref_adamw):
            o.zero_grad(set_to_none=True)
        got, want = model.state_dict(), ref.state_dict()
        for name in want:
            assert torch.allclose(got[name], want[name], rtol=1e-5, atol=1e-7), (step, name)
    assert max_abs_diff(model.state_dict(), tiny().state_dict()) > 1e-4  # it did train


def test_muon_state_round_trips_through_state_dict():
    """A checkpoint's optimiser state (momentum buffers, AdamW moments, rates) resumes the same steps."""
    x = volumes(2)
    runs = []
    for reload in (False, True):
        model = tiny()
        opt = build_optimizer(model, lr=1e-3, weight_decay=0.05, algorithm="muon")
        for step in range(4):
            if reload and step == 2:
                saved_model, saved_opt = model.state_dict(), opt.state_dict()
                model = tiny(seed=1)
                model.load_state_dict(saved_model)
                opt = build_optimizer(model, lr=5.0, weight_decay=0.5, algorithm="muon")
                opt.load_state_dict(saved_opt)
            torch.manual_seed(step)
            model(x)[0].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs.append(model.state_dict())
    assert max_abs_diff(runs[0], runs[1]) == 0


def test_muon_orthogonalises_its_stacks_concurrently_to_the_same_values():
    """On a CPU with several intra-op threads the shape stacks run on threads at once; the values are
    those of one after another, bit for bit, in the order given."""
    from sfm.train import muon

    gen = torch.Generator().manual_seed(0)
    stacks = [torch.randn(k, r, c, generator=gen) for k, r, c in ((4, 48, 16), (2, 16, 16), (1, 64, 16), (3, 16, 40))]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = muon.orthogonalise_all(stacks)
        assert muon._pool is not None  # it did use the threads
    finally:
        torch.set_num_threads(threads)
    alone = [muon.orthogonalise(s) for s in stacks]
    assert [u.shape for u in together] == [s.shape for s in stacks]
    assert all(torch.equal(a, b) for a, b in zip(together, alone))
