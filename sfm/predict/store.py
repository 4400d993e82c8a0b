"""The prediction store: a Zarr v3 group on the survey's grid, written in parts and published atomically.

Layout (``sfm/data_contracts/prediction_store.schema.json``): the predicted variable, ``probability`` (float32:
[inline, crossline, sample] for a binary task, the probability of class 1; [inline, crossline, sample,
class] with several classes) or ``classes`` (uint8 [inline, crossline, sample]), sharded like the survey's
amplitude (the survey's bricks, shards of whole bricks along the samples), 0 at dead traces; beside it copies
of the survey's ``trace_mask``, line numbers, sample axis and CDP coordinates, so ``xarray.open_zarr`` shows
the prediction with the survey's coordinates. With ``layout = "mdio"`` the store also carries what MDIO 1.1.3
reads and exports (:mod:`sfm.formats.mdio_layout`: the template's attributes with the predicted variable as
the default, ``statsV1``, the survey's ``segy_file_header`` and trace ``headers``).

Atomicity, as the ingest's parts (:mod:`sfm.ingest.parts`): the plan step creates the arrays (metadata
and small arrays) and stages the plan under ``<out>/.predict/``; each part writes the shards of its own
shard rows (no shard has two writers, a rerun writes the same bytes) and then its marker
``.predict/part-<k>.json`` with its statistics; the publish step refuses while a marker is missing,
then writes the root ``zarr.json`` (attributes and consolidated metadata) last, the one object that makes
the store a store: before it nothing opens. A store whose root ``zarr.json`` exists is published, and a
new prediction into it is refused.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sfm import storage
from sfm.errors import SFMError

STAGING = ".predict"
PREDICTION_VERSION = 1
COPIED = ("trace_mask", "inline", "crossline", "cdp_x", "cdp_y", "sample", "time", "depth")  # small arrays
SAMPLE_AXES = ("sample", "time", "depth")


@dataclass
class PredictionPlan:
    """Everything the parts and the publish step of one prediction need, staged as ``.predict/plan.json``."""

    out: str  # the prediction store's URL
    survey: str  # the survey store's URL
    model: str  # the task model resolved: NAME:vN, or its URL
    data_root: str  # where NAME is registered
    variable: str  # "probability" or "classes"
    shape: tuple[int, ...]  # the variable's shape
    bricks: tuple[int, ...]
    shards: tuple[int, ...]
    rows: list[tuple[int, int]]  # each part's shard rows [lo, hi)
    settings: dict[str, Any]  # overlap, mirror, batch_size, layout, segy, crop, channels
    identity: str  # what must match for a rerun to reuse finished parts
    metadata: dict[str, str] = field(default_factory=dict)  # every zarr.json but the root's (GroupWriter)
    attrs: dict[str, Any] = field(default_factory=dict)  # root attributes but the statistics

    def inlines(self, part: int) -> tuple[int, int]:
        """The inlines [lo, hi) part ``part`` writes."""
        lo, hi = self.rows[part]
        return lo * self.bricks[0], min(self.shape[0], hi * self.bricks[0])

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "PredictionPlan":
        d = json.loads(data)
        tuples = {k: tuple(d[k]) for k in ("shape", "bricks", "shards")}
        return cls(**{**d, **tuples, "rows": [tuple(r) for r in d["rows"]]})

    def group(self):
        """The writer of the store's group, whose arrays the plan step made."""
        from sfm.formats.zarr_writer import GroupWriter

        return GroupWriter.from_metadata(self.out, self.metadata)


def staging(out: str) -> str:
    return storage.join(out, STAGING)


def published(out: str) -> bool:
    """Whether a store is published at ``out`` (its root ``zarr.json`` exists)."""
    return storage.exists(storage.join(out, "zarr.json"))


def staged_plan(out: str) -> PredictionPlan | None:
    url = storage.join(staging(out), "plan.json")
    return PredictionPlan.from_json(storage.read_bytes(url)) if storage.exists(url) else None


def marker_url(plan: PredictionPlan, part: int) -> str:
    return storage.join(staging(plan.out), f"part-{part}.json")


def part_done(plan: PredictionPlan, part: int) -> bool:
    return storage.exists(marker_url(plan, part))


def mark_done(plan: PredictionPlan, part: int, summary: dict[str, Any]) -> None:
    """Written last by a part: its shards are all written."""
    storage.write_bytes(marker_url(plan, part), json.dumps(summary, sort_keys=True).encode())


