"""A registered encoder for the fine-tuning tests: the tiny preset, randomly initialised (seed 0), exported to a
folder and registered as ``sfm-mae`` in a data root, so it is the champion the fine-tune flow's ``--encoder`` and
the baselines' architecture default to."""

from __future__ import annotations

from pathlib import Path


def register_tiny_encoder(folder: Path, data_root: str) -> int:
    """Export the tiny encoder to ``folder`` and register it in ``data_root``; returns its version."""
    import torch

    from sfm.config import JobConfig
    from sfm.model import mae_config, registry, save
    from sfm.model.mae import MaskedAutoencoder3D

    torch.manual_seed(0)
    save(MaskedAutoencoder3D(mae_config("tiny")), str(folder))
    record = registry.register(data_root, "sfm-mae", str(folder), config=JobConfig().to_dict(),
                               metrics={"masked_nmse": 1.0}, lineage={"run_pathspec": "test", "manifest_version": "m0",
                                                                      "code_version": "test", "surveys": []})
    return record["version"]
