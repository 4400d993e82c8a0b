"""An MDIO v1 store registered as a survey, with no copy of its data: a reference group and a manifest row.

    row = register_mdio("s3://bucket/f3.mdio", data_root)   # what `sfm ingest s3://bucket/f3.mdio` does

writes ``<data_root>/surveys/<survey_id>.zarr``, a small Zarr v3 group whose root attributes
(``sfm/data_contracts/survey_store.schema.json``, ``source_kind: "mdio"``) name the MDIO store
(``amplitude_url``) and its variable and hold the statistics recomputed from its data, beside a copy of
its ``trace_mask`` and line numbers; then the manifest row, last (the survey is visible only now).
Readers (:func:`sfm.data.survey.read_survey_info`) open the reference, then read the amplitude where it
is. The flow does the same in two tasks: :func:`scan_to_staging` (identity and statistics) and
:func:`publish_from_staging`.
"""

from __future__ import annotations

import io
import json
import time
from typing import Any

import numpy as np

from sfm import storage
from sfm.config import IngestConfig
from sfm.formats import manifest
from sfm.formats.contracts import validate
from sfm.ingest.mdio_source import (DIGEST_ALGORITHM, DIGEST_DESCRIPTION, MdioSource, content_digest, inspect,
                                    statistics, survey_name)
from sfm.formats.store_layout import STORE_VERSION


def reference_attrs(src: MdioSource, digest: str, stats: dict[str, Any]) -> dict[str, Any]:
    """The reference group's root attributes (survey_store.schema.json, the ``source_kind: "mdio"`` case)."""
    amp = src.amp
    shards = getattr(amp, "shards", None) or amp.chunks
    codecs = [c.to_dict() for c in amp.metadata.codecs]
    steps = [int(v[1] - v[0]) if len(v) > 1 else 1 for v in (src.coords["inline"], src.coords["crossline"])]
    return {
        "sfm_store_version": STORE_VERSION, "source_kind": "mdio", "survey_id": digest[:16],
        "name": survey_name(src.url), "source_url": src.url, "amplitude_url": src.url, "variable": src.variable,
        "sample_axis": src.sample_axis, "mdio_api_version": src.api_version,
        "checksum": f"{DIGEST_ALGORITHM}:{digest}", "checksum_algorithm": DIGEST_DESCRIPTION,
        "sample_format": src.sample_format, "sample_interval_us": src.sample_interval_us,
        "sample_start_ms": src.sample_start_ms, "text_header": src.text_header,
        "shape": list(src.shape), "live_traces": int(src.mask.sum()),
        "inline_step": steps[0], "crossline_step": steps[1], "dtype": str(np.dtype(amp.dtype)),
        "stats": stats,
        "store": {"bricks": list(src.chunks), "shards": [int(s) for s in shards],
                  "codec": " ".join(c["name"] for c in codecs), "dtype": str(np.dtype(amp.dtype))},
    }


def describe(url: str, cfg: IngestConfig) -> tuple[MdioSource, dict[str, Any]]:
    """Check the MDIO store at ``url``, then its identity and statistics: the source and the reference
    group's attributes."""
    src = inspect(url)
    digest = content_digest(src)
    stats = statistics(src, cfg.mdio_stats_gb * 1e9)
    return src, reference_attrs(src, digest, stats)


def write_reference(store_url: str, attrs: dict[str, Any], mask: np.ndarray, coords: dict[str, np.ndarray]) -> None:
    """Write the reference group: ``trace_mask`` [IL, XL], ``inline`` [IL], ``crossline`` [XL], then the
    root attributes (validated first)."""
    import zarr

    validate("survey_store", attrs, f"survey store {store_url}")
    group = zarr.create_group(storage.zarr_store(store_url), overwrite=True, zarr_format=3)
    for name, values, dims in (("trace_mask", mask, ["inline", "crossline"]),
                               ("inline", coords["inline"], ["inline"]),
                               ("crossline", coords["crossline"], ["crossline"])):
        values = np.asarray(values)
        array = group.create_array(name, shape=values.shape, chunks=values.shape, dtype=values.dtype,
                                   fill_value=values.dtype.type(0), dimension_names=dims)
        array[...] = values
    group.attrs.update(attrs)  # the root zarr.json, last


