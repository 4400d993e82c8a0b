"""Reading post-stack 3D SEG-Y: byte order, geometry from trace headers, traces in runs.

The file is read in two passes, both in bounded memory:

1. :func:`scan_file` reads every byte once, in fixed blocks: it digests the content (BLAKE3, the
   survey's identity, :data:`DIGEST_ALGORITHM`) and, on the other cores meanwhile, keeps a few integer
   fields of each 240-byte trace header (any 4- or 2-byte position, not only the fields segyio names);
   :func:`scan_range` does the same for one range of pieces, so several tasks can scan one file.
2. :class:`sfm.ingest.segy_traces.TraceReader` reads runs of consecutive traces and converts their
   samples to float32, equal to what ``segyio`` reads.

:func:`build_geometry` turns the header fields into a full regular (inline, crossline) grid and
refuses what ingest cannot store faithfully: pre-stack gathers (offsets that vary), duplicate traces,
grids far sparser than their traces, trace headers that contradict the binary header, traces with
different delays. Problems a user can cause raise :class:`SFMError` naming the file and the fix.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from sfm.errors import SFMError
from sfm.storage.ranged_file import RangedFile, open_ranged

TEXT_HEADER_BYTES = 3200
BINARY_HEADER_BYTES = 400
TRACE_HEADER_BYTES = 240

# sample format code -> (description, numpy type code in the file or None for IBM float, bytes per sample)
SAMPLE_FORMATS = {
    1: ("4-byte IBM float", None, 4),
    2: ("4-byte signed integer", "i4", 4),
    3: ("2-byte signed integer", "i2", 2),
    5: ("4-byte IEEE float", "f4", 4),
    6: ("8-byte IEEE float", "f8", 8),
    8: ("1-byte signed integer", "i1", 1),
    9: ("8-byte signed integer", "i8", 8),
    10: ("4-byte unsigned integer", "u4", 4),
    11: ("2-byte unsigned integer", "u2", 2),
    12: ("8-byte unsigned integer", "u8", 8),
    16: ("1-byte unsigned integer", "u1", 1),
}
SAMPLE_BYTES = {code: spec[2] for code, spec in SAMPLE_FORMATS.items()}
# defined by SEG-Y but not read by segyio (it silently falls back to IBM float for them)
UNSUPPORTED_FORMATS = {4: "4-byte fixed-point with gain", 7: "3-byte signed integer", 15: "3-byte unsigned integer"}

DEFAULT_BYTE_PAIR = (189, 193)
CDP_COORDINATE_PAIR = (181, 185)  # CDP X/Y in SEG-Y rev 1: taken as line numbers only when no line-number pair fits
# Line-number pairs first: rev 1's 189/193, then 9/21 (field record / CDP number, where older processing
# systems put inline/crossline) and 221/225 (unassigned bytes some writers use). Byte 5 (trace sequence
# number in the file) is not tried: it is unique per trace, so with 21 it forms a diagonal "grid" on
# small files.
COMMON_BYTE_PAIRS = [DEFAULT_BYTE_PAIR, (9, 21), (221, 225), CDP_COORDINATE_PAIR]
OFFSET_FIELD = (37, 4)
DELAY_FIELD = (109, 2)  # delay recording time, ms: the time of the first sample
SCALAR_FIELD = (71, 2)
SAMPLE_COUNT_FIELD = (115, 2)
CDP_X_FIELD = (181, 4)
CDP_Y_FIELD = (185, 4)
BYTE_ORDER_CONSTANT = 0x01020304  # SEG-Y rev 2, byte 3297, written in the file's byte order

SCAN_BLOCK_BYTES = 16 << 20  # the file is read in windows of this size while it is digested
# The content digest: BLAKE3 (cryptographic, faster than sha256: BENCHMARKS.md "Ingest"); survey_id is its first 16
# hex digits. A file of up to PIECE_BYTES: the BLAKE3 of the whole file, exactly what `b3sum FILE` prints, recorded as
# "blake3:<64 hex digits>". A larger file: BLAKE3 over the 32-byte BLAKE3 digests of its consecutive PIECE_BYTES
# pieces (the last one shorter), recorded as "blake3-4GiB-pieces:<64 hex digits>". The pieces hash independently,
# so the scan of a big file runs as many tasks as it has pieces, and the identity depends on the bytes only, never
# on how many tasks read them; a fixed piece size keeps every file up to 4 GiB at its b3sum identity.
DIGEST_ALGORITHM = "blake3"
PIECE_BYTES = 4 << 30
PIECES_ALGORITHM = "blake3-4GiB-pieces"
READ_BUFFER_BYTES = 1 << 20  # TraceReader reads at most this many bytes per call (traces stay in L2 cache)


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
    trace_header_bytes: int = TRACE_HEADER_BYTES  # 240 per header, more with rev 2 trace header extensions
    revision: str = "0.0"
    endian_source: str = "given"  # how the byte order was decided

    @property
    def trace_bytes(self) -> int:
        return self.trace_header_bytes + self.samples * SAMPLE_BYTES[self.sample_format]

    @property
    def format_name(self) -> str:
        return SAMPLE_FORMATS[self.sample_format][0]

    @property
    def name(self) -> str:
        return os.path.basename(str(self.path).rstrip("/"))


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


# ------------------------------------------------------------------------------------------------
# binary header


def read_layout(path: str, endian: str = "auto") -> SegyLayout:
    """Byte order, format and trace count of a SEG-Y file, local or ``s3://`` (one ranged GET)."""
    with open_ranged(path) as source:
        head = source.read(0, TEXT_HEADER_BYTES + BINARY_HEADER_BYTES)
        return layout_from_header(path, head, source.size, endian)


