"""A prediction as SEG-Y, with the source's trace headers: what interpretation software loads beside the survey.

Two sources of headers, in this order:

- the SEG-Y file the survey was ingested from (its ``source_url``, when it is still there with the size it
  had): the export is that file with each trace's samples replaced by the prediction at its inline and
  crossline (read at the store's ``iline_byte`` / ``xline_byte``), as IEEE floats (format 5) in the file's byte
  order; every header byte, extended textual headers and trace order included, is the source's;
- the trace headers an MDIO-layout store or an MDIO store keeps (``headers``, the rev-1 fields, and
  ``segy_file_header``), written back by :func:`sfm.formats.mdio_layout.encode_trace_headers`, one trace per
  live cell, inlines outer, big-endian.

Classes are written as their float values. The file is written whole or not at all (a temporary name
renamed into place; on S3 one upload). Memory: the prediction's brick columns one brick row (or column) of
the survey holds, as the traces come.
"""

from __future__ import annotations

import collections
import os
import tempfile
from typing import Callable

import numpy as np

from sfm import storage
from sfm.errors import SFMError
from sfm.predict import store
from sfm.predict.store import PredictionPlan

TRACES_PER_READ = 1024


class Columns:
    """Brick columns [bricks IL, bricks XL, NS] of the predicted variable, read as traces ask for them, the
    ``capacity`` most recent kept."""

    def __init__(self, values, bricks: tuple[int, ...], capacity: int):
        self.values, self.bricks, self.capacity = values, bricks, capacity
        self.kept: collections.OrderedDict = collections.OrderedDict()

    def traces(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """[T, NS] float32: the prediction at cells (i, j)."""
        b0, b1 = self.bricks[:2]
        out = np.empty((len(i), self.values.shape[2]), np.float32)
        for n, (a, b) in enumerate(zip(i, j)):
            key = (int(a) // b0, int(b) // b1)
            column = self.kept.get(key)
            if column is None:
                column = self.kept[key] = np.asarray(self.values[key[0] * b0:(key[0] + 1) * b0,
                                                                 key[1] * b1:(key[1] + 1) * b1])
                if len(self.kept) > self.capacity:
                    self.kept.popitem(last=False)
            else:
                self.kept.move_to_end(key)
            out[n] = column[int(a) - key[0] * b0, int(b) - key[1] * b1]
        return out


def predicted(plan: PredictionPlan):
    """The predicted variable, opened without the root ``zarr.json`` (not written yet)."""
    import zarr

    return zarr.open_array(storage.zarr_store(plan.out, read_only=True), path=plan.variable, mode="r")


def header_source(plan: PredictionPlan):
    """Where the export's trace headers come from: ``("source", URL of the source SEG-Y)`` or ``("store", the
    group holding MDIO's headers)``; SFMError when neither can serve, or the prediction is not one value per
    sample. Checked when the prediction is planned, before any work."""
    if len(plan.shape) != 3:
        raise SFMError(f"--segy writes one value per sample, and a prediction of {plan.shape[3]} class "
                       "probabilities has several; predict with --output classes, or without --segy")
    group, attrs, mdio = store.open_source(plan.survey)
    source = attrs.get("source_url", "")
    if attrs.get("source_kind") != "mdio" and _source_intact(source, attrs):
        return "source", source
    holder = group if "headers" in group else mdio if mdio is not None and "headers" in mdio else None
    if holder is None or "segy_file_header" not in holder:
        raise SFMError(f"--segy needs the survey's trace headers: its source {source} is gone or changed, and "
                       f"{plan.survey} keeps no headers (ingested with --layout sfm); restore the SEG-Y, or "
                       "re-ingest it with --layout mdio")
    return "store", holder


def export_segy(plan: PredictionPlan, target: str) -> str:
    """Write the prediction of ``plan`` as the SEG-Y file ``target`` (local or s3://); returns which headers
    it carries: "source" (the source SEG-Y's) or "store" (an MDIO-layout store's)."""
    values = predicted(plan)
    kind, where = header_source(plan)
    if kind == "source":
        _write_atomically(target, lambda path: _from_source(plan, values, where, path))
    else:
        _write_atomically(target, lambda path: _from_headers(plan, values, where, path))
    return kind


def _source_intact(url: str, attrs: dict) -> bool:
    try:
        return bool(url) and storage.read_head(url, 0)[1] == int(attrs.get("source_size", -1))
    except SFMError:
        return False


def _write_atomically(target: str, write: Callable[[str], None]) -> None:
    """``write(path)`` a local file, then put it at ``target`` in one step."""
    if storage.is_s3(target):
        with tempfile.TemporaryDirectory(prefix="sfm-segy-") as tmp:
            path = os.path.join(tmp, "export.sgy")
            write(path)
            storage.upload(path, target)
        return
    target = storage.normalize(target)
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    partial = f"{target}.sfm-{os.getpid()}.partial"
    try:
        write(partial)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _from_source(plan: PredictionPlan, values, source: str, path: str) -> None:
    """The source SEG-Y, its samples replaced by the prediction (format 5, the file's byte order)."""
    from sfm.formats.segy import read_layout
    from sfm.storage.ranged_file import open_ranged

    _, attrs, _ = store.open_source(plan.survey)
    layout = read_layout(source, attrs.get("endian", "auto"))
    order = ">" if layout.endian == "big" else "<"
    inlines, crosslines = (np.asarray(plan_coordinate(plan, name)) for name in ("inline", "crossline"))
    ilb, xlb, hb = int(attrs["iline_byte"]), int(attrs["xline_byte"]), layout.trace_header_bytes
    columns = Columns(values, plan.bricks, max(-(-n // b) for n, b in zip(plan.shape[:2], plan.bricks[:2])) + 1)
    with open_ranged(source) as src, open(path, "wb") as out:
        head = bytearray(src.read(0, layout.data_offset))
        head[3224:3226] = (5).to_bytes(2, layout.endian)  # data sample format: 4-byte IEEE float
        out.write(head)
        for start in range(0, layout.n_traces, TRACES_PER_READ):
            n = min(TRACES_PER_READ, layout.n_traces - start)
            raw = np.frombuffer(src.read(layout.data_offset + start * layout.trace_bytes, n * layout.trace_bytes),
                                np.uint8).reshape(n, layout.trace_bytes)
            headers = raw[:, :hb]
            i = _index(headers[:, ilb - 1:ilb + 3].copy().view(f"{order}i4")[:, 0], inlines, "inline", source)
            j = _index(headers[:, xlb - 1:xlb + 3].copy().view(f"{order}i4")[:, 0], crosslines, "crossline", source)
            records = np.empty((n, hb + 4 * layout.samples), np.uint8)
            records[:, :hb] = headers
            records[:, hb:] = columns.traces(i, j).astype(f"{order}f4").view(np.uint8)
            out.write(records.tobytes())


def plan_coordinate(plan: PredictionPlan, name: str):
    import zarr

    return zarr.open_array(storage.zarr_store(plan.out, read_only=True), path=name, mode="r")[...]


def _index(numbers: np.ndarray, lines: np.ndarray, what: str, source: str) -> np.ndarray:
    """The grid indices of line ``numbers`` among the store's ``lines`` (evenly spaced)."""
    step = int(lines[1] - lines[0]) if len(lines) > 1 else 1
    index = (numbers.astype(np.int64) - int(lines[0])) // step
    if ((index < 0) | (index >= len(lines))).any() or (lines[np.clip(index, 0, len(lines) - 1)] != numbers).any():
        raise SFMError(f"{source} holds {what} numbers the survey store does not (it changed since it was "
                       "ingested?); re-ingest it, or export without --segy")
    return index


def _from_headers(plan: PredictionPlan, values, holder, path: str) -> None:
    """One trace per live cell, inlines outer: the stored rev-1 headers, big-endian, format 5."""
    from sfm.formats.mdio_layout import encode_file_header, encode_trace_headers

    mask = np.asarray(plan_coordinate(plan, "trace_mask"), dtype=bool)
    headers, b0 = holder["headers"], plan.bricks[0]
    with open(path, "wb") as out:
        out.write(encode_file_header(dict(holder["segy_file_header"].attrs), "big", 5))
        for i0 in range(0, plan.shape[0], b0):
            i1 = min(plan.shape[0], i0 + b0)
            live = mask[i0:i1]
            if not live.any():
                continue
            rows = encode_trace_headers(np.asarray(headers[i0:i1])[live], "big")
            samples = np.asarray(values[i0:i1])[live].astype(">f4")
            out.write(np.concatenate([rows, samples.view(np.uint8)], axis=1).tobytes())
