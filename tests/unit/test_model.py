"""The 3D ViT-MAE: geometry, masking, loss, positional embedding, checkpointing, learning, cost."""

import json
import math
import subprocess
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from sfm.model import (
    PRESETS,
    MAEConfig,
    PatchEmbed3D,
    build_model,
    mae_config,
    param_count,
    train_flops_per_sample,
)
from sfm.model.flops import mfu, preset_table
from sfm.model.mae import sincos_pos_embed_3d

torch.set_num_threads(min(2, torch.get_num_threads()))


def layered_volumes(n: int, shape=(32, 32, 32), seed: int = 0) -> torch.Tensor:
    """[n, 1, D, H, W] smooth folded sine layers, like reflectors in a seismic cube."""
    g = torch.Generator().manual_seed(seed)
    D, H, W = shape
    d = torch.arange(D).float()[:, None, None]
    h = torch.arange(H).float()[None, :, None]
    w = torch.arange(W).float()[None, None, :]
    vols = []
    for _ in range(n):
        a, b, f, phase = torch.rand(4, generator=g)
        z = w + 3 * torch.sin(2 * math.pi * (a * d + b * h) / 32)
        vols.append(torch.sin(2 * math.pi * (0.1 + 0.15 * f) * z + 6 * phase))
    return torch.stack(vols)[:, None]


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    return build_model(mae_config("tiny"))


# ---- config -------------------------------------------------------------------------------


def test_config_round_trips_through_json():
    cfg = mae_config("small", crop=(64, 32, 128), mask_ratio=0.9)
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["crop"] == [64, 32, 128]
    back = MAEConfig.from_dict(d)
    assert back == cfg and back.crop == (64, 32, 128) and isinstance(back.patch, tuple)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(crop=(128, 128, 120)), "divisible by patch"),
        (dict(embed_dim=100, num_heads=12), "num_heads"),
        (dict(decoder_embed_dim=500, decoder_num_heads=16), "decoder_num_heads"),
        (dict(mask_ratio=1.0), "mask_ratio"),
        (dict(decoder_mask_ratio=1.0), "decoder_mask_ratio"),
        (dict(crop=(128, 128)), "crop"),
    ],
)
def test_config_rejects_bad_values(kwargs, words):
    with pytest.raises(ValueError, match=words):
        MAEConfig(**kwargs)


def test_unknown_preset_names_the_valid_ones():
    with pytest.raises(ValueError, match="tiny, mini, small, base, large, huge"):
        mae_config("gigantic")


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown keys"):
        MAEConfig.from_dict({**MAEConfig().to_dict(), "dropout": 0.1})


# ---- geometry -----------------------------------------------------------------------------


def test_patchify_unpatchify_round_trip(tiny):
    x = torch.randn(2, 1, 32, 32, 32)
    p = tiny.patchify(x)
    assert p.shape == (2, 64, 8 * 8 * 8)
    assert torch.equal(tiny.unpatchify(p), x)
    # patch 0 is the corner block; patch 1 is the next one along W (the fastest axis)
    assert torch.equal(p[0, 0], x[0, 0, :8, :8, :8].reshape(-1))
    assert torch.equal(p[0, 1], x[0, 0, :8, :8, 8:16].reshape(-1))
    # other sizes and several channels
    cfg = mae_config("tiny", in_chans=2)
    m = build_model(cfg)
    y = torch.randn(1, 2, 16, 24, 40)
    p = m.patchify(y)
    assert p.shape == (1, 2 * 3 * 5, 8 * 8 * 8 * 2)
    assert torch.equal(m.unpatchify(p, grid=(2, 3, 5)), y)


@pytest.mark.parametrize("chans", [1, 2])
def test_patch_embed_equals_conv3d(chans):
    """PatchEmbed3D is Conv3d(kernel = stride = patch) computed as a matmul: same outputs, same
    gradients, same parameter names and shapes (checkpoints of either load into the other), and
    patches in patchify's order."""
    torch.manual_seed(0)
    embed = PatchEmbed3D(chans, 12, (4, 2, 8))
    conv = torch.nn.Conv3d(chans, 12, kernel_size=(4, 2, 8), stride=(4, 2, 8))
    conv.load_state_dict(embed.state_dict())
    x = torch.randn(2, chans, 8, 6, 16)
    ours = embed(x)
    ref = conv(x).flatten(2).transpose(1, 2)  # [N, L, E]
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(ref)
    ours.backward(g)
    ref.backward(g)
    for name, p in embed.named_parameters():
        torch.testing.assert_close(p.grad, dict(conv.named_parameters())[name].grad, atol=1e-4, rtol=1e-4)
    # token l is patch l of patchify (C=1: the weight's flattened order is patchify's)
    if chans == 1:
        model = build_model(mae_config("tiny", patch=(4, 2, 8), crop=(8, 6, 16), embed_dim=12, num_heads=2))
        model.patch_embed.load_state_dict(embed.state_dict())
        by_patch = model.patchify(x) @ embed.weight.reshape(12, -1).T + embed.bias
        torch.testing.assert_close(model.patch_embed(x), by_patch, atol=1e-5, rtol=1e-5)


