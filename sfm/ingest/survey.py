"""SEG-Y -> Zarr v3 survey store, published atomically through the manifest.

One call ingests one survey:

1. read the layout from the binary header, then one parallel pass over the file digests its content
   (``survey_id``) and reads the trace header fields; a survey already in the manifest is a no-op.
   An ``s3://`` file is read where it is, by ranged GETs (:mod:`sfm.storage.ranged_file`), never copied
   to local disk;
2. build the full (inline, crossline) grid, refusing what cannot be stored faithfully;
3. stream the traces, one column of bricks (``chunk`` inlines x ``chunk`` crosslines x all samples)
   at a time, on all cores: read runs of consecutive traces into a small per-thread buffer, convert
   them to float32 and accumulate the statistics while they are in cache, place them into the
   column, laid out brick after brick so the codec reads each brick where it lies, then encode and
   write whole shards;
4. write the attributes (validated against ``data_contracts/survey_store.schema.json``) and the
   consolidated metadata, and only then publish the manifest row.

Memory is bounded by ``workers`` brick columns in flight, never by the file size. A store is
written in place at ``surveys/<survey_id>.zarr`` with atomic object writes; every attempt writes the
same bytes for the same file and options, so an interrupted ingest (no row: invisible) is completed by
a rerun, and two ingests of the same file at once cannot corrupt each other.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import time
from typing import Any


from sfm import storage
from sfm.config import IngestConfig
from sfm.ingest import manifest
from sfm.ingest.contracts import read_store_attrs
from sfm.errors import SFMError
from sfm.ingest.segy import checksum_fields, header_fields_needed, read_layout, scan_file, text_header
from sfm.ingest.segy_geometry import build_geometry
from sfm.ingest.options import DEFAULT_CODEC, STORE_VERSION, ingest_threads  # noqa: F401  (DEFAULT_CODEC: the CLI's)
from sfm.ingest.cube_writer import write_store
from sfm.ingest.mdio_register import register_mdio
from sfm.ingest.mdio_source import is_mdio


def survey_store_url(data_root: str, survey_id: str) -> str:
    return storage.join(data_root, "surveys", f"{survey_id}.zarr")


def source_size(layout) -> int:
    """Bytes of the SEG-Y file (its layout accounts for every byte: a file that does not is refused)."""
    return int(layout.data_offset + layout.n_traces * layout.trace_bytes)


def survey_name(url: str) -> str:
    """The survey's display name: the file name without its SEG-Y suffix. Control characters (a
    newline in a landing file's name would forge log lines) become ``_``."""
    base = str(url).rstrip("/").rsplit("/", 1)[-1]
    for suffix in (".sgy", ".segy", ".SGY", ".SEGY"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
    base = "".join("_" if ord(ch) < 32 or ord(ch) == 127 else ch for ch in base)
    return base or "survey"


def ingest_survey(src_url: str, data_root: str, config: IngestConfig | None = None, *, progress: bool = False,
                  **settings: Any) -> dict[str, Any]:
    """Ingest one SEG-Y file into ``<data_root>/surveys/<survey_id>.zarr`` and publish it (an MDIO store is
    registered instead, read in place: :func:`sfm.ingest.mdio_register.register_mdio`).

    Returns the manifest row plus ``status`` ("ingested" or "exists"), ``message``, ``seconds``,
    ``mb_per_s`` and ``details`` (byte locations and how they were found, byte order, holes, ...).

    ``survey_id`` is the first 16 hex digits of the file's BLAKE3 content digest (what ``b3sum`` prints for
    files up to 4 GiB; see :data:`sfm.ingest.segy.DIGEST_ALGORITHM` for larger ones), so the same bytes
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
    il_byte, xl_byte = opts.iline_byte or None, opts.xline_byte or None
    t0 = time.perf_counter()
    data_root = storage.normalize(data_root)
    src_url = storage.normalize(src_url)
    name = survey_name(src_url)
    # read where the file is (ranged GETs for s3://, no local copy): local disk stays untouched
    layout = read_layout(src_url, opts.endian)  # fails fast on files that are not SEG-Y
    fields = header_fields_needed(il_byte, xl_byte)
    t_scan = time.perf_counter()
    digest, headers = scan_file(layout, fields, ingest_threads(opts))
    timings = {"open_s": t_scan - t0, "scan_s": time.perf_counter() - t_scan}
    survey_id = digest[:16]
    existing = manifest.get_row(data_root, survey_id)
    if existing is not None:
        return _exists(existing, src_url, t0)
    geometry = build_geometry(layout, headers, il_byte, xl_byte, opts.max_sparsity)
    store_url = survey_store_url(data_root, survey_id)
    size = source_size(layout)
    attrs = _store_attrs(survey_id, name, src_url, size, digest, layout, geometry, opts)
    t_write = time.perf_counter()
    timings["geometry_s"] = t_write - t_scan - timings["scan_s"]
    try:
        stats = write_store(store_url, layout, geometry, headers, attrs, opts, progress)
        timings["write_s"] = time.perf_counter() - t_write
    except BaseException as err:
        if isinstance(err, Exception) and manifest.get_row(data_root, survey_id) is None:
            storage.remove(store_url)  # a failed ingest leaves no store (a killed one leaves an invisible one)
        raise
    row = manifest_row(attrs, store_url, stats)
    if not manifest.publish(data_root, row):  # last: the survey becomes visible only now
        return _exists(manifest.get_row(data_root, survey_id), src_url, t0, concurrent=True)
    seconds = time.perf_counter() - t0
    holes = geometry.shape[0] * geometry.shape[1] - layout.n_traces
    message = f"ingested {name}: {attrs['shape'][0]} x {attrs['shape'][1]} x {attrs['shape'][2]}, {holes} holes"
    if geometry.extra["byte_locations"].startswith("detected ("):  # say when line numbers are really coordinates
        message += f", inline/crossline {geometry.extra['byte_locations']}"
    if stats["nonfinite_replaced"]:
        message += f", {stats['nonfinite_replaced']} NaN/inf samples replaced by 0"
    details = {k: attrs[k] for k in ("iline_byte", "xline_byte", "byte_locations", "endian", "endian_source",
                                     "sample_format_name", "text_encoding")}
    details["holes"] = int(holes)
    details["timings"] = {k: round(v, 3) for k, v in timings.items()}
    return {**row, "status": "ingested", "message": message, "details": details, "seconds": seconds,
            "mb_per_s": attrs["source_size"] / 1e6 / seconds}


def manifest_row(attrs: dict[str, Any], store_url: str, stats: dict[str, Any]) -> dict[str, Any]:
    """The survey's manifest row (data_contracts/manifest_row.schema.json) from its store attributes."""
    made = {"store_url": store_url, "ingested_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "stats_json": json.dumps(stats, sort_keys=True)}
    return {k: made[k] if k in made else attrs[k] for k in manifest.COLUMNS}


def _store_attrs(survey_id: str, name: str, src_url: str, size: int, digest: str, layout, geometry,
                 opts: IngestConfig) -> dict[str, Any]:
    """The store's root attributes (data_contracts/survey_store.schema.json)."""
    text, encoding = text_header(layout)
    return {
        "sfm_store_version": STORE_VERSION, "survey_id": survey_id, "name": name, "source_url": src_url,
        "source_size": size, **checksum_fields(size, digest),
        "iline_byte": geometry.iline_byte, "xline_byte": geometry.xline_byte,
        "byte_locations": geometry.extra["byte_locations"],
        "byte_pairs_rejected": geometry.extra["byte_pairs_rejected"],
        "endian": layout.endian, "endian_source": layout.endian_source, "segy_revision": layout.revision,
        "sample_format": layout.sample_format, "sample_format_name": layout.format_name,
        "sample_interval_us": layout.sample_interval_us, "sample_start_ms": geometry.extra["sample_start_ms"],
        "text_header": text, "text_encoding": encoding,
        "shape": [*geometry.shape, layout.samples], "live_traces": int(layout.n_traces),
        "inline_step": geometry.extra["inline_step"], "crossline_step": geometry.extra["crossline_step"],
        "dtype": opts.dtype, "nonfinite_policy": opts.nonfinite,
    }


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


def resolve_sources(urls: list[str]) -> list[str]:
    """Normalise source URLs, rejecting empty entries with a clear message."""
    out = []
    for url in urls:
        url = str(url).strip()
        if not url:
            raise SFMError("an empty survey URL was given; remove the stray comma or pass a path")
        out.append(storage.normalize(url))
    return out


def stats_of(row: dict[str, Any]) -> dict[str, Any]:
    return json.loads(row["stats_json"])


__all__ = ["ingest_survey", "open_survey", "survey_store_url", "stats_of", "resolve_sources"]
