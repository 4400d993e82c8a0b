"""Streaming a SEG-Y file's traces into a new survey store: the amplitude bricks, the trace mask and
the statistics, one column of bricks at a time on all cores, in bounded memory.

    group, store = prepare_store(store_url, layout, geometry, headers, cfg)  # arrays and small arrays sent
    moments = write_columns(group, store, layout, columns, units, cfg, progress)  # any subset of the units
    stats = finish_store(group, store, moments, attrs)  # statistics merged, root zarr.json written, last

:mod:`sfm.ingest.parts` runs these steps, in one task or many."""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sfm import storage
from sfm.config import IngestConfig
from sfm.formats.contracts import validate
from sfm.errors import SFMError
from sfm.progress import Progress
from sfm.formats.segy import SegyLayout
from sfm.formats.segy_geometry import SurveyGeometry, cdp_coordinates
from sfm.formats import mdio_layout
from sfm.formats.moments import Moments
from sfm.formats.zarr_writer import GroupWriter
from sfm.formats.segy_traces import TraceReader
from sfm.formats.store_layout import (AMPLITUDE_CODEC, FLOAT16_MAX, INT8_MAX, PERCENTILE_TRACES, SHARD_BYTES,
                                      TRANSFORM_TRACES, codec_spec)


# ------------------------------------------------------------------------------------------------
# the store


def ingest_threads(cfg: IngestConfig, remote: bool = False) -> int:
    """Threads to use. Writing a local store is CPU work (page-cache copies), so one thread per core
    (more only thrash the caches, BENCHMARKS.md "Ingest"); PUTs to S3 wait on the network, so two
    more threads keep the cores busy meanwhile."""
    return int(cfg.workers) or min(16, (os.cpu_count() or 1) + (2 if remote else 0))


@dataclass
class StorePlan:
    """The survey store's amplitude cube: its shapes and those of the work units (brick columns), its codec
    and, for float16 and int8, the transform from stored values to amplitudes."""

    shape: tuple[int, int, int]
    bricks: tuple[int, int, int]
    shards: tuple[int, int, int]
    dtype: str
    codec: dict[str, Any] = field(default_factory=lambda: dict(AMPLITUDE_CODEC))
    offset: float = 0.0  # float16 and int8: amplitude = stored * scale + offset
    scale: float = 1.0
    hole: float = 0.0  # the stored value of a missing trace (decodes to exactly 0)
    layout: str = "sfm"  # "mdio": with MDIO's arrays and attributes too (sfm.formats.mdio_layout)
    domain: str = "time"  # the sample axis (named so in the mdio layout)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StorePlan":
        return cls(**{**d, "shape": tuple(d["shape"]), "bricks": tuple(d["bricks"]), "shards": tuple(d["shards"])})

    @property
    def stored_limit(self) -> float:
        """The largest magnitude written in the stored dtype; values beyond it saturate."""
        return INT8_MAX if self.dtype == "int8" else FLOAT16_MAX

    @property
    def units(self) -> list[tuple[int, int, int, int]]:
        """(il0, il1, xl0, xl1) of every brick column, inline blocks outermost."""
        n_il, n_xl, _ = self.shape
        b_il, b_xl, _ = self.bricks
        return [(i, min(n_il, i + b_il), j, min(n_xl, j + b_xl))
                for i in range(0, n_il, b_il) for j in range(0, n_xl, b_xl)]