def test_bad_volume_size_is_a_clear_error(tiny):
    with pytest.raises(ValueError, match="not divisible by patch"):
        tiny(torch.randn(1, 1, 32, 30, 32))


# ---- masking ------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio, keep", [(0.75, 16), (0.5, 32), (0.9, 6), (0.999, 1), (0.0, 64)])
def test_random_masking_invariants(tiny, ratio, keep):
    N, L, E = 3, 64, 5
    x = torch.randn(N, L, E)
    kept, mask, ids_restore = tiny.random_masking(x, ratio)
    assert kept.shape == (N, keep, E)
    assert mask.shape == (N, L) and set(mask.unique().tolist()) <= {0.0, 1.0}
    assert torch.equal(mask.sum(1), torch.full((N,), float(L - keep)))
    # ids_restore is a permutation; its inverse lists kept tokens first
    ids_shuffle = torch.argsort(ids_restore, dim=1)
    assert torch.equal(torch.sort(ids_restore, dim=1).values, torch.arange(L).expand(N, L))
    assert torch.equal(torch.gather(ids_shuffle, 1, ids_restore), torch.arange(L).expand(N, L))
    for n in range(N):
        visible = (mask[n] == 0).nonzero().squeeze(1)
        assert torch.equal(torch.sort(ids_shuffle[n, :keep]).values, visible)
        # the kept rows are exactly the unmasked tokens, in shuffle order
        assert torch.equal(kept[n], x[n, ids_shuffle[n, :keep]])


def test_masks_differ_per_sample(tiny):
    _, mask, _ = tiny.random_masking(torch.randn(4, 64, 3), 0.75)
    assert len({tuple(m.tolist()) for m in mask}) == 4


# ---- loss ---------------------------------------------------------------------------------


def test_loss_counts_only_masked_patches(tiny):
    x = layered_volumes(2)
    torch.manual_seed(1)
    loss, pred, mask = tiny(x)
    assert loss.ndim == 0 and pred.shape == (2, 64, 512) and mask.shape == (2, 64)
    visible = (mask == 0).unsqueeze(-1)
    scrambled = torch.where(visible, torch.randn_like(pred) * 100, pred)
    torch.testing.assert_close(tiny.forward_loss(x, scrambled, mask), loss)
    perturbed = torch.where(~visible, pred + 1.0, pred)
    assert tiny.forward_loss(x, perturbed, mask) > loss + 0.5
    # and by hand: mean over masked patches of the per-patch MSE against normalised patches
    t = tiny.patchify(x)
    t = (t - t.mean(-1, keepdim=True)) / (t.var(-1, keepdim=True) + 1e-6).sqrt()
    by_hand = ((pred - t) ** 2).mean(-1)[mask.bool()].mean()
    torch.testing.assert_close(loss, by_hand)


def test_dual_masking_decodes_the_visible_and_part_of_the_masked_patches():
    """decoder_mask_ratio (VideoMAE V2's dual masking): in training the decoder sees the visible patches
    and the masked ones with the lowest masking noise; the loss is over those masked ones only."""
    torch.manual_seed(0)
    model = build_model(mae_config("tiny", decoder_mask_ratio=0.5))  # 64 patches, 16 visible, 48 masked
    x = layered_volumes(3)
    noise = torch.rand(3, 64, generator=torch.Generator().manual_seed(5))
    model.train()
    loss, pred, mask = model(x, noise=noise)
    rank = torch.argsort(torch.argsort(noise, dim=1), dim=1)  # each patch's place by rising noise
    decoded = rank < 16 + 24
    assert mask.sum(1).tolist() == [24.0] * 3
    assert torch.equal(mask.bool(), decoded & (rank >= 16))
    assert torch.all(pred[~decoded] == 0) and torch.all(pred[decoded].abs().sum(-1) > 0)
    t = model.patchify(x)
    t = (t - t.mean(-1, keepdim=True)) / (t.var(-1, keepdim=True) + 1e-6).sqrt()
    torch.testing.assert_close(loss, ((pred - t) ** 2).mean(-1)[mask.bool()].mean())
    # the same noise decodes the same patches; a shorter decoder sequence changes what it predicts
    torch.testing.assert_close(model(x, noise=noise)[0], loss)
    full = build_model(mae_config("tiny"))
    full.load_state_dict(model.state_dict())
    full.train()
    _, full_pred, full_mask = full(x, noise=noise)
    assert full_mask.sum(1).tolist() == [48.0] * 3
    assert not torch.allclose(full_pred[decoded], pred[decoded], atol=1e-4)
    # evaluation decodes every patch, as the reconstruction metrics expect
    model.eval()
    with torch.no_grad():
        _, eval_pred, eval_mask = model(x, noise=noise)
    assert eval_mask.sum(1).tolist() == [48.0] * 3
    torch.testing.assert_close(eval_pred, full(x, noise=noise)[1].detach())


