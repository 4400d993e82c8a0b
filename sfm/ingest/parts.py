"""One survey's ingest as steps: plan, write parts, publish. One task runs them in one process
(:func:`sfm.ingest.survey.ingest_survey`: the one-part case); the flow runs each in its own task:

    scans = plan_scans(url, key, data_root, cfg)   # byte ranges: whole 4 GiB pieces of the file
    scan_part(scan)                                # per task: piece digests + trace header fields
    parts = plan_writes(scans, data_root, cfg)     # one task: survey_id, geometry, the store's arrays
    write_part(part, cfg)                          # per task: the shards of whole shard rows
    publish_parts(parts, data_root)                # one task: statistics, root zarr.json, manifest row

The steps themselves, in memory: :func:`plan_survey` (geometry, attributes, the store's arrays, the
write parts), :func:`write_rows` (one write part's shards and statistics) and :func:`publish_survey`
(statistics merged, root ``zarr.json``, manifest row, last). The flow's task functions only stage what
the next task needs.

The store is the same, byte for byte, however many parts write it: every part writes the shards of its
own inlines (whole rows of shards, so no shard has two writers); the statistics of every brick column
are kept apart and merged in the publish step in the store's column order
(:func:`sfm.ingest.cube_writer.finish_store`); the content digest combines the pieces' digests in file
order (:func:`sfm.formats.segy.combine_pieces`), so neither depends on the number of parts.

What the tasks hand each other lives under ``<data_root>/surveys/ingest-parts/<key>/`` (the header
fields, each part's cells and statistics, the survey's plan: object writes, each atomic) and is
removed once the survey is published; the tasks themselves pass only names and numbers. A part that
was killed is simply run again: it rewrites the same shards with the same bytes. The survey stays
invisible until the publish step writes its manifest row, last, and that step refuses to publish while
any part's statistics are missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from sfm import storage
from sfm.config import IngestConfig
from sfm.errors import SFMError
from sfm.formats import manifest
from sfm.ingest.cube_writer import Columns, StorePlan, finish_store, ingest_threads, prepare_store, write_columns
from sfm.formats.moments import Moments, moments_from_bytes, moments_to_bytes
from sfm.ingest.mdio_register import publish_from_staging, scan_to_staging
from sfm.formats.store_layout import STORE_VERSION, split_runs
from sfm.formats import segy
from sfm.formats.segy import (SegyLayout, checksum_fields, combine_pieces, header_fields_needed, read_layout,
                             scan_range, text_header)
from sfm.formats.segy_geometry import SurveyGeometry, build_geometry
from sfm.formats.zarr_writer import GroupWriter


def staging_url(data_root: str, key: str) -> str:
    """Where the parts of one survey's ingest leave what the next step reads (``key``: one per ingest)."""
    return storage.join(data_root, "surveys", "ingest-parts", key)


def part_count(size: int, cfg: IngestConfig, parts: int = 0) -> int:
    """Tasks to split a ``size``-byte survey into: ``parts`` if given, else ``cfg.parts``, else one per
    ``cfg.part_gb`` GB (at least one)."""
    wanted = int(parts) or int(cfg.parts)
    return wanted if wanted > 0 else max(1, math.ceil(size / (cfg.part_gb * 1e9)))



# ------------------------------------------------------------------------------------------------
# the steps