# ---- the plan step: arrays and small arrays ---------------------------------------------------------


def open_source(survey: str):
    """The survey store's zarr group and its attributes (an MDIO reference's MDIO store too, or None)."""
    import zarr

    from sfm.storage.resilient_store import open_survey_store

    group = zarr.open_group(open_survey_store(survey), mode="r")
    attrs = dict(group.attrs)
    mdio = None
    if attrs.get("source_kind") == "mdio":
        mdio = zarr.open_group(open_survey_store(attrs["amplitude_url"]), mode="r")
    return group, attrs, mdio


def output_axis(group, attrs: dict, layout: str) -> str:
    """The prediction's sample axis name: the survey's (sample in the sfm layout, time or depth in the mdio
    layout and MDIO references), time or depth in the mdio layout."""
    axis = str(attrs["sample_axis"]) if attrs.get("source_kind") == "mdio" else \
        next(name for name in SAMPLE_AXES if name in group)
    return ("depth" if axis == "depth" else "time") if layout == "mdio" else axis


def create_arrays(plan: PredictionPlan):
    """Make the store's arrays in memory (the predicted variable's metadata, copies of the survey's small
    arrays; with the mdio layout MDIO's header arrays, their chunks copied) and send them, all but the root
    ``zarr.json``. Returns the GroupWriter."""
    from zarr.codecs import BloscCodec

    from sfm.formats.store_layout import AMPLITUDE_CODEC
    from sfm.formats.zarr_writer import GroupWriter

    group, _, mdio = open_source(plan.survey)
    mdio_layout = plan.settings["layout"] == "mdio"
    out_axis = plan.settings["axis"]
    writer = GroupWriter(plan.out)
    dims = ["inline", "crossline", out_axis] + (["class"] if len(plan.shape) == 4 else [])
    long_name = {"probability": "probability of class 1" if len(plan.shape) == 3 else "probability of each class",
                 "classes": "predicted class"}[plan.variable]
    writer.create_array(plan.variable, shape=plan.shape, chunks=plan.bricks, dtype=_dtype(plan.variable),
                        shards={"shape": plan.shards, "index_location": "start"},
                        compressors=BloscCodec(**AMPLITUDE_CODEC), fill_value=0, dimension_names=dims,
                        attributes={"coordinates": "cdp_x cdp_y", "long_name": long_name})
    for name in COPIED:
        source = group if name in group else mdio if mdio is not None and name in mdio else None
        if source is None:
            continue
        arr = source[name]
        values = np.asarray(arr[...])
        new_dims = [out_axis if d in SAMPLE_AXES else d for d in (arr.metadata.dimension_names or ())]
        writer.create_array(out_axis if name in SAMPLE_AXES else name, values, shape=values.shape,
                            chunks=values.shape, dtype=values.dtype, fill_value=0, dimension_names=new_dims,
                            attributes=dict(arr.attrs),
                            compressors=BloscCodec(cname="zstd", clevel=3, shuffle="shuffle"))
    if mdio_layout:
        _create_headers(writer, group if "headers" in group else mdio, plan)
    writer.put(layout_of=[plan.variable])
    if mdio_layout:
        _copy_header_chunks(writer, group if "headers" in group else mdio)
    return writer


def _dtype(variable: str) -> np.dtype:
    return np.dtype("float32") if variable == "probability" else np.dtype("uint8")


def _create_headers(writer, source, plan: PredictionPlan) -> None:
    """MDIO's ``segy_file_header`` and ``headers`` (metadata; the chunks follow the put), from ``source``."""
    import warnings

    from zarr.codecs import BloscCodec, ZstdCodec
    from zarr.errors import UnstableSpecificationWarning

    from sfm.formats.mdio_layout import HEADER_CODEC

    if source is None or "headers" not in source or "segy_file_header" not in source:
        raise SFMError(f"--layout mdio needs the survey's trace headers, and {plan.survey} has none (ingested with "
                       "--layout sfm); re-ingest it with --layout mdio, or predict with --layout sfm (and --segy "
                       "for a SEG-Y with the source's headers)")
    headers = source["headers"]
    with warnings.catch_warnings():  # structured and fixed-length string types have no Zarr v3 spec yet; MDIO uses them
        warnings.simplefilter("ignore", category=UnstableSpecificationWarning)
        writer.create_array("segy_file_header", shape=(), dtype=np.dtype("<U1"), fill_value="",
                            compressors=ZstdCodec(level=0), attributes=dict(source["segy_file_header"].attrs))
        writer.create_array("headers", shape=headers.shape, chunks=headers.chunks, dtype=headers.dtype,
                            compressors=BloscCodec(**HEADER_CODEC), dimension_names=["inline", "crossline"],
                            attributes={"coordinates": "cdp_x cdp_y"})


