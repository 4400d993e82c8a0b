"""SEG-Y -> Zarr v3 survey store, published atomically through the manifest, in one task.

One call ingests one survey, running the steps of :mod:`sfm.ingest.parts` as one part:

1. read the layout from the binary header, then one parallel pass over the file digests its content
   (``survey_id``) and reads the trace header fields; a survey already in the manifest is a no-op.
   An ``s3://`` file is read where it is, by ranged GETs (:mod:`sfm.storage.ranged_file`), never copied
   to local disk;
2. plan (:func:`~sfm.ingest.parts.plan_survey`): build the full (inline, crossline) grid, refusing what
   cannot be stored faithfully, and create the store's arrays;
3. write (:func:`~sfm.ingest.parts.write_rows`): stream the traces, one column of bricks (``chunk``
   inlines x ``chunk`` crosslines x all samples) at a time, on all cores: read runs of consecutive traces
   into a small per-thread buffer, convert them to float32 and accumulate the statistics while they are
   in cache, place them into the column, laid out brick after brick so the codec reads each brick where
   it lies, then encode and write whole shards;
4. publish (:func:`~sfm.ingest.parts.publish_survey`): write the attributes (validated against
   ``sfm/data_contracts/survey_store.schema.json``) and the consolidated metadata, and only then the manifest row.

Memory is bounded by ``workers`` brick columns in flight, never by the file size. A store is
written in place at ``surveys/<survey_id>.zarr`` with atomic object writes; every attempt writes the
same bytes for the same file and options, so an interrupted ingest (no row: invisible) is completed by
a rerun, and two ingests of the same file at once cannot corrupt each other.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any

from sfm import storage
from sfm.config import IngestConfig
from sfm.errors import SFMError
from sfm.formats import manifest
from sfm.formats.contracts import read_store_attrs
from sfm.ingest.mdio_register import register_mdio
from sfm.ingest.mdio_source import is_mdio
from sfm.ingest.cube_writer import ingest_threads
from sfm.ingest.parts import header_fields, plan_survey, publish_survey, write_rows
from sfm.formats.segy import read_layout, scan_file


def ingest_survey(src_url: str, data_root: str, config: IngestConfig | None = None, *, progress: bool = False,
                  **settings: Any) -> dict[str, Any]:
    """Ingest one SEG-Y file into ``<data_root>/surveys/<survey_id>.zarr`` and publish it (an MDIO store is
    registered instead, read in place: :func:`sfm.ingest.mdio_register.register_mdio`).

    Returns the manifest row plus ``status`` ("ingested" or "exists"), ``message``, ``seconds``,
    ``mb_per_s`` and ``details`` (byte locations and how they were found, byte order, holes, ...).

    ``survey_id`` is the first 16 hex digits of the file's BLAKE3 content digest (what ``b3sum`` prints for
    files up to 4 GiB; see :data:`sfm.formats.segy.DIGEST_ALGORITHM` for larger ones), so the same bytes
    always give the same survey, wherever they come from; the store and the manifest row record the whole
    digest as ``checksum`` = "<algorithm>:<64 hex digits>".

    ``config`` (default: ``IngestConfig()``) says how; ``settings`` override its fields (e.g.
    ``chunk=64``; ``iline_byte=None`` means detect, as 0 does).
    """
    settings = {k: (0 if v is None and k in ("iline_byte", "xline_byte") else v) for k, v in settings.items()}
    opts = dataclasses.replace(config or IngestConfig(), **settings)
    opts.check()
    if is_mdio(src_url):  # an MDIO store is registered where it is: nothing copied
        return register_mdio(src_url, data_root, opts)
    t0 = time.perf_counter()
    data_root = storage.normalize(data_root)
    src_url = storage.normalize(src_url)
    # read where the file is (ranged GETs for s3://, no local copy): local disk stays untouched
    layout = read_layout(src_url, opts.endian)  # fails fast on files that are not SEG-Y
    t_scan = time.perf_counter()
    digest, headers = scan_file(layout, header_fields(opts), ingest_threads(opts))
    timings = {"open_s": t_scan - t0, "scan_s": time.perf_counter() - t_scan}
    existing = manifest.get_row(data_root, digest[:16])
    if existing is not None:
        return _exists(existing, src_url, t0)
    survey = plan_survey(src_url, layout, headers, digest, data_root, opts)  # one write part: every shard row
    t_write = time.perf_counter()
    timings["plan_s"] = t_write - t_scan - timings["scan_s"]
    try:
        moments = write_rows(survey, 0, survey.cells, layout, opts, progress)
        row, published = publish_survey(survey, moments, data_root)
        timings["write_s"] = time.perf_counter() - t_write
    except BaseException as err:
        if isinstance(err, Exception) and manifest.get_row(data_root, digest[:16]) is None:
            storage.remove(survey.store_url)  # a failed ingest leaves no store (a killed one leaves an invisible one)
        raise
    if not published:
        return _exists(row, src_url, t0, concurrent=True)
    return {**row, "status": "ingested", **_report(survey.attrs, timings, time.perf_counter() - t0)}



def survey_row(survey: str, data_root: str, cfg: IngestConfig | None = None) -> dict[str, Any]:
    """The manifest row of ``survey``: a published survey id, a survey store URL, or a source (SEG-Y, MDIO) to
    ingest into ``data_root`` first."""
    if manifest.is_id(survey):
        row = manifest.get_row(data_root, survey)
        if row is None:
            raise SFMError(f"survey {survey} is not published in {data_root}; ingest it or name its SEG-Y")
        return row
    if survey.rstrip("/").endswith(".zarr"):
        row = manifest.get_row(data_root, read_store_attrs(storage.normalize(survey))["survey_id"])
        if row is None:
            raise SFMError(f"survey store {survey} is not published in {data_root}; name its SEG-Y to ingest it")
        return row
    return ingest_survey(survey, data_root, cfg)


def survey_store(survey: str, data_root: str) -> str:
    """The survey store URL a prediction's ``--survey`` names (``sfm predict``, the predict flow): a survey id
    published in ``data_root``, a survey store's URL, or a SEG-Y file or MDIO store, ingested into ``data_root`` first
    as the fine-tune flow ingests (the same file twice is found, not copied: :func:`survey_row`); a line on stderr
    names what was ingested."""
    value = str(survey).strip()
    if manifest.is_id(value):
        row = manifest.get_row(data_root, value)
        if row is None:
            raise SFMError(f"--survey {value} is not a survey published in {data_root}; pass the --data-root it was "
                           "ingested into, its store URL, or its SEG-Y")
        return row["store_url"]
    url = storage.normalize(value)
    meta = storage.join(url, "zarr.json")
    if storage.exists(meta) and "survey_id" in (json.loads(storage.read_bytes(meta)).get("attributes") or {}):
        return url  # a survey store (in either layout)
    if not storage.exists(url) and not is_mdio(url):
        raise SFMError(f"--survey {value}: nothing there; give a survey id, a survey store URL, or a SEG-Y / MDIO "
                       "file to ingest")
    row = survey_row(url, data_root)
    print(f"sfm predict: survey {row['survey_id']} ({row['name']}) at {row['store_url']}", file=sys.stderr, flush=True)
    return row["store_url"]


def _report(attrs: dict[str, Any], timings: dict[str, float], seconds: float) -> dict[str, Any]:
    """``message``, ``details``, ``seconds`` and ``mb_per_s`` of an ingest that wrote the store of ``attrs``."""
    shape = attrs["shape"]
    holes = shape[0] * shape[1] - attrs["live_traces"]
    message = f"ingested {attrs['name']}: {shape[0]} x {shape[1]} x {shape[2]}, {holes} holes"
    if attrs["byte_locations"].startswith("detected ("):  # say when line numbers are really coordinates
        message += f", inline/crossline {attrs['byte_locations']}"
    if attrs["stats"]["nonfinite_replaced"]:
        message += f", {attrs['stats']['nonfinite_replaced']} NaN/inf samples replaced by 0"
    details = {k: attrs[k] for k in ("iline_byte", "xline_byte", "byte_locations", "endian", "endian_source",
                                     "sample_format_name", "text_encoding")}
    details["holes"] = int(holes)
    details["timings"] = {k: round(v, 3) for k, v in timings.items()}
    return {"message": message, "details": details, "seconds": seconds, "mb_per_s": attrs["source_size"] / 1e6 / seconds}


def _exists(row: dict[str, Any], src_url: str, t0: float, concurrent: bool = False) -> dict[str, Any]:
    how = "by an ingest running at the same time" if concurrent else "before"
    message = (f"{src_url}: same content as survey {row['survey_id']} ({row['name']}), published {how}; "
               "nothing to do")
    return {**row, "status": "exists", "message": message, "details": {}, "seconds": time.perf_counter() - t0,
            "mb_per_s": 0.0}


# ------------------------------------------------------------------------------------------------
# readers


def open_survey(store_url: str):
    """The survey as an xarray Dataset (lazy), after checking its attributes against the contract (an MDIO
    reference: the MDIO store it names, as MDIO wrote it)."""
    import xarray as xr

    attrs = read_store_attrs(store_url)
    options = {"zarr_format": 3}
    if attrs.get("source_kind") == "mdio":
        store_url = attrs["amplitude_url"]
        options["consolidated"] = False  # MDIO 1.x writes no consolidated metadata
    if storage.is_s3(store_url):
        return xr.open_zarr(store_url, storage_options=storage.s3fs_options(), **options)
    return xr.open_zarr(storage.normalize(store_url), **options)


__all__ = ["ingest_survey", "open_survey", "survey_row"]
