"""Reading post-stack 3D SEG-Y: byte order, the header scan, the text header.

The file is read in two passes, both in bounded memory:

1. :func:`scan_file` reads every byte once, in fixed blocks: it digests the content (BLAKE3, the
   survey's identity, :data:`DIGEST_ALGORITHM`) and, on the other cores meanwhile, keeps a few integer
   fields of each 240-byte trace header (any 4- or 2-byte position, not only the fields segyio names);
   :func:`scan_range` does the same for one range of pieces, so several tasks can scan one file.
2. :class:`sfm.formats.segy_traces.TraceReader` reads runs of consecutive traces and converts their
   samples to float32, equal to what ``segyio`` reads.

:func:`sfm.formats.segy_geometry.build_geometry` turns the header fields into the (inline, crossline)
grid. Problems a user can cause raise :class:`SFMError` naming the file and the fix.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

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
    def size(self) -> int:
        """Bytes of the file: the layout accounts for every byte (a file that it does not is refused)."""
        return int(self.data_offset + self.n_traces * self.trace_bytes)

    @property
    def name(self) -> str:
        return os.path.basename(str(self.path).rstrip("/"))


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

    try:
        with ThreadPoolExecutor(max_workers=max(1, min(2, workers or 2))) as pool:
            pieces = _piece_digests(source, start, stop, lambda at, view: pool.submit(headers_in, at, view))
    finally:
        if own:
            source.close()
    return pieces, values


def _piece_digests(source: RangedFile, start: int, stop: int, beside=None) -> list[str]:
    """Hex BLAKE3 of each :data:`PIECE_BYTES` piece of bytes ``[start, stop)`` of ``source``, in order (none
    for an empty range: :func:`combine_pieces` of none is BLAKE3 of no bytes). ``beside(at, window)``, if
    given, starts work on each window and returns its future, awaited once this thread has hashed it."""
    import blake3

    pieces = []
    for piece in range(start, stop, PIECE_BYTES):
        hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        for at, view in source.windows(piece, min(stop, piece + PIECE_BYTES), SCAN_BLOCK_BYTES):
            job = beside(at, view) if beside is not None else None
            hasher.update(view)
            if job is not None:
                job.result()
        pieces.append(hasher.hexdigest())
    return pieces


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
    with open_ranged(path) as source:  # read in windows: memory stays at a few whatever the file size
        return combine_pieces(_piece_digests(source, 0, source.size))


def checksum_fields(size: int, digest: str) -> dict[str, str]:
    """``checksum`` ("<algorithm>:<64 hex digits>") and ``checksum_algorithm`` of a store and its row."""
    algorithm = digest_algorithm(size)
    return {"checksum": f"{algorithm}:{digest}", "checksum_algorithm": algorithm}


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
