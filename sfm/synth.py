"""Synthetic post-stack seismic surveys: a volume that looks like geology, written as real SEG-Y.

The generator follows FaultSeg3D's forward model (Wu et al., 2019), see :func:`synthesize_volume`:
layered reflectivity, folding (Gaussian bumps growing with depth, planar shear), 5-8 normal and
reverse faults whose throw varies along the plane, a Ricker wavelet of 20-35 Hz and band-limited
noise at SNR 2-5. Deformation is applied backwards: every output voxel undoes the youngest fault
first, then the older ones, then the folding, and reads the reflectivity at the depth it lands on.
That keeps everything vectorised and makes the labels exact: a voxel is labelled a fault when it
lies within one voxel of a plane, in the coordinates the fault was created in.

:func:`write_segy` writes any ``[IL, XL, NS]`` volume with segyio in formats 1, 3, 5 or 8, either
endianness, either trace sorting and in/crossline numbers at any 4-byte trace header position;
:func:`synth_survey` does both and puts the fault labels beside the SEG-Y file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from sfm.errors import SFMError

log = logging.getLogger(__name__)

SAMPLE_INTERVAL_US = 4000

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
# geology


def synthesize_volume(shape: tuple[int, int, int], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Make a synthetic post-stack volume and its fault labels, in the manner of FaultSeg3D.

    The recipe of Wu et al. (2019, "FaultSeg3D"): horizontal layers of random reflectivity, folded
    by Gaussian bumps that grow with depth plus a planar shear, cut by 5-8 faults per 128 x 128 traces
    (normal and reverse, dips 60-85 degrees, any strike) whose throw varies along the plane, convolved with a
    Ricker wavelet of 20-35 Hz and mixed with band-limited noise at a signal-to-noise ratio of 2-5.

    Args:
        shape: (IL, XL, NS): inlines, crosslines, samples per trace (4 ms).
        seed: seeds ``np.random.default_rng``; the same seed gives the same arrays.

    Returns:
        amplitude: float32 [IL, XL, NS], zero mean, unit standard deviation.
        faults: uint8 [IL, XL, NS], 1 within one voxel of a fault plane where its throw is at least
        one sample, else 0.
    """
    ni, nx, ns = (int(n) for n in shape)
    rng = np.random.default_rng(seed)

    folding = Folding.random(rng, ni, nx, ns)
    faults = random_faults(rng, ni, nx, ns)
    pad = int(np.ceil(folding.max_shift + sum(f.max_throw for f in faults))) + 8
    refl = reflectivity(rng, ns + 2 * pad)

    # Each output voxel is traced back to where it sat before deformation: undo the youngest fault
    # first (older planes were moved by younger faults), then the folding, and read the layered
    # reflectivity at the depth reached there.
    i = np.broadcast_to(np.arange(ni, dtype=np.float32)[:, None, None], (ni, nx, ns)).copy()
    j = np.broadcast_to(np.arange(nx, dtype=np.float32)[None, :, None], (ni, nx, ns)).copy()
    t = np.broadcast_to(np.arange(ns, dtype=np.float32)[None, None, :], (ni, nx, ns)).copy()
    labels = np.zeros((ni, nx, ns), dtype=np.uint8)
    for fault in reversed(faults):
        labels |= fault.undo(i, j, t)
    amplitude = sample_linear(refl, t - folding.shift(i, j, t) + pad)

    freq_hz = rng.uniform(20.0, 35.0)
    dt_s = SAMPLE_INTERVAL_US * 1e-6
    amplitude = convolve_samples(amplitude, ricker(freq_hz, dt_s))
    noise = convolve_samples(rng.standard_normal(amplitude.shape, dtype=np.float32),
                             ricker(rng.uniform(20.0, 40.0), dt_s))  # band-limited, like the signal
    snr = rng.uniform(2.0, 5.0)  # standard deviation of the signal over that of the noise
    noise *= np.float32(float(amplitude.std()) / (snr * (float(noise.std()) or 1.0)))
    amplitude += noise
    amplitude -= amplitude.mean(dtype=np.float64)
    amplitude /= np.float32(amplitude.std(dtype=np.float64) or 1.0)
    return amplitude.astype(np.float32, copy=False), labels


