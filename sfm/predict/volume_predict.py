"""Whole-volume fault probability from a network that segments fixed-size crops.

A volume is cut into the crops the network takes (:func:`tiles`); their sigmoid
probabilities are put back in place and averaged where crops overlap. With test-time augmentation
the crops slide every half crop and each is also seen mirrored (nnU-Net's inference).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import nn


def tile_origins(n: int, c: int, step: int | None = None) -> list[int]:
    """Crop origins along an axis of ``n`` voxels: every ``step`` (default ``c``: no overlap), plus one flush
    with the end if needed."""
    if n < c:
        raise ValueError(f"a labelled volume axis of {n} voxels is smaller than the model's crop of {c}")
    origins = list(range(0, n - c + 1, step or c))
    return origins if origins[-1] + c == n else origins + [n - c]


def tiles(shape: Sequence[int], crop: Sequence[int], overlap: bool = False) -> list[tuple[int, int, int]]:
    """Origins of the crops that cover a volume of ``shape``: overlapping only at the far ends, or with
    ``overlap`` every half crop (sliding windows, so every voxel is seen from several contexts)."""
    axes = [tile_origins(n, c, max(1, c // 2) if overlap else None) for n, c in zip(shape, crop)]
    return [(i, j, k) for i in axes[0] for j in axes[1] for k in axes[2]]


def cut(volume: np.ndarray, origins: list[tuple[int, int, int]], crop: Sequence[int]) -> torch.Tensor:
    """The crops of ``volume`` [IL, XL, NS] at ``origins`` -> [M, 1, D, H, W] float32."""
    d, h, w = crop
    return torch.from_numpy(np.stack([volume[i:i + d, j:j + h, k:k + w] for i, j, k in origins]))[:, None].float()



def mirrorings(crop: tuple[int, int, int]) -> list[tuple[bool, bool, bool]]:
    """The label-preserving mirror images of a crop, as (flip inlines, flip crosslines, swap the two): all 8,
    or the 4 flips when the crop is not square in IL x XL."""
    swaps = (False, True) if crop[0] == crop[1] else (False,)
    return [(fi, fj, sw) for fi in (False, True) for fj in (False, True) for sw in swaps]


def _mirror(x: torch.Tensor, view: tuple[bool, bool, bool], inverse: bool = False) -> torch.Tensor:
    """x [N, IL, XL, ...] seen in ``view`` (``inverse``: back from it)."""
    fi, fj, sw = view
    if sw and inverse:
        x = x.transpose(1, 2)
    if fi:
        x = x.flip(1)
    if fj:
        x = x.flip(2)
    if sw and not inverse:
        x = x.transpose(1, 2)
    return x


def predict(net: nn.Module, amplitude: np.ndarray, batch_size: int = 8, *, augment: bool = False) -> np.ndarray:
    """Class probabilities of a whole volume: its tiles' probabilities, averaged where they overlap.
    ``net`` is a :class:`sfm.model.segmenter.Segmenter` (imgs [N, 1, D, H, W] -> logits [N, C, D, H, W] for
    crops of ``net.crop``; ``net.probabilities`` turns them into probabilities). Returns [IL, XL, NS]: the
    probability of class 1 of a binary task (C = 1), or [C, IL, XL, NS] for C classes.

    ``augment``: test-time augmentation as nnU-Net infers (sliding windows and mirroring): windows every
    half crop along each axis, each seen in every :func:`mirrorings` view, the probabilities mapped back
    and averaged, so a voxel's score does not hang on where the tile and patch borders fall or on its
    side of a flip. It costs about 18x the plain prediction for a 64^3 volume and 32 x 32 x 64 crops."""
    crop = tuple(net.crop)
    origins = tiles(amplitude.shape, crop, overlap=augment)
    imgs = cut(amplitude, origins, crop)[:, 0]  # [M, D, H, W]
    total: np.ndarray | None = None
    count = np.zeros(amplitude.shape, np.float32)
    net.eval()
    with torch.no_grad():
        for view in mirrorings(crop) if augment else [(False, False, False)]:
            for first in range(0, len(origins), batch_size):
                seen = _mirror(imgs[first:first + batch_size], view).contiguous()[:, None]
                probs = net.probabilities(net(seen)).float().cpu().movedim(1, -1)  # [N, D, H, W, C]
                probs = _mirror(probs, view, inverse=True).numpy()
                if total is None:
                    total = np.zeros((*amplitude.shape, probs.shape[-1]), np.float32)
                for (i, j, k), p in zip(origins[first:first + batch_size], probs):
                    total[i:i + crop[0], j:j + crop[1], k:k + crop[2]] += p
                    count[i:i + crop[0], j:j + crop[1], k:k + crop[2]] += 1
    mean = total / count[..., None]
    return np.ascontiguousarray(mean[..., 0] if mean.shape[-1] == 1 else np.moveaxis(mean, -1, 0))