def _copy_header_chunks(writer, source) -> None:
    """Copy the survey's trace header chunks, one at a time (memory: one chunk)."""
    headers = source["headers"]
    a, b = headers.chunks
    for i in range(0, headers.shape[0], a):
        for j in range(0, headers.shape[1], b):
            writer.write_chunk("headers", (i, j), np.asarray(headers[i:i + a, j:j + b]))


def root_attributes(plan: PredictionPlan, survey_attrs: dict, model: dict) -> dict[str, Any]:
    """The store's root attributes but ``stats`` (prediction_store.schema.json)."""
    keep = ("survey_id", "source_url", "sample_interval_us", "sample_start_ms", "inline_step", "crossline_step",
            "iline_byte", "xline_byte")
    name = str(survey_attrs.get("survey_name") or survey_attrs.get("name") or survey_attrs.get("survey_id", ""))
    return {"sfm_prediction_version": PREDICTION_VERSION, "name": f"{name} {plan.variable}",
            "variable": plan.variable, "shape": list(plan.shape), "sample_axis": plan.settings["axis"],
            "survey": {"store_url": plan.survey, "name": name,
                       **{k: survey_attrs[k] for k in keep if k in survey_attrs}},
            "model": model, "prediction": {k: plan.settings[k] for k in ("overlap", "mirror", "crop", "channels",
                                                                         "threshold") if k in plan.settings},
            "store": {"bricks": list(plan.bricks), "shards": list(plan.shards), "shard_index": "start",
                      "dtype": str(_dtype(plan.variable))}}


# ---- the publish step ------------------------------------------------------------------------------------


def merged_stats(plan: PredictionPlan) -> dict[str, Any]:
    """The statistics of the predicted values over the live traces, from every part's marker (in part order);
    SFMError naming the first part not written."""
    from sfm.formats.moments import Moments

    total, counts = Moments(), None
    for k in range(len(plan.rows)):
        if not part_done(plan, k):
            raise SFMError(f"prediction {plan.out}: part {k + 1} of {len(plan.rows)} was not written; run it "
                           f"(`sfm predict ... --parts {len(plan.rows)} --part {k}`, or the flow's `resume`) "
                           "before the store is published")
        summary = json.loads(storage.read_bytes(marker_url(plan, k)))
        total.merge(Moments(**summary["moments"]))
        if summary.get("class_counts") is not None:
            counts = np.add(counts if counts is not None else 0, summary["class_counts"])
    std = float(np.sqrt(total.m2 / total.n)) if total.n else 0.0
    stats = {"count": int(total.n), "mean": float(total.mean) if total.n else 0.0, "std": std,
             "min": float(total.min) if total.n else 0.0, "max": float(total.max) if total.n else 0.0}
    if counts is not None:
        stats["class_counts"] = [int(c) for c in counts]
    return {"stats": stats, "m2": float(total.m2)}


def publish(plan: PredictionPlan) -> dict[str, Any]:
    """Write the root ``zarr.json`` (the statistics merged from the parts' markers), last; then remove the
    staging folder. Returns the root attributes."""
    from sfm.formats import mdio_layout
    from sfm.formats.contracts import validate

    merged = merged_stats(plan)
    stats = merged["stats"]
    group = plan.group()
    attrs = {**plan.attrs, "stats": stats}
    written = attrs
    if plan.settings["layout"] == "mdio":
        group.update_attributes(plan.variable, {"statsV1": mdio_layout.stats_v1(
            stats["count"], stats["mean"], merged["m2"], stats["min"], stats["max"])})
        written = mdio_layout.root_attributes(attrs, plan.settings["axis"])
        written["attributes"]["defaultVariableName"] = plan.variable
    written = json.loads(json.dumps(written, sort_keys=True))  # the same bytes whichever task publishes
    validate("prediction_store", written, f"prediction store {plan.out}")
    if not storage.is_s3(plan.out):  # what killed writers left (never zarr keys, but not part of the store)
        from pathlib import Path

        from sfm.formats.zarr_writer import remove_stale_partials

        remove_stale_partials(Path(storage.normalize(plan.out)))
    group.finish(written)
    storage.remove(staging(plan.out))
    return written
