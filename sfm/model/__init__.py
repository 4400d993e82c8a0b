"""The 3D ViT Masked AutoEncoder: plain PyTorch, no distributed code (applied from outside).

``sfm.model.load(url)`` rebuilds an exported model (local folder or s3://) in one call;
``sfm.model.save(model, url)`` exports one. Both use safetensors + config.json, never pickle.

The names below are imported on first use (PEP 562), so ``sfm.model.registry``, which reads and writes
version records and needs no torch, does not import torch: ``sfm registry list`` stays quick.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "mfu": "flops", "param_count": "flops", "preset_table": "flops", "train_flops_per_sample": "flops",
    "load": "io", "save": "io",
    "MAEConfig": "mae", "MaskedAutoencoder3D": "mae", "PatchEmbed3D": "mae", "sincos_pos_embed_3d": "mae",
    "PRESETS": "presets", "build_model": "presets", "mae_config": "presets", "model_config_for": "presets",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
