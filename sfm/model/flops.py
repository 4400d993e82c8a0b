"""What a training step costs: analytic matmul FLOPs per sample, parameter counts and MFU, in
the spirit of nanoGPT's ``estimate_mfu``. Checked against ``torch.utils.flop_counter`` in tests.

Only matmuls and the patch-embedding convolution are counted (2 FLOPs per multiply-add);
norms, softmax, GELU and the loss are a few percent at most and are left out, as is usual.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .mae import MAEConfig, MaskedAutoencoder3D
from .presets import PRESETS, mae_config

def _blocks_fwd_flops(tokens: int, dim: int, depth: int, mlp_ratio: float) -> float:
    """Forward matmul FLOPs of `depth` ViT blocks on `tokens` tokens of width `dim`."""
    hidden = int(dim * mlp_ratio)
    qkv = 2 * tokens * dim * 3 * dim
    attn = 2 * tokens * tokens * dim * 2  # q @ k^T and attn @ v, summed over heads
    proj = 2 * tokens * dim * dim
    mlp = 2 * tokens * dim * hidden * 2
    return depth * (qkv + attn + proj + mlp)


def forward_flops_per_sample(cfg: MAEConfig) -> dict[str, float]:
    """Forward FLOPs of one training sample at cfg.crop and cfg.mask_ratio, by part (the decoder over the
    patches it decodes: all, or with cfg.decoder_mask_ratio the kept ones and part of the masked)."""
    L = cfg.num_patches
    K = max(1, int(L * (1 - cfg.mask_ratio)))
    D = K + cfg.decoded_masked(L - K)  # the patches the decoder sees
    P = math.prod(cfg.patch) * cfg.in_chans
    E, Ed = cfg.embed_dim, cfg.decoder_embed_dim
    return {
        "patch_embed": 2 * L * P * E,  # all patches are embedded, then masked
        "encoder": _blocks_fwd_flops(K + 1, E, cfg.depth, cfg.mlp_ratio),
        "decoder_embed": 2 * (K + 1) * E * Ed,
        "decoder": _blocks_fwd_flops(D + 1, Ed, cfg.decoder_depth, cfg.mlp_ratio),
        "decoder_pred": 2 * D * Ed * P,
    }


def train_flops_per_sample(cfg: MAEConfig) -> float:
    """FLOPs of forward + backward for one sample.

    Backward costs twice the forward (grads for inputs and weights), except the patch embedding,
    whose input (the volume) needs no gradient: it costs 1x more, not 2x.
    """
    f = forward_flops_per_sample(cfg)
    return 3 * sum(f.values()) - f["patch_embed"]


def param_count(model_or_cfg: nn.Module | MAEConfig, encoder_only: bool = False) -> int:
    """Trainable parameters of a model, or of the model a config would build (without allocating
    it). encoder_only counts what downstream tasks keep: patch embed, cls token, blocks, norm."""
    if isinstance(model_or_cfg, MAEConfig):
        with torch.device("meta"):
            model_or_cfg = MaskedAutoencoder3D(model_or_cfg)
    return sum(
        p.numel()
        for name, p in model_or_cfg.named_parameters()
        if p.requires_grad and not (encoder_only and name.startswith(("decoder", "mask_token")))
    )


def mfu(flops_per_sample: float, samples_per_s: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the hardware peak (all devices together)."""
    return flops_per_sample * samples_per_s / peak_flops


def preset_table(crop: tuple[int, int, int] = (128, 128, 128)) -> list[dict]:
    """One row per preset at the given crop: size and training cost per sample."""
    rows = []
    for name in PRESETS:
        cfg = mae_config(name, crop=crop)
        rows.append({
            "preset": name,
            "crop": list(cfg.crop),
            "patch": list(cfg.patch),
            "patches": cfg.num_patches,
            "embed_dim": cfg.embed_dim,
            "depth": cfg.depth,
            "num_heads": cfg.num_heads,
            "params_M": round(param_count(cfg) / 1e6, 2),
            "encoder_params_M": round(param_count(cfg, encoder_only=True) / 1e6, 2),
            "train_GFLOPs_per_sample": round(train_flops_per_sample(cfg) / 1e9, 2),
        })
    return rows
