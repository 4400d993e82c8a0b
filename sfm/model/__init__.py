"""The 3D ViT Masked AutoEncoder: plain PyTorch, no distributed code (applied from outside).

``sfm.model.load(url)`` rebuilds an exported model (local folder or s3://) in one call;
``sfm.model.save(model, url)`` exports one. Both use safetensors + config.json, never pickle.
"""

from .flops import mfu, param_count, preset_table, train_flops_per_sample
from .io import load, save
from .mae import MAEConfig, MaskedAutoencoder3D, PatchEmbed3D, sincos_pos_embed_3d
from .presets import PRESETS, build_model, mae_config, model_config_for

__all__ = [
    "MAEConfig",
    "MaskedAutoencoder3D",
    "PatchEmbed3D",
    "mae_config",
    "model_config_for",
    "build_model",
    "PRESETS",
    "load",
    "save",
    "train_flops_per_sample",
    "param_count",
    "mfu",
    "preset_table",
    "sincos_pos_embed_3d",
]
