"""Labelled crops for fine-tuning, through the data path: survey stores read by :mod:`sfm.data`, label
stores (:mod:`sfm.ingest.labels`) cut at the same place and in the same orientation.

- :class:`LabelledCrops`: one rank's training batches. The crop plan (:class:`sfm.data.crops.CropPlan`)
  draws origins among the windows holding at least one trace with training labels, so with sparse labels
  (a few inlines) every crop sees some; the amplitude comes from :class:`sfm.data.crop_reader.CropReader`
  (normalised from the stored statistics, flipped, swapped, time-reversed, polarity-inverted as
  ``data.augment`` allows), the labels from the label store, flipped and swapped alike.
- :func:`split_lines`: labelled lines held out of training: the last ``fraction`` of the labelled inlines
  (or crosslines, when only crosslines are labelled), one block at the survey's far end.
- :class:`Part` / :meth:`LabelledSurveys.read_part` / :class:`PartVolume`: the held-out lines of a survey (every
  labelled line of a validation or test survey), read with the amplitude every prediction window reaching them
  needs, predicted as ``sfm predict`` predicts the survey (the same windows, weights and mirrorings), and their
  labels, to score (validation and held-out test);
  :func:`split_roles`: which labels train, which validate, which are scored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from sfm.config import LABEL_IGNORE
from sfm.data.crop_reader import CropReader
from sfm.data.crops import Crop, CropPlan
from sfm.data.survey import Surveys
from sfm.errors import SFMError
from sfm.formats.label_store import open_labels
from sfm.predict.windows import IDENTITY, WindowGrid, mirrorings, predict_box, window_probabilities

IN_MEMORY_BYTES = 256 << 20  # label stores up to this size are read once and kept in memory


def finetune_data(cfg, crop: tuple[int, ...]):
    """The data section fine-tuning reads with (``cfg``: a JobConfig): the model's ``crop``, the ``[finetune]``
    batch size, seed and augmentation, every crop read on its own in the training process."""
    data = dataclasses.replace(cfg.data, crop=tuple(crop), batch_size=cfg.finetune.batch_size, seed=cfg.finetune.seed,
                               augment=cfg.finetune.augment, workers=0, crops_per_region=1, align="voxel")
    data.check()
    return data


def lines_axis(mask: np.ndarray) -> int:
    """The axis whose lines carry the labels: 1 (crosslines) when every inline holds labels but not every
    crossline (labels on some crosslines only), else 0 (inlines)."""
    return 1 if mask.any(axis=1).all() and not mask.any(axis=0).all() else 0


def split_lines(mask: np.ndarray, fractions: tuple[float, ...]) -> list[np.ndarray]:
    """Hold out blocks of labelled lines: for each fraction (in order from the far end), that share of the
    labelled lines (at least one where the fraction is above 0), as a trace mask [IL, XL]; every block
    from the lines left by the ones before it. ``mask`` [IL, XL]: the traces with labels."""
    axis = lines_axis(mask)
    lines = np.flatnonzero(mask.any(axis=1 - axis))
    out, end = [], len(lines)
    for fraction in fractions:
        n = max(1, round(len(lines) * fraction)) if fraction > 0 else 0
        if n >= end:
            raise SFMError(f"holding out {fraction:.0%} of {len(lines)} labelled lines leaves none to train on; "
                           "label more lines or hold out less")
        held = np.zeros(mask.shape[axis], bool)
        held[lines[end - n:end]] = True
        out.append(mask & (held[:, None] if axis == 0 else held[None, :]))
        end -= n
    return out


@dataclass
class Part:
    """What is predicted and scored of one survey: the lines ``lo:hi`` along ``axis`` (0 inlines, 1
    crosslines; every labelled line of a validation or test survey), scored where ``traces`` [IL, XL] (the
    held-out traces) hold labels."""

    survey: int
    axis: int
    lo: int
    hi: int
    traces: np.ndarray

    def box(self, shape: tuple[int, int, int]) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """(lo, hi) per axis of the part's voxels in a survey of ``shape``."""
        lo, hi = [0, 0, 0], list(shape)
        lo[self.axis], hi[self.axis] = self.lo, self.hi
        return tuple(lo), tuple(hi)


