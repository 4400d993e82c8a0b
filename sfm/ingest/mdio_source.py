"""MDIO v1 post-stack stores as survey sources, read where they are: detect, check, identify, measure.

An MDIO v1 store (written by ``multidimio`` 1.x; ``sfm/data_contracts/mdio_input.schema.json``) is a Zarr v3
group whose default variable (``amplitude``) is float32 [inline, crossline, time|depth] in regular chunks,
NaN where no trace was; ``trace_mask`` [inline, crossline] says which traces exist and 1-D ``inline``,
``crossline`` and ``time``/``depth`` arrays hold the coordinates. sfm trains on it without a copy:

    src = inspect(url)                # refuses what sfm cannot train on, with one line naming the store
    digest = content_digest(src)      # identity: the same for a local and an S3 copy
    stats = statistics(src, budget)   # recomputed from the data (MDIO's statsV1 is not trusted)

:mod:`sfm.ingest.mdio_register` turns these into a reference group and a manifest row. Nothing here
imports ``multidimio``; every read goes through :func:`sfm.storage.resilient_store.open_survey_store`.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from sfm import storage
from sfm.errors import SFMError
from sfm.formats.moments import Moments
from sfm.formats.store_layout import PERCENTILE_TRACES

SAMPLE_AXES = ("time", "depth")
AMPLITUDE_DTYPES = ("float32", "float16")
DIGEST_ALGORITHM = "mdio-blake3"
DIGEST_DESCRIPTION = ("mdio-blake3: BLAKE3 of the canonical JSON (sorted keys, createdOn dropped) of every zarr.json "
                      "of the store, the sorted (key, size) index of every other object, and the values of "
                      "trace_mask and the inline, crossline and sample coordinates")
STATS_THREADS = 4
REGRID = ("sfm needs evenly spaced lines and samples: re-grid it, e.g. export it to SEG-Y and `sfm ingest` the "
          "SEG-Y, which stores missing lines as holes")


def is_mdio(url: str) -> bool:
    """True for an MDIO store: a URL ending in ``.mdio``, or a Zarr group whose root attributes carry MDIO's
    ``apiVersion`` and ``attributes.defaultVariableName``. A SEG-Y file costs one existence check."""
    url = storage.normalize(url).rstrip("/")
    if url.lower().endswith(".mdio"):
        return True
    meta = storage.join(url, "zarr.json")
    try:
        if not storage.exists(meta):
            return False
        attrs = json.loads(storage.read_bytes(meta)).get("attributes") or {}
    except (SFMError, ValueError, NotADirectoryError):
        return False
    return "apiVersion" in attrs and "defaultVariableName" in (attrs.get("attributes") or {})


def survey_name(url: str) -> str:
    """The display name: the store's folder name without ``.mdio``; control characters become ``_``."""
    base = storage.normalize(url).rstrip("/").rsplit("/", 1)[-1]
    if base.lower().endswith(".mdio"):
        base = base[: -len(".mdio")]
    return "".join("_" if ord(ch) < 32 or ord(ch) == 127 else ch for ch in base) or "survey"


@dataclass
class MdioSource:
    """One checked MDIO store: where it is, its amplitude array (open) and what sfm records of it."""

    url: str
    store: Any  # sfm.storage.resilient_store.ResilientStore (counts the bytes read)
    amp: Any  # zarr.Array of the default variable
    variable: str
    sample_axis: str  # time | depth
    api_version: str
    mask: np.ndarray  # [IL, XL] bool
    coords: dict[str, np.ndarray]  # inline [IL], crossline [XL], <sample_axis> [NS]
    sample_interval_us: int
    sample_start_ms: int
    text_header: str
    sample_format: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(int(n) for n in self.amp.shape)

    @property
    def chunks(self) -> tuple[int, int, int]:
        return tuple(int(n) for n in self.amp.chunks)


def _refuse(url: str, problem: str, fix: str) -> SFMError:
    return SFMError(f"MDIO store {url}: {problem}; {fix}")


def inspect(url: str, client: str = "auto") -> MdioSource:
    """Open and check the MDIO store at ``url``; SFMError (one line: the store, the problem, the fix) for
    anything sfm cannot train on as it is. Reads the metadata, ``trace_mask`` and the coordinates only."""
    import zarr

    from sfm.storage.resilient_store import open_survey_store

    url = storage.normalize(url).rstrip("/")
    store = open_survey_store(url, client)
    try:
        group = zarr.open_group(store, mode="r")
        root = dict(group.attrs)
    except (FileNotFoundError, KeyError, ValueError) as err:
        raise _refuse(url, f"no Zarr v3 group there ({type(err).__name__})",
                      "check the URL names the .mdio folder, written by MDIO 1.x") from None
    version = str(root.get("apiVersion", ""))
    variable = (root.get("attributes") or {}).get("defaultVariableName")
    if not version.startswith("1.") or not variable:
        raise _refuse(url, f"not an MDIO v1 store (root attributes apiVersion {version or 'missing'}, "
                      f"defaultVariableName {variable or 'missing'})", "write it with MDIO 1.x (multidimio)")
    amp = _member(group, url, variable, "the default variable")
    sample_axis = _check_amplitude(url, variable, amp)
    mask = _check_mask(url, group, amp.shape[:2])
    coords = {name: _coordinate(url, group, name, n)
              for name, n in zip(("inline", "crossline", sample_axis), amp.shape)}
    if not mask.any():
        raise _refuse(url, "trace_mask has no live trace", "write the store from a SEG-Y that holds traces")
    interval, text, fmt = _file_header(group, coords[sample_axis])
    return MdioSource(url=url, store=store, amp=amp, variable=variable, sample_axis=sample_axis,
                      api_version=version, mask=mask, coords=coords, sample_interval_us=interval,
                      sample_start_ms=int(coords[sample_axis][0]), text_header=text, sample_format=fmt)


