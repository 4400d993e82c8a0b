"""Labelled volumes for the downstream evaluation (sfm.eval.downstream): generated, normalised, cut.

- :func:`labelled_volumes`: FaultSeg3D-like volumes from :func:`sfm.synth.geology.synthesize_volume`,
  normalised the way the training sampler normalises a survey; the pool's seeds and the test seeds are
  disjoint, and far from every survey seed the pipeline generates for pretraining.
- :func:`random_crops`: fine-tuning batches with flips, inline/crossline swap, polarity inversion and time reversal.
- :func:`split_for_validation`: the held-out inlines early stopping scores, inside the label budget.
- :func:`evaluation_validation` / :func:`whole`: separate labelled volumes early stopping scores instead.
- :func:`budget_volumes`: the volumes of one run's label budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from sfm.synth.geology import Volume

LABELLED_SEED = 1_000_000  # labelled pool: seeds LABELLED_SEED, +1, ...; pretraining surveys use small seeds
TEST_SEED = 2_000_000  # held-out test volumes: TEST_SEED, +1, ...
VALIDATION_SEED = 3_000_000  # early-stopping volumes: VALIDATION_SEED, +1, ... (neither pool nor test)
REFERENCE_SEED = 4_000_000  # a supervised reference encoder's training volumes (benchmarks/quality.py)


def normalise(amplitude: np.ndarray) -> np.ndarray:
    """Clip to the 0.1/99.9 percentiles and standardise, as the training sampler treats a survey."""
    lo, hi = np.percentile(amplitude, (0.1, 99.9))
    clipped = np.clip(amplitude, lo, hi)
    return ((clipped - clipped.mean()) / (clipped.std() or 1.0)).astype(np.float32)


def labelled_volumes(count: int, shape: Sequence[int], first_seed: int) -> list[Volume]:
    """``count`` generated volumes (seeds ``first_seed`` ...): (normalised amplitude, fault labels)."""
    from sfm.synth.geology import synthesize_volume

    out = []
    for k in range(count):
        amplitude, faults = synthesize_volume(tuple(shape), first_seed + k)
        out.append((normalise(amplitude), faults))
    return out


def random_crops(volumes: list[Volume], crop: Sequence[int], count: int, rng: np.random.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` random crops with random inline/crossline flips (and swap when the crop is square in
    IL x XL), polarity inversion and time reversal (each label-preserving for faults; with one labelled
    volume a baseline without the last two overfits its few crops): images [count, 1, D, H, W] float32,
    labels [count, D, H, W] float32."""
    d, h, w = crop
    imgs, labels = [], []
    for _ in range(count):
        amplitude, faults = volumes[int(rng.integers(len(volumes)))]
        i, j, k = (int(rng.integers(n - c + 1)) for n, c in zip(amplitude.shape, crop))
        a, f = amplitude[i:i + d, j:j + h, k:k + w], faults[i:i + d, j:j + h, k:k + w]
        flip_i, flip_j, swap = rng.integers(0, 2, size=3)
        if flip_i:
            a, f = a[::-1], f[::-1]
        if flip_j:
            a, f = a[:, ::-1], f[:, ::-1]
        if swap and d == h:
            a, f = a.transpose(1, 0, 2), f.transpose(1, 0, 2)
        imgs.append(a)
        labels.append(f)
    for n, (invert, reverse) in enumerate(rng.integers(0, 2, size=(count, 2))):
        if reverse:
            imgs[n], labels[n] = imgs[n][:, :, ::-1], labels[n][:, :, ::-1]
        if invert:
            imgs[n] = -imgs[n]
    return torch.from_numpy(np.stack(imgs))[:, None], torch.from_numpy(np.stack(labels).astype(np.float32))


@dataclass
class Held:
    """The validation part of a labelled volume: ``amplitude``/``faults`` [C, XL, NS] cut so that a crop
    fits, of which only inlines ``first:`` are scored (the ones before are training labels)."""

    amplitude: np.ndarray
    faults: np.ndarray
    first: int


def split_for_validation(volumes: list[Volume], fraction: float, crop: Sequence[int]
                         ) -> tuple[list[Volume], list[Held]]:
    """Hold out the labels of the last ``fraction`` of each volume's inlines: (the volumes cut to the
    inlines before, for fine-tuning; the held-out parts, for validation). No split (``[]``) where a
    volume would leave less than a crop to fine-tune on, or ``fraction`` is 0."""
    fit, held = [], []
    for amplitude, faults in volumes:
        n, c = amplitude.shape[0], crop[0]
        slab = max(1, round(n * fraction)) if fraction > 0 else 0
        if slab == 0 or n - slab < c:
            return list(volumes), []
        width = max(c, slab)  # a whole crop of amplitude around the held-out inlines
        fit.append((amplitude[:n - slab], faults[:n - slab]))
        held.append(Held(amplitude[n - width:], faults[n - width:], width - slab))
    return fit, held


def whole(volumes: list[Volume]) -> list[Held]:
    """Whole labelled volumes as validation parts (every inline scored)."""
    return [Held(amplitude, faults, 0) for amplitude, faults in volumes]


def budget_volumes(pool: list[Volume], budget: int, seed: int) -> list[Volume]:
    """The ``budget`` labelled volumes of run ``seed``: a seeded draw from the pool (the whole pool at its size)."""
    pick = np.random.default_rng(seed).permutation(len(pool))[:budget]
    return [pool[i] for i in sorted(pick)]


def pool_size(pool_volumes: int, budgets: Sequence[int]) -> int:
    """How many labelled volumes the budgets draw from: ``pool_volumes``, or (0) the largest budget."""
    return max(pool_volumes, max(budgets))


def evaluation_pool(recipe) -> list[Volume]:
    """The labelled volumes a recipe's budgets draw from (``recipe``: an sfm.eval.downstream.Recipe, or
    anything with ``pool_volumes``, ``budgets`` and ``volume``), seeds from :data:`LABELLED_SEED` on."""
    return labelled_volumes(pool_size(recipe.pool_volumes, recipe.budgets), recipe.volume, LABELLED_SEED)


def evaluation_test(recipe) -> list[Volume]:
    """A recipe's held-out test volumes (``test_volumes`` of ``volume``), seeds from :data:`TEST_SEED` on."""
    return labelled_volumes(recipe.test_volumes, recipe.volume, TEST_SEED)


def evaluation_validation(recipe) -> list[Volume]:
    """A recipe's early-stopping volumes (``validation_volumes`` of ``volume``; none for 0), seeds from
    :data:`VALIDATION_SEED` on: disjoint from the pool, the test volumes and every pretraining survey."""
    return labelled_volumes(recipe.validation_volumes, recipe.volume, VALIDATION_SEED)
