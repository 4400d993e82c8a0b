"""Where label volumes come from, each checked against the grid of the survey they label.

:func:`survey_grid` reads what a survey store says of its grid (shape, line numbers, samples, the SEG-Y
byte locations its traces were placed by). :func:`open_source` opens a label source for that grid:

- a SEG-Y file with the survey's geometry (:class:`SegyLabels`): the same samples per trace and sample
  interval, each trace placed by its inline/crossline numbers at the survey's byte locations; traces may
  be missing (every voxel of a missing trace is unlabelled) and sample values must be whole numbers;
- a ``.npy`` array [IL, XL, NS] on the survey's grid (:class:`ArrayLabels`);
- a Zarr or MDIO store with an integer 3-D variable (:class:`ArrayLabels`), its inline, crossline and
  sample coordinates, where it has them, equal to the survey's.

A source reads the raw values of a run of inlines, ``block(i0, i1)`` -> (values [n, XL, NS], present
[n, XL] bool: the traces the source has); :mod:`sfm.ingest.labels` turns them into classes. Anything that
does not fit the grid is refused with one line naming the label file and the mismatch.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np

from sfm import storage
from sfm.errors import SFMError

SAMPLE_COORDS = ("sample", "time", "depth")


@dataclass
class SurveyGrid:
    """The grid of one published survey, as its store records it."""

    store_url: str
    survey_id: str
    name: str
    shape: tuple[int, int, int]  # IL, XL, NS
    inlines: np.ndarray  # [IL] line numbers
    crosslines: np.ndarray  # [XL]
    samples: np.ndarray  # [NS] ms (or m)
    sample_interval_us: int
    bricks: tuple[int, int, int]  # the amplitude's chunks: label stores are chunked alike
    trace_mask: np.ndarray  # [IL, XL] bool: traces the survey has
    iline_byte: int
    xline_byte: int


def survey_grid(survey: str, data_root: str = "") -> SurveyGrid:
    """The grid of ``survey``: a survey id published in ``data_root``'s manifest, or a survey store URL."""
    import zarr

    from sfm.formats import manifest
    from sfm.formats.contracts import read_store_attrs

    url = survey
    if data_root and len(survey) == 16 and all(c in "0123456789abcdef" for c in survey):
        row = manifest.get_row(data_root, survey)
        if row is None:
            raise SFMError(f"survey {survey} is not published in {data_root}; ingest it first (`sfm ingest`)")
        url = row["store_url"]
    url = storage.normalize(url)
    attrs = read_store_attrs(url, f"survey store {url}")
    group = zarr.open_group(storage.zarr_store(url, read_only=True), mode="r")
    shape = tuple(int(n) for n in attrs["shape"])
    interval = int(attrs["sample_interval_us"])
    samples = next((np.asarray(group[n][...], np.float64) for n in SAMPLE_COORDS if n in group),
                   attrs.get("sample_start_ms", 0) + np.arange(shape[2]) * interval / 1000.0)
    return SurveyGrid(url, attrs["survey_id"], str(attrs.get("survey_name") or attrs["name"]), shape,
                      np.asarray(group["inline"][...]), np.asarray(group["crossline"][...]), samples, interval,
                      tuple(int(b) for b in attrs["store"]["bricks"]), np.asarray(group["trace_mask"][...], bool),
                      int(attrs.get("iline_byte", 189)), int(attrs.get("xline_byte", 193)))


def refuse(url: str, problem: str, fix: str) -> SFMError:
    return SFMError(f"label file {url}: {problem}; {fix}")


class ArrayLabels:
    """Labels from an array on the survey's grid: a ``.npy`` file, or an integer variable of a Zarr or MDIO store."""

    def __init__(self, url: str, array: Any, kind: str, variable: str = ""):
        self.url, self.array, self.kind, self.variable = url, array, kind, variable

    def block(self, i0: int, i1: int) -> tuple[np.ndarray, np.ndarray]:
        values = np.asarray(self.array[i0:i1])
        return values, np.ones(values.shape[:2], bool)