def reflectivity(rng: np.random.Generator, n: int) -> np.ndarray:
    """Sparse reflection coefficients in depth, float32 [n].

    Formations 6-40 samples thick each get their own strength (log-normal), carry sparse random
    spikes inside, and a strong, continuous reflector at their top.
    """
    tops = np.cumsum(rng.integers(6, 41, size=n // 6 + 1))
    tops = tops[tops < n]
    formation = np.searchsorted(tops, np.arange(n), side="right")
    strength = rng.lognormal(0.0, 0.6, size=len(tops) + 1)[formation]

    spikes = (rng.random(n) < 0.3) * rng.standard_normal(n) * strength
    spikes[tops] += rng.choice([-1.0, 1.0], size=len(tops)) * rng.uniform(1.5, 3.0, size=len(tops))
    return spikes.astype(np.float32)


class Folding:
    """Vertical shift of the layers, in samples: Gaussian bumps whose relief grows with depth, plus a
    planar shear, ``shift(i, j, t) = (0.5 + t / NS) * bumps(i, j) + e0 + f i + g j``."""

    def __init__(self, bumps: list[tuple[float, float, float, float]], shear: tuple[float, float, float], ns: int):
        self.bumps, self.shear, self.ns = bumps, shear, ns  # bumps: (amplitude, centre il, centre xl, sigma)
        self.max_shift = 1.5 * sum(abs(b[0]) for b in bumps) + abs(shear[0])
        self.max_shift += (abs(shear[1]) + abs(shear[2])) * 2 * ns  # generous: lateral offsets of the faults

    @classmethod
    def random(cls, rng: np.random.Generator, ni: int, nx: int, ns: int) -> "Folding":
        size = float(max(ni, nx))
        bumps = [(rng.uniform(-1, 1), rng.uniform(0, ni), rng.uniform(0, nx), rng.uniform(0.15, 0.5) * size)
                 for _ in range(rng.integers(3, 7))]
        # relief 5-15 % of NS, but dips no steeper than 0.1-0.3 samples per trace at the deepest layer
        il, xl = np.meshgrid(np.arange(ni, dtype=np.float64), np.arange(nx, dtype=np.float64), indexing="ij")
        surface = sum(a * np.exp(-((il - ci) ** 2 + (xl - cj) ** 2) / (2 * s * s)) for a, ci, cj, s in bumps)
        peak = float(np.abs(surface - surface.mean()).max())
        steepest = 1.5 * float(max((np.hypot(*np.gradient(surface)).max() if min(ni, nx) > 1 else 0.0), 1e-9))
        scale = min(rng.uniform(0.05, 0.15) * ns / max(peak, 1e-9), rng.uniform(0.1, 0.3) / steepest)
        bumps = [(a * scale, ci, cj, s) for a, ci, cj, s in bumps]
        shear = (0.0, rng.uniform(-0.05, 0.05), rng.uniform(-0.05, 0.05))
        return cls(bumps, shear, ns)

    def shift(self, i: np.ndarray, j: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Shift [...] at fractional positions (i, j, t) [...] (float32)."""
        bumps = np.zeros_like(i)
        for a, ci, cj, s in self.bumps:
            bumps += np.float32(a) * np.exp(((i - np.float32(ci)) ** 2 + (j - np.float32(cj)) ** 2) * np.float32(-0.5 / (s * s)))
        e0, f, g = (np.float32(v) for v in self.shear)
        return (np.float32(0.5) + t * np.float32(1.0 / self.ns)) * bumps + e0 + f * i + g * j


class Fault:
    """A planar fault through (il0, xl0, t0) dipping ``dip`` degrees towards azimuth ``strike``.

    The plane is ``t = t0 + tan(dip) * h`` with ``h = (il - il0) cos(strike) + (xl - xl0) sin(strike)``;
    voxels are cubes. The hanging wall (the block above the plane) slid along the dip direction by
    ``throw(s, v) = max_throw * exp(-s^2 / 2 sigma_s^2 - v^2 / 2 sigma_v^2)``, with ``s`` the distance along
    strike and ``v`` down the dip from the centre: down for a normal fault, up for a reverse one.
    """

    def __init__(self, il0, xl0, t0, strike, dip_deg, max_throw, sigma_strike, sigma_dip, reverse):
        self.il0, self.xl0, self.t0 = il0, xl0, t0
        self.cos_s, self.sin_s = np.float32(np.cos(strike)), np.float32(np.sin(strike))
        dip = np.deg2rad(dip_deg)
        self.cos_d, self.sin_d, self.tan_d = np.float32(np.cos(dip)), np.float32(np.sin(dip)), np.float32(np.tan(dip))
        self.max_throw, self.sigma_strike, self.sigma_dip = max_throw, sigma_strike, sigma_dip
        self.reverse = bool(reverse)

    def undo(self, i: np.ndarray, j: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Move the hanging wall's voxels (i, j, t) [...] back to before the slip, in place; return
        uint8 [...] labels: 1 within one voxel of the plane where the throw is at least one sample."""
        di, dj = i - np.float32(self.il0), j - np.float32(self.xl0)
        h = di * self.cos_s + dj * self.sin_s
        above = t - (np.float32(self.t0) + self.tan_d * h)  # < 0 in the hanging wall
        s = dj * self.cos_s - di * self.sin_s
        v = h / self.cos_d  # down-dip distance along the plane from its centre
        throw = np.float32(self.max_throw) * np.exp(s * s * np.float32(-0.5 / self.sigma_strike**2)
                                                    + v * v * np.float32(-0.5 / self.sigma_dip**2))
        labels = ((np.abs(above) * self.cos_d < 1.0) & (throw >= 1.0)).astype(np.uint8)
        slip = np.where(above < 0, throw, np.float32(0.0)) * np.float32(-1.0 if self.reverse else 1.0)
        # a normal fault moved the hanging wall down the dip: its voxels came from up-dip
        i -= slip * (self.cos_d * self.cos_s)
        j -= slip * (self.cos_d * self.sin_s)
        t -= slip * self.sin_d
        return labels


FAULTS_PER_AREA = (5, 8)  # faults per 128 x 128 traces, as in FaultSeg3D's 128^3 training volumes
FAULT_AREA = 128 * 128


def random_faults(rng: np.random.Generator, ni: int, nx: int, ns: int) -> list[Fault]:
    """Faults, oldest first: 5-8 per 128 x 128 traces (at least one), about a third reverse, dips
    60-85 degrees, any strike, centres in the middle 80 % of the volume, maximum throws of 3-12
    samples that fade over 0.4-1.2 volume widths along strike and dip."""
    size = float(max(ni, nx, 8))
    density = rng.uniform(FAULTS_PER_AREA[0], FAULTS_PER_AREA[1] + 1)
    faults = []
    for _ in range(max(1, int(density * ni * nx / FAULT_AREA))):
        faults.append(Fault(
            il0=rng.uniform(0.1, 0.9) * (ni - 1), xl0=rng.uniform(0.1, 0.9) * (nx - 1),
            t0=rng.uniform(0.1, 0.9) * (ns - 1), strike=rng.uniform(0, 2 * np.pi), dip_deg=rng.uniform(60.0, 85.0),
            max_throw=rng.uniform(3.0, 12.0), sigma_strike=rng.uniform(0.4, 1.2) * size,
            sigma_dip=rng.uniform(0.4, 1.2) * size, reverse=rng.random() < 0.35,
        ))
    return faults


def sample_linear(series: np.ndarray, position: np.ndarray) -> np.ndarray:
    """Linear interpolation of a 1D ``series`` [n] at fractional indices ``position`` [...]."""
    position = np.clip(position, 0, len(series) - 1.001)
    lower = position.astype(np.int32)
    slope = np.diff(series, append=series[-1])
    return np.take(series, lower) + (position - lower) * np.take(slope, lower)


def ricker(freq_hz: float, dt_s: float) -> np.ndarray:
    """Zero-phase Ricker wavelet with peak frequency ``freq_hz``, float32 [2 * half + 1]."""
    half = int(np.ceil(1.5 / (freq_hz * dt_s)))
    arg = (np.pi * freq_hz * dt_s * np.arange(-half, half + 1)) ** 2
    return ((1 - 2 * arg) * np.exp(-arg)).astype(np.float32)


def convolve_samples(volume: np.ndarray, wavelet: np.ndarray) -> np.ndarray:
    """Convolve every trace of ``volume`` [..., NS] with a centred ``wavelet`` [2h+1]; same shape."""
    ns, half = volume.shape[-1], len(wavelet) // 2
    nfft = ns + 2 * half
    spectrum = np.fft.rfft(volume.astype(np.float32, copy=False), n=nfft, axis=-1)
    spectrum *= np.fft.rfft(wavelet, n=nfft)
    return np.fft.irfft(spectrum, n=nfft, axis=-1)[..., half : half + ns].astype(np.float32)


# --------------------------------------------------------------------------------------------
# SEG-Y


def write_segy(
    path,
    amplitude: np.ndarray,
    *,
    sample_format: int = 5,
    endian: str = "big",
    iline_byte: int = 189,
    xline_byte: int = 193,
    sorting: str = "inline",
    first_inline: int = 100,
    first_crossline: int = 300,
    sample_interval_us: int = SAMPLE_INTERVAL_US,
    text: Sequence[str] = (),
) -> None:
    """Write ``amplitude`` [IL, XL, NS] as a post-stack 3D SEG-Y file at ``path``.

    Traces go in inline order (crossline numbers fastest) or crossline order (inline numbers
    fastest), as ``sorting`` says. Each trace header holds the inline and crossline number as
    4-byte signed integers at ``iline_byte`` / ``xline_byte`` (1-based, any position 1..237),
    the CDP coordinates of a rotated 25 m grid at bytes 181/185 with scalar -100 at byte 71, the
    trace sequence number (byte 1), CDP bin number (21), offset 0 (37), sample count and interval.
    The integer formats 3 and 8 are scaled so the largest absolute amplitude is 0.9 of the type's
    range; the textual header (EBCDIC) states the factor. ``text`` adds lines to that header.

    Plain ``segyio.open(path, iline=B, xline=B)`` reads the result when B starts a 4-byte field
    segyio knows (1-25, 41-65 and 73-85 in steps of 4, 189, 193, 197, 205, 219, 225, 233, 237).
    Other positions are written just the same, but segyio refuses them (``KeyError``) or, where
    it knows a 2-byte field, reads only 2 bytes; readers must then take the bytes themselves.
    """
    amplitude = np.asarray(amplitude)
    if amplitude.ndim != 3 or min(amplitude.shape) < 1:
        raise ValueError(f"amplitude must be [IL, XL, NS] with every axis >= 1, got shape {amplitude.shape}")
    check_layout(sample_format, endian, iline_byte, xline_byte, sorting)
    ni, nx, ns = amplitude.shape
    if ns > 32767:
        raise SFMError(f"NS {ns} does not fit the 2-byte SEG-Y sample count; use --shape with NS <= 32767")

    import segyio

    traces, scale = encode_samples(amplitude, sample_format)
    if sorting == "crossline":
        traces = traces.transpose(1, 0, 2)
    # Our own copy: for format 1 segyio converts each trace to IBM and back in place, rounding it.
    traces = np.array(traces.reshape(-1, ns), order="C", copy=True)

    inlines = first_inline + np.arange(ni)
    crosslines = first_crossline + np.arange(nx)
    spec = segyio.spec()
    spec.iline, spec.xline = iline_byte, xline_byte
    spec.format = sample_format
    spec.endian = endian
    spec.sorting = {
        "inline": segyio.TraceSortingFormat.INLINE_SORTING,
        "crossline": segyio.TraceSortingFormat.CROSSLINE_SORTING,
    }[sorting]
    spec.samples = np.arange(ns) * (sample_interval_us / 1000.0)
    spec.ilines, spec.xlines, spec.offsets = inlines, crosslines, [0]

    lines = [
        "SYNTHETIC POST-STACK SEISMIC, NOT REAL DATA. WRITTEN BY SFM.SYNTH",
        *text,
        f"INLINES {inlines[0]}-{inlines[-1]} ({ni})  CROSSLINES {crosslines[0]}-{crosslines[-1]} ({nx})",
        f"SAMPLES {ns} AT {sample_interval_us} US  FORMAT {sample_format}  {endian.upper()} ENDIAN",
        f"SORTING {sorting.upper()}",
        f"INLINE BYTE {iline_byte}  CROSSLINE BYTE {xline_byte}  (4-BYTE SIGNED INTEGERS)",
        f"CDP_X BYTE {CDP_X[0]}  CDP_Y BYTE {CDP_Y[0]}  SCALAR BYTE {SCALCO[0]} = {COORDINATE_SCALAR}",
        f"GRID ORIGIN X {GRID_ORIGIN_M[0]:.2f} Y {GRID_ORIGIN_M[1]:.2f} M, BIN {GRID_BIN_M:g} M, "
        f"ROTATION {GRID_ROTATION_DEG:g} DEG",
    ]
    if scale is not None:
        lines.append(f"INTEGER SAMPLES: AMPLITUDE = SAMPLE / {scale:.6g}")
    lines.append("END TEXTUAL HEADER")
    header_text = segyio.tools.create_text_header({i + 1: line[:76] for i, line in enumerate(lines[:40])})

    with segyio.create(str(path), spec) as f:
        f.text[0] = header_text
        f.bin.update(
            {
                segyio.BinField.Interval: sample_interval_us,
                segyio.BinField.IntervalOriginal: sample_interval_us,
                segyio.BinField.MeasurementSystem: 1,  # metres
                segyio.BinField.SortingCode: 4,  # horizontally stacked
            }
        )
        for k in range(len(traces)):
            f.trace[k] = traces[k]

    fields = trace_headers(
        ni, nx, ns, sorting=sorting, iline_byte=iline_byte, xline_byte=xline_byte,
        first_inline=first_inline, first_crossline=first_crossline, sample_interval_us=sample_interval_us,
    )
    write_trace_headers(path, fields, ns=ns, sample_format=sample_format, endian=endian)


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


def trace_headers(
    ni: int,
    nx: int,
    ns: int,
    *,
    sorting: str,
    iline_byte: int,
    xline_byte: int,
    first_inline: int,
    first_crossline: int,
    sample_interval_us: int,
) -> dict[tuple[int, int], np.ndarray]:
    """Trace header values in file order: {(1-based byte, width in bytes): int64 [IL * XL]}.

    The in/crossline numbers come last, so when they share bytes with the trace sequence or CDP
    number (e.g. ``--iline-byte 21``), writing the fields in order leaves the line numbers there.
    """
    i, j = np.meshgrid(np.arange(ni), np.arange(nx), indexing="ij")  # [IL, XL] grid indices
    if sorting == "crossline":
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
        TRACE_SAMPLE_INTERVAL: np.full(n, sample_interval_us),
        CDP_X: np.rint(x * -COORDINATE_SCALAR).astype(np.int64),
        CDP_Y: np.rint(y * -COORDINATE_SCALAR).astype(np.int64),
    }
    fields.pop((iline_byte, 4), None)  # re-insert at the end so the line numbers win
    fields.pop((xline_byte, 4), None)
    fields[(iline_byte, 4)] = first_inline + i
    fields[(xline_byte, 4)] = first_crossline + j
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


def check_layout(sample_format: int, endian: str, iline_byte: int, xline_byte: int, sorting: str) -> None:
    """Raise :class:`SFMError` naming the option and the fix if the SEG-Y layout is not writable."""
    if sample_format not in SAMPLE_FORMATS:
        raise SFMError(
            f"--format {sample_format} is not supported; use 1 (IBM float), 3 (int16), 5 (IEEE float) or 8 (int8)"
        )
    if endian not in ENDIANS:
        raise SFMError(f"--endian {endian!r} is not a byte order; use 'big' or 'little'")
    if sorting not in SORTINGS:
        raise SFMError(f"--sorting {sorting!r} is not a trace sorting; use 'inline' or 'crossline'")

    spans = {}
    for option, byte in (("--iline-byte", iline_byte), ("--xline-byte", xline_byte)):
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
            f"--iline-byte {iline_byte} and --xline-byte {xline_byte} overlap; "
            "give two different 4-byte positions at least 4 bytes apart"
        )


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
    check_layout(sample_format, endian, iline_byte, xline_byte, sorting)
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
        write_segy(
            segy_tmp,
            amplitude,
            sample_format=sample_format,
            endian=endian,
            iline_byte=iline_byte,
            xline_byte=xline_byte,
            sorting=sorting,
            text=[f"SEED {seed}  FAULT LABELS: <THIS NAME WITHOUT .SGY>.FAULTS.NPY BESIDE IT"],
        )

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