def _plan(layout: SegyLayout, geometry: SurveyGeometry, opts: IngestConfig) -> StorePlan:
    n_il, n_xl = geometry.shape
    ns = layout.samples
    c = int(opts.chunk)
    bricks = (min(c, n_il), min(c, n_xl), min(c, ns))
    brick_bytes = math.prod(bricks) * np.dtype(opts.dtype).itemsize
    per_shard = max(1, min(-(-ns // bricks[2]), SHARD_BYTES // brick_bytes))
    return StorePlan((n_il, n_xl, ns), bricks, (bricks[0], bricks[1], bricks[2] * per_shard), opts.dtype,
                     codec_spec(opts.codec), layout=opts.layout, domain=opts.domain)


def _fix_transform(plan: StorePlan, reader: TraceReader, n_traces: int) -> None:
    """Fix the float16 or int8 transform from the finite samples of evenly spaced traces, read before
    the main pass."""
    picks = np.unique(np.linspace(0, n_traces - 1, min(n_traces, TRANSFORM_TRACES)).astype(np.int64))
    values = np.concatenate([reader.read(int(t), int(t) + 1).ravel() for t in picks])
    values = values[np.isfinite(values)]
    (_quantise if plan.dtype == "int8" else _standardise)(plan, values)


def _standardise(plan: StorePlan, values: np.ndarray) -> None:
    """float16: stored = (amplitude - offset) / std of ``values`` [N] float32, offset near the mean."""
    values = values.astype(np.float64)
    mean = float(values.mean()) if values.size else 0.0
    std = float(values.std()) if values.size else 0.0
    scale = std if std > 0 else (abs(mean) or 1.0)
    hole = np.float16(-mean / scale)  # holes must decode to exactly 0: pick the offset to make it so
    plan.scale, plan.hole, plan.offset = scale, float(hole), -float(hole) * scale


def _quantise(plan: StorePlan, values: np.ndarray) -> None:
    """int8: 254 steps across the 0.1 to 99.9 percentiles of ``values`` [N] float32 (the range the loader
    clips amplitudes to; defined as in the statistics), widened to take in 0 where it does not, so that
    a hole has an integer: ``hole = round(-centre / scale)``, and ``offset = -hole * scale`` makes it
    decode to exactly 0. Every amplitude in the range is stored within scale / 2; beyond, it saturates."""
    lo, hi = (float(v) for v in np.percentile(values, (0.1, 99.9))) if values.size else (0.0, 0.0)
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = (hi - lo) / (2 * INT8_MAX) if hi > lo else 1.0
    hole = int(np.rint(-0.5 * (lo + hi) / scale))
    plan.scale, plan.hole, plan.offset = scale, float(hole), -hole * scale + 0.0  # + 0.0: never -0.0


def _transform_attrs(plan: StorePlan) -> dict[str, Any]:
    """``attrs["amplitude_transform"]``: how the stored values of a float16 or int8 store decode."""
    transform = {"offset": plan.offset, "scale": plan.scale, "decode": "amplitude = stored * scale + offset"}
    if plan.dtype == "float16":
        return {"kind": "standardise", "stored_dtype": "float16", "hole_value": plan.hole, **transform}
    limit = INT8_MAX
    return {"kind": "quantise", "stored_dtype": "int8", "hole_value": int(plan.hole), **transform,
            "stored_range": [-limit, limit],
            "clip": [plan.offset - limit * plan.scale, plan.offset + limit * plan.scale],
            "saturation": "amplitudes beyond clip (about the 0.1 and 99.9 percentiles) are stored as its ends"}


def _create_arrays(group: GroupWriter, plan: StorePlan, geometry: SurveyGeometry, layout: SegyLayout,
                   headers: dict) -> None:
    """The store's arrays: ``amplitude`` (metadata only; its shards come later) and the small ones."""
    from zarr.codecs import BloscCodec

    n_il, n_xl, ns = plan.shape
    start_ms = geometry.extra.get("sample_start_ms", 0)
    if plan.layout == "mdio":
        axis, (samples, sample_attrs) = plan.domain, mdio_layout.sample_coordinate(
            plan.domain, start_ms, layout.sample_interval_us, ns)
    else:
        axis, samples = "sample", start_ms + np.arange(ns) * layout.sample_interval_us / 1000.0
        sample_attrs = {"units": "ms", "long_name": "time: delay (trace bytes 109-110) + index * interval"}
    amp_attrs = {"coordinates": "cdp_x cdp_y", "long_name": "amplitude"}
    if plan.dtype != "float32":  # CF convention: xarray decodes stored values back to amplitude
        amp_attrs.update({"scale_factor": plan.scale, "add_offset": plan.offset})
    group.create_array(
        "amplitude", shape=plan.shape, chunks=plan.bricks, dtype=plan.dtype,
        shards={"shape": plan.shards, "index_location": "start"},
        compressors=BloscCodec(**plan.codec), fill_value=np.dtype(plan.dtype).type(plan.hole),
        dimension_names=["inline", "crossline", axis], attributes=amp_attrs)
    mask = np.zeros((n_il, n_xl), dtype=bool)
    mask[geometry.trace_il, geometry.trace_xl] = True
    cdp_x, cdp_y, _ = cdp_coordinates(geometry, headers)
    small = (
        ("trace_mask", mask, ["inline", "crossline"], {"coordinates": "cdp_x cdp_y"} if plan.layout == "mdio" else {}),
        ("cdp_x", cdp_x, ["inline", "crossline"], {"long_name": "CDP X (scaled by byte 71)"}),
        ("cdp_y", cdp_y, ["inline", "crossline"], {"long_name": "CDP Y (scaled by byte 71)"}),
        ("inline", geometry.inlines, ["inline"], {}),
        ("crossline", geometry.crosslines, ["crossline"], {}),
        (axis, samples, [axis], sample_attrs),
    )
    for name, values, dims, attributes in small:
        group.create_array(name, values, shape=values.shape, chunks=values.shape, dtype=values.dtype, fill_value=0,
                           dimension_names=dims, attributes=attributes,
                           compressors=BloscCodec(cname="zstd", clevel=3, shuffle="shuffle"))
    if plan.layout == "mdio":
        mdio_layout.create_arrays(group, layout, plan.bricks)
    group.put(layout_of=["amplitude"])


def prepare_store(store_url: str, layout: SegyLayout, geometry: SurveyGeometry, headers: dict,
                  opts: IngestConfig) -> tuple[GroupWriter, StorePlan]:
    """Create the group's arrays and send their metadata and small arrays (not yet the root ``zarr.json``);
    the float16 / int8 transform is fixed first, from evenly spaced traces."""
    plan = _plan(layout, geometry, opts)
    if plan.dtype != "float32":
        with TraceReader(layout) as reader:
            _fix_transform(plan, reader, layout.n_traces)
    group = GroupWriter(store_url)
    _create_arrays(group, plan, geometry, layout, headers)
    return group, plan


@dataclass
class Columns:
    """The grid cells some brick columns read: ``cells`` [IL', XL] trace numbers (-1: hole) of the
    inlines ``il_origin`` .. ``il_origin + IL' - 1``, and the survey's line numbers (for messages)."""

    cells: np.ndarray
    il_origin: int
    inlines: np.ndarray  # [IL] int32
    crosslines: np.ndarray  # [XL] int32

    def line_of(self, trace: int) -> tuple[int, int]:
        """(inline, crossline) numbers of ``trace``."""
        i, j = (int(v[0]) for v in np.nonzero(self.cells == trace))
        return int(self.inlines[self.il_origin + i]), int(self.crosslines[j])


def write_columns(group: GroupWriter, plan: StorePlan, layout: SegyLayout, columns: Columns,
                  units: list[tuple[int, int, int, int]], opts: IngestConfig, progress: bool) -> list[Moments]:
    """Read, encode and write the shards of brick columns ``units`` [(il0, il1, xl0, xl1)] (all inside
    ``columns``) on all cores; returns the statistics of each unit, in the order of ``units``.

    Memory stays at two units per thread in flight. With ``opts.nonfinite == "refuse"`` the first unit (in
    order) holding NaN/inf stops the work with an SFMError naming its first such trace.
    """
    cells = columns.cells
    stride = max(1, layout.n_traces // PERCENTILE_TRACES)
    writer = group.shards("amplitude")
    b_il, b_xl, depth = plan.bricks
    n_k = -(-plan.shape[2] // depth)  # bricks along the samples
    per_shard = plan.shards[2] // depth
    buffers = threading.local()  # per thread, reused: no page faults per column
    with TraceReader(layout) as reader:

        def work(unit: tuple[int, int, int, int]) -> Moments:
            il0, il1, xl0, xl1 = unit
            if getattr(buffers, "column", None) is None:
                # brick-major: column[k] is the k-th brick along the samples, C-contiguous, what the codec reads
                buffers.column = np.empty((n_k, b_il, b_xl, depth), dtype=np.float32)
                buffers.block = np.empty((reader.max_traces, plan.shape[2]), dtype=np.float32)
                if plan.layout == "mdio":  # the trace headers too, read with the samples
                    buffers.headers = (np.empty((b_il, b_xl, mdio_layout.HEADER_BYTES), dtype=np.uint8),
                                       np.empty((reader.max_traces, mdio_layout.HEADER_BYTES), dtype=np.uint8))
            unit_cells = cells[il0 - columns.il_origin : il1 - columns.il_origin, xl0:xl1]
            raw = getattr(buffers, "headers", None)
            moments = _read_unit(reader, unit_cells, buffers.column, buffers.block, stride, raw)
            if moments.n == 0:
                return moments  # all holes: no shard (zarr reads fill value, which decodes to 0)
            if raw is not None:
                a, b = unit_cells.shape
                mdio_layout.write_headers(group, (il0, xl0), raw[0][:a, :b], unit_cells >= 0, layout.endian)
            stored = _encode(buffers.column, unit_cells >= 0, plan, buffers)
            for s in range(writer.shards_per_column):
                bricks = [stored[k] if k < n_k else None for k in range(s * per_shard, (s + 1) * per_shard)]
                writer.write_bricks((il0 // b_il, xl0 // b_xl, s), bricks)
            return moments

        done: list[Moments] = []
        bar = Progress(len(units), f"ingest {layout.name}", unit="column", enabled=progress)

        def collect(moments: Moments) -> None:
            done.append(moments)
            bar.update(1)
            if moments.nonfinite and opts.nonfinite == "refuse":
                inline, crossline = columns.line_of(moments.first_nonfinite)
                raise SFMError(
                    f"{layout.name} has NaN/inf samples (first in trace #{moments.first_nonfinite + 1}, inline "
                    f"{inline}, crossline {crossline}); fix the file, or ingest without "
                    "--refuse-nonfinite to replace them by 0 and count them")

        workers = ingest_threads(opts, remote=storage.is_s3(group.url) or storage.is_s3(layout.path))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sfm-ingest") as pool:
            pending: deque = deque()
            try:
                for unit in units:  # at most 2 units per worker in flight: memory stays bounded
                    pending.append(pool.submit(work, unit))
                    while len(pending) >= 2 * workers:
                        collect(pending.popleft().result())
                while pending:
                    collect(pending.popleft().result())
            except BaseException:
                for future in pending:
                    future.cancel()
                raise
            finally:
                bar.close()
    return done


def finish_store(group: GroupWriter, plan: StorePlan, moments: list[Moments], attrs: dict[str, Any]) -> dict[str, Any]:
    """Merge the units' statistics in the order given (the store's unit order: the same bytes however
    the units were split between tasks), complete ``attrs`` and write the root ``zarr.json``, last.
    Returns the statistics."""
    total = Moments()
    for unit in moments:
        total.merge(unit)
    stats = total.result()
    attrs["stats"] = stats
    if plan.layout == "mdio":
        group.update_attributes("amplitude", {"statsV1": mdio_layout.stats_v1(
            total.n, total.mean, total.m2, total.min, total.max)})
    attrs["store"] = {"bricks": list(plan.bricks), "shards": list(plan.shards), "shard_index": "start",
                      "codec": "blosc " + " ".join(f"{k}={v}" for k, v in plan.codec.items()),
                      "dtype": plan.dtype}
    if plan.dtype != "float32":
        attrs["amplitude_transform"] = _transform_attrs(plan)
    written = mdio_layout.root_attributes(attrs, plan.domain) if plan.layout == "mdio" else attrs
    validate("survey_store", written, f"survey store {group.url}")
    group.finish(written)
    return stats


def _read_unit(reader: TraceReader, cells: np.ndarray, column: np.ndarray, block: np.ndarray,
               stride: int, headers: tuple[np.ndarray, np.ndarray] | None = None) -> Moments:
    """Fill brick column ``column`` [K, A, B, D] (brick-major: brick k holds samples k*D .. k*D + D - 1)
    with the traces of ``cells`` [a, b] (trace numbers, -1 for holes) and return the statistics of its
    live samples. Whatever no trace fills is 0: holes, cells past the unit's edge (a < A or b < B) and
    samples past the trace's end (K * D > NS).

    Consecutive trace numbers are read together, in pieces of at most ``len(block)`` traces: each piece
    is converted into ``block`` [T, NS] float32 (small: it stays in cache), its statistics taken there,
    and only then placed into the column (along a crossline row for inline-sorted files, along an
    inline column for crossline-sorted ones, cell by cell otherwise). ``headers`` = (unit [A, B, 240],
    piece [len(block), 240]) uint8, if given, receives the live cells' trace headers the same way.
    """
    moments = Moments()
    a, b = cells.shape
    n_k, big_a, big_b, depth = column.shape
    ns = block.shape[1]
    full, rest = divmod(ns, depth)  # bricks the samples fill, samples in the last one
    if a < big_a:
        column[:, a:] = 0.0
    if b < big_b:
        column[:, :a, b:] = 0.0
    if rest:
        column[full, :a, :b, rest:] = 0.0
    live = cells >= 0
    hole_i, hole_j = np.nonzero(~live)
    if hole_i.size:
        column[:, hole_i, hole_j] = 0.0
    li, lj = np.nonzero(live)
    if li.size == 0:
        return moments
    traces = cells[li, lj]
    order = np.argsort(traces, kind="stable")
    traces, li, lj = traces[order], li[order], lj[order]
    breaks = np.nonzero(np.diff(traces) != 1)[0] + 1
    step = len(block)
    pieces = [(p, min(p + step, hi)) for lo, hi in zip(np.r_[0, breaks], np.r_[breaks, len(traces)])
              for p in range(int(lo), int(hi), step)]
    for lo, hi in pieces:
        start, stop = int(traces[lo]), int(traces[hi - 1]) + 1
        i, j = li[lo:hi], lj[lo:hi]
        if i[0] == i[-1] and j[-1] - j[0] == hi - lo - 1:  # along a crossline row
            i, j = int(i[0]), slice(int(j[0]), int(j[-1]) + 1)
        elif j[0] == j[-1] and i[-1] - i[0] == hi - lo - 1:  # along an inline column
            i, j = slice(int(i[0]), int(i[-1]) + 1), int(j[0])
        piece = block[: hi - lo]
        reader.read_into(start, stop, piece, None if headers is None else headers[1][: hi - lo])
        if headers is not None:
            headers[0][i, j] = headers[1][: hi - lo]
        low, high = float(piece.min()), float(piece.max())
        if not (math.isfinite(low) and math.isfinite(high)):  # NaN or inf somewhere: count, locate, replace by 0
            bad = ~np.isfinite(piece)
            moments.nonfinite += int(bad.sum())
            if moments.first_nonfinite < 0:
                moments.first_nonfinite = start + int(np.nonzero(bad.any(axis=1))[0][0])
            piece[bad] = 0.0
            low, high = float(piece.min()), float(piece.max())
        moments.add_block(piece, low, high)
        keep = np.nonzero(np.arange(start, stop) % stride == 0)[0]
        if keep.size:
            moments.sample.append(piece[keep].copy())
        if full:
            column[:full, i, j] = piece[:, : full * depth].reshape(hi - lo, full, depth).transpose(1, 0, 2)
        if rest:
            column[full, i, j, :rest] = piece[:, full * depth :]
    return moments


def _encode(column: np.ndarray, live: np.ndarray, plan: StorePlan, buffers) -> np.ndarray:
    """The stored values of brick column ``column`` [K, A, B, D] (filled by :func:`_read_unit` for the
    cells ``live`` [a, b]): itself (float32), or ``(column - offset) / scale`` as float16 or rounded to
    int8, saturating at the stored dtype's limit, with the hole value wherever no trace is."""
    if plan.dtype == "float32":
        return column
    column -= np.float32(plan.offset)
    column *= np.float32(1.0 / plan.scale)
    if plan.dtype == "int8":
        np.rint(column, out=column)
    np.clip(column, -plan.stored_limit, plan.stored_limit, out=column)
    if getattr(buffers, "stored", None) is None:
        buffers.stored = np.empty(column.shape, dtype=plan.dtype)
    stored = buffers.stored
    np.copyto(stored, column, casting="unsafe")
    hole = stored.dtype.type(plan.hole)
    a, b = live.shape
    stored[:, a:] = hole
    stored[:, :, b:] = hole
    hole_i, hole_j = np.nonzero(~live)
    stored[:, hole_i, hole_j] = hole
    rest = plan.shape[2] % column.shape[3]
    if rest:
        stored[-1, :, :, rest:] = hole
    return stored