@dataclass
class SurveyPlan:
    """What the plan step decided for one SEG-Y survey: where its store goes (``store_url``), its root
    attributes less the statistics (``attrs``), its cube (``store``), every ``zarr.json`` of its arrays
    (``metadata``: made and sent already, all but the root's), its line numbers and its write parts, whole
    shard rows [lo, hi) each (``rows``). ``cells`` [IL, XL] (trace numbers, -1: hole) stays with the process
    that planned; the flow's write tasks read their own rows' cells from staging."""

    url: str
    store_url: str
    attrs: dict[str, Any]
    store: StorePlan
    metadata: dict[str, str]
    inlines: list[int]
    crosslines: list[int]
    rows: list[tuple[int, int]]
    cells: np.ndarray | None = None

    def part_cells(self, part: int) -> np.ndarray:
        """[IL', XL] the cells of write part ``part``'s inlines."""
        lo, hi = (r * self.store.bricks[0] for r in self.rows[part])
        return self.cells[lo:hi]

    def to_json(self) -> bytes:
        """The plan but its cells, for :meth:`from_json` in another task."""
        kept = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("store", "cells")}
        return json.dumps({**kept, "store": self.store.to_dict()}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "SurveyPlan":
        plan = json.loads(data)
        return cls(**{**plan, "store": StorePlan.from_dict(plan["store"]), "rows": [tuple(r) for r in plan["rows"]]})

    def group(self) -> GroupWriter:
        """The writer of the store's group, whose arrays the plan step made."""
        return GroupWriter.from_metadata(self.store_url, self.metadata)


def survey_name(url: str) -> str:
    """The survey's display name: the file name without its SEG-Y suffix. Control characters (a
    newline in a landing file's name would forge log lines) become ``_``."""
    base = str(url).rstrip("/").rsplit("/", 1)[-1]
    for suffix in (".sgy", ".segy", ".SGY", ".SEGY"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
    base = "".join("_" if ord(ch) < 32 or ord(ch) == 127 else ch for ch in base)
    return base or "survey"


def store_attrs(url: str, digest: str, layout: SegyLayout, geometry: SurveyGeometry, cfg: IngestConfig
                ) -> dict[str, Any]:
    """The store's root attributes (sfm/data_contracts/survey_store.schema.json) before the statistics."""
    text, encoding = text_header(layout)
    return {
        "sfm_store_version": STORE_VERSION, "survey_id": digest[:16], "name": survey_name(url), "source_url": url,
        "source_size": layout.size, **checksum_fields(layout.size, digest),
        "iline_byte": geometry.iline_byte, "xline_byte": geometry.xline_byte,
        "byte_locations": geometry.extra["byte_locations"],
        "byte_pairs_rejected": geometry.extra["byte_pairs_rejected"],
        "endian": layout.endian, "endian_source": layout.endian_source, "segy_revision": layout.revision,
        "sample_format": layout.sample_format, "sample_format_name": layout.format_name,
        "sample_interval_us": layout.sample_interval_us, "sample_start_ms": geometry.extra["sample_start_ms"],
        "text_header": text, "text_encoding": encoding,
        "shape": [*geometry.shape, layout.samples], "live_traces": int(layout.n_traces),
        "inline_step": geometry.extra["inline_step"], "crossline_step": geometry.extra["crossline_step"],
        "dtype": cfg.dtype, "nonfinite_policy": cfg.nonfinite,
    }


def header_fields(cfg: IngestConfig) -> list[tuple[int, int]]:
    """The trace header fields the scan keeps: those of ``cfg``'s byte locations, or of every common pair."""
    return header_fields_needed(cfg.iline_byte or None, cfg.xline_byte or None)


def plan_survey(url: str, layout: SegyLayout, headers: dict[tuple[int, int], np.ndarray], digest: str,
                data_root: str, cfg: IngestConfig, parts: int = 1) -> SurveyPlan:
    """The plan step of the SEG-Y survey at ``url`` whose content digest is ``digest`` and whose scan kept the
    trace header fields ``headers`` {(byte, width): [T]}: its grid (refusing what cannot be stored
    faithfully), its attributes and its store's arrays (created and sent: :func:`prepare_store`), in at
    most ``parts`` write parts of whole shard rows."""
    geometry = build_geometry(layout, headers, cfg.iline_byte or None, cfg.xline_byte or None, cfg.max_sparsity)
    store_url = manifest.survey_store_url(data_root, digest[:16])
    attrs = store_attrs(url, digest, layout, geometry, cfg)
    group, store = prepare_store(store_url, layout, geometry, headers, cfg)
    rows = split_runs(-(-store.shape[0] // store.bricks[0]), parts)
    return SurveyPlan(url, store_url, attrs, store, group.metadata(), geometry.inlines.tolist(),
                      geometry.crosslines.tolist(), rows, geometry.cell_traces())


def write_rows(survey: SurveyPlan, part: int, cells: np.ndarray, layout: SegyLayout, cfg: IngestConfig,
               progress: bool = False) -> list[Moments]:
    """Write the shards of write part ``part`` of ``survey``, whose cells [IL', XL] are ``cells``
    (:meth:`SurveyPlan.part_cells`), on all cores; the statistics of its brick columns, in the store's order."""
    lo, hi = (r * survey.store.bricks[0] for r in survey.rows[part])
    columns = Columns(cells, lo, np.asarray(survey.inlines), np.asarray(survey.crosslines))
    units = [u for u in survey.store.units if lo <= u[0] < hi]
    return write_columns(survey.group(), survey.store, layout, columns, units, cfg, progress)


def publish_survey(survey: SurveyPlan, moments: list[Moments], data_root: str) -> tuple[dict[str, Any], bool]:
    """The publish step: merge the statistics of every brick column (``moments``, in the store's order), write
    the root ``zarr.json``, then the manifest row, last (:func:`sfm.formats.manifest.publish_or_get`)."""
    stats = finish_store(survey.group(), survey.store, moments, survey.attrs)
    return manifest.publish_or_get(data_root, manifest.make_row(survey.attrs, survey.store_url, stats))


# ------------------------------------------------------------------------------------------------
# the flow's tasks: scan


def plan_scans(url: str, key: str, data_root: str, cfg: IngestConfig, parts: int = 0, kind: str = "segy"
               ) -> list[dict[str, Any]]:
    """The scan parts of one survey: whole :data:`~sfm.formats.segy.PIECE_BYTES` pieces of the file each, at
    most ``part_count`` of them. Each is a small dict for :func:`scan_part`. An MDIO store (``kind`` "mdio")
    has one scan part, its identity and statistics, and nothing to write."""
    if kind == "mdio":
        return [{"url": url, "key": key, "staging": staging_url(data_root, key), "kind": "mdio", "scan_part": 0,
                 "scan_parts": 1}]

    size = read_layout(url, cfg.endian).size  # refuses a file that is not SEG-Y before any task starts
    n_parts = part_count(size, cfg, parts)
    piece = segy.PIECE_BYTES
    runs = split_runs(-(-size // piece), n_parts)
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
    pieces, values = scan_range(layout, header_fields(cfg), scan["start"], scan["stop"], ingest_threads(cfg))
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
# the flow's tasks: plan, write, publish


def plan_writes(scans: list[dict[str, Any]], data_root: str, cfg: IngestConfig) -> list[dict[str, Any]]:
    """After every scan part of one survey: :func:`plan_survey`, its plan and each write part's cells staged;
    the write parts (small dicts for :func:`write_part`). A survey already published gives one part with
    ``rows`` None, which writes nothing."""
    scans = sorted(scans, key=lambda s: s["scan_part"])
    first = scans[0]
    if [s["scan_part"] for s in scans] != list(range(first["scan_parts"])):
        raise SFMError(f"{first['url']}: scan parts {[s['scan_part'] for s in scans]} of {first['scan_parts']} "
                       "arrived; rerun the flow with `resume` to scan the missing ones")
    if first.get("kind") == "mdio":  # read in place: one part that writes nothing; the publish step registers
        return [{"url": first["url"], "staging": first["staging"], "survey_id": first["survey_id"], "kind": "mdio",
                 "part": 0, "write_parts": 1, "rows": None}]
    digest = combine_pieces([p for s in scans for p in s["pieces"]])
    base = {"url": first["url"], "staging": first["staging"], "survey_id": digest[:16]}
    if manifest.get_row(data_root, digest[:16]) is not None:
        return [{**base, "part": 0, "write_parts": 1, "rows": None}]
    layout = read_layout(first["url"], cfg.endian)
    survey = plan_survey(first["url"], layout, _headers(scans), digest, data_root, cfg, first["parts"])
    for k in range(len(survey.rows)):
        buf = io.BytesIO()
        np.save(buf, survey.part_cells(k))
        storage.write_bytes(storage.join(first["staging"], f"cells-{k}.npy"), buf.getvalue())
    storage.write_bytes(storage.join(first["staging"], "survey.json"), survey.to_json())
    return [{**base, "part": k, "write_parts": len(survey.rows), "rows": list(rows)}
            for k, rows in enumerate(survey.rows)]


def _survey(staging: str) -> SurveyPlan:
    return SurveyPlan.from_json(storage.read_bytes(storage.join(staging, "survey.json")))


def write_part(part: dict[str, Any], cfg: IngestConfig, progress: bool = False) -> dict[str, Any]:
    """Write the shards of ``part``'s shard rows (:func:`write_rows`) and keep their statistics in
    ``<staging>/moments-<k>.npz`` (written last: present means the part is complete). Returns ``part`` with
    its count of brick columns."""
    if part["rows"] is None:
        return {**part, "columns": 0}
    cells = np.load(io.BytesIO(storage.read_bytes(storage.join(part["staging"], f"cells-{part['part']}.npy"))))
    layout = read_layout(part["url"], cfg.endian)
    moments = write_rows(_survey(part["staging"]), part["part"], cells, layout, cfg, progress)
    storage.write_bytes(storage.join(part["staging"], f"moments-{part['part']}.npz"), moments_to_bytes(moments))
    return {**part, "columns": len(moments)}


def publish_parts(parts: list[dict[str, Any]], data_root: str) -> dict[str, Any]:
    """After every write part of one survey: :func:`publish_survey` from their staged statistics, then remove
    the staging folder. Returns the row with ``status`` ("ingested", or "exists" for a survey published
    before). Refuses while a part's statistics are missing."""
    first = parts[0]
    if first.get("kind") == "mdio":
        row = publish_from_staging(first, data_root)
        _remove_staging(first["staging"])
        return row
    if first["rows"] is None:
        return {**manifest.get_row(data_root, first["survey_id"]), "status": "exists"}
    survey = _survey(first["staging"])
    moments = []
    for k in range(len(survey.rows)):
        url = storage.join(first["staging"], f"moments-{k}.npz")
        if not storage.exists(url):
            raise SFMError(f"{first['url']}: part {k + 1} of {len(survey.rows)} was not written (no "
                           f"{url}); rerun the flow with `resume` to write it before the survey is published")
        moments.extend(moments_from_bytes(storage.read_bytes(url)))
    row, published = publish_survey(survey, moments, data_root)
    _remove_staging(first["staging"])
    return {**row, "status": "ingested" if published else "exists"}


def _remove_staging(staging: str) -> None:
    """Remove one survey's staging folder (and, on a local disk, the parts folder once it is empty)."""
    storage.remove(staging)
    if not storage.is_s3(staging):

        parent = os.path.dirname(staging)
        if os.path.isdir(parent) and not os.listdir(parent):
            with contextlib.suppress(OSError):  # another survey's parts arrived meanwhile
                os.rmdir(parent)