def part_of(survey: int, traces: np.ndarray) -> Part:
    """The part of ``survey`` scoring ``traces``: the lines from the first to the last that hold them."""
    axis = lines_axis(traces)
    lines = np.flatnonzero(traces.any(axis=1 - axis))
    return Part(survey, axis, int(lines[0]), int(lines[-1]) + 1, traces)


@dataclass
class PartVolume:
    """A part read for prediction as ``sfm predict`` predicts its survey: ``amplitude`` holds the survey's
    normalised voxels from ``start`` on, every window of ``grid`` (the whole survey's) that reaches the part's box
    ``lo``..``hi`` included; ``labels`` [box] (255 off the part's traces)."""

    part: Part
    grid: WindowGrid
    lo: tuple[int, int, int]
    hi: tuple[int, int, int]
    start: tuple[int, int, int]
    amplitude: np.ndarray
    labels: np.ndarray

    def predict(self, net, mirror: bool = False, batch_size: int = 8) -> np.ndarray:
        """The task model's probabilities of the box: [box] of class 1 (binary), or [C, box]
        (:func:`sfm.predict.windows.predict_box`, each window also mirrored with ``mirror``)."""
        views = mirrorings(self.grid.crop) if mirror else [IDENTITY]
        net.eval()
        out = predict_box(lambda imgs: window_probabilities(net, imgs, views), self.amplitude, self.grid, self.lo,
                          self.hi, start=self.start, batch_size=batch_size)
        return out[0] if out.shape[0] == 1 else out

    def box_amplitude(self) -> np.ndarray:
        """The normalised amplitude of the box [box] (what the card draws beside the prediction)."""
        return self.amplitude[tuple(slice(a - s, b - s) for a, b, s in zip(self.lo, self.hi, self.start))]


class LabelledSurveys:
    """Survey stores and their label stores, pairwise (``pairs``: [(survey store URL, label store URL)]),
    opened for reading with ``data`` (the checked ``JobConfig.data``; its crop is the model's)."""

    def __init__(self, pairs: list[tuple[str, str]], data):
        self.data = data
        self.surveys = Surveys([s for s, _ in pairs], data)
        if len(self.surveys) != len(pairs):
            raise SFMError(f"a labelled survey is smaller than the model's crop {list(data.crop)} along some axis; "
                           "fine-tune a model with a smaller crop, or label a larger survey")
        self.labels, self.masks, self.attrs = [], [], []
        for (survey_url, label_url), info in zip(pairs, self.surveys):
            attrs, labels, mask = open_labels(label_url)
            if tuple(attrs["shape"]) != tuple(info.shape):
                raise SFMError(f"label store {label_url} is {attrs['shape']}, its survey {survey_url} "
                               f"{list(info.shape)}; ingest the labels for that survey")
            self.labels.append(np.asarray(labels[...]) if labels.nbytes <= IN_MEMORY_BYTES else labels)
            self.masks.append(mask & info.trace_mask)
            self.attrs.append(attrs)

    def label_box(self, k: int, origin: tuple[int, ...], extent: tuple[int, ...], traces: np.ndarray) -> np.ndarray:
        """Labels [*extent] of survey ``k`` at ``origin``, 255 on traces outside ``traces`` [IL, XL]."""
        box = tuple(slice(o, o + n) for o, n in zip(origin, extent))
        out = np.array(self.labels[k][box], np.uint8)
        out[~traces[box[:2]]] = LABEL_IGNORE
        return out

    def read_part(self, part: Part, overlap: float) -> PartVolume:
        """``part`` read for prediction with windows of the model's crop (``data.crop``) overlapping by ``overlap``:
        the amplitude every window that reaches it reads (the grid is the whole survey's, as ``sfm predict``'s)
        and its labels."""
        shape = tuple(self.surveys[part.survey].shape)
        grid = WindowGrid(shape, self.data.crop, overlap)
        lo, hi = part.box(shape)
        start, stop = grid.span(lo, hi)
        extent = tuple(b - a for a, b in zip(start, stop))
        reader = CropReader(self.surveys, dataclasses.replace(self.data, crop=extent, cache_mb=0))
        try:
            amplitude = reader.read([Crop(part.survey, start, extent)])[0, 0]
        finally:
            reader.close()
        labels = self.label_box(part.survey, lo, tuple(b - a for a, b in zip(lo, hi)), part.traces)
        return PartVolume(part, grid, lo, hi, start, amplitude, labels)


