"""Synthetic post-stack seismic surveys: a volume that looks like geology, written as real SEG-Y.

The volume and its fault labels come from :func:`sfm.synth.geology.synthesize_volume` (FaultSeg3D's
forward model).

:func:`write_segy` writes any ``[IL, XL, NS]`` volume with segyio in formats 1, 3, 5 or 8, either
endianness, either trace sorting and in/crossline numbers at any 4-byte trace header position
(:class:`SegyOptions`);
:func:`synth_survey` does both and puts the fault labels beside the SEG-Y file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from sfm.errors import SFMError
from sfm.synth.geology import SAMPLE_INTERVAL_US, synthesize_volume

log = logging.getLogger(__name__)


# SEG-Y sample format code -> numpy dtype segyio reads and writes traces in. segyio does not
# scale or round for the integer formats: a float trace is truncated (and wraps on overflow).
SAMPLE_FORMATS = {1: np.float32, 3: np.int16, 5: np.float32, 8: np.int8}
ENDIANS = ("big", "little")
SORTINGS = ("inline", "crossline")

# Trace header fields written besides the in/crossline numbers, as (1-based byte, width).
# The in/crossline numbers may not overlap these: readers need them to place and scale traces,
# and segyio builds its geometry from the offset field.
TRACE_SEQUENCE_LINE = (1, 4)
CDP = (21, 4)
OFFSET = (37, 4)
SCALCO = (71, 2)
TRACE_SAMPLE_COUNT = (115, 2)
TRACE_SAMPLE_INTERVAL = (117, 2)
CDP_X = (181, 4)
CDP_Y = (185, 4)
PROTECTED_FIELDS = {
    "offset": OFFSET,
    "coordinate scalar": SCALCO,
    "sample count": TRACE_SAMPLE_COUNT,
    "sample interval": TRACE_SAMPLE_INTERVAL,
    "CDP_X": CDP_X,
    "CDP_Y": CDP_Y,
}

# Survey grid: a rotated regular grid of 25 m bins, coordinates stored in centimetres.
GRID_ORIGIN_M = (605000.00, 6073000.00)
GRID_BIN_M = 25.0
GRID_ROTATION_DEG = 30.0
COORDINATE_SCALAR = -100  # SEG-Y convention: negative means divide by 100

TEXT_HEADER_BYTES = 3600  # 3200 textual + 400 binary
TRACE_HEADER_BYTES = 240


# --------------------------------------------------------------------------------------------
# SEG-Y


@dataclass(frozen=True)
class SegyOptions:
    """How :func:`write_segy` lays a survey out: the sample format code (1, 3, 5 or 8), the byte order, the
    1-based first bytes of the 4-byte signed inline and crossline numbers in each trace header (any position
    1..237 clear of the fields readers need), the trace order (inline: crossline numbers fastest), the first
    line numbers and the sample interval."""

    sample_format: int = 5
    endian: str = "big"
    iline_byte: int = 189
    xline_byte: int = 193
    sorting: str = "inline"
    first_inline: int = 100
    first_crossline: int = 300
    sample_interval_us: int = SAMPLE_INTERVAL_US

    def check(self) -> None:
        """Raise :class:`SFMError` naming the option and the fix if the layout is not writable."""
        if self.sample_format not in SAMPLE_FORMATS:
            raise SFMError(f"--format {self.sample_format} is not supported; use 1 (IBM float), 3 (int16), "
                           "5 (IEEE float) or 8 (int8)")
        if self.endian not in ENDIANS:
            raise SFMError(f"--endian {self.endian!r} is not a byte order; use 'big' or 'little'")
        if self.sorting not in SORTINGS:
            raise SFMError(f"--sorting {self.sorting!r} is not a trace sorting; use 'inline' or 'crossline'")

        spans = {}
        for option, byte in (("--iline-byte", self.iline_byte), ("--xline-byte", self.xline_byte)):
            if isinstance(byte, bool) or not isinstance(byte, (int, np.integer)) or not 1 <= byte <= 237:
                raise SFMError(
                    f"{option} {byte} is outside the 240-byte trace header; "
                    "give the 1-based first byte of a 4-byte field, from 1 to 237"
                )
            spans[option] = set(range(byte, byte + 4))
            for name, (start, width) in PROTECTED_FIELDS.items():
                if spans[option] & set(range(start, start + width)):
                    raise SFMError(
                        f"{option} {byte} overlaps the {name} field (bytes {start}-{start + width - 1}); "
                        "choose a 4-byte position clear of bytes 37-40, 71-72, 115-118 and 181-188"
                    )
        if spans["--iline-byte"] & spans["--xline-byte"]:
            raise SFMError(
                f"--iline-byte {self.iline_byte} and --xline-byte {self.xline_byte} overlap; "
                "give two different 4-byte positions at least 4 bytes apart"
            )


def write_segy(path, amplitude: np.ndarray, options: SegyOptions = SegyOptions(), text: Sequence[str] = ()) -> None:
    """Write ``amplitude`` [IL, XL, NS] as a post-stack 3D SEG-Y file at ``path``, laid out as ``options`` say.

    Traces go in inline order (crossline numbers fastest) or crossline order (inline numbers
    fastest), as ``options.sorting`` says. Each trace header holds the inline and crossline number as
    4-byte signed integers at ``options.iline_byte`` / ``options.xline_byte``, the CDP coordinates of a
    rotated 25 m grid at bytes 181/185 with scalar -100 at byte 71, the trace sequence number (byte 1),
    CDP bin number (21), offset 0 (37), sample count and interval. The integer formats 3 and 8 are scaled
    so the largest absolute amplitude is 0.9 of the type's range; the textual header (EBCDIC) states the
    factor. ``text`` adds lines to that header.

    Plain ``segyio.open(path, iline=B, xline=B)`` reads the result when B starts a 4-byte field
    segyio knows (1-25, 41-65 and 73-85 in steps of 4, 189, 193, 197, 205, 219, 225, 233, 237).
    Other positions are written just the same, but segyio refuses them (``KeyError``) or, where
    it knows a 2-byte field, reads only 2 bytes; readers must then take the bytes themselves.
    """
    amplitude = np.asarray(amplitude)
    if amplitude.ndim != 3 or min(amplitude.shape) < 1:
        raise ValueError(f"amplitude must be [IL, XL, NS] with every axis >= 1, got shape {amplitude.shape}")
    options.check()
    ni, nx, ns = amplitude.shape
    if ns > 32767:
        raise SFMError(f"NS {ns} does not fit the 2-byte SEG-Y sample count; use --shape with NS <= 32767")

    import segyio

    traces, scale = encode_samples(amplitude, options.sample_format)
    if options.sorting == "crossline":
        traces = traces.transpose(1, 0, 2)
    # Our own copy: for format 1 segyio converts each trace to IBM and back in place, rounding it.
    traces = np.array(traces.reshape(-1, ns), order="C", copy=True)

    spec = segyio.spec()
    spec.iline, spec.xline = options.iline_byte, options.xline_byte
    spec.format = options.sample_format
    spec.endian = options.endian
    spec.sorting = {
        "inline": segyio.TraceSortingFormat.INLINE_SORTING,
        "crossline": segyio.TraceSortingFormat.CROSSLINE_SORTING,
    }[options.sorting]
    spec.samples = np.arange(ns) * (options.sample_interval_us / 1000.0)
    spec.ilines = options.first_inline + np.arange(ni)
    spec.xlines = options.first_crossline + np.arange(nx)
    spec.offsets = [0]

    with segyio.create(str(path), spec) as f:
        f.text[0] = _text_header(options, amplitude.shape, scale, text)
        f.bin.update(
            {
                segyio.BinField.Interval: options.sample_interval_us,
                segyio.BinField.IntervalOriginal: options.sample_interval_us,
                segyio.BinField.MeasurementSystem: 1,  # metres
                segyio.BinField.SortingCode: 4,  # horizontally stacked
            }
        )
        for k in range(len(traces)):
            f.trace[k] = traces[k]

    write_trace_headers(path, trace_headers(amplitude.shape, options), ns=ns, sample_format=options.sample_format,
                        endian=options.endian)


def _text_header(options: SegyOptions, shape: tuple[int, int, int], scale: float | None, text: Sequence[str]) -> str:
    """The EBCDIC textual header's 40 lines: what the file of ``shape`` (IL, XL, NS) is and how it is laid out."""
    import segyio

    ni, nx, ns = shape
    o = options
    lines = [
        "SYNTHETIC POST-STACK SEISMIC, NOT REAL DATA. WRITTEN BY SFM.SYNTH",
        *text,
        f"INLINES {o.first_inline}-{o.first_inline + ni - 1} ({ni})  "
        f"CROSSLINES {o.first_crossline}-{o.first_crossline + nx - 1} ({nx})",
        f"SAMPLES {ns} AT {o.sample_interval_us} US  FORMAT {o.sample_format}  {o.endian.upper()} ENDIAN",
        f"SORTING {o.sorting.upper()}",
        f"INLINE BYTE {o.iline_byte}  CROSSLINE BYTE {o.xline_byte}  (4-BYTE SIGNED INTEGERS)",
        f"CDP_X BYTE {CDP_X[0]}  CDP_Y BYTE {CDP_Y[0]}  SCALAR BYTE {SCALCO[0]} = {COORDINATE_SCALAR}",
        f"GRID ORIGIN X {GRID_ORIGIN_M[0]:.2f} Y {GRID_ORIGIN_M[1]:.2f} M, BIN {GRID_BIN_M:g} M, "
        f"ROTATION {GRID_ROTATION_DEG:g} DEG",
    ]
    if scale is not None:
        lines.append(f"INTEGER SAMPLES: AMPLITUDE = SAMPLE / {scale:.6g}")
    lines.append("END TEXTUAL HEADER")
    return segyio.tools.create_text_header({i + 1: line[:76] for i, line in enumerate(lines[:40])})