def _binary_fields(binary: bytes, order: str) -> dict[str, int]:
    """The binary-header fields the layout needs, read in byte order ``order``."""

    def unsigned(pos: int, size: int = 2) -> int:  # pos: 1-based byte position in the file
        start = pos - TEXT_HEADER_BYTES - 1
        return int.from_bytes(binary[start : start + size], order, signed=False)

    def signed(pos: int, size: int = 2) -> int:
        start = pos - TEXT_HEADER_BYTES - 1
        return int.from_bytes(binary[start : start + size], order, signed=True)

    major, minor = binary[300], binary[301]  # bytes 3501/3502: revision, one byte each (rev 2)
    if order == "little" and (major, minor) == (0, 1):  # a rev 1 writer's 16-bit 0x0100, little-endian
        major, minor = 1, 0
    fields = {
        "format": signed(3225), "samples": unsigned(3221), "interval": unsigned(3217),
        "ext_text_headers": signed(3505), "major": major, "minor": minor,
        "trace_header_ext": 0, "first_trace_offset": 0,
    }
    if major >= 2:  # rev 2 fields; older files may hold anything at these bytes
        fields["trace_header_ext"] = unsigned(3507)
        fields["samples"] = unsigned(3269, 4) or fields["samples"]
        if minor >= 1 or major > 2:
            fields["first_trace_offset"] = unsigned(3509, 8)
    return fields


def _format_problem(fmt: int) -> str | None:
    if fmt in SAMPLE_FORMATS:
        return None
    if fmt in UNSUPPORTED_FORMATS:
        return f"sample format {fmt} ({UNSUPPORTED_FORMATS[fmt]}) is not read by segyio"
    return f"sample format code {fmt} is not a SEG-Y format"


