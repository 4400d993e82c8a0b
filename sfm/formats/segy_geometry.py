"""The (inline, crossline) grid of a post-stack SEG-Y file, from the trace header fields
:func:`sfm.formats.segy.scan_file` read: :func:`build_geometry`.

It finds the byte pair that holds the line numbers (189/193 first, the CDP coordinates 181/185
last, said so when taken), builds the full regular grid, and refuses what ingest cannot store
faithfully: pre-stack gathers (offsets that vary), duplicate traces, grids far sparser than their
traces, trace headers that contradict the binary header, traces with different delays. Problems a
user can cause raise :class:`SFMError` naming the file and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from sfm.errors import SFMError
from sfm.formats.segy import (CDP_COORDINATE_PAIR, CDP_X_FIELD, CDP_Y_FIELD, COMMON_BYTE_PAIRS, DEFAULT_BYTE_PAIR,
                             DELAY_FIELD, OFFSET_FIELD, SAMPLE_COUNT_FIELD, SCALAR_FIELD, SegyLayout)


@dataclass
class SurveyGeometry:
    """The full regular (inline, crossline) grid the traces sit on.

    ``trace_il[t]``/``trace_xl[t]`` are grid indices of trace t; cells without a trace are holes.
    """

    inlines: np.ndarray  # [IL] int32 line numbers, evenly spaced
    crosslines: np.ndarray  # [XL] int32
    trace_il: np.ndarray  # [T] int32 index into inlines
    trace_xl: np.ndarray  # [T] int32 index into crosslines
    iline_byte: int
    xline_byte: int
    extra: dict = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.inlines), len(self.crosslines)

    def cell_traces(self) -> np.ndarray:
        """Trace number of every grid cell, -1 for holes: [IL, XL] int64."""
        cells = np.full(self.shape, -1, dtype=np.int64)
        cells[self.trace_il, self.trace_xl] = np.arange(len(self.trace_il))
        return cells





def check_trace_headers(layout: SegyLayout, headers: dict[tuple[int, int], np.ndarray]) -> None:
    """Refuse files whose trace headers are not trace headers (e.g. sample data where headers should be).

    The sample count in trace byte 115 may legitimately differ from the binary header's (the binary
    header governs fixed-length files, and cropped files often keep the original count), but in real
    trace headers it is the same in every trace that fills it in.
    """
    counts = headers[SAMPLE_COUNT_FIELD].astype(np.int64) & 0xFFFF
    filled = np.nonzero(counts)[0]
    if filled.size < 2 or (counts[filled] == counts[filled[0]]).all():
        return
    first = int(filled[0])
    other = int(filled[np.argmax(counts[filled] != counts[first])])
    raise SFMError(
        f"{layout.name}: the trace headers are missing or damaged: their sample counts (trace byte 115) disagree, "
        f"trace #{first + 1} says {int(counts[first])} and trace #{other + 1} says {int(counts[other])}, while the "
        f"binary header says {layout.samples} samples per trace (byte 3221); re-export the file as fixed-length "
        "SEG-Y with a 240-byte header before every trace"
    )


def _axis(values: np.ndarray) -> tuple[int, int, int]:
    """(first, step, count) of the evenly spaced axis that holds every value in ``values``."""
    unique = np.unique(values)
    if len(unique) == 1:
        return int(unique[0]), 1, 1
    step = int(np.gcd.reduce(np.diff(unique)))
    return int(unique[0]), step, int((unique[-1] - unique[0]) // step) + 1


class _GridProblem(Exception):
    """Why one (inline byte, crossline byte) pair gives no valid grid."""


def _grid(layout: SegyLayout, headers: dict, il_byte: int, xl_byte: int, max_sparsity: float) -> SurveyGeometry:
    il = headers[(il_byte, 4)]
    xl = headers[(xl_byte, 4)]
    n = layout.n_traces
    if n > 1 and il.min() == il.max() and xl.min() == xl.max():
        raise _GridProblem(f"every trace has inline {int(il[0])}, crossline {int(xl[0])}")
    il0, il_step, n_il = _axis(il)
    xl0, xl_step, n_xl = _axis(xl)
    cells = n_il * n_xl
    if cells / n > max_sparsity:
        raise _GridProblem(
            f"the {n_il} x {n_xl} grid (inline step {il_step}, crossline step {xl_step}) has {cells / n:.1f} cells per "
            f"trace, more than the limit {max_sparsity:g}; if the geometry is right, pass --max-sparsity "
            f"{math.ceil(cells / n)}"
        )
    trace_il = ((il.astype(np.int64) - il0) // il_step).astype(np.int32)
    trace_xl = ((xl.astype(np.int64) - xl0) // xl_step).astype(np.int32)
    flat = trace_il.astype(np.int64) * n_xl + trace_xl
    order = np.argsort(flat, kind="stable")  # equal cells keep file order
    repeat = np.nonzero(flat[order][1:] == flat[order][:-1])[0]
    if repeat.size:
        later = order[repeat + 1]  # the second (or later) trace at a repeated cell
        k = int(np.argmin(later))
        t2, t1 = int(later[k]), int(order[repeat[k]])
        at = f"inline {int(il[t2])}, crossline {int(xl[t2])}"
        dup_cells = flat[later]
        raise _GridProblem(
            f"duplicate traces: {at} appears at trace #{t1 + 1} and #{t2 + 1} "
            f"({len(np.unique(dup_cells))} locations have more than one trace)")
    inlines = (il0 + il_step * np.arange(n_il)).astype(np.int32)
    crosslines = (xl0 + xl_step * np.arange(n_xl)).astype(np.int32)
    return SurveyGeometry(inlines, crosslines, trace_il, trace_xl, il_byte, xl_byte,
                          {"fill_ratio": n / cells, "inline_step": il_step, "crossline_step": xl_step})


def _locations(headers: dict, il_byte: int, xl_byte: int) -> np.ndarray:
    """One int64 per trace naming its (value at ``il_byte``, value at ``xl_byte``) pair: [T]."""
    return headers[(il_byte, 4)].astype(np.int64) << 32 | (headers[(xl_byte, 4)].astype(np.int64) & 0xFFFFFFFF)


def refuse_pre_stack(layout: SegyLayout, headers: dict[tuple[int, int], np.ndarray],
                     pairs: list[tuple[int, int]]) -> None:
    """Raise :class:`SFMError` if the file holds pre-stack traces: the offset (bytes 37-40) is not one value.

    A post-stack cube has one offset (0, absent, or the offset of a common-offset cube). Varying offsets
    mean gathers: several traces per (inline, crossline) location (CDP gathers, one gather), or one per
    (shot, channel) "location" of a shot gather whose line-number bytes hold shot and channel numbers.
    The message names the offsets and the traces per location at the first pair of ``pairs`` whose
    values are not all the same.
    """
    offsets = headers[OFFSET_FIELD]
    low, high = int(offsets.min()), int(offsets.max())
    if low == high:
        return
    n = layout.n_traces
    il_byte, xl_byte = next((p for p in pairs if len(np.unique(_locations(headers, *p))) > 1), pairs[0])
    locations = np.unique(_locations(headers, il_byte, xl_byte))
    if len(locations) == 1:
        where = (f"all {n} traces at one location (bytes {il_byte}/{xl_byte} = {int(headers[(il_byte, 4)][0])}/"
                 f"{int(headers[(xl_byte, 4)][0])}): a single gather")
    elif len(locations) == n:
        changes = int(np.count_nonzero(np.diff(offsets)))
        where = (f"1 trace per location at bytes {il_byte}/{xl_byte} with the offset changing {changes} times from "
                 "trace to trace: shot/channel numbers of a shot gather, not an inline/crossline grid")
    else:
        where = f"{n / len(locations):.1f} traces per (inline, crossline) location at bytes {il_byte}/{xl_byte}"
    raise SFMError(
        f"{layout.name} is pre-stack data: {len(np.unique(offsets))} offsets from {low} to {high} (trace bytes 37-40), "
        f"{where}; ingest takes post-stack cubes only: stack the gathers, or select one offset (a common-offset "
        "cube) first")


def sample_start_ms(layout: SegyLayout, headers: dict[tuple[int, int], np.ndarray]) -> int:
    """The time of the first sample, ms: the delay recording time (trace bytes 109-110), as segyio reads it.

    A cube has one time axis, so every trace must have the same delay; else :class:`SFMError`.
    """
    delays = headers[DELAY_FIELD]
    values, first, counts = np.unique(delays, return_index=True, return_counts=True)
    if len(values) == 1:
        return int(values[0])
    n, common = layout.n_traces, int(np.argmax(counts))
    earliest = first.copy()
    earliest[common] = n
    other = int(np.argmin(earliest))  # the delay other than the most common one that comes first
    raise SFMError(
        f"{layout.name}: the traces start at {len(values)} different times: the delay recording time (trace bytes "
        f"109-110) is {int(values[common])} ms in {int(counts[common])} of {n} traces but {int(values[other])} ms in "
        f"trace #{int(first[other]) + 1}; a cube needs one time axis: shift the traces to one delay (e.g. pad or "
        "crop them to a common start) before ingest")


def build_geometry(layout: SegyLayout, headers: dict[tuple[int, int], np.ndarray], iline_byte: int | None = None,
                   xline_byte: int | None = None, max_sparsity: float = 10.0) -> SurveyGeometry:
    """The (inline, crossline) grid from the headers at the given bytes, or found among the common pairs.

    Without given bytes, 189/193 is tried first, then 9/21 and 221/225, and the CDP coordinates 181/185
    last; the pair used is recorded in ``extra["byte_locations"]`` ("given", "default", "detected", or
    "detected (CDP coordinates ...)" when only 181/185 formed a grid). Pre-stack files are refused
    first (:func:`refuse_pre_stack`), whatever the bytes.
    """
    name = layout.name
    if bool(iline_byte) != bool(xline_byte):
        raise SFMError("give both --iline-byte and --xline-byte, or neither to detect them")
    check_trace_headers(layout, headers)
    given = bool(iline_byte and xline_byte)
    pairs = [(iline_byte, xline_byte)] if given else COMMON_BYTE_PAIRS
    refuse_pre_stack(layout, headers, pairs)
    start_ms = sample_start_ms(layout, headers)
    problems: list[tuple[tuple[int, int], _GridProblem]] = []
    for il_byte, xl_byte in pairs:
        try:
            geometry = _grid(layout, headers, il_byte, xl_byte, max_sparsity)
        except _GridProblem as problem:
            problems.append(((il_byte, xl_byte), problem))
            continue
        if not given and (il_byte, xl_byte) != DEFAULT_BYTE_PAIR and min(geometry.shape) < 2:
            # a detected pair must look like a 3D grid: a constant field (often 0) is not a line number
            problems.append(((il_byte, xl_byte), _GridProblem(
                f"a {geometry.shape[0]} x {geometry.shape[1]} grid, not a 3D survey")))
            continue
        geometry.extra["byte_locations"] = "given" if given else (
            "default" if (il_byte, xl_byte) == DEFAULT_BYTE_PAIR else
            "detected (CDP coordinates 181/185: no line-number pair formed a grid)"
            if (il_byte, xl_byte) == CDP_COORDINATE_PAIR else "detected")
        geometry.extra["byte_pairs_rejected"] = {f"{a}/{b}": str(p) for (a, b), p in problems}
        geometry.extra["sample_start_ms"] = start_ms
        return geometry
    (il_byte, xl_byte), first = problems[0]
    if given:
        raise SFMError(f"{name}: no valid inline/crossline grid at bytes {il_byte}/{xl_byte}: {first}; "
                       "check --iline-byte/--xline-byte")
    others = "; ".join(f"{a}/{b}: {p}" for (a, b), p in problems[1:])
    raise SFMError(f"{name}: no valid inline/crossline grid at bytes {il_byte}/{xl_byte}: {first}; nor at the other "
                   f"common byte pairs ({others}); pass --iline-byte/--xline-byte with the header bytes that hold them")


def cdp_coordinates(geometry: SurveyGeometry, headers: dict[tuple[int, int], np.ndarray]
                    ) -> tuple[np.ndarray, np.ndarray, int]:
    """CDP X/Y (bytes 181/185) scaled by the coordinate scalar (byte 71), on the grid [IL, XL] float64.

    Holes are NaN. Also returns the most common raw scalar (recorded with the store).
    """
    scalar = headers[SCALAR_FIELD].astype(np.float64)
    factor = np.where(scalar < 0, 1.0 / np.where(scalar == 0, 1, -scalar), np.where(scalar == 0, 1.0, scalar))
    grid_x = np.full(geometry.shape, np.nan)
    grid_y = np.full(geometry.shape, np.nan)
    grid_x[geometry.trace_il, geometry.trace_xl] = headers[CDP_X_FIELD] * factor
    grid_y[geometry.trace_il, geometry.trace_xl] = headers[CDP_Y_FIELD] * factor
    values, counts = np.unique(headers[SCALAR_FIELD], return_counts=True)
    return grid_x, grid_y, int(values[np.argmax(counts)])