def encode_samples(amplitude: np.ndarray, sample_format: int) -> tuple[np.ndarray, float | None]:
    """Samples [IL, XL, NS] in the dtype segyio stores ``sample_format`` in, and the integer scale.

    For the integer formats 3 (int16) and 8 (int8) the amplitude is multiplied by ``scale`` so its
    largest absolute value becomes 0.9 of the type's maximum, then rounded; float formats are not
    scaled and ``scale`` is None.
    """
    dtype = SAMPLE_FORMATS[sample_format]
    if np.issubdtype(dtype, np.floating):
        return amplitude.astype(dtype, copy=False), None
    peak = float(np.abs(amplitude).max())
    scale = 0.9 * np.iinfo(dtype).max / peak if peak > 0 else 1.0
    return np.rint(amplitude * scale).astype(dtype), scale


def trace_headers(shape: tuple[int, int, int], options: SegyOptions) -> dict[tuple[int, int], np.ndarray]:
    """Trace header values in file order of a survey of ``shape`` (IL, XL, NS) laid out as ``options`` say:
    {(1-based byte, width in bytes): int64 [IL * XL]}.

    The in/crossline numbers come last, so when they share bytes with the trace sequence or CDP
    number (e.g. ``--iline-byte 21``), writing the fields in order leaves the line numbers there.
    """
    ni, nx, ns = shape
    i, j = np.meshgrid(np.arange(ni), np.arange(nx), indexing="ij")  # [IL, XL] grid indices
    if options.sorting == "crossline":
        i, j = i.T, j.T
    i, j = i.ravel(), j.ravel()

    theta = np.deg2rad(GRID_ROTATION_DEG)
    x = GRID_ORIGIN_M[0] + GRID_BIN_M * (j * np.cos(theta) - i * np.sin(theta))
    y = GRID_ORIGIN_M[1] + GRID_BIN_M * (j * np.sin(theta) + i * np.cos(theta))
    n = ni * nx
    fields = {
        TRACE_SEQUENCE_LINE: np.arange(1, n + 1),
        CDP: i * nx + j + 1,
        OFFSET: np.zeros(n, dtype=np.int64),
        SCALCO: np.full(n, COORDINATE_SCALAR),
        TRACE_SAMPLE_COUNT: np.full(n, ns),
        TRACE_SAMPLE_INTERVAL: np.full(n, options.sample_interval_us),
        CDP_X: np.rint(x * -COORDINATE_SCALAR).astype(np.int64),
        CDP_Y: np.rint(y * -COORDINATE_SCALAR).astype(np.int64),
    }
    fields.pop((options.iline_byte, 4), None)  # re-insert at the end so the line numbers win
    fields.pop((options.xline_byte, 4), None)
    fields[(options.iline_byte, 4)] = options.first_inline + i
    fields[(options.xline_byte, 4)] = options.first_crossline + j
    return fields


