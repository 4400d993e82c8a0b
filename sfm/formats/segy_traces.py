"""Reading the samples of SEG-Y traces: :class:`TraceReader`.

It reads runs of consecutive traces into a reused buffer (``os.preadv`` from a local file, ranged GETs
from S3: :mod:`sfm.storage.ranged_file`) and converts their samples to float32: numpy for the integer
and IEEE formats, so the values equal what ``segyio`` reads (formats 2, 3, 5, 6, 8, 9, 10, 11, 12, 16),
and an exact converter for IBM floats (format 1), equal to ``ibm2ieee`` for every word and so to
segyio for normalised ones within float32's range; in either byte order, with or without SEG-Y rev 2
trace header extensions. The file's layout comes from :func:`sfm.formats.segy.read_layout`.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

from sfm.errors import SFMError
from sfm.formats.segy import READ_BUFFER_BYTES, SAMPLE_FORMATS, TRACE_HEADER_BYTES, SegyLayout
from sfm.storage.ranged_file import open_ranged


class TraceReader:
    """Reads runs of consecutive traces and converts their samples to float32; safe to share by threads.

    Integer and IEEE formats are cast by numpy (exactly what ``np.asarray(segyio_trace, float32)``
    gives); IBM floats are converted exactly (:func:`_ibm_to_float32`).
    """

    def __init__(self, layout: SegyLayout):
        self.layout = layout
        code = SAMPLE_FORMATS[layout.sample_format][1]
        order = ">" if layout.endian == "big" else "<"
        self._dtype = np.dtype(f"{order}{code}") if code else None  # None: IBM float
        self.source = open_ranged(layout.path)
        self._local = threading.local()  # one read buffer per thread, reused
        # traces per read: runs longer than this are read in pieces, so a piece stays in the L2 cache
        self.max_traces = max(1, READ_BUFFER_BYTES // layout.trace_bytes)

    def read_into(self, start: int, stop: int, out: np.ndarray, headers: np.ndarray | None = None) -> None:
        """Traces [start, stop) into ``out`` [stop - start, samples] float32 (any writable view), and their
        first 240 header bytes into ``headers`` [stop - start, 240] uint8 if given (read in the same pass).

        The run's bytes are read with one ``preadv`` (or one ranged GET) into this thread's buffer (no page
        faults, no mapping to tear down) and converted from there into ``out``.
        """
        for lo in range(start, stop, self.max_traces):
            hi = min(stop, lo + self.max_traces)
            self._read_piece(lo, hi, out[lo - start : hi - start],
                             None if headers is None else headers[lo - start : hi - start])

    def _read_piece(self, start: int, stop: int, out: np.ndarray, headers: np.ndarray | None = None) -> None:
        lay = self.layout
        n = stop - start
        nbytes = n * lay.trace_bytes
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = self._local.buf = bytearray(max(nbytes, self.max_traces * lay.trace_bytes))
        got = self.source.read_into(lay.data_offset + start * lay.trace_bytes, memoryview(buf)[:nbytes])
        if got < nbytes:
            raise SFMError(f"{lay.name} changed while it was read (it ends before trace #{stop}); "
                           "ingest a file that is not being written")
        raw = np.frombuffer(buf, dtype=np.uint8, count=nbytes)
        samples = raw.reshape(n, lay.trace_bytes)[:, lay.trace_header_bytes :]
        if headers is not None:
            headers[...] = raw.reshape(n, lay.trace_bytes)[:, :TRACE_HEADER_BYTES]
        if self._dtype is not None:
            np.copyto(out, samples.view(self._dtype), casting="unsafe")
        else:
            ibm = samples.copy().view(np.float32)  # contiguous, converted in place below
            if lay.endian == "little":
                ibm.byteswap(inplace=True)  # the converter takes the big-endian byte layout
            out[...] = _ibm_to_float32(ibm)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Traces [start, stop) as float32 [stop - start, samples]."""
        out = np.empty((stop - start, self.layout.samples), dtype=np.float32)
        self.read_into(start, stop, out)
        return out

    def close(self) -> None:
        self.source.close()

    def __enter__(self) -> "TraceReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _ibm_scale_tables() -> tuple[np.ndarray, np.ndarray]:
    """Two float32 powers of two per IBM top byte (sign and 7-bit exponent), [256] each.

    An IBM float is ``(-1)^s * F * 2^(4 * (e - 64) - 24)`` with F its 24-bit fraction. ``F * first``
    is exact and normal (F < 2^24 fits float32's significand; the exponent is clipped to keep it in
    range); ``* second`` then brings it to its value with one IEEE rounding (round half to even into
    the denormal range, inf beyond float32's range), so the result is the correctly rounded value.
    """
    top = np.arange(256)
    k = 4 * ((top & 0x7F) - 64) - 24
    first = np.clip(k, -126, 104)  # F * 2^first in [2^-126, 2^128): exact
    second = np.clip(k - first, -126, 127)  # k < -252: |value| < 2^-228, which rounds to 0 either way
    return ((np.where(top >= 128, -1.0, 1.0) * np.exp2(first)).astype(np.float32),
            np.exp2(second).astype(np.float32))


