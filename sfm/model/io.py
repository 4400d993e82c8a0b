"""Exported models: ``model.safetensors`` + ``config.json`` in a folder (local or s3://).

Weights are never pickled. ``load(url)`` rebuilds the model from its config and loads the tensors. The same
folder, with a model card, is what ``MaskedAutoencoder3D.save_pretrained`` / ``from_pretrained`` write and read
(:mod:`sfm.model.hub`).
"""

from __future__ import annotations

import torch

from .hub import CONFIG, WEIGHTS
from .mae import MaskedAutoencoder3D


def save(model: MaskedAutoencoder3D, url: str, extra_config: dict | None = None) -> None:
    """Write ``url``/model.safetensors and ``url``/config.json (config last: the export is complete)."""
    from sfm import storage  # lazy: the model package imports with torch alone

    files = model.folder_files(extra_config)
    for name in (WEIGHTS, CONFIG):
        storage.write_bytes(storage.join(url, name), files[name])


def load(url: str, map_location: str | torch.device = "cpu") -> MaskedAutoencoder3D:
    """The model exported at ``url`` (a folder holding model.safetensors and config.json)."""
    from sfm import storage

    config, weights = (storage.read_bytes(storage.join(url, name)) for name in (CONFIG, WEIGHTS))
    return MaskedAutoencoder3D.from_folder_files(config, weights, url).to(map_location)
