"""Reading a published label store (written by :mod:`sfm.ingest.labels`, ``label_store.schema.json``):
:func:`open_labels`."""

from __future__ import annotations

from typing import Any

import numpy as np

from sfm import storage
from sfm.errors import SFMError
from sfm.formats.contracts import validate


def open_labels(store_url: str) -> tuple[dict[str, Any], Any, np.ndarray]:
    """A published label store: its attributes (validated), its ``labels`` zarr array [IL, XL, NS] uint8 and
    its ``label_mask`` [IL, XL] bool."""
    import zarr

    try:
        group = zarr.open_group(storage.zarr_store(store_url, read_only=True), mode="r")
        attrs = dict(group.attrs)
        labels, mask = group["labels"], np.asarray(group["label_mask"][...], bool)
    except (FileNotFoundError, KeyError) as err:
        raise SFMError(f"label store {store_url} does not exist or is incomplete ({type(err).__name__}); ingest "
                       "the labels first (`sfm ingest-labels`)") from err
    validate("label_store", attrs, f"label store {store_url}")
    return attrs, labels, mask