def write_trace_headers(path, fields: dict, *, ns: int, sample_format: int, endian: str) -> None:
    """Write trace header ``fields`` {(byte, width): [traces]} into a SEG-Y file, in order, all traces at once.

    segyio only accepts the byte positions it has names for, so the headers are written as raw
    signed integers through a memory map, in the file's byte order.
    """
    bytes_per_sample = np.dtype(SAMPLE_FORMATS[sample_format]).itemsize
    record = np.dtype([("header", np.uint8, (TRACE_HEADER_BYTES,)), ("data", np.uint8, (ns * bytes_per_sample,))])
    order = ">" if endian == "big" else "<"
    mm = np.memmap(path, dtype=record, mode="r+", offset=TEXT_HEADER_BYTES)
    try:
        headers = mm["header"]
        for (byte, width), values in fields.items():
            values = np.asarray(values).astype(f"{order}i{width}")
            headers[:, byte - 1 : byte - 1 + width] = values.view(np.uint8).reshape(-1, width)
        mm.flush()
    finally:
        del mm


# --------------------------------------------------------------------------------------------
# survey


def synth_survey(
    out,
    *,
    shape: tuple[int, int, int] = (64, 64, 128),
    seed: int = 0,
    sample_format: int = 5,
    endian: str = "big",
    iline_byte: int = 189,
    xline_byte: int = 193,
    sorting: str = "inline",
) -> dict:
    """Write a synthetic survey to the local path ``out`` and its fault labels beside it.

    The SEG-Y file and the labels (``<out without .sgy/.segy>.faults.npy``, uint8 [IL, XL, NS],
    same orientation as the amplitude whatever the trace sorting) are each written to a temporary
    name in the target folder and renamed into place, so readers never see half a file. The same
    arguments always give byte-identical files, whatever ``out`` is called.

    Returns:
        {"segy", "faults", "shape", "format", "endian", "iline_byte", "xline_byte", "sorting", "seed"}
    """
    shape = tuple(int(n) for n in shape)
    if len(shape) != 3 or min(shape) < 1 or not 8 <= shape[2] <= 32767:
        dims = " ".join(str(n) for n in shape)
        raise SFMError(
            f"--shape {dims} is not a survey: give IL XL NS with IL, XL >= 1 and 8 <= NS <= 32767, "
            "e.g. --shape 64 64 128"
        )
    options = SegyOptions(sample_format, endian, iline_byte, xline_byte, sorting)
    options.check()
    if "://" in str(out):
        raise SFMError(f"output {out} is a URL; sfm synth writes a local file, copy it to the bucket afterwards")

    started = time.perf_counter()
    segy_path = Path(out)
    faults_path = fault_labels_path(segy_path)
    segy_path.parent.mkdir(parents=True, exist_ok=True)

    amplitude, labels = synthesize_volume(shape, seed)
    # Both files appear together or not at all: the renames happen after both are written.
    with _replace_atomically(faults_path) as faults_tmp, _replace_atomically(segy_path) as segy_tmp:
        with open(faults_tmp, "wb") as fh:
            np.save(fh, labels)
        write_segy(segy_tmp, amplitude, options,
                   text=[f"SEED {seed}  FAULT LABELS: <THIS NAME WITHOUT .SGY>.FAULTS.NPY BESIDE IT"])

    seconds = time.perf_counter() - started
    size_mb = segy_path.stat().st_size / 1e6
    log.info(
        "wrote %s (%d x %d x %d, %.1f MB) and its fault labels in %.2f s, %.1f MB/s",
        segy_path, *shape, size_mb, seconds, size_mb / seconds,
    )
    return {
        "segy": str(segy_path),
        "faults": str(faults_path),
        "shape": list(shape),
        "format": sample_format,
        "endian": endian,
        "iline_byte": iline_byte,
        "xline_byte": xline_byte,
        "sorting": sorting,
        "seed": seed,
    }


def fault_labels_path(segy_path) -> Path:
    """``survey.sgy`` / ``survey.segy`` (any case) -> ``survey.faults.npy``; other names get the suffix appended."""
    segy_path = Path(segy_path)
    stem = segy_path.stem if segy_path.suffix.lower() in (".sgy", ".segy") else segy_path.name
    return segy_path.with_name(f"{stem}.faults.npy")


@contextlib.contextmanager
def _replace_atomically(target: Path):
    """Yield a temporary path beside ``target``; rename it onto ``target`` if the block succeeds."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