def check_array(url: str, shape: tuple[int, ...], dtype: np.dtype, grid: SurveyGrid) -> None:
    """Refuse an array whose shape is not the survey's grid or whose values are not integer classes."""
    if tuple(shape) != grid.shape:
        raise refuse(url, f"shape {list(shape)} does not match survey {grid.name}'s grid {list(grid.shape)} "
                     "(inline x crossline x sample)", "write the labels on the survey's grid")
    if not (np.issubdtype(dtype, np.integer) or dtype == np.bool_):
        raise refuse(url, f"dtype {dtype} is not an integer class per sample",
                     "store the labels as integers (e.g. uint8), one class per sample")


def npy_labels(url: str, grid: SurveyGrid) -> ArrayLabels:
    if storage.is_s3(url):
        array = np.load(io.BytesIO(storage.read_bytes(url)), allow_pickle=False)
    else:
        try:
            array = np.load(storage.normalize(url), mmap_mode="r", allow_pickle=False)
        except FileNotFoundError:
            raise refuse(url, "does not exist", "check the path") from None
        except ValueError as err:
            raise refuse(url, f"is not a .npy array ({err})", "save the labels with numpy.save") from None
    check_array(url, array.shape, array.dtype, grid)
    return ArrayLabels(url, array, "npy")


def zarr_labels(url: str, grid: SurveyGrid, variable: str = "") -> ArrayLabels:
    """An integer 3-D variable of a Zarr (or MDIO) store: ``variable``, or the only one there is."""
    import zarr

    from sfm.ingest.mdio_source import is_mdio

    try:
        group = zarr.open_group(storage.zarr_store(url, read_only=True), mode="r")
    except (FileNotFoundError, KeyError, ValueError) as err:
        raise refuse(url, f"is neither SEG-Y, .npy nor a Zarr store ({type(err).__name__})",
                     "give a SEG-Y file, a .npy array or a Zarr/MDIO store") from None
    arrays = {name: a for name, a in group.arrays() if len(a.shape) == 3}
    integer = [n for n, a in arrays.items() if np.issubdtype(np.dtype(a.dtype), np.integer)]
    if variable and variable not in arrays:
        raise refuse(url, f"has no 3-D variable {variable!r} (it has {sorted(arrays) or 'none'})", "name one of them")
    if not variable and len(integer) != 1:
        raise refuse(url, f"has {len(integer)} integer 3-D variables ({sorted(integer)})",
                     "name the one holding the labels with --variable")
    name = variable or integer[0]
    check_array(url, arrays[name].shape, np.dtype(arrays[name].dtype), grid)
    for coord, expected in (("inline", grid.inlines), ("crossline", grid.crosslines)):
        if coord in group and not np.array_equal(np.asarray(group[coord][...]), expected):
            values = np.asarray(group[coord][...])
            raise refuse(url, f"{coord} numbers {values[:1].tolist()}..{values[-1:].tolist()} are not survey "
                         f"{grid.name}'s {expected[:1].tolist()}..{expected[-1:].tolist()}",
                         "label the survey's own lines")
    for coord in SAMPLE_COORDS:
        if coord in group and not np.allclose(np.asarray(group[coord][...], np.float64), grid.samples):
            raise refuse(url, f"its {coord} axis is not survey {grid.name}'s samples", "label the survey's own samples")
    return ArrayLabels(url, arrays[name], "mdio" if is_mdio(url) else "zarr", name)


