"""One survey ingested by many tasks: the flow's ingest in parts, each a function a task calls.

    scans = plan_scans(url, key, data_root, cfg)   # byte ranges: whole 4 GiB pieces of the file
    scan_part(scan)                                # per task: piece digests + trace header fields
    parts = plan_writes(scans, data_root, cfg)     # one task: survey_id, geometry, the store's arrays
    write_part(part, cfg)                          # per task: the shards of whole shard rows
    publish_parts(parts, data_root)                # one task: statistics, root zarr.json, manifest row

The store is the same, byte for byte, as :func:`sfm.ingest.survey.ingest_survey` writes in one task:
every part writes the shards of its own inlines (whole rows of shards, so no shard has two writers);
the statistics of every brick column are kept apart and merged in the publish step in the store's
column order, exactly as one task merges them (:func:`sfm.ingest.cube_writer.finish_store`); the
content digest combines the pieces' digests in file order (:func:`sfm.ingest.segy.combine_pieces`),
so neither depends on the number of parts.

What the tasks hand each other lives under ``<data_root>/surveys/ingest-parts/<key>/`` (the header
fields, each part's cells and statistics, the survey's plan: object writes, each atomic) and is
removed once the survey is published; the tasks themselves pass only names and numbers. A part that
was killed is simply run again: it rewrites the same shards with the same bytes. The survey stays
invisible until the publish step writes its manifest row, last, and that step refuses to publish while
any part's statistics are missing.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from typing import Any

import numpy as np

from sfm import storage
from sfm.config import IngestConfig
from sfm.errors import SFMError
from sfm.ingest import manifest
from sfm.ingest.cube_writer import Columns, _Plan, finish_store, prepare_store, write_columns
from sfm.ingest.moments import moments_from_bytes, moments_to_bytes
from sfm.ingest.mdio_register import publish_from_staging, scan_to_staging
from sfm.ingest.options import ingest_threads
from sfm.ingest import segy
from sfm.ingest.segy import combine_pieces, header_fields_needed, read_layout, scan_range
from sfm.ingest.segy_geometry import build_geometry
from sfm.ingest.zarr_writer import GroupWriter


def staging_url(data_root: str, key: str) -> str:
    """Where the parts of one survey's ingest leave what the next step reads (``key``: one per ingest)."""
    return storage.join(data_root, "surveys", "ingest-parts", key)


def part_count(size: int, cfg: IngestConfig, parts: int = 0) -> int:
    """Tasks to split a ``size``-byte survey into: ``parts`` if given, else ``cfg.parts``, else one per
    ``cfg.part_gb`` GB (at least one)."""
    wanted = int(parts) or int(cfg.parts)
    return wanted if wanted > 0 else max(1, math.ceil(size / (cfg.part_gb * 1e9)))