def layout_from_header(path: str, head: bytes, size: int, endian: str = "auto") -> SegyLayout:
    """The layout from the first 3600 bytes and the file size (works for remote files too).

    Byte order: ``endian`` when given; else the rev-2 constant at byte 3297; else the order in which
    the binary header holds a valid sample format code and a plausible sample count.
    """
    name = os.path.basename(str(path).rstrip("/"))
    if endian not in ("auto", "big", "little"):
        raise SFMError(f"--endian {endian!r} is not a byte order; use auto, big or little")
    if size < TEXT_HEADER_BYTES + BINARY_HEADER_BYTES:
        raise SFMError(f"{name} is not SEG-Y: {size} bytes is shorter than the 3600-byte file header")
    binary = head[TEXT_HEADER_BYTES : TEXT_HEADER_BYTES + BINARY_HEADER_BYTES]

    if endian != "auto":
        order, source = endian, "given (--endian)"
    elif int.from_bytes(binary[96:100], "big") == BYTE_ORDER_CONSTANT:
        order, source = "big", "rev-2 byte-order constant (byte 3297)"
    elif int.from_bytes(binary[96:100], "little") == BYTE_ORDER_CONSTANT:
        order, source = "little", "rev-2 byte-order constant (byte 3297)"
    else:
        plausible = []
        for candidate in ("big", "little"):
            f = _binary_fields(binary, candidate)
            if (f["format"] in SAMPLE_FORMATS or f["format"] in UNSUPPORTED_FORMATS) and f["samples"] > 0:
                plausible.append(candidate)
        if len(plausible) == 2:  # both readings look valid: keep the one whose traces fill the file exactly
            whole = [o for o in plausible if _LayoutCheck(name, path, size, o, "", binary).n_traces_exact]
            plausible = whole if len(whole) == 1 else plausible
        if len(plausible) != 1:
            what = "no byte order" if not plausible else "both byte orders"
            raise SFMError(
                f"{name} is not readable SEG-Y: {what} gives a valid sample format code and sample count in the "
                "binary header (bytes 3221-3226); pass --endian big|little if you know it"
            )
        order, source = plausible[0], "format code and sample count (bytes 3221-3226)"
    return _LayoutCheck(name, path, size, order, source, binary).checked()


class _LayoutCheck:
    """A reading of the binary header in one byte order, with the checks that make it a layout."""

    def __init__(self, name: str, path: str, size: int, order: str, source: str, binary: bytes):
        self.name, self.path, self.size, self.order, self.source = name, str(path), size, order, source
        self.f = f = _binary_fields(binary, order)
        fmt, samples = f["format"], f["samples"]
        self.valid = _format_problem(fmt) is None and samples > 0
        ext = max(0, f["ext_text_headers"])
        self.data_offset = f["first_trace_offset"] or TEXT_HEADER_BYTES + BINARY_HEADER_BYTES + ext * TEXT_HEADER_BYTES
        self.trace_header_bytes = TRACE_HEADER_BYTES * (1 + f["trace_header_ext"])
        self.trace_bytes = self.trace_header_bytes + samples * SAMPLE_BYTES.get(fmt, 0) if self.valid else 0
        self.n_traces, self.rest = divmod(max(0, size - self.data_offset), self.trace_bytes) if self.valid else (0, 0)
        self.n_traces_exact = self.valid and self.n_traces > 0 and self.rest == 0

    def checked(self) -> SegyLayout:
        """The layout, or an SFMError saying what makes this reading of the header unusable."""
        f, name, size = self.f, self.name, self.size
        fmt, samples = f["format"], f["samples"]
        problem = _format_problem(fmt)
        if problem:
            hint = "convert the file to IEEE or IBM float" if fmt in UNSUPPORTED_FORMATS else \
                f"try --endian {'little' if self.order == 'big' else 'big'}"
            raise SFMError(f"{name}: {problem} (binary header byte 3225, read {self.order}-endian); {hint}")
        if samples <= 0:
            raise SFMError(f"{name}: the binary header says 0 samples per trace (byte 3221, read {self.order}-endian); "
                           "the file header is damaged or the byte order is wrong: try --endian")
        if f["ext_text_headers"] < 0:
            raise SFMError(f"{name} has a variable number of extended textual headers (byte 3505 = -1), which "
                           "ingest does not read; rewrite the file with a fixed count")
        if self.n_traces == 0 and self.rest == 0:
            raise SFMError(f"{name} has a file header but no traces; nothing to ingest")
        if self.rest:
            raise SFMError(
                f"{name} is truncated or inconsistent: {size - self.data_offset} trace bytes are not a whole number "
                f"of {self.trace_bytes}-byte traces ({samples} samples of format {fmt}, "
                f"{self.trace_header_bytes}-byte trace headers): the last trace has {self.rest} bytes; "
                "re-export or re-download the file"
            )
        return SegyLayout(self.path, self.order, fmt, samples, f["interval"], self.n_traces, self.data_offset,
                          self.trace_header_bytes, f"{f['major']}.{f['minor']}", self.source)


# ------------------------------------------------------------------------------------------------
# one pass over the file: content digest and trace header fields


