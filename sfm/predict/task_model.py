"""The task model a prediction runs: found by name in the registry or at a URL (its windows run through
:func:`sfm.predict.windows.window_probabilities`).

``--model`` is a model reference (:func:`sfm.model.registry.find`): ``NAME`` (its champion), ``NAME:vN`` /
``NAME:latest`` / ``NAME:champion``, a registry version of ``<data-root>/registry/NAME/``; or the URL of a task
model's folder (a registry version's, or one exported with :func:`sfm.model.segmenter.save_segmenter`; local or
s3://). Registered files are checked against their sha256 first.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from sfm.errors import SFMError

@dataclass
class TaskModel:
    """A loaded task model: ``net`` (a :class:`sfm.model.segmenter.Segmenter`) and where it came from."""

    net: torch.nn.Module
    name: str  # registry name, or "" for a URL
    version: int  # registry version, or 0 for a URL
    url: str  # the folder its files were read from
    sha256: str  # of model.safetensors: what a prediction's identity records
    data_root: str = ""  # the registry's data root, or "" for a URL

    @property
    def channels(self) -> int:
        """Logits per voxel: 1 (binary) or the number of classes."""
        return int(self.net.task.channels)

    @property
    def classes(self) -> int:
        return int(self.net.task.classes)

    def describe(self) -> dict:
        """What the prediction store's attributes record about the model."""
        return {"name": self.name, "version": self.version, "url": self.url, "sha256": self.sha256,
                "task": self.net.task.name, "crop": list(self.net.crop)}


def load_task_model(spec: str, data_root: str, device: str = "cpu") -> TaskModel:
    """The task model ``spec`` names (see the module docstring), on ``device``, in eval mode."""
    from sfm import storage
    from sfm.model import registry
    from sfm.model.segmenter import CONFIG, WEIGHTS, segmenter_from_files

    ref = registry.find(data_root, spec, flag="--model")
    if ref.name:
        files = registry.verified_files(ref.data_root, ref.name, ref.version)
    else:
        if not storage.exists(storage.join(ref.url, CONFIG)):
            raise SFMError(f"--model {spec}: no exported model there (no {CONFIG}); name a registry model as "
                           "NAME:vN or the folder a task model was exported to")
        files = {CONFIG: storage.read_bytes(storage.join(ref.url, CONFIG)),
                 WEIGHTS: storage.read_bytes(storage.join(ref.url, WEIGHTS))}
    net = segmenter_from_files(files[CONFIG], files[WEIGHTS], str(spec).strip())
    return TaskModel(net.to(device).eval(), ref.name, ref.version, ref.url, hashlib.sha256(files[WEIGHTS]).hexdigest(),
                     ref.data_root)

