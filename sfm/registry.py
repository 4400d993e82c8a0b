"""The model registry under ``<data-root>/registry/<model>/``: numbered versions and a champion alias.

::

    registry/<model>/v<N>/.claim            created if-absent: allocates N (safe under concurrency)
    registry/<model>/v<N>/model.safetensors
    registry/<model>/v<N>/config.json
    registry/<model>/v<N>/version.json      written last: the version is complete (registry_version contract)
    registry/<model>/champion.json          {"version": N, ...}: the version users get by default

A new version becomes champion only if its held-out ``masked_nmse`` beats the champion's by at least
the configured margin (lower is better), unless promotion is forced.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from typing import Any

from sfm import storage
from sfm.contracts import validate
from sfm.errors import SFMError

METRIC = "masked_nmse"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_VERSION = re.compile(r"^v(\d+)$")
FILES = ("model.safetensors", "config.json")


def model_root(data_root: str, model_name: str) -> str:
    if not _NAME.match(model_name) or ".." in model_name:
        raise SFMError(f"model name {model_name!r} is not allowed; use letters, digits, '.', '_' and '-'")
    return storage.join(data_root, "registry", model_name)


def version_url(data_root: str, model_name: str, version: int) -> str:
    return storage.join(model_root(data_root, model_name), f"v{version}")


def versions(data_root: str, model_name: str) -> list[int]:
    """Complete versions (those with version.json), ascending."""
    root = model_root(data_root, model_name)
    found = []
    for name in storage.list_dir(root):
        match = _VERSION.match(name)
        if match and storage.exists(storage.join(root, name, "version.json")):
            found.append(int(match.group(1)))
    return sorted(found)


def _claimed(data_root: str, model_name: str) -> list[int]:
    root = model_root(data_root, model_name)
    return sorted(int(m.group(1)) for m in map(_VERSION.match, storage.list_dir(root)) if m)


def _allocate(data_root: str, model_name: str, owner: str) -> int:
    claimed = _claimed(data_root, model_name)
    version = (claimed[-1] if claimed else 0) + 1
    while not storage.write_bytes_if_absent(storage.join(version_url(data_root, model_name, version), ".claim"),
                                            owner.encode()):
        version += 1
    return version


def get(data_root: str, model_name: str, version: int | str = "champion") -> dict[str, Any]:
    """The version record; ``version`` is a number, ``"latest"`` or ``"champion"``."""
    if version == "champion":
        champion = champion_version(data_root, model_name)
        if champion is None:
            raise SFMError(f"model {model_name!r} has no champion yet; register a version first")
        version = champion
    elif version == "latest":
        found = versions(data_root, model_name)
        if not found:
            raise SFMError(f"model {model_name!r} has no versions in {data_root}; register one first")
        version = found[-1]
    url = storage.join(version_url(data_root, model_name, int(version)), "version.json")
    if not storage.exists(url):
        raise SFMError(f"model {model_name!r} has no version v{version}; see `sfm registry list`")
    record = json.loads(storage.read_bytes(url))
    validate("registry_version", record, url)
    return record


def champion_version(data_root: str, model_name: str) -> int | None:
    url = storage.join(model_root(data_root, model_name), "champion.json")
    return int(json.loads(storage.read_bytes(url))["version"]) if storage.exists(url) else None


def register(data_root: str, model_name: str, model_url: str, *, config: dict, metrics: dict, lineage: dict,
             margin: float = 0.0, force_champion: bool = False) -> dict[str, Any]:
    """Copy an exported model into a new version and maybe promote it; returns the version record."""
    owner = lineage.get("run_pathspec", "") or "unknown"
    version = _allocate(data_root, model_name, owner)
    target = version_url(data_root, model_name, version)
    files = {}
    for name in FILES:
        data = storage.read_bytes(storage.join(model_url, name))
        storage.write_bytes(storage.join(target, name), data)
        files[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    record = {
        "model_name": model_name, "version": version,
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "files": files, "config": config, "metrics": metrics, "lineage": lineage,
    }
    validate("registry_version", record, f"{model_name} v{version}")
    storage.write_bytes(storage.join(target, "version.json"), json.dumps(record, indent=1, sort_keys=True).encode())
    record["champion"] = maybe_promote(data_root, model_name, version, margin=margin, force=force_champion)
    return record


def maybe_promote(data_root: str, model_name: str, version: int, *, margin: float = 0.0, force: bool = False) -> bool:
    """Make ``version`` the champion if forced, if there is none, or if it beats the champion by ``margin``."""
    candidate = get(data_root, model_name, version)
    current = champion_version(data_root, model_name)
    if not force and current is not None:
        incumbent = get(data_root, model_name, current)
        if not candidate["metrics"][METRIC] <= incumbent["metrics"][METRIC] - margin:
            return False
    champion = {"version": version, METRIC: candidate["metrics"][METRIC],
                "promoted_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    storage.write_bytes(storage.join(model_root(data_root, model_name), "champion.json"), json.dumps(champion).encode())
    return True


def load(data_root: str, model_name: str, version: int | str = "champion"):
    """The registered model (``sfm.model.MaskedAutoencoder3D``) of that version."""
    from sfm.model.io import load as load_model

    record = get(data_root, model_name, version)
    return load_model(version_url(data_root, model_name, record["version"]))