def publish_reference(data_root: str, attrs: dict[str, Any], mask: np.ndarray, coords: dict[str, np.ndarray]
                      ) -> dict[str, Any]:
    """Write the reference group and publish its manifest row (last); the row with ``status``
    ("registered", or "exists" when the same content was published meanwhile)."""
    store_url = manifest.survey_store_url(data_root, attrs["survey_id"])
    try:
        write_reference(store_url, attrs, mask, coords)
    except BaseException:
        if manifest.get_row(data_root, attrs["survey_id"]) is None:
            storage.remove(store_url)
        raise
    row, published = manifest.publish_or_get(data_root, manifest.make_row(attrs, store_url, attrs["stats"]))
    return {**row, "status": "registered" if published else "exists"}


def register_mdio(url: str, data_root: str, cfg: IngestConfig | None = None) -> dict[str, Any]:
    """Register the MDIO store at ``url`` in ``data_root`` (see the module docstring); nothing of its data is
    copied. Returns the manifest row plus ``status`` ("registered" or "exists"), ``message``, ``seconds``,
    ``details`` (bytes read for the statistics, the fraction of traces they cover)."""
    t0 = time.perf_counter()
    cfg = cfg or IngestConfig()
    data_root = storage.normalize(data_root)
    src, attrs = describe(url, cfg)
    existing = manifest.get_row(data_root, attrs["survey_id"])
    row = ({**existing, "status": "exists"} if existing is not None
           else publish_reference(data_root, attrs, src.mask, src.coords))
    stats = attrs["stats"]
    shape = " x ".join(str(n) for n in attrs["shape"])
    if row["status"] == "exists":
        message = f"{src.url}: same content as survey {row['survey_id']} ({row['name']}), published before; nothing to do"
    else:
        message = (f"registered MDIO store {attrs['name']}: {shape}, "
                   f"{attrs['live_traces']} live traces, read in place (nothing copied); statistics from "
                   f"{stats['fraction_read']:.0%} of the traces ({stats['bytes_read'] / 1e6:.1f} MB read)")
    details = {"bytes_read": stats["bytes_read"], "fraction_read": stats["fraction_read"],
               "amplitude_url": attrs["amplitude_url"]}
    return {**row, "message": message, "details": details, "seconds": time.perf_counter() - t0, "mb_per_s": 0.0}


# ------------------------------------------------------------------------------------------------
# the flow's tasks: one scan task per MDIO survey, nothing to write, the publish step


def scan_to_staging(scan: dict[str, Any], cfg: IngestConfig) -> dict[str, Any]:
    """The scan task of an MDIO survey: identity and statistics into ``<staging>/mdio.json`` and its mask and
    line numbers into ``<staging>/mdio.npz``; returns ``scan`` with ``survey_id``."""
    src, attrs = describe(scan["url"], cfg)
    buf = io.BytesIO()
    np.savez(buf, trace_mask=src.mask, inline=src.coords["inline"], crossline=src.coords["crossline"])
    storage.write_bytes(storage.join(scan["staging"], "mdio.npz"), buf.getvalue())
    storage.write_bytes(storage.join(scan["staging"], "mdio.json"), json.dumps(attrs).encode())  # last
    return {**scan, "survey_id": attrs["survey_id"]}


def publish_from_staging(part: dict[str, Any], data_root: str) -> dict[str, Any]:
    """The publish step of an MDIO survey: its reference group and manifest row from the scan task's staging
    files (nothing when the content is published already)."""
    existing = manifest.get_row(data_root, part["survey_id"])
    if existing is not None:
        return {**existing, "status": "exists"}
    attrs = json.loads(storage.read_bytes(storage.join(part["staging"], "mdio.json")))
    with np.load(io.BytesIO(storage.read_bytes(storage.join(part["staging"], "mdio.npz")))) as z:
        mask, coords = z["trace_mask"], {"inline": z["inline"], "crossline": z["crossline"]}
    return publish_reference(data_root, attrs, mask, coords)
