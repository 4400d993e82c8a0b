"""The amplitude statistics ingest takes while the traces stream through: :class:`Moments` per brick
column, merged in the store's column order, and their exact serialisation between ingest tasks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sfm.formats.store_layout import PERCENTILES


@dataclass
class Moments:
    """Count, mean, M2 (sum of squared deviations), min, max of live samples; merged with Chan's formula."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0
    min: float = math.inf
    max: float = -math.inf
    nonfinite: int = 0
    first_nonfinite: int = -1  # trace number
    zero_traces: int = 0
    sample: list = field(default_factory=list)  # [k, NS] float32 arrays of evenly spaced traces

    def add_block(self, block: np.ndarray, lo: float, hi: float) -> None:
        """Add live traces ``block`` [T, NS] float32 (finite), whose min and max are ``lo`` and ``hi``."""
        t, ns = block.shape
        sums = block.sum(axis=1)
        squares = np.einsum("ij,ij->i", block, block)
        n = t * ns
        total = float(sums.sum(dtype=np.float64))
        mean = total / n
        m2 = float(squares.sum(dtype=np.float64)) - total * mean
        if not math.isfinite(m2) or m2 <= 1e-3 * float(squares.sum(dtype=np.float64)):
            # float32 partial sums lose the spread when |mean| >> std (or overflow): redo exactly
            wide = block.astype(np.float64)
            mean = float(wide.mean())
            m2 = float(np.square(wide - mean).sum())
        self.merge(Moments(n, mean, max(0.0, m2), lo, hi))
        if lo == 0.0 or hi == 0.0:
            self.zero_traces += int(np.count_nonzero((block == 0).all(axis=1)))

    def merge(self, other: "Moments") -> None:
        if other.n:
            n = self.n + other.n
            delta = other.mean - self.mean
            self.mean += delta * other.n / n
            self.m2 += other.m2 + delta * delta * self.n * other.n / n
            self.n = n
            self.min, self.max = min(self.min, other.min), max(self.max, other.max)
        self.nonfinite += other.nonfinite
        if self.first_nonfinite < 0:
            self.first_nonfinite = other.first_nonfinite
        self.zero_traces += other.zero_traces
        self.sample.extend(other.sample)

    def result(self) -> dict[str, Any]:
        base = {"nonfinite_replaced": int(self.nonfinite), "zero_traces": int(self.zero_traces),
                "percentile_traces": int(sum(len(s) for s in self.sample))}
        if self.n == 0:
            return {"count": 0, "mean": 0.0, "std": 0.0, "min": 0.0, "max": 0.0, "all_zero": True,
                    "percentiles": {f"{p:g}": 0.0 for p in PERCENTILES}, **base}
        values = np.concatenate([s.ravel() for s in self.sample]) if self.sample else np.zeros(1, np.float32)
        pct = np.percentile(values, PERCENTILES)
        return {
            "count": int(self.n), "mean": float(self.mean), "std": float(math.sqrt(self.m2 / self.n)),
            "min": float(self.min), "max": float(self.max), "all_zero": self.min == 0.0 and self.max == 0.0,
            "percentiles": {f"{p:g}": float(v) for p, v in zip(PERCENTILES, pct)}, **base,
        }


def moments_to_bytes(units: list[Moments]) -> bytes:
    """Per-unit statistics as one ``.npz`` (exact: float64 and int64 columns, the kept traces stacked)."""
    import io

    ns = next((s.shape[1] for m in units for s in m.sample), 0)
    columns = {name: np.array([getattr(m, name) for m in units], dtype=np.float64 if name in _FLOATS else np.int64)
               for name in _FLOATS + _INTS}
    counts = [[len(s) for s in m.sample] for m in units]
    samples = [s for m in units for s in m.sample]
    buf = io.BytesIO()
    np.savez(buf, **columns, sample_units=np.array([len(c) for c in counts], dtype=np.int64),
             sample_rows=np.array([n for c in counts for n in c], dtype=np.int64),
             samples=np.concatenate(samples) if samples else np.zeros((0, ns), np.float32))
    return buf.getvalue()


def moments_from_bytes(data: bytes) -> list[Moments]:
    """The inverse of :func:`moments_to_bytes`."""
    import io

    z = np.load(io.BytesIO(data))
    rows, samples = z["sample_rows"], z["samples"]
    units, r, at = [], 0, 0
    for u, k in enumerate(z["sample_units"]):
        kept = []
        for n in rows[r : r + int(k)]:
            kept.append(samples[at : at + int(n)])
            at += int(n)
        r += int(k)
        fields = {name: float(z[name][u]) for name in _FLOATS} | {name: int(z[name][u]) for name in _INTS}
        units.append(Moments(**fields, sample=kept))
    return units


_FLOATS = ("mean", "m2", "min", "max")
_INTS = ("n", "nonfinite", "first_nonfinite", "zero_traces")
