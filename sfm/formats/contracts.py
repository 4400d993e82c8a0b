"""Validation against the machine-readable schemas in ``sfm/data_contracts/``: what crosses a boundary
(store attributes, manifest and registry rows), read through importlib.resources, in a checkout and in an
installed wheel alike.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from importlib import resources
from typing import Any

from sfm.errors import SFMError

CONTRACTS_DIR = resources.files("sfm") / "data_contracts"


@functools.cache
def _validator(name: str):
    import jsonschema

    schema = json.loads((CONTRACTS_DIR / f"{name}.schema.json").read_text())
    return jsonschema.Draft202012Validator(schema)


def validate(name: str, document: dict[str, Any], where: str) -> None:
    """Raise SFMError naming ``where`` if ``document`` breaks the ``name`` contract."""
    errors = sorted(_validator(name).iter_errors(document), key=lambda e: list(e.path))
    if errors:
        err = errors[0]
        path = "/".join(str(p) for p in err.path) or "(root)"
        raise SFMError(f"{where} breaks the {name} contract at {path}: {err.message}")


def read_store_attrs(store, where: str | None = None, *, stats_in_stored_units: bool = False) -> dict[str, Any]:
    """The root attributes of a survey store, validated against ``survey_store.schema.json``.

    ``store`` is a store URL, an open zarr Group, or its attributes (a mapping). Every reader goes
    through here, so a store written by another version (or damaged) fails with one line naming it
    instead of deep inside a read.

    With ``stats_in_stored_units``, ``stats`` (mean, std, min, max, percentiles) is expressed in the
    units of the stored ``amplitude`` array: for float16 and int8 stores that is ``(value - offset) / scale``
    (see ``amplitude_transform``), so code that normalises raw stored values with these statistics
    gets the same result as on the float32 store; float32 stores are returned unchanged.
    """
    if isinstance(store, str):
        import zarr

        from sfm import storage

        where = where or f"survey store {store}"
        try:
            store = zarr.open_group(storage.zarr_store(store, read_only=True), mode="r")
        except FileNotFoundError as err:
            raise SFMError(f"{where} does not exist; ingest the survey first") from err
    attrs = dict(store) if isinstance(store, Mapping) else dict(store.attrs)
    validate("survey_store", attrs, where or "survey store")
    transform = attrs.get("amplitude_transform")
    if stats_in_stored_units and transform:
        offset, scale = float(transform["offset"]), float(transform["scale"])
        stats = dict(attrs["stats"])
        for key in ("mean", "min", "max"):
            stats[key] = (stats[key] - offset) / scale
        stats["std"] = stats["std"] / scale
        stats["percentiles"] = {k: (v - offset) / scale for k, v in stats["percentiles"].items()}
        attrs["stats"] = stats
    return attrs