def split(count: int, parts: int) -> list[tuple[int, int]]:
    """``count`` consecutive items split into at most ``parts`` contiguous runs [(lo, hi)], as even as can be."""
    parts = max(1, min(parts, count))
    return [(count * k // parts, count * (k + 1) // parts) for k in range(parts)]


# ------------------------------------------------------------------------------------------------
# scan


def plan_scans(url: str, key: str, data_root: str, cfg: IngestConfig, parts: int = 0, kind: str = "segy"
               ) -> list[dict[str, Any]]:
    """The scan parts of one survey: whole :data:`~sfm.ingest.segy.PIECE_BYTES` pieces of the file each, at
    most ``part_count`` of them. Each is a small dict for :func:`scan_part`. An MDIO store (``kind`` "mdio")
    has one scan part, its identity and statistics, and nothing to write."""
    from sfm.ingest.survey import source_size

    if kind == "mdio":
        return [{"url": url, "key": key, "staging": staging_url(data_root, key), "kind": "mdio", "scan_part": 0,
                 "scan_parts": 1}]

    size = source_size(read_layout(url, cfg.endian))  # refuses a file that is not SEG-Y before any task starts
    n_parts = part_count(size, cfg, parts)
    piece = segy.PIECE_BYTES
    runs = split(-(-size // piece), n_parts)
    return [{"url": url, "key": key, "staging": staging_url(data_root, key), "size": size, "parts": n_parts,
             "scan_part": k, "scan_parts": len(runs), "start": lo * piece, "stop": min(size, hi * piece)}
            for k, (lo, hi) in enumerate(runs)]


def scan_part(scan: dict[str, Any], cfg: IngestConfig) -> dict[str, Any]:
    """Digest the pieces of ``scan``'s byte range and keep the header fields of its traces, into
    ``<staging>/scan-<k>.npz``; returns ``scan`` with the pieces' digests (an MDIO store's: with its
    survey_id, :func:`sfm.ingest.mdio_register.scan_to_staging`)."""
    if scan.get("kind") == "mdio":
        return scan_to_staging(scan, cfg)
    layout = read_layout(scan["url"], cfg.endian)
    fields = header_fields_needed(cfg.iline_byte or None, cfg.xline_byte or None)
    pieces, values = scan_range(layout, fields, scan["start"], scan["stop"], ingest_threads(cfg))
    buf = io.BytesIO()
    np.savez(buf, **{f"{byte}_{width}": v for (byte, width), v in values.items()})
    storage.write_bytes(storage.join(scan["staging"], f"scan-{scan['scan_part']}.npz"), buf.getvalue())
    return {**scan, "pieces": pieces}


def _headers(scans: list[dict[str, Any]]) -> dict[tuple[int, int], np.ndarray]:
    """The header fields of every trace, from the scan parts' files in order."""
    parts = []
    for scan in scans:
        with np.load(io.BytesIO(storage.read_bytes(storage.join(scan["staging"], f"scan-{scan['scan_part']}.npz")))) as z:
            parts.append({tuple(int(v) for v in name.split("_")): z[name] for name in z.files})
    return {field: np.concatenate([p[field] for p in parts]) for field in parts[0]}


# ------------------------------------------------------------------------------------------------
# plan, write, publish


def plan_writes(scans: list[dict[str, Any]], data_root: str, cfg: IngestConfig) -> list[dict[str, Any]]:
    """After every scan part of one survey: its identity, geometry and store arrays, and its write parts
    (whole shard rows each; small dicts for :func:`write_part`). A survey already published gives one
    part with ``rows`` None, which writes nothing."""
    from sfm.ingest.survey import _store_attrs, survey_name, survey_store_url

    scans = sorted(scans, key=lambda s: s["scan_part"])
    first = scans[0]
    if [s["scan_part"] for s in scans] != list(range(first["scan_parts"])):
        raise SFMError(f"{first['url']}: scan parts {[s['scan_part'] for s in scans]} of {first['scan_parts']} "
                       "arrived; rerun the flow with `resume` to scan the missing ones")
    if first.get("kind") == "mdio":  # read in place: one part that writes nothing; the publish step registers
        return [{"url": first["url"], "staging": first["staging"], "survey_id": first["survey_id"], "kind": "mdio",
                 "part": 0, "write_parts": 1, "rows": None}]
    digest = combine_pieces([p for s in scans for p in s["pieces"]])
    survey_id = digest[:16]
    base = {"url": first["url"], "staging": first["staging"], "survey_id": survey_id}
    if manifest.get_row(data_root, survey_id) is not None:
        return [{**base, "part": 0, "write_parts": 1, "rows": None}]
    url, opts = first["url"], cfg
    layout = read_layout(url, opts.endian)
    headers = _headers(scans)
    il_byte, xl_byte = opts.iline_byte or None, opts.xline_byte or None
    geometry = build_geometry(layout, headers, il_byte, xl_byte, opts.max_sparsity)
    store_url = survey_store_url(data_root, survey_id)
    attrs = _store_attrs(survey_id, survey_name(url), url, first["size"], digest, layout, geometry, opts)
    group, plan = prepare_store(store_url, layout, geometry, headers, opts)
    cells = geometry.cell_traces()
    b_il = plan.bricks[0]
    runs = split(-(-plan.shape[0] // b_il), first["parts"])
    for k, (lo, hi) in enumerate(runs):
        buf = io.BytesIO()
        np.save(buf, cells[lo * b_il : hi * b_il])
        storage.write_bytes(storage.join(first["staging"], f"cells-{k}.npy"), buf.getvalue())
    survey = {"store_url": store_url, "attrs": attrs, "plan": plan.to_dict(), "metadata": group.metadata(),
              "inlines": geometry.inlines.tolist(), "crosslines": geometry.crosslines.tolist(),
              "write_parts": len(runs)}
    storage.write_bytes(storage.join(first["staging"], "survey.json"), json.dumps(survey).encode())
    return [{**base, "part": k, "write_parts": len(runs), "rows": [lo, hi]} for k, (lo, hi) in enumerate(runs)]


def _survey(staging: str) -> dict[str, Any]:
    return json.loads(storage.read_bytes(storage.join(staging, "survey.json")))


def write_part(part: dict[str, Any], cfg: IngestConfig, progress: bool = False) -> dict[str, Any]:
    """Write the shards of ``part``'s shard rows and keep their statistics in ``<staging>/moments-<k>.npz``
    (written last: present means the part is complete). Returns ``part`` with its count of brick columns."""
    if part["rows"] is None:
        return {**part, "columns": 0}
    survey = _survey(part["staging"])
    plan = _Plan.from_dict(survey["plan"])
    group = GroupWriter.from_metadata(survey["store_url"], survey["metadata"])
    layout = read_layout(part["url"], cfg.endian)
    b_il = plan.bricks[0]
    lo, hi = part["rows"]
    cells = np.load(io.BytesIO(storage.read_bytes(storage.join(part["staging"], f"cells-{part['part']}.npy"))))
    columns = Columns(cells, lo * b_il, np.asarray(survey["inlines"]), np.asarray(survey["crosslines"]))
    units = [u for u in plan.units if lo * b_il <= u[0] < hi * b_il]
    moments = write_columns(group, plan, layout, columns, units, cfg, progress)
    storage.write_bytes(storage.join(part["staging"], f"moments-{part['part']}.npz"), moments_to_bytes(moments))
    return {**part, "columns": len(units)}


def publish_parts(parts: list[dict[str, Any]], data_root: str) -> dict[str, Any]:
    """After every write part of one survey: merge their statistics in order, write the root ``zarr.json``,
    then publish the manifest row (last) and remove the staging folder. Returns the row with ``status``
    ("ingested", or "exists" for a survey published before). Refuses while a part's statistics are missing."""
    from sfm.ingest.survey import manifest_row

    first = parts[0]
    if first.get("kind") == "mdio":
        row = publish_from_staging(first, data_root)
        _remove_staging(first["staging"])
        return row
    if first["rows"] is None:
        return {**manifest.get_row(data_root, first["survey_id"]), "status": "exists"}
    survey = _survey(first["staging"])
    moments = []
    for k in range(survey["write_parts"]):
        url = storage.join(first["staging"], f"moments-{k}.npz")
        if not storage.exists(url):
            raise SFMError(f"{first['url']}: part {k + 1} of {survey['write_parts']} was not written (no "
                           f"{url}); rerun the flow with `resume` to write it before the survey is published")
        moments.extend(moments_from_bytes(storage.read_bytes(url)))
    plan = _Plan.from_dict(survey["plan"])
    group = GroupWriter.from_metadata(survey["store_url"], survey["metadata"])
    attrs = survey["attrs"]
    stats = finish_store(group, plan, moments, attrs)
    row = manifest_row(attrs, survey["store_url"], stats)
    status = "ingested" if manifest.publish(data_root, row) else "exists"  # last: the survey becomes visible now
    _remove_staging(first["staging"])
    return {**(row if status == "ingested" else manifest.get_row(data_root, row["survey_id"])), "status": status}


def _remove_staging(staging: str) -> None:
    """Remove one survey's staging folder (and, on a local disk, the parts folder once it is empty)."""
    storage.remove(staging)
    if not storage.is_s3(staging):
        import os

        parent = os.path.dirname(staging)
        if os.path.isdir(parent) and not os.listdir(parent):
            with contextlib.suppress(OSError):  # another survey's parts arrived meanwhile
                os.rmdir(parent)
