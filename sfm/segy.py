"""Reading post-stack 3D SEG-Y: byte order, geometry from trace headers, traces in slabs.

Trace headers are read straight from the file bytes (a numpy memmap), so inline/crossline numbers
can sit at any 4-byte position of the 240-byte trace header; samples are read and converted by
segyio, which knows every sample format. Problems a user can cause raise :class:`SFMError` naming
the file and the fix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from sfm.errors import SFMError

TEXT_HEADER_BYTES = 3200
BINARY_HEADER_BYTES = 400
TRACE_HEADER_BYTES = 240
# sample format code -> bytes per sample (SEG-Y rev 2)
SAMPLE_BYTES = {1: 4, 2: 4, 3: 2, 5: 4, 6: 8, 8: 1, 9: 8, 10: 4, 11: 2, 12: 8, 16: 1}
COMMON_BYTE_PAIRS = [(189, 193), (9, 21), (181, 185), (221, 225)]


@dataclass
class SegyLayout:
    """Where things are in the file: byte order, sample format, trace record size."""

    path: str
    endian: str  # "big" | "little"
    sample_format: int
    samples: int
    sample_interval_us: int
    n_traces: int
    data_offset: int  # first trace header's byte offset

    @property
    def trace_bytes(self) -> int:
        return TRACE_HEADER_BYTES + self.samples * SAMPLE_BYTES[self.sample_format]


@dataclass
class SurveyGeometry:
    """The regular (inline, crossline) grid the traces sit on.

    ``trace_il[t]``/``trace_xl[t]`` are grid indices of trace t; cells without a trace are holes.
    """

    inlines: np.ndarray  # [IL] int32 line numbers
    crosslines: np.ndarray  # [XL] int32
    trace_il: np.ndarray  # [T] int64 index into inlines
    trace_xl: np.ndarray  # [T] int64 index into crosslines
    iline_byte: int
    xline_byte: int
    extra: dict = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.inlines), len(self.crosslines)


def _header_field(raw: np.ndarray, byte: int, endian: str, size: int = 4) -> np.ndarray:
    """Integer field at 1-based ``byte`` of every trace header. raw: [T, trace_bytes] uint8."""
    dtype = np.dtype(f"{'>' if endian == 'big' else '<'}i{size}")
    cols = raw[:, byte - 1 : byte - 1 + size]
    return np.ascontiguousarray(cols).view(dtype).reshape(-1).astype(np.int64)


def read_layout(path: str, endian: str = "auto") -> SegyLayout:
    """Byte order, format and trace count of a local SEG-Y file."""
    with open(path, "rb") as fh:
        head = fh.read(TEXT_HEADER_BYTES + BINARY_HEADER_BYTES)
    return layout_from_header(path, head, os.path.getsize(path), endian)


def layout_from_header(path: str, head: bytes, size: int, endian: str = "auto") -> SegyLayout:
    """The layout from the first 3600 bytes and the file size (works for remote files too)."""
    name = os.path.basename(str(path).rstrip("/"))
    if size < TEXT_HEADER_BYTES + BINARY_HEADER_BYTES:
        raise SFMError(f"{name} is not SEG-Y: {size} bytes is shorter than the 3600-byte file header")
    binary = head[TEXT_HEADER_BYTES:]

    def field16(offset: int, order: str) -> int:  # offset: 1-based position within the file
        start = offset - TEXT_HEADER_BYTES - 1
        return int.from_bytes(binary[start : start + 2], order, signed=True)

    candidates = ["big", "little"] if endian == "auto" else [endian]
    if endian == "auto":  # rev-2 byte-order constant 0x01020304 at byte 3297, in the file's order
        for order in ("big", "little"):
            if int.from_bytes(binary[96:100], order) == 0x01020304:
                candidates = [order]
    for order in candidates:
        fmt, samples, interval = field16(3225, order), field16(3221, order), field16(3217, order)
        if fmt in SAMPLE_BYTES and samples > 0:
            break
    else:
        if endian == "auto":
            raise SFMError(
                f"{name} is not readable SEG-Y: no byte order gives a valid sample format code and sample "
                "count in the binary header; pass --endian big|little if you know it"
            )
        raise SFMError(f"{name}: the binary header read as {endian}-endian has format code {fmt} and {samples} samples; "
                       "try the other --endian")
    ext_headers = max(0, field16(3505, order))
    data_offset = TEXT_HEADER_BYTES + BINARY_HEADER_BYTES + ext_headers * TEXT_HEADER_BYTES
    trace_bytes = TRACE_HEADER_BYTES + samples * SAMPLE_BYTES[fmt]
    n_traces, rest = divmod(size - data_offset, trace_bytes)
    if n_traces <= 0:
        raise SFMError(f"{name} has a file header but no traces; nothing to ingest")
    if rest:
        raise SFMError(
            f"{name} is truncated or inconsistent: {size - data_offset} trace bytes are not a whole number of "
            f"{trace_bytes}-byte traces ({samples} samples, format {fmt}); re-export or re-download the file"
        )
    return SegyLayout(str(path), order, fmt, samples, max(0, interval), n_traces, data_offset)


def trace_headers(layout: SegyLayout) -> np.ndarray:
    """All trace headers as a read-only view [T, 240] uint8 (a memmap, not loaded into memory)."""
    records = np.memmap(layout.path, dtype=np.uint8, mode="r", offset=layout.data_offset,
                        shape=(layout.n_traces, layout.trace_bytes))
    return records[:, :TRACE_HEADER_BYTES]


def build_geometry(layout: SegyLayout, iline_byte: int | None = None, xline_byte: int | None = None,
                   max_sparsity: float = 10.0) -> SurveyGeometry:
    """Inline/crossline grid from the headers at the given bytes, or the first common pair that works."""
    name = os.path.basename(layout.path)
    headers = trace_headers(layout)
    pairs = [(iline_byte, xline_byte)] if iline_byte and xline_byte else COMMON_BYTE_PAIRS
    problems = []
    for il_byte, xl_byte in pairs:
        for byte in (il_byte, xl_byte):
            if not 1 <= byte <= TRACE_HEADER_BYTES - 3:
                raise SFMError(f"byte location {byte} is outside the 240-byte trace header; use 1..237")
        il = _header_field(headers, il_byte, layout.endian)
        xl = _header_field(headers, xl_byte, layout.endian)
        inlines, trace_il = np.unique(il, return_inverse=True)
        crosslines, trace_xl = np.unique(xl, return_inverse=True)
        cells = len(inlines) * len(crosslines)
        if len(inlines) < 2 and len(crosslines) < 2 and layout.n_traces > 1:
            problems.append(f"{il_byte}/{xl_byte}: every trace has the same numbers")
            continue
        flat = trace_il * len(crosslines) + trace_xl
        counts = np.bincount(flat, minlength=cells)
        if counts.max() > 1:
            first = int(np.argmax(counts > 1))
            pair = (int(inlines[first // len(crosslines)]), int(crosslines[first % len(crosslines)]))
            problems.append(f"{il_byte}/{xl_byte}: duplicate traces at inline {pair[0]}, crossline {pair[1]}")
            if iline_byte and xline_byte:
                raise SFMError(
                    f"{name} has {int(counts.max())} traces at inline {pair[0]}, crossline {pair[1]} (bytes "
                    f"{il_byte}/{xl_byte}): duplicate traces or pre-stack data; ingest needs one trace per location"
                )
            continue
        sparsity = cells / layout.n_traces
        if sparsity > max_sparsity:
            problems.append(f"{il_byte}/{xl_byte}: grid {len(inlines)}x{len(crosslines)} is {sparsity:.1f}x "
                            f"larger than the {layout.n_traces} traces")
            continue
        return SurveyGeometry(inlines.astype(np.int32), crosslines.astype(np.int32), trace_il, trace_xl,
                              il_byte, xl_byte, {"fill_ratio": layout.n_traces / cells})
    raise SFMError(f"{name}: no valid inline/crossline grid ({'; '.join(problems)}); "
                   "pass --iline-byte/--xline-byte with the header bytes that hold them")


def cdp_coordinates(layout: SegyLayout, geometry: SurveyGeometry) -> tuple[np.ndarray, np.ndarray]:
    """CDP X/Y (bytes 181/185) scaled by the coordinate scalar (byte 71), on the grid [IL, XL] float64.

    Holes are NaN.
    """
    headers = trace_headers(layout)
    scalar = _header_field(headers, 71, layout.endian, size=2).astype(np.float64)
    factor = np.where(scalar < 0, 1.0 / np.where(scalar == 0, 1, -scalar), np.where(scalar == 0, 1.0, scalar))
    cx = _header_field(headers, 181, layout.endian) * factor
    cy = _header_field(headers, 185, layout.endian) * factor
    grid_x = np.full(geometry.shape, np.nan)
    grid_y = np.full(geometry.shape, np.nan)
    grid_x[geometry.trace_il, geometry.trace_xl] = cx
    grid_y[geometry.trace_il, geometry.trace_xl] = cy
    return grid_x, grid_y


def text_header(layout: SegyLayout) -> str:
    """The 3200-byte textual header decoded as EBCDIC or ASCII, whichever reads as text."""
    with open(layout.path, "rb") as fh:
        raw = fh.read(TEXT_HEADER_BYTES)
    ascii_text = raw.decode("ascii", errors="replace")
    ebcdic_text = raw.decode("cp037", errors="replace")

    def printable(text: str) -> int:
        return sum(ch.isprintable() for ch in text)

    text = ebcdic_text if printable(ebcdic_text) > printable(ascii_text) else ascii_text
    return "\n".join(text[i : i + 80].rstrip() for i in range(0, len(text), 80)).rstrip("\x00 \n")


class TraceReader:
    """Reads trace samples as float32 through segyio, which converts every sample format."""

    def __init__(self, layout: SegyLayout):
        import segyio

        self.layout = layout
        try:
            self._file = segyio.open(layout.path, mode="r", ignore_geometry=True, endian=layout.endian)
        except Exception as err:  # segyio raises RuntimeError/ValueError/OSError for bad files
            raise SFMError(f"{os.path.basename(layout.path)} cannot be read by segyio ({err}); "
                           "check the file is complete post-stack SEG-Y") from err

    def read(self, start: int, stop: int) -> np.ndarray:
        """Traces [start, stop) as float32 [stop - start, samples]."""
        data = self._file.trace.raw[start:stop]
        return np.asarray(data, dtype=np.float32).reshape(stop - start, self.layout.samples)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "TraceReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