def _member(group, url: str, name: str, what: str):
    """The array ``name`` of ``group``, or SFMError naming the store and ``what`` it is."""
    import zarr

    try:
        node = group[name]
    except KeyError:
        node = None
    if not isinstance(node, zarr.Array):
        raise _refuse(url, f"{what} {name!r} is missing", "write the store with MDIO 1.x (multidimio); a "
                      "partial copy misses arrays")
    return node


def _check_amplitude(url: str, variable: str, amp) -> str:
    """The sample axis (time | depth) of the default variable, after checking its rank, dims and dtype."""
    dims = tuple(getattr(amp.metadata, "dimension_names", None) or ())
    if len(amp.shape) != 3:
        raise _refuse(url, f"{variable} is {len(amp.shape)}-D {list(amp.shape)}, not 3-D post-stack "
                      "[inline, crossline, time|depth]", "sfm trains on post-stack 3-D volumes; stack the gathers")
    if dims[:2] != ("inline", "crossline") or len(dims) != 3 or dims[2] not in SAMPLE_AXES:
        raise _refuse(url, f"{variable} has dimensions {list(dims)}, not [inline, crossline, time|depth]",
                      "write a PostStack3DTime or PostStack3DDepth store")
    if str(np.dtype(amp.dtype)) not in AMPLITUDE_DTYPES:
        raise _refuse(url, f"{variable} holds {np.dtype(amp.dtype)}, not float32 or float16",
                      "write the amplitudes as float32")
    return dims[2]


def _check_mask(url: str, group, shape) -> np.ndarray:
    mask_array = _member(group, url, "trace_mask", "the live-trace array")
    if tuple(mask_array.shape) != tuple(shape):
        raise _refuse(url, f"trace_mask is {list(mask_array.shape)}, not [inline, crossline] {list(shape)}",
                      "write the store with MDIO 1.x (multidimio)")
    return np.asarray(mask_array[...], dtype=bool)


def _coordinate(url: str, group, name: str, n: int) -> np.ndarray:
    """The 1-D coordinate ``name`` [n], checked present, as long as its axis and evenly spaced."""
    values = np.asarray(_member(group, url, name, "the coordinate")[...])
    if values.ndim != 1 or len(values) != n:
        raise _refuse(url, f"coordinate {name} has shape {list(values.shape)}, not [{n}]",
                      "write the store with MDIO 1.x (multidimio)")
    if n > 1:
        steps = np.diff(values.astype(np.float64))
        changed = np.nonzero(steps != steps[0])[0]
        if steps[0] <= 0 or changed.size:
            at = int(changed[0]) if changed.size else 0
            raise _refuse(url, f"{name} values are not evenly spaced (step {steps[0]:g} up to {name} "
                          f"{values[at]:g}, then {steps[at]:g} to {values[at + 1]:g})" if changed.size else
                          f"{name} values do not increase (step {steps[0]:g} after {values[0]:g})", REGRID)
    return values


def _file_header(group, samples: np.ndarray) -> tuple[int, str, int]:
    """(sample interval in µs, text header, SEG-Y sample format) from ``segy_file_header`` when the store has
    one; otherwise the interval is the sample coordinate's step (ms or m) x 1000 and the format 5 (IEEE
    float, what the store holds)."""
    import zarr

    step = int(round(float(samples[1] - samples[0]) * 1000)) if len(samples) > 1 else 0
    header = group.get("segy_file_header")
    if not isinstance(header, zarr.Array):
        return step, "", 5
    attrs = dict(header.attrs)
    binary = attrs.get("binaryHeader") or {}
    if isinstance(binary, str):
        binary = json.loads(binary)
    interval = int(binary.get("sample_interval") or step)
    fmt = int(binary.get("data_sample_format") or 5)
    return interval, str(attrs.get("textHeader") or ""), fmt if fmt in (1, 2, 3, 5, 6, 8, 9, 10, 11, 12, 16) else 5


# ------------------------------------------------------------------------------------------------
# identity