def test_patch_targets_normalise_each_patch(tiny):
    x = layered_volumes(1) * 7 + 3
    t = tiny.patch_targets(x)
    torch.testing.assert_close(t.mean(-1), torch.zeros(1, 64), atol=1e-4, rtol=0)
    torch.testing.assert_close(t.var(-1), torch.ones(1, 64), atol=1e-3, rtol=0)
    raw = build_model(mae_config("tiny", norm_pix_loss=False))
    assert torch.equal(raw.patch_targets(x), raw.patchify(x))


# ---- positional embedding -----------------------------------------------------------------


def test_pos_embed_rows_distinct_and_dim_not_divisible_by_6():
    for dim in (64, 96, 100):
        pe = sincos_pos_embed_3d(dim, (4, 5, 6))
        assert pe.shape == (120, dim) and pe.dtype == torch.float32
        assert torch.cdist(pe, pe).add(torch.eye(120) * 1e3).min() > 1e-3
    pe = sincos_pos_embed_3d(64, (2, 2, 2))  # 64 = 3 * 20 + 4 zero channels
    assert torch.all(pe[:, 60:] == 0) and torch.any(pe[:, :60] != 0)


def test_pos_embed_is_analytic_in_grid_position():
    big = sincos_pos_embed_3d(96, (6, 4, 8)).reshape(6, 4, 8, 96)
    small = sincos_pos_embed_3d(96, (3, 2, 5)).reshape(3, 2, 5, 96)
    assert torch.equal(small, big[:3, :2, :5])


def test_model_runs_on_other_crop_sizes(tiny):
    x = torch.randn(2, 1, 48, 32, 64)  # grid (6, 4, 8) = 192 patches; built for 32^3
    loss, pred, mask = tiny(x)
    assert torch.isfinite(loss)
    assert pred.shape == (2, 192, 512) and mask.shape == (2, 192)
    assert mask.sum(1).tolist() == [192 - 48] * 2
    assert tiny.unpatchify(pred, grid=tiny.grid_shape(x)).shape == x.shape
    assert tiny.encode(x).shape == (2, 192, tiny.cfg.embed_dim)
    # tables for both grids are cached, not persisted in the state dict
    assert not any("pos" in k for k in tiny.state_dict())


def test_encode_sees_every_patch(tiny):
    tiny.eval()
    x = torch.randn(2, 1, 32, 32, 32)
    f = tiny.encode(x)
    assert f.shape == (2, 64, tiny.cfg.embed_dim)
    # equals the encoder with nothing masked, tokens back in grid order
    latent, mask, ids_restore = tiny.forward_encoder(x, 0.0)
    assert mask.sum() == 0
    unshuffled = torch.gather(latent[:, 1:], 1, ids_restore.unsqueeze(-1).expand_as(f))
    torch.testing.assert_close(unshuffled, f, atol=1e-5, rtol=1e-5)


def test_inference_first_then_training():
    """A positional table first cached under inference_mode must not break a later backward."""
    model = build_model(mae_config("tiny"))
    x = torch.randn(1, 1, 32, 32, 32)
    with torch.inference_mode():
        model.encode(x)
    model(x)[0].backward()
    assert model.blocks[0].attn.qkv.weight.grad is not None


# ---- attention seam, checkpointing --------------------------------------------------------


def test_attention_function_is_replaceable(tiny):
    calls = []

    def spy(q, k, v):
        calls.append(q.shape)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    x = layered_volumes(2)
    torch.manual_seed(3)
    ref = tiny(x)[0]
    for blk in [*tiny.blocks, *tiny.decoder_blocks]:
        blk.attn.attn_fn = spy
    torch.manual_seed(3)
    torch.testing.assert_close(tiny(x)[0], ref)
    cfg = tiny.cfg
    assert calls[0] == (2, cfg.num_heads, 1 + 16, cfg.embed_dim // cfg.num_heads)
    assert calls[-1] == (2, cfg.decoder_num_heads, 1 + 64, cfg.decoder_embed_dim // cfg.decoder_num_heads)
    assert len(calls) == cfg.depth + cfg.decoder_depth


def test_grad_checkpointing_matches(tiny):
    x = layered_volumes(2)

    def loss_and_grads():
        tiny.zero_grad()
        torch.manual_seed(7)
        loss = tiny(x)[0]
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in tiny.named_parameters()}

    ref_loss, ref_grads = loss_and_grads()
    tiny.grad_checkpointing = True
    loss, grads = loss_and_grads()
    torch.testing.assert_close(loss, ref_loss)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], atol=1e-6, rtol=1e-5, msg=n)


