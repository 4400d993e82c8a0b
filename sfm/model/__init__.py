"""The 3D ViT Masked AutoEncoder: plain PyTorch, no distributed code (applied from outside)."""

from .flops import mfu, param_count, preset_table, train_flops_per_sample
from .mae import MAEConfig, MaskedAutoencoder3D, sincos_pos_embed_3d
from .presets import PRESETS, build_model, mae_config

__all__ = [
    "MAEConfig",
    "MaskedAutoencoder3D",
    "mae_config",
    "build_model",
    "PRESETS",
    "train_flops_per_sample",
    "param_count",
    "mfu",
    "preset_table",
    "sincos_pos_embed_3d",
]
