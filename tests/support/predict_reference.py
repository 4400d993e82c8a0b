"""What a whole-survey prediction should hold, computed the plain way: every window that reaches a region run
alone through the network (each mirror view flipped by hand), its probabilities times a 3D Gaussian added
into a numerator and the Gaussian into a denominator, in memory (nnU-Net's sliding-window inference), and
the survey's values read and normalised straight from the store with zarr."""

from __future__ import annotations

import itertools

import numpy as np
import torch
import zarr

from sfm import storage
from sfm.data.survey import read_survey_info
from sfm.predict.windows import origins


class SurveyValues:
    """Normalised amplitude of a survey store (dead traces 0), read with zarr, region by region."""

    def __init__(self, store_url: str):
        self.info, _ = read_survey_info(store_url)
        self.amp = zarr.open_group(storage.zarr_store(store_url, read_only=True), mode="r")["amplitude"]

    def window(self, origin, crop) -> np.ndarray:
        """[D, H, W] float32 at ``origin``, zeros past the survey's end."""
        out = np.zeros(crop, np.float32)
        box = tuple(slice(o, min(o + c, n)) for o, c, n in zip(origin, crop, self.info.shape))
        stored = np.asarray(self.amp[box])
        part = out[tuple(slice(0, s.stop - s.start) for s in box)]
        self.info.normalise_into(stored, part)
        part *= self.info.trace_mask[box[0], box[1]][..., None]
        return out


def gaussian(crop) -> np.ndarray:
    """[D, H, W] float64: exp(-|x - centre|^2 / 2 sigma^2) per axis, sigma = crop / 8."""
    axes = [np.exp(-0.5 * ((np.arange(c) - (c - 1) / 2) / (c / 8)) ** 2) for c in crop]
    return axes[0][:, None, None] * axes[1][None, :, None] * axes[2][None, None, :]


def views(crop, mirror: bool):
    if not mirror:
        return [(False, False, False)]
    swaps = (False, True) if crop[0] == crop[1] else (False,)
    return list(itertools.product((False, True), (False, True), swaps))


def seen(x: torch.Tensor, view, back: bool = False) -> torch.Tensor:
    """x [N, C, IL, XL, NS] flipped (fi, fj) then swapped (sw); ``back``: the inverse."""
    fi, fj, sw = view
    if back and sw:
        x = x.transpose(2, 3)
    x = x.flip(2) if fi else x
    x = x.flip(3) if fj else x
    if not back and sw:
        x = x.transpose(2, 3)
    return x


def blended(net, values: SurveyValues, box, overlap: float, mirror: bool) -> np.ndarray:
    """[C, *box extent] float64: the prediction of region ``box`` ((i0, i1), (j0, j1), (k0, k1))."""
    crop, shape = tuple(net.crop), values.info.shape
    reach = [[o for o in origins(n, c, overlap) if o < hi and o + c > lo]
             for n, c, (lo, hi) in zip(shape, crop, box)]
    g = gaussian(crop)
    num = den = None
    for origin in itertools.product(*reach):
        x = torch.from_numpy(values.window(origin, crop))[None, None]
        with torch.no_grad():
            p = sum(seen(net.probabilities(net(seen(x, v).contiguous())), v, back=True) for v in views(crop, mirror))
        p = (p / len(views(crop, mirror)))[0].double().numpy()
        src = tuple(slice(max(lo - o, 0), min(hi - o, c)) for o, c, (lo, hi) in zip(origin, crop, box))
        dst = tuple(slice(max(o - lo, 0), max(o - lo, 0) + s.stop - s.start) for o, s, (lo, _) in zip(origin, src, box))
        if num is None:
            num = np.zeros((p.shape[0], *(hi - lo for lo, hi in box)))
            den = np.zeros(tuple(hi - lo for lo, hi in box))
        num[(slice(None), *dst)] += p[(slice(None), *src)] * g[src]
        den[dst] += g[src]
    return num / den
