"""Exported models: ``model.safetensors`` + ``config.json`` in a folder (local or s3://).

Weights are never pickled. ``load(url)`` rebuilds the model from its config and loads the tensors.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from .mae import MAEConfig, MaskedAutoencoder3D

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def save(model: MaskedAutoencoder3D, url: str, extra_config: dict | None = None) -> None:
    """Write ``url``/model.safetensors and ``url``/config.json (config last: the export is complete)."""
    from sfm import storage  # lazy: the model package imports with torch alone

    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    storage.write_bytes(storage.join(url, WEIGHTS), save_safetensors(tensors))
    config = {"model": model.cfg.to_dict(), **(extra_config or {})}
    storage.write_bytes(storage.join(url, CONFIG), json.dumps(config, indent=2, sort_keys=True).encode())


def load(url: str, map_location: str | torch.device = "cpu") -> MaskedAutoencoder3D:
    """The model exported at ``url`` (a folder holding model.safetensors and config.json)."""
    from sfm import storage

    config = json.loads(storage.read_bytes(storage.join(url, CONFIG)))
    model = MaskedAutoencoder3D(MAEConfig.from_dict(config["model"]))
    state = load_safetensors(storage.read_bytes(storage.join(url, WEIGHTS)))
    model.load_state_dict(state)
    return model.to(map_location)