class SegyLabels:
    """Labels from a SEG-Y file with the survey's geometry: one class per sample, traces placed by their
    inline/crossline numbers at the survey's byte locations; the survey's other traces are unlabelled."""

    kind, variable = "segy", ""

    def __init__(self, url: str, grid: SurveyGrid):
        from sfm.formats.segy import DELAY_FIELD, read_layout, scan_file

        self.url = url
        self.layout = read_layout(url)
        if self.layout.samples != grid.shape[2]:
            raise refuse(url, f"{self.layout.samples} samples per trace, survey {grid.name} has {grid.shape[2]}",
                         "write the labels with the survey's samples")
        if self.layout.sample_interval_us != grid.sample_interval_us:
            raise refuse(url, f"sample interval {self.layout.sample_interval_us} us, survey {grid.name}'s is "
                         f"{grid.sample_interval_us} us", "write the labels with the survey's samples")
        fields = [(grid.iline_byte, 4), (grid.xline_byte, 4), DELAY_FIELD]
        _, headers = scan_file(self.layout, fields)
        delays = np.unique(headers[DELAY_FIELD])
        if len(delays) and (len(delays) > 1 or abs(int(delays[0]) - grid.samples[0]) > 1e-6):
            raise refuse(url, f"traces start at {delays[:3].tolist()} ms, survey {grid.name}'s at "
                         f"{grid.samples[0]:g} ms (trace bytes 109-110)", "write the labels with the survey's samples")
        self.il = self._indices(headers[(grid.iline_byte, 4)], grid.inlines, "inline", grid)
        self.xl = self._indices(headers[(grid.xline_byte, 4)], grid.crosslines, "crossline", grid)
        cells = self.il.astype(np.int64) * grid.shape[1] + self.xl
        unique, counts = np.unique(cells, return_counts=True)
        if len(unique) < len(cells):
            cell = int(unique[np.argmax(counts)])
            raise refuse(url, f"{len(cells) - len(unique)} traces repeat a location (e.g. inline "
                         f"{grid.inlines[cell // grid.shape[1]]}, crossline {grid.crosslines[cell % grid.shape[1]]})",
                         "write one trace per location")
        self.order = np.argsort(self.il, kind="stable")
        self.sorted_il = self.il[self.order]
        self.xls = grid.shape[1]

    def _indices(self, numbers: np.ndarray, lines: np.ndarray, axis: str, grid: SurveyGrid) -> np.ndarray:
        """Grid indices of the traces' line ``numbers`` along ``axis``, or refused: a number off the survey's lines."""
        step = int(lines[1] - lines[0]) if len(lines) > 1 else 1
        offset = numbers.astype(np.int64) - int(lines[0])
        index = offset // step
        off = (offset % step != 0) | (index < 0) | (index >= len(lines))
        if off.any():
            bad = int(numbers[np.argmax(off)])
            raise refuse(self.url, f"{int(off.sum())} traces have {axis} numbers off survey {grid.name}'s grid "
                         f"(e.g. {bad}; the survey's {axis}s run {int(lines[0])}..{int(lines[-1])} by {step}, at "
                         f"trace bytes {grid.iline_byte if axis == 'inline' else grid.xline_byte})",
                         "write the labels on the survey's geometry")
        return index.astype(np.int32)

    def block(self, i0: int, i1: int) -> tuple[np.ndarray, np.ndarray]:
        from sfm.formats.segy_traces import TraceReader

        values = np.zeros((i1 - i0, self.xls, self.layout.samples), np.float32)
        present = np.zeros((i1 - i0, self.xls), bool)
        lo, hi = np.searchsorted(self.sorted_il, [i0, i1])
        traces = np.sort(self.order[lo:hi])
        if len(traces):
            buf = np.empty((len(traces), self.layout.samples), np.float32)
            with TraceReader(self.layout) as reader:
                for run in np.split(np.arange(len(traces)), np.flatnonzero(np.diff(traces) != 1) + 1):
                    reader.read_into(int(traces[run[0]]), int(traces[run[-1]]) + 1, buf[run[0]:run[-1] + 1])
            values[self.il[traces] - i0, self.xl[traces]] = buf
            present[self.il[traces] - i0, self.xl[traces]] = True
        return values, present


def open_source(url: str, grid: SurveyGrid, variable: str = ""):
    """The label source at ``url`` (SEG-Y by its suffix or its header, ``.npy``, else a Zarr/MDIO store),
    checked against ``grid``."""
    from sfm.formats.segy import BINARY_HEADER_BYTES, TEXT_HEADER_BYTES, layout_from_header

    url = storage.normalize(url).rstrip("/")
    lower = url.lower()
    if lower.endswith(".npy"):
        return npy_labels(url, grid)
    if lower.endswith((".sgy", ".segy")):
        return SegyLabels(url, grid)
    if not storage.exists(storage.join(url, "zarr.json")):
        try:  # a SEG-Y file by another name
            head, size = storage.read_head(url, TEXT_HEADER_BYTES + BINARY_HEADER_BYTES)
            layout_from_header(url, head, size)
        except (SFMError, OSError, IsADirectoryError):
            raise refuse(url, "is neither SEG-Y, .npy nor a Zarr store", "give one of these") from None
        return SegyLabels(url, grid)
    return zarr_labels(url, grid, variable)