_IBM_FIRST, _IBM_SECOND = _ibm_scale_tables()


# IBM exponents (bits 24-30, bias 64) whose every value is a normal float32: 16^(e - 64) * F * 2^-24 with
# 1 <= F < 2^24 stays within [2^-126, 2^128). Files whose samples all have them take the fast path.
_IBM_MODERATE = (39, 96)
_IEEE_EXPONENT_SHIFT = np.uint32((-153 << 23) & 0xFFFFFFFF)  # e << 25 plus this: the bits of 2^(4e - 280)


def _ibm_to_float32(ibm: np.ndarray) -> np.ndarray:
    """IBM floats (big-endian bytes viewed as float32, any shape, contiguous) -> IEEE float32, in place.

    Exact for every IBM word, equal bit for bit to ``ibm2ieee.ibm2float32``: unnormalised fractions,
    zero with any exponent (signed), values in the IEEE denormal range (rounded half to even), and
    exponents beyond float32's range (+-inf). The value is the 24-bit fraction (exact in float32) times
    a power of two, ``±2^(4 * (e - 64) - 24)``: built from the exponent bits when every exponent is
    moderate (one exact product), else looked up in two steps (:func:`_ibm_scale_tables`).
    """
    words = ibm.view(np.uint32)
    if sys.byteorder == "little":
        words.byteswap(inplace=True)
    scale = np.bitwise_and(words, 0x7F000000)  # e << 24
    if scale.max() > _IBM_MODERATE[1] << 24:
        return _ibm_extreme_to_float32(words, ibm)
    if scale.min() < _IBM_MODERATE[0] << 24:  # fine only on zero words (muted or padded samples)
        np.bitwise_and(words, 0x7FFFFFFF, out=scale)
        scale -= 1  # a zero word wraps to the top
        if scale.min() < (_IBM_MODERATE[0] << 24) - 1:
            return _ibm_extreme_to_float32(words, ibm)
        scale += 1
        scale &= 0x7F000000
        np.maximum(scale, _IBM_MODERATE[0] << 24, out=scale)  # a zero word: any moderate exponent gives its ±0
    scale <<= 1
    scale += _IEEE_EXPONENT_SHIFT
    scale |= np.bitwise_and(words, 0x80000000)  # the float32 bits of ±2^(4e - 280)
    np.bitwise_and(words, 0xFFFFFF, out=words)  # the fraction, < 2^24
    np.multiply(words.view(np.int32), scale.view(np.float32), out=ibm, dtype=np.float32)
    return ibm


def _ibm_extreme_to_float32(words: np.ndarray, out: np.ndarray) -> np.ndarray:
    """:func:`_ibm_to_float32` for words [native uint32] with any exponent, into ``out`` (their float32 view)."""
    top = np.right_shift(words, 24)  # sign and exponent
    scale = _IBM_FIRST.take(top, mode="clip")
    np.bitwise_and(words, 0xFFFFFF, out=words)
    np.multiply(words.view(np.int32), scale, out=out, dtype=np.float32)
    with np.errstate(over="ignore"):  # beyond float32's range: inf, which ingest counts as non-finite
        out *= _IBM_SECOND.take(top, mode="clip", out=scale)
    return out