def test_grad_checkpointing_saves_fewer_activations(tiny):
    x = layered_volumes(2)

    def saved_bytes():
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            tiny(x)[0]
        return total

    plain = saved_bytes()
    tiny.grad_checkpointing = True
    assert saved_bytes() < 0.6 * plain


# ---- learning -----------------------------------------------------------------------------


def test_tiny_preset_learns_layered_volumes():
    """Predicting zeros scores ~1 against per-patch normalised targets; the model must beat it."""
    torch.manual_seed(0)
    model = build_model(mae_config("tiny"))
    x = layered_volumes(8)
    opt = torch.optim.AdamW(model.parameters(), lr=1.5e-3, weight_decay=0.05)
    losses = []
    for _ in range(100):
        loss = model(x)[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.9 and last < 0.85 * first, (first, last)


# ---- cost ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, overrides",
    [("tiny", {}), ("small", dict(crop=(64, 64, 64), depth=4, decoder_depth=2)),
     ("tiny", dict(crop=(32, 48, 64), mlp_ratio=2.0, mask_ratio=0.6)),
     ("tiny", dict(decoder_mask_ratio=0.5))],
)
def test_train_flops_match_flop_counter(name, overrides):
    cfg = mae_config(name, **overrides)
    model = build_model(cfg)
    x = torch.randn(2, 1, *cfg.crop)
    counter = FlopCounterMode(display=False)
    # the math backend decomposes attention into matmuls the counter sees on CPU
    with sdpa_kernel(SDPBackend.MATH), counter:
        model(x)[0].backward()
    measured = counter.get_total_flops() / 2
    analytic = train_flops_per_sample(cfg)
    assert abs(analytic / measured - 1) < 0.02, (analytic, measured)


def test_param_count_from_config_matches_model(tiny):
    assert param_count(tiny.cfg) == param_count(tiny) == sum(p.numel() for p in tiny.parameters())
    cfg = mae_config("small", crop=(64, 64, 64))
    assert param_count(cfg) == param_count(build_model(cfg))
    assert param_count(cfg, encoder_only=True) < param_count(cfg)


def test_preset_sizes_are_plausible():
    millions = {name: param_count(mae_config(name)) / 1e6 for name in PRESETS}
    assert millions["tiny"] < 2
    assert 20 < millions["small"] < 35
    assert 85 < millions["base"] < 125
    assert 300 < millions["large"] < 360
    assert 600 < millions["huge"] < 700
    assert param_count(mae_config("base"), encoder_only=True) / 1e6 == pytest.approx(88, abs=4)


def test_preset_table_and_mfu():
    rows = {r["preset"]: r for r in preset_table()}
    assert list(rows) == list(PRESETS)
    g = [rows[n]["train_GFLOPs_per_sample"] for n in ("small", "base", "large", "huge")]
    assert g == sorted(g) and 100 < rows["base"]["train_GFLOPs_per_sample"] < 250
    assert rows["base"]["crop"] == [128, 128, 128]
    # bigger crops cost more than linearly (decoder attention over all patches)
    big = {r["preset"]: r for r in preset_table(crop=(256, 256, 256))}
    assert big["base"]["train_GFLOPs_per_sample"] > 8 * rows["base"]["train_GFLOPs_per_sample"]
    assert mfu(1e12, 100.0, 1e15) == pytest.approx(0.1)


# ---- packaging ----------------------------------------------------------------------------


def test_model_package_imports_only_torch():
    code = (
        "import sys, sfm.model\n"
        "assert callable(sfm.model.load) and callable(sfm.model.save)\n"
        "from sfm.model.mae import MaskedAutoencoder3D\n"
        "from sfm.model.segmenter import Segmenter\n"
        "assert callable(MaskedAutoencoder3D.from_pretrained) and callable(Segmenter.save_pretrained)\n"
        "bad = [m for m in ('metaflow', 'zarr', 'segyio', 'boto3', 'fsspec', 's3fs', 'sfm.storage.objects',"
        " 'torch.distributed.fsdp', 'huggingface_hub', 'mlflow')"
        " if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"sfm.model imported {out.stdout.strip()}"