def content_digest(src: MdioSource) -> str:
    """64 hex digits: BLAKE3 over the canonical JSON of every ``zarr.json`` (``createdOn`` dropped: when a
    store was written says nothing of what it holds, so two conversions of one SEG-Y are one survey), the
    sorted (key, size) of every other object (one listing, no chunk read: a rewritten chunk changes its
    size, and its array's ``statsV1``), and the values of ``trace_mask`` and the coordinates."""
    import blake3

    h = blake3.blake3()
    objects = [(k, n) for k, n in storage.list_tree(src.url) if not any(p.startswith(".") for p in k.split("/"))]
    for key, size in objects:
        if key == "zarr.json" or key.endswith("/zarr.json"):
            meta = json.loads(storage.read_bytes(storage.join(src.url, key)))
            (meta.get("attributes") or {}).pop("createdOn", None)
            h.update(f"json {key} {json.dumps(meta, sort_keys=True, separators=(',', ':'))}\n".encode())
        else:
            h.update(f"object {key} {size}\n".encode())
    for name, values in [("trace_mask", src.mask), *sorted(src.coords.items())]:
        values = np.ascontiguousarray(values)
        h.update(f"values {name} {values.dtype.str} {list(values.shape)}\n".encode())
        h.update(values.tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------
# statistics


def stats_columns(src: MdioSource, budget_bytes: float) -> list[tuple[int, int]]:
    """The chunk columns (inline chunk, crossline chunk) the statistics read: all of them when the
    amplitude's chunks fit ``budget_bytes``, else as many as fit, evenly spaced in C order."""
    n_i, n_j = (-(-n // c) for n, c in zip(src.shape[:2], src.chunks[:2]))
    columns = [(i, j) for i in range(n_i) for j in range(n_j)
               if src.mask[i * src.chunks[0]:(i + 1) * src.chunks[0], j * src.chunks[1]:(j + 1) * src.chunks[1]].any()]
    column_bytes = src.chunks[0] * src.chunks[1] * src.shape[2] * np.dtype(src.amp.dtype).itemsize
    fit = max(1, int(budget_bytes // column_bytes))
    if fit >= len(columns):
        return columns
    picks = np.unique(np.linspace(0, len(columns) - 1, fit).round().astype(int))
    return [columns[k] for k in picks]


def statistics(src: MdioSource, budget_bytes: float, threads: int = STATS_THREADS) -> dict[str, Any]:
    """The amplitude statistics as sfm's SEG-Y ingest computes them (``sfm.ingest.cube_writer``): over live
    traces only (trace_mask), NaN/inf inside them replaced by 0 and counted, percentiles from evenly spaced
    live traces (every one of surveys up to 4096 traces). Over the chunk columns of :func:`stats_columns`;
    ``fraction_read`` is the share of live traces they hold, ``bytes_read`` what was fetched."""
    columns = stats_columns(src, budget_bytes)
    b_i, b_j = src.chunks[:2]
    in_columns = sum(int(src.mask[i * b_i:(i + 1) * b_i, j * b_j:(j + 1) * b_j].sum()) for i, j in columns)
    stride = max(1, in_columns // PERCENTILE_TRACES)
    # the rank of each live trace among those read, in (inline, crossline) order: what the percentile
    # traces are picked by (file order, for an inline-sorted SEG-Y)
    read = np.zeros_like(src.mask)
    for i, j in columns:
        read[i * b_i:(i + 1) * b_i, j * b_j:(j + 1) * b_j] = True
    rank = np.full(src.mask.shape, -1, dtype=np.int64)
    live_read = src.mask & read
    rank[live_read] = np.arange(int(live_read.sum()))
    before = src.store.bytes_fetched
    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="sfm-mdio-stats") as pool:
        parts = list(pool.map(lambda c: _column_moments(src, c, rank, stride), columns))
    total = Moments()
    for part in parts:
        total.merge(part)
    stats = total.result()
    stats["fraction_read"] = in_columns / max(1, int(src.mask.sum()))
    stats["bytes_read"] = int(src.store.bytes_fetched - before)
    return stats


def _column_moments(src: MdioSource, column: tuple[int, int], rank: np.ndarray, stride: int) -> Moments:
    """The statistics of the live traces of one chunk column (all its chunks along the samples)."""
    (i, j), (b_i, b_j) = column, src.chunks[:2]
    region = (slice(i * b_i, min(src.shape[0], (i + 1) * b_i)), slice(j * b_j, min(src.shape[1], (j + 1) * b_j)))
    live = src.mask[region]
    moments = Moments()
    if not live.any():
        return moments
    block = np.asarray(src.amp[region], dtype=np.float32)[live]  # [T, NS]
    low, high = float(block.min()), float(block.max())
    if not (math.isfinite(low) and math.isfinite(high)):
        bad = ~np.isfinite(block)
        moments.nonfinite = int(bad.sum())
        block[bad] = 0.0
        low, high = float(block.min()), float(block.max())
    moments.add_block(block, low, high)
    keep = rank[region][live] % stride == 0
    if keep.any():
        moments.sample.append(block[keep].copy())
    return moments
