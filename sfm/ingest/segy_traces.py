"""Reading the samples of SEG-Y traces: :class:`TraceReader`.

It reads runs of consecutive traces into a reused buffer (``os.preadv`` from a local file, ranged GETs
from S3: :mod:`sfm.storage.ranged_file`) and converts their samples
to float32: numpy for the integer and IEEE formats, segyio's own converter for IBM floats, so the
values equal what ``segyio`` reads in every format segyio supports (1, 2, 3, 5, 6, 8, 9, 10, 11, 12,
16), in either byte order, with or without SEG-Y rev 2 trace header extensions. The file's layout
comes from :func:`sfm.ingest.segy.read_layout`.
"""

from __future__ import annotations

import threading

import numpy as np

from sfm.errors import SFMError
from sfm.ingest.segy import READ_BUFFER_BYTES, SAMPLE_FORMATS, SegyLayout
from sfm.storage.ranged_file import open_ranged


class TraceReader:
    """Reads runs of consecutive traces and converts their samples to float32; safe to share by threads.

    Integer and IEEE formats are cast by numpy (exactly what ``np.asarray(segyio_trace, float32)``
    gives); IBM floats go through segyio's own converter.
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

    def read_into(self, start: int, stop: int, out: np.ndarray) -> None:
        """Traces [start, stop) into ``out`` [stop - start, samples] float32 (any writable view).

        The run's bytes are read with one ``preadv`` (or one ranged GET) into this thread's buffer (no page
        faults, no mapping to tear down) and converted from there into ``out``.
        """
        for lo in range(start, stop, self.max_traces):
            hi = min(stop, lo + self.max_traces)
            self._read_piece(lo, hi, out[lo - start : hi - start])

    def _read_piece(self, start: int, stop: int, out: np.ndarray) -> None:
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
        if self._dtype is not None:
            np.copyto(out, samples.view(self._dtype), casting="unsafe")
        else:
            ibm = samples.copy().view(np.float32)  # contiguous, converted in place below
            if lay.endian == "little":
                ibm.byteswap(inplace=True)  # segyio's converter expects the big-endian byte layout
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


def _ibm_to_float32(ibm: np.ndarray) -> np.ndarray:
    """IBM floats (big-endian bytes viewed as float32) -> IEEE float32, in place, by segyio's converter."""
    import segyio._segyio  # noqa: F401  (segyio.tools.native needs the extension loaded)
    import segyio.tools

    return segyio.tools.native(ibm, format=1, copy=False)
