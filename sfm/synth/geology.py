"""Synthetic geology in the manner of FaultSeg3D (Wu et al., 2019): :func:`synthesize_volume`.

Layered reflectivity, folding (Gaussian bumps growing with depth, planar shear), 5-8 normal and
reverse faults whose throw varies along the plane, a Ricker wavelet of 20-35 Hz and band-limited
noise at SNR 2-5. Deformation is applied backwards: every output voxel undoes the youngest fault
first, then the older ones, then the folding, and reads the reflectivity at the depth it lands on.
That keeps everything vectorised and makes the labels exact: a voxel is labelled a fault when it
lies within one voxel of a plane, in the coordinates the fault was created in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SAMPLE_INTERVAL_US = 4000
Volume = tuple[np.ndarray, np.ndarray]  # amplitude float32 [IL, XL, NS], fault labels uint8 [IL, XL, NS]


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


@dataclass
class Fault:
    """A planar fault through ``centre`` = (il0, xl0, t0) dipping ``dip_deg`` degrees towards azimuth ``strike``
    (radians).

    The plane is ``t = t0 + tan(dip) * h`` with ``h = (il - il0) cos(strike) + (xl - xl0) sin(strike)``;
    voxels are cubes. The hanging wall (the block above the plane) slid along the dip direction by
    ``throw(s, v) = max_throw * exp(-s^2 / 2 sigma_s^2 - v^2 / 2 sigma_v^2)``, with ``s`` the distance along
    strike and ``v`` down the dip from the centre, ``throw`` = (max_throw, sigma_s, sigma_v): down for a
    normal fault, up for a ``reverse`` one.
    """

    centre: tuple[float, float, float]  # (il0, xl0, t0) in voxels
    strike: float
    dip_deg: float
    throw: tuple[float, float, float]  # (max_throw in samples, sigma_s and sigma_v in voxels)
    reverse: bool

    def __post_init__(self) -> None:
        self.cos_s, self.sin_s = np.float32(np.cos(self.strike)), np.float32(np.sin(self.strike))
        dip = np.deg2rad(self.dip_deg)
        self.cos_d, self.sin_d, self.tan_d = np.float32(np.cos(dip)), np.float32(np.sin(dip)), np.float32(np.tan(dip))
        self.reverse = bool(self.reverse)

    @property
    def max_throw(self) -> float:
        return self.throw[0]

    def undo(self, i: np.ndarray, j: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Move the hanging wall's voxels (i, j, t) [...] back to before the slip, in place; return
        uint8 [...] labels: 1 within one voxel of the plane where the throw is at least one sample."""
        il0, xl0, t0 = self.centre
        max_throw, sigma_strike, sigma_dip = self.throw
        di, dj = i - np.float32(il0), j - np.float32(xl0)
        h = di * self.cos_s + dj * self.sin_s
        above = t - (np.float32(t0) + self.tan_d * h)  # < 0 in the hanging wall
        s = dj * self.cos_s - di * self.sin_s
        v = h / self.cos_d  # down-dip distance along the plane from its centre
        throw = np.float32(max_throw) * np.exp(s * s * np.float32(-0.5 / sigma_strike**2)
                                               + v * v * np.float32(-0.5 / sigma_dip**2))
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
            centre=(rng.uniform(0.1, 0.9) * (ni - 1), rng.uniform(0.1, 0.9) * (nx - 1),
                    rng.uniform(0.1, 0.9) * (ns - 1)),
            strike=rng.uniform(0, 2 * np.pi), dip_deg=rng.uniform(60.0, 85.0),
            throw=(rng.uniform(3.0, 12.0), rng.uniform(0.4, 1.2) * size, rng.uniform(0.4, 1.2) * size),
            reverse=rng.random() < 0.35,
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
