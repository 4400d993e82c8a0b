"""SEG-Y -> Zarr v3 survey store, published atomically through the manifest.

One call ingests one survey: read the geometry from the trace headers, stream the traces in
inline slabs into 3D-chunked bricks, compute statistics in the same pass, write the attributes,
and only then publish the manifest row. ``survey_id`` is derived from the file's content, so
ingesting the same bytes twice is a no-op.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import tempfile
import time
import warnings
from typing import Any

import numpy as np

from sfm import manifest, storage
from sfm.contracts import validate
from sfm.errors import SFMError
from sfm.segy import TraceReader, build_geometry, cdp_coordinates, read_layout, text_header

PERCENTILES = (0.1, 1, 50, 99, 99.9)
_STATS_SAMPLE_TRACES = 4096  # traces kept (evenly spaced) for the percentile estimate


def survey_store_url(data_root: str, survey_id: str) -> str:
    return storage.join(data_root, "surveys", f"{survey_id}.zarr")


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(8 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def survey_name(url: str) -> str:
    base = str(url).rstrip("/").rsplit("/", 1)[-1]
    for suffix in (".sgy", ".segy", ".SGY", ".SEGY"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
    return base or "survey"


class _RunningStats:
    """Count, mean, std, min, max over live samples, plus percentiles from evenly spaced traces."""

    def __init__(self, n_traces: int):
        self.count = 0
        self.total = 0.0
        self.total_sq = 0.0
        self.min = np.inf
        self.max = -np.inf
        self.stride = max(1, n_traces // _STATS_SAMPLE_TRACES)
        self.sampled: list[np.ndarray] = []

    def update(self, traces: np.ndarray, trace_numbers: np.ndarray) -> None:
        """traces: [T, NS] float32 live traces; trace_numbers: [T] their positions in the file."""
        if traces.size == 0:
            return
        values = traces.astype(np.float64)
        self.count += values.size
        self.total += float(values.sum())
        self.total_sq += float(np.square(values).sum())
        self.min = min(self.min, float(values.min()))
        self.max = max(self.max, float(values.max()))
        keep = trace_numbers % self.stride == 0
        if keep.any():
            self.sampled.append(traces[keep].ravel())

    def result(self, nonfinite: int) -> dict[str, Any]:
        if self.count == 0:
            return {"count": 0, "mean": 0.0, "std": 0.0, "min": 0.0, "max": 0.0,
                    "percentiles": {str(p): 0.0 for p in PERCENTILES}, "nonfinite_replaced": nonfinite}
        mean = self.total / self.count
        var = max(0.0, self.total_sq / self.count - mean * mean)
        sample = np.concatenate(self.sampled)
        pct = np.percentile(sample, PERCENTILES)
        return {
            "count": int(self.count), "mean": mean, "std": float(np.sqrt(var)),
            "min": self.min, "max": self.max,
            "percentiles": {f"{p:g}": float(v) for p, v in zip(PERCENTILES, pct)},
            "nonfinite_replaced": int(nonfinite),
        }


def ingest_survey(
    src_url: str,
    data_root: str,
    *,
    iline_byte: int | None = None,
    xline_byte: int | None = None,
    endian: str = "auto",
    chunk: int = 64,
) -> dict[str, Any]:
    """Ingest one SEG-Y file into ``<data_root>/surveys/<survey_id>.zarr`` and publish it.

    Returns the manifest row plus ``status`` ("ingested" or "exists"), ``seconds`` and ``mb_per_s``.
    """
    t0 = time.perf_counter()
    data_root = storage.normalize(data_root)
    src_url = storage.normalize(src_url)
    name = survey_name(src_url)
    with tempfile.TemporaryDirectory(prefix="sfm-ingest-") as workdir:
        local = storage.local_copy(src_url, workdir)
        if os.path.isdir(local):
            raise SFMError(f"{src_url} is a directory, not a SEG-Y file; name the .sgy file itself")
        layout = read_layout(local, endian)  # fails fast, before hashing, on files that are not SEG-Y
        checksum = file_sha256(local)
        survey_id = checksum[:16]
        existing = manifest.get_row(data_root, survey_id)
        if existing is not None:
            return {**existing, "status": "exists", "seconds": time.perf_counter() - t0, "mb_per_s": 0.0}
        geometry = build_geometry(layout, iline_byte, xline_byte)
        store_url = survey_store_url(data_root, survey_id)
        attrs = {
            "sfm_store_version": 1, "survey_id": survey_id, "name": name, "source_url": src_url,
            "source_size": os.path.getsize(local), "checksum_sha256": checksum,
            "iline_byte": geometry.iline_byte, "xline_byte": geometry.xline_byte,
            "endian": layout.endian, "sample_format": layout.sample_format,
            "sample_interval_us": layout.sample_interval_us, "text_header": text_header(layout),
            "shape": [*geometry.shape, layout.samples],
        }
        stats = _write_store(store_url, layout, geometry, attrs, chunk)
    row = {
        "survey_id": survey_id, "name": name, "source_url": src_url, "store_url": store_url,
        "shape": attrs["shape"], "live_traces": int(layout.n_traces), "checksum_sha256": checksum,
        "sample_format": layout.sample_format, "sample_interval_us": layout.sample_interval_us,
        "ingested_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "stats_json": json.dumps(stats, sort_keys=True),
    }
    manifest.publish(data_root, row)  # last: the survey becomes visible only now
    seconds = time.perf_counter() - t0
    return {**row, "status": "ingested", "seconds": seconds, "mb_per_s": attrs["source_size"] / 1e6 / seconds}


def _write_store(store_url: str, layout, geometry, attrs: dict[str, Any], chunk: int) -> dict[str, Any]:
    """Write the Zarr v3 group (overwriting any unpublished leftovers) and return the statistics."""
    import zarr

    n_il, n_xl = geometry.shape
    ns = layout.samples
    bricks = (min(chunk, n_il), min(chunk, n_xl), min(chunk, ns))
    root = zarr.open_group(storage.zarr_store(store_url), mode="w", zarr_format=3)
    amp = root.create_array("amplitude", shape=(n_il, n_xl, ns), chunks=bricks, dtype="float32",
                            fill_value=0.0, dimension_names=["inline", "crossline", "sample"],
                            attributes={"coordinates": "cdp_x cdp_y", "long_name": "amplitude"})
    mask = np.zeros((n_il, n_xl), dtype=bool)
    mask[geometry.trace_il, geometry.trace_xl] = True
    cdp_x, cdp_y = cdp_coordinates(layout, geometry)
    for arr_name, values, dims in (
        ("trace_mask", mask, ["inline", "crossline"]),
        ("cdp_x", cdp_x, ["inline", "crossline"]),
        ("cdp_y", cdp_y, ["inline", "crossline"]),
        ("inline", geometry.inlines, ["inline"]),
        ("crossline", geometry.crosslines, ["crossline"]),
        ("sample", np.arange(ns) * layout.sample_interval_us / 1000.0, ["sample"]),
    ):
        arr = root.create_array(arr_name, shape=values.shape, chunks=values.shape, dtype=values.dtype,
                                dimension_names=dims)
        arr[...] = values
    root["sample"].attrs["units"] = "ms"

    running = _RunningStats(layout.n_traces)
    nonfinite = 0
    order = np.argsort(geometry.trace_il, kind="stable")
    sorted_il = geometry.trace_il[order]
    with TraceReader(layout) as reader:
        for il0 in range(0, n_il, bricks[0]):
            il1 = min(n_il, il0 + bricks[0])
            lo, hi = np.searchsorted(sorted_il, [il0, il1])
            traces_in_slab = np.sort(order[lo:hi])
            slab = np.zeros((il1 - il0, n_xl, ns), dtype=np.float32)
            for run in _contiguous_runs(traces_in_slab):
                data = reader.read(int(run[0]), int(run[-1]) + 1)
                bad = ~np.isfinite(data)
                if bad.any():
                    nonfinite += int(bad.sum())
                    data[bad] = 0.0
                running.update(data, run)
                slab[geometry.trace_il[run] - il0, geometry.trace_xl[run]] = data
            amp[il0:il1] = slab
    stats = running.result(nonfinite)
    attrs["stats"] = stats
    validate("survey_store", attrs, f"survey store {store_url}")
    root.attrs.update(attrs)
    with warnings.catch_warnings():  # consolidated metadata is a zarr-python extension to v3; xarray uses it
        warnings.simplefilter("ignore", category=UserWarning)
        zarr.consolidate_metadata(root.store)
    return stats


def _contiguous_runs(indices: np.ndarray) -> list[np.ndarray]:
    """Split sorted trace numbers into runs of consecutive numbers (one segyio read each)."""
    if indices.size == 0:
        return []
    breaks = np.nonzero(np.diff(indices) != 1)[0] + 1
    return np.split(indices, breaks)


def open_survey(store_url: str):
    """The survey as an xarray Dataset (lazy; amplitude is dask/zarr-backed)."""
    import xarray as xr

    if storage.is_s3(store_url):
        return xr.open_zarr(store_url, storage_options=storage.s3_storage_options(), zarr_format=3)
    return xr.open_zarr(storage.normalize(store_url), zarr_format=3)


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
