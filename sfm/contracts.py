"""Validation against the machine-readable schemas in ``data_contracts/``."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from sfm.errors import SFMError

CONTRACTS_DIR = Path(__file__).resolve().parents[1] / "data_contracts"


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