def summed_area(mask: np.ndarray) -> np.ndarray:
    """[IL + 1, XL + 1] summed-area table of a trace mask (what :class:`sfm.data.survey.SurveyInfo` plans from)."""
    table = np.zeros((mask.shape[0] + 1, mask.shape[1] + 1), np.int64)
    table[1:, 1:] = mask.cumsum(0).cumsum(1)
    return table


class LabelledCrops:
    """One rank's fine-tuning batches from ``surveys``, labels only on ``traces`` (per survey [IL, XL]:
    its training traces): ``batch(step)`` -> (imgs float32 [B, 1, D, H, W], labels uint8 [B, D, H, W]).
    Batch ``b`` of rank ``r`` holds samples ``(b * world_size + r) * B + [0, B)`` of the plan of ``seed``
    (default ``data.seed``), so ranks never share a crop, and every network trained with one seed sees the same."""

    def __init__(self, surveys: LabelledSurveys, traces: list[np.ndarray], rank: int = 0, world_size: int = 1,
                 seed: int | None = None):
        self.surveys, self.traces, self.rank = surveys, traces, rank
        data = surveys.data if seed is None else dataclasses.replace(surveys.data, seed=seed)
        d, h, _ = data.crop
        # crops start where a window of d x h traces holds one with training labels (and the survey a trace)
        planned = [dataclasses.replace(info, trace_mask=t & info.trace_mask,
                                       live_cells=summed_area(t & info.trace_mask))
                   for info, t in zip(surveys.surveys, traces)]
        self.plan = CropPlan(planned, dataclasses.replace(data, min_live_fraction=1.0 / (d * h), crops_per_region=1),
                             world_size)
        self.reader = CropReader(surveys.surveys, data)

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        b, world = self.plan.batch_size, self.plan.world_size
        crops = [self.plan.locate(0, (step * world + self.rank) * b + n) for n in range(b)]
        imgs = self.reader.read(crops)
        return imgs, np.stack([self.oriented_labels(c) for c in crops])

    def oriented_labels(self, c: Crop) -> np.ndarray:
        """The labels of crop ``c`` as :class:`CropReader` delivers its amplitude: flipped, then swapped."""
        labels = self.surveys.label_box(c.survey, c.origin, c.extent, self.traces[c.survey])
        labels = labels[:: -1 if c.flip_inline else 1, :: -1 if c.flip_crossline else 1, :: -1 if c.reverse_time else 1]
        return np.ascontiguousarray(labels.transpose(1, 0, 2) if c.swap else labels)

    def close(self) -> None:
        self.reader.close()


ROLES = ("train", "validation", "test")


@dataclass
class Split:
    """Which labels do what: ``train`` per survey (its training traces [IL, XL]; none for a validation or
    test survey), the ``validation`` parts early stopping scores and the ``test`` parts the model is
    scored on."""

    train: list[np.ndarray]
    validation: list[Part]
    test: list[Part]


def split_roles(surveys: LabelledSurveys, roles: list[str], validation: float, held_out: float) -> Split:
    """The :class:`Split` of ``surveys`` whose pairs have ``roles`` (train | validation | test). Without
    test surveys, the last ``held_out`` fraction of each training survey's labelled lines is the test
    set; without validation surveys, the ``validation`` fraction before it validates (0: no early
    stopping). Every process of a run computes the same split."""
    out = Split([], [], [])
    fractions = ([held_out] if "test" not in roles else []) + ([validation] if "validation" not in roles else [])
    for k, (role, mask) in enumerate(zip(roles, surveys.masks)):
        if role != "train":
            out.train.append(np.zeros_like(mask))
            getattr(out, role).append(part_of(k, mask))
            continue
        blocks = split_lines(mask, tuple(fractions))
        train = mask.copy()
        for block in blocks:
            train &= ~block
        out.train.append(train)
        named = dict(zip(([] if "test" in roles else ["test"]) + ([] if "validation" in roles else ["validation"]),
                         blocks))
        for name, block in named.items():
            if block.any():
                getattr(out, name).append(part_of(k, block))
    if not any(t.any() for t in out.train):
        raise SFMError("no labelled traces are left to fine-tune on; name training surveys with labels")
    return out
