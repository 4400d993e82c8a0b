"""One part of a prediction, streamed along the inlines: brick rows in, windows through the network,
blended slabs out. Memory stays bounded whatever the survey's length.

The part writes the inlines of its own shard rows and runs every window that reaches them (windows across
a part border are run by both parts; each keeps its own inlines). Windows are taken one inline origin at a
time (:meth:`sfm.predict.windows.WindowGrid.row`), in order:

- :class:`InlineBand` holds the normalised amplitude of the survey's brick rows those windows read, read
  whole through the data path (:class:`sfm.data.crop_reader.CropReader`: brick tiles on threads, dead traces
  0, transient storage failures retried), the next row fetched while the network runs, rows behind the
  windows dropped: at most ``crop / brick + 2`` brick rows of [brick, XL, NS] float32;
- :class:`SlabBlender` adds each window's probabilities, times its normalised Gaussian weights, into the
  output brick rows it reaches, and as soon as no window left reaches a row (the next inline origin lies
  beyond it) converts it (probabilities or classes; 0 at dead traces) and writes its shards: at most
  ``crop / brick + 2`` rows of [C, brick, XL, NS] float32.

So memory is about ``2 * (crop + 2 * brick) * XL * NS * 4`` bytes (times the channels), plus the network.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future
from typing import Any, Callable

import numpy as np

from sfm.data import Crop, CropReader, Surveys
from sfm.data.crop_reader import wait_all
from sfm.formats.moments import Moments
from sfm.predict.windows import WindowGrid, add_window
from sfm.progress import Progress, quantity


class InlineBand:
    """Whole brick rows of survey 0 of ``surveys``, normalised, each read once, up to inline ``stop``:
    :meth:`cut` copies windows out. ``data``: the checked ``JobConfig.data`` (its client, retries, threads)."""

    def __init__(self, surveys: Surveys, data, stop: int):
        self.surveys, self.data = surveys, data
        self.info = surveys[0]
        self.stop = min(stop, self.info.shape[0])  # no inline at or past it is ever needed
        self.rows: dict[int, np.ndarray] = {}  # brick row -> [rows, XL, NS] float32
        self.pending: dict[int, tuple[np.ndarray, list[Future]]] = {}
        self.readers: dict[int, CropReader] = {}  # one per row height (the last row may be shorter)
        self.bytes_read = 0

    def _reader(self, height: int) -> CropReader:
        if height not in self.readers:
            _, xl, ns = self.info.shape
            self.readers[height] = CropReader(self.surveys, dataclasses.replace(self.data, crop=(height, xl, ns)))
        return self.readers[height]

    def _submit(self, row: int) -> None:
        b = self.info.bricks[0]
        n, xl, ns = self.info.shape
        if row in self.rows or row in self.pending or not 0 <= row * b < self.stop:
            return
        height = min(b, n - row * b)
        out = np.empty((height, xl, ns), np.float32)
        futures = self._reader(height).submit(Crop(0, (row * b, 0, 0), (height, xl, ns)), out)
        self.pending[row] = (out, futures)

    def need(self, lo: int, hi: int, ahead: bool = True) -> None:
        """Hold the brick rows of inlines [lo, hi) (and start reading the next one); drop those below."""
        b = self.info.bricks[0]
        first, last = lo // b, (min(hi, self.info.shape[0]) - 1) // b
        for row in [r for r in self.rows if r < first]:
            del self.rows[row]
        for row in range(first, last + 1):
            self._submit(row)
        if ahead:
            self._submit(last + 1)
        for row in range(first, last + 1):
            if row in self.pending:
                out, futures = self.pending.pop(row)
                wait_all(futures)
                self.rows[row] = out
                self.bytes_read += out.nbytes

    def cut(self, origin: tuple[int, int, int], out: np.ndarray) -> None:
        """``out`` [D, H, W] = the window at ``origin``, zeros past the survey's end."""
        b = self.info.bricks[0]
        d, h, w = out.shape
        (i, j, k), (n, xl, ns) = origin, self.info.shape
        hi, h2, w2 = min(i + d, n), min(h, xl - j), min(w, ns - k)
        if hi - i < d or h2 < h or w2 < w:
            out.fill(0.0)
        for row in range(i // b, (hi - 1) // b + 1):
            lo, top = max(i, row * b), min(hi, (row + 1) * b)
            out[lo - i:top - i, :h2, :w2] = self.rows[row][lo - row * b:top - row * b, j:j + h2, k:k + w2]

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()


class SlabBlender:
    """The blended probabilities [C, rows, XL, NS] of the output brick rows inside inlines [lo, hi) that windows
    have reached; :meth:`flush` hands finished rows to ``write(row, values)`` after ``convert``."""

    def __init__(self, shape: tuple[int, int, int], brick: int, channels: int, part: tuple[int, int]):
        self.shape, self.brick, self.channels = shape, brick, channels
        self.lo, self.hi = part
        self.rows: dict[int, np.ndarray] = {}

    def add(self, origin: tuple[int, int, int], probs: np.ndarray, weight: np.ndarray) -> None:
        """Add ``probs`` [C, D, H, W] of the window at ``origin`` times ``weight`` [d, h, w] (the window cut
        at the survey's end) into the rows of this part it reaches."""
        i = origin[0]
        b = self.brick
        start, stop = max(i, self.lo), min(i + weight.shape[0], self.hi)
        for row in range(start // b, (stop - 1) // b + 1) if stop > start else ():
            acc = self.rows.get(row)
            if acc is None:
                height = min(b, self.shape[0] - row * b)
                acc = self.rows[row] = np.zeros((self.channels, height, *self.shape[1:]), np.float32)
            add_window(acc, (row * b, 0, 0), origin, probs, weight)

    def flush(self, before: int, write: Callable[[int, np.ndarray], None]) -> None:
        """Hand over every row that ends at or before inline ``before`` (no window left reaches it), in order."""
        for row in sorted(self.rows):
            if min((row + 1) * self.brick, self.shape[0]) <= before:
                write(row, self.rows.pop(row))


def predict_rows(grid: WindowGrid, band: InlineBand, blender: SlabBlender, run: Callable[[np.ndarray], np.ndarray],
                 write: Callable[[int, np.ndarray], None], batch_size: int, progress: str = "") -> dict[str, Any]:
    """Run every window that reaches the part's inlines through ``run`` (imgs [B, 1, D, H, W] -> probabilities
    [B, C, D, H, W]), blend, and ``write`` each output brick row once final. With a ``progress`` name, the
    windows are counted on a :class:`sfm.progress.Progress` of that name (a bar on a terminal, else a plain line
    every 30 s: windows done of all, the part's voxels per second, ETA). Returns counts and timings."""
    starts = grid.axes[0].reaching(blender.lo, blender.hi)
    total = len(starts) * len(grid.row(starts[0])) if starts else 0
    part_voxels = (blender.hi - blender.lo) * grid.shape[1] * grid.shape[2]
    bar = Progress(total, progress, unit="window", enabled=bool(progress))
    batch = np.empty((batch_size, 1, *grid.crop), np.float32)
    windows, clock = 0, time.perf_counter()
    spent = {"model_s": 0.0, "model_cpu_s": 0.0, "window_cpu_s": 0.0}  # this thread's, see the return
    try:
        for n, i in enumerate(starts):
            band.need(i, i + grid.crop[0], ahead=True)
            row = grid.row(i)
            for first in range(0, len(row), batch_size):
                chunk = row[first:first + batch_size]
                cpu = time.thread_time()
                for m, origin in enumerate(chunk):
                    band.cut(origin, batch[m, 0])
                tick, cut = time.perf_counter(), time.thread_time()
                probs = run(batch[:len(chunk)])
                spent["model_s"] += time.perf_counter() - tick
                model = time.thread_time()
                for origin, p in zip(chunk, probs):
                    blender.add(origin, p, grid.weight(origin))
                spent["model_cpu_s"] += model - cut
                spent["window_cpu_s"] += (cut - cpu) + (time.thread_time() - model)
                windows += len(chunk)
                if bar.enabled:  # the part's voxels, in proportion to the windows run
                    rate = windows / total * part_voxels / max(time.perf_counter() - clock, 1e-9)
                    bar.set(**{"voxels/s": quantity(rate)})
                    bar.update(len(chunk))
            blender.flush(starts[n + 1] if n + 1 < len(starts) else blender.hi, write)
    finally:
        bar.close()
    # model_cpu_s: this thread's CPU in the network (all of it when torch runs on one thread); window_cpu_s: in
    # cutting windows out and blending them in (the work that grows with the windows per voxel)
    return {"windows": windows, **spent, "wall_s": time.perf_counter() - clock, "bytes_read": band.bytes_read}


class RowWriter:
    """Converts finished output brick rows [C, rows, XL, NS] and writes their shards; keeps their statistics
    over the live traces."""

    def __init__(self, shards, variable: str, mask: np.ndarray, shard_shape: tuple[int, ...], threshold: float):
        self.shards, self.variable, self.mask, self.threshold = shards, variable, mask, threshold
        self.shard_shape = shard_shape
        self.moments = Moments()
        self.class_counts: np.ndarray | None = None

    def values(self, row: int, acc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The row as stored, [rows, XL, NS] (or [rows, XL, NS, C]): probabilities, or classes as uint8 (one
        channel: 1 where the probability reaches ``threshold``; several: the most probable); 0 at dead traces. Also
        its live traces [rows, XL] bool."""
        channels = acc.shape[0]
        if self.variable == "classes":
            out = (acc[0] >= self.threshold) if channels == 1 else acc.argmax(axis=0)
            out = out.astype(np.uint8)
        else:
            out = acc[0] if channels == 1 else np.moveaxis(acc, 0, -1)
        b = self.shard_shape[0]
        live = self.mask[row * b:row * b + out.shape[0]]
        out[~live] = 0
        return out, live

    def __call__(self, row: int, acc: np.ndarray) -> None:
        out, live = self.values(row, acc)
        traces = out[live].reshape(int(live.sum()), -1)
        if traces.size:
            values = traces.astype(np.float32, copy=False)
            self.moments.add_block(values, float(values.min()), float(values.max()))
        if self.variable == "classes":
            counts = np.bincount(traces.ravel(), minlength=max(2, acc.shape[0]))
            self.class_counts = counts if self.class_counts is None else self.class_counts + counts
        shard_xl, shard_ns = self.shard_shape[1], self.shard_shape[2]
        for js, j in enumerate(range(0, out.shape[1], shard_xl)):
            for ks, k in enumerate(range(0, out.shape[2], shard_ns)):
                coords = (row, js, ks) + ((0,) if out.ndim == 4 else ())
                self.shards.write(coords, out[:, j:j + shard_xl, k:k + shard_ns])

    def summary(self) -> dict[str, Any]:
        m = self.moments
        return {"moments": {"n": m.n, "mean": m.mean, "m2": m.m2, "min": m.min if m.n else 0.0,
                            "max": m.max if m.n else 0.0},
                "class_counts": None if self.class_counts is None else [int(c) for c in self.class_counts]}
