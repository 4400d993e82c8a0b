"""The task model a prediction runs: found by name in the registry or at a URL (its windows run through
:func:`sfm.predict.windows.window_probabilities`).

``--model`` is ``NAME`` (its champion), ``NAME:vN`` / ``NAME:N`` / ``NAME:latest`` / ``NAME:champion``, a registry
version of ``<data-root>/registry/NAME/``; or the URL of an exported task model folder (local or s3://,
:func:`sfm.model.segmenter.save_segmenter`). Registered files are checked against their sha256 first.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import torch

from sfm.errors import SFMError

_NAME_AND_VERSION = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]{0,99})(:(?P<version>[A-Za-z0-9]+))?$")


@dataclass
class TaskModel:
    """A loaded task model: ``net`` (a :class:`sfm.model.segmenter.Segmenter`) and where it came from."""

    net: torch.nn.Module
    name: str  # registry name, or "" for a URL
    version: int  # registry version, or 0 for a URL
    url: str  # the folder its files were read from
    sha256: str  # of model.safetensors: what a prediction's identity records

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


def is_url(spec: str) -> bool:
    return "://" in spec or "/" in spec or spec.startswith(".")


def load_task_model(spec: str, data_root: str, device: str = "cpu") -> TaskModel:
    """The task model ``spec`` names (see the module docstring), on ``device``, in eval mode."""
    from sfm import storage
    from sfm.model import registry
    from sfm.model.segmenter import CONFIG, WEIGHTS, segmenter_from_files

    spec = str(spec).strip()
    if is_url(spec):
        url = storage.normalize(spec)
        if not storage.exists(storage.join(url, CONFIG)):
            raise SFMError(f"--model {spec}: no exported model there (no {CONFIG}); name a registry model as "
                           "NAME:vN or the folder a task model was exported to")
        files = {CONFIG: storage.read_bytes(storage.join(url, CONFIG)),
                 WEIGHTS: storage.read_bytes(storage.join(url, WEIGHTS))}
        name, version = "", 0
    else:
        match = _NAME_AND_VERSION.match(spec)
        if not match:
            raise SFMError(f"--model {spec!r} is neither NAME[:vN] nor a URL; e.g. sfm-faults:v3")
        name = match["name"]
        if not registry.versions(data_root, name):
            raise SFMError(f"model {name!r} is not in the registry at {data_root}; see `sfm registry list --model "
                           f"{name}`, or pass --data-root where it was registered")
        version = registry.resolve(data_root, name, match["version"] or "champion")
        files = registry.verified_files(data_root, name, version)
        url = registry.version_url(data_root, name, version)
    net = segmenter_from_files(files[CONFIG], files[WEIGHTS], spec)
    return TaskModel(net.to(device).eval(), name, version, url, hashlib.sha256(files[WEIGHTS]).hexdigest())