def scan_file(layout: SegyLayout, fields: list[tuple[int, int]], workers: int | None = None
              ) -> tuple[str, dict[tuple[int, int], np.ndarray]]:
    """Digest the whole file and read trace header ``fields`` [(1-based byte, width 2 or 4)], in one pass.

    Returns:
        digest: hex content digest of the file's bytes (:func:`content_digest`, see :data:`DIGEST_ALGORITHM`).
        values: {(byte, width): int32 [T]} signed integers in the file's byte order.
    """
    with open_ranged(layout.path) as source:
        pieces, values = scan_range(layout, fields, 0, source.size, workers, source)
    return combine_pieces(pieces), values


def scan_range(layout: SegyLayout, fields: list[tuple[int, int]], start: int, stop: int,
               workers: int | None = None, source: RangedFile | None = None
               ) -> tuple[list[str], dict[tuple[int, int], np.ndarray]]:
    """Digest bytes ``[start, stop)`` piece by piece and read the ``fields`` of the trace headers that
    begin there, in one pass; ``start`` is a multiple of :data:`PIECE_BYTES` (``stop`` too, or the file's end).

    The bytes come in :data:`SCAN_BLOCK_BYTES` windows, one after the other (mapped from a local file,
    fetched ahead by ranged GETs from S3, :meth:`sfm.storage.ranged_file.RangedFile.windows`): this thread
    hashes each window (BLAKE3 releases the GIL and may use idle cores itself) while a pool thread copies
    the header fields out of it. Memory stays at a few windows whatever the file size.

    Returns:
        pieces: hex BLAKE3 of each :data:`PIECE_BYTES` piece in the range, in order.
        values: {(byte, width): int32 [t1 - t0]} for the traces t0 <= t < t1 whose headers begin in the range
            (:func:`traces_in_range`), signed integers in the file's byte order.
    """
    import blake3

    if start % PIECE_BYTES:
        raise ValueError(f"scan ranges start on a piece boundary ({PIECE_BYTES} bytes), not at {start}")
    own = source is None
    source = source or open_ranged(layout.path)
    fields = sorted(set(fields))
    t0, t1 = traces_in_range(layout, start, stop)
    values = {f: np.empty(t1 - t0, dtype=np.int32) for f in fields}
    order = ">" if layout.endian == "big" else "<"

    def headers_in(at: int, data: memoryview) -> None:
        """Copy the fields of the trace headers that start inside [at, at + len(data)) and in the range."""
        tb, off, hb = layout.trace_bytes, layout.data_offset, TRACE_HEADER_BYTES
        first = max(t0, -(-(at - off) // tb))
        last = min(t1, (at + len(data) - off + tb - 1) // tb)  # exclusive
        if last <= first:
            return
        whole_last = max(first, min(last, (at + len(data) - off - hb) // tb + 1))  # headers entirely inside
        buf = np.frombuffer(data, dtype=np.uint8)
        if whole_last > first:
            base = off + first * tb - at
            rows = np.lib.stride_tricks.as_strided(buf[base:], shape=(whole_last - first, hb), strides=(tb, 1))
            for byte, width in fields:
                col = np.ascontiguousarray(rows[:, byte - 1 : byte - 1 + width]).view(f"{order}i{width}")
                values[(byte, width)][first - t0 : whole_last - t0] = col.ravel()
        for t in range(whole_last, last):  # a header cut by the window's end: read it whole
            raw = np.frombuffer(source.read(off + t * tb, hb), dtype=np.uint8)
            for byte, width in fields:
                values[(byte, width)][t - t0] = raw[byte - 1 : byte - 1 + width].view(f"{order}i{width}")[0]

    pieces: list[str] = []
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(2, workers or 2))) as pool:
            for piece in range(start, stop, PIECE_BYTES):
                hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
                for at, view in source.windows(piece, min(stop, piece + PIECE_BYTES), SCAN_BLOCK_BYTES):
                    headers = pool.submit(headers_in, at, view)
                    hasher.update(view)
                    headers.result()
                pieces.append(hasher.hexdigest())
    finally:
        if own:
            source.close()
    return pieces, values


def traces_in_range(layout: SegyLayout, start: int, stop: int) -> tuple[int, int]:
    """(t0, t1): the traces whose headers begin in bytes ``[start, stop)``."""
    tb, off = layout.trace_bytes, layout.data_offset
    first = max(0, -(-(start - off) // tb))
    last = max(first, min(layout.n_traces, -(-(stop - off) // tb)))
    return first, last


def combine_pieces(pieces: list[str]) -> str:
    """The content digest from the BLAKE3 digests of the file's consecutive :data:`PIECE_BYTES` pieces:
    that digest itself for a file of one piece (what ``b3sum`` prints), else BLAKE3 over the pieces'
    32-byte digests, concatenated in order (:data:`PIECES_ALGORITHM`)."""
    import blake3

    if len(pieces) == 1:
        return pieces[0]
    return blake3.blake3(b"".join(bytes.fromhex(p) for p in pieces)).hexdigest()


def digest_algorithm(size: int) -> str:
    """How the content digest of a ``size``-byte file is computed: :data:`DIGEST_ALGORITHM` for a file of
    one piece, :data:`PIECES_ALGORITHM` for a larger one."""
    return DIGEST_ALGORITHM if size <= PIECE_BYTES else PIECES_ALGORITHM


def file_digest(path: str) -> str:
    """The content digest of any file, local or ``s3://`` (the same as :func:`scan_file` gives)."""
    import blake3

    pieces = []
    with open_ranged(path) as source:  # read in windows: memory stays at a few whatever the file size
        for piece in range(0, max(1, source.size), PIECE_BYTES):
            hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
            for _, view in source.windows(piece, min(source.size, piece + PIECE_BYTES), SCAN_BLOCK_BYTES):
                hasher.update(view)
            pieces.append(hasher.hexdigest())
    return combine_pieces(pieces)


def checksum_fields(size: int, digest: str) -> dict[str, str]:
    """``checksum`` ("<algorithm>:<64 hex digits>") and ``checksum_algorithm`` of a store and its row."""
    algorithm = digest_algorithm(size)
    return {"checksum": f"{algorithm}:{digest}", "checksum_algorithm": algorithm}


def checksum_text(digest: str) -> str:
    """How stores and manifest rows record the digest of a file of one piece: ``"blake3:<64 hex digits>"``
    (:func:`checksum_fields` for any size)."""
    return f"{DIGEST_ALGORITHM}:{digest}"


def header_fields_needed(iline_byte: int | None, xline_byte: int | None) -> list[tuple[int, int]]:
    """Trace-header fields :func:`build_geometry` and :func:`cdp_coordinates` read."""
    pairs = [(iline_byte, xline_byte)] if iline_byte and xline_byte else COMMON_BYTE_PAIRS
    fields = {OFFSET_FIELD, SCALAR_FIELD, SAMPLE_COUNT_FIELD, CDP_X_FIELD, CDP_Y_FIELD, DELAY_FIELD}
    for il, xl in pairs:
        for byte in (il, xl):
            if not 1 <= byte <= TRACE_HEADER_BYTES - 3:
                raise SFMError(f"byte location {byte} is outside the 240-byte trace header; use 1..237")
            fields.add((byte, 4))
    return sorted(fields)


# ------------------------------------------------------------------------------------------------
# geometry


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


def text_header(layout: SegyLayout) -> tuple[str, str]:
    """The 3200-byte textual header decoded as EBCDIC or ASCII, whichever reads as text, and which it was."""
    with open_ranged(layout.path) as source:
        return decode_text_header(source.read(0, TEXT_HEADER_BYTES))


def decode_text_header(raw: bytes) -> tuple[str, str]:
    """(text in 40 lines of 80 columns, right-stripped; "ebcdic" | "ascii" | "empty")."""
    ascii_score = sum(32 <= b < 127 for b in raw)
    ebcdic_text = raw.decode("cp037", errors="replace")
    ebcdic_score = sum(32 <= ord(ch) < 127 for ch in ebcdic_text)
    if max(ascii_score, ebcdic_score) == 0:
        return "", "empty"
    if ebcdic_score > ascii_score:
        text, encoding = ebcdic_text, "ebcdic"
    else:
        text, encoding = raw.decode("ascii", errors="replace"), "ascii"
    text = "".join(ch if ch.isprintable() else " " for ch in text)
    return "\n".join(text[i : i + 80].rstrip() for i in range(0, len(text), 80)).rstrip(), encoding
