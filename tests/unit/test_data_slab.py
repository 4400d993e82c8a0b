"""Context-parallel crop reads: each cp rank of a group reads only its inline slab of the group's crops.

The slabs of one crop, from :func:`sfm.distributed.context_parallel.crop_slab`, tile it: concatenated along axis 0
they are the crop, with every augmentation. A rank fetches only the bricks its slab needs, and a
slab stream resumes like a whole-crop stream.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from support.crop_stores import crops_of, stream, surveys  # noqa: F401 (surveys: the same two holed surveys, a fixture)
from sfm import data
from sfm.config import JobConfig
from sfm.distributed.context_parallel import crop_slab
from sfm.errors import SFMError

SQUARE = (24, 24, 16)  # D == H, so swap is drawn
PATCH = (4, 4, 4)


def slab_stream(urls, slab=None, *, batch=3, **kw):
    """test_data's stream of SQUARE crops (unless ``crop`` is given), reading only ``slab``."""
    return stream(urls, batch=batch, slab=slab, crop=kw.pop("crop", SQUARE), **kw)


def take(s: data.BatchStream, n: int) -> list[torch.Tensor]:
    try:
        return [next(s) for _ in range(n)]
    finally:
        s.close()


def slabs(crop, cp: int) -> list[tuple[int, int]]:
    return [(s.start, s.stop) for s in (crop_slab(crop, PATCH, r, cp) for r in range(cp))]


@pytest.mark.parametrize("augment", [data.AUGMENTATIONS, ()], ids=["augmented", "plain"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_slabs_of_a_cp_group_tile_its_crops_exactly(surveys, seed, augment):
    n = 4
    whole = take(slab_stream(surveys.urls, seed=seed, augment=augment, rank=1, world=2,
                             min_live_fraction=0.3), n)
    for cp in (2, 3):
        parts = [take(slab_stream(surveys.urls, slab, seed=seed, augment=augment, rank=1, world=2,
                                  min_live_fraction=0.3), n) for slab in slabs(SQUARE, cp)]
        for b in range(n):
            for part, (start, stop) in zip(parts, slabs(SQUARE, cp)):
                assert part[b].shape == (3, 1, stop - start, *SQUARE[1:])
            assert torch.equal(torch.cat([p[b] for p in parts], dim=2), whole[b]), (cp, b)


def test_every_augmentation_combination_is_covered_by_the_tiling(surveys):
    """The seeds above draw most combinations; this pins each of the 8 (flip_il, flip_xl, swap)."""
    sampler = crops_of(surveys.urls, SQUARE, seed=5, augment=data.AUGMENTATIONS, min_live_fraction=0.3)
    by_kind = {}
    for i in range(200):
        c = sampler.locate(i)
        by_kind.setdefault((c.flip_inline, c.flip_crossline, c.swap), i)
    assert len(by_kind) == 8
    indices = list(by_kind.values())
    whole = sampler.read(indices)
    for cp in (2, 3):
        parts = []
        for slab in slabs(SQUARE, cp):
            part = crops_of(surveys.urls, SQUARE, seed=5, augment=data.AUGMENTATIONS, min_live_fraction=0.3,
                                    slab=slab)
            parts.append(part.read(indices))
            part.close()
        np.testing.assert_array_equal(np.concatenate(parts, axis=2), whole)
    sampler.close()


def test_a_cp_rank_fetches_only_the_bricks_of_its_slab(surveys):
    crop, n = (32, 32, 32), 12  # brick-aligned crops of 2 x 2 x 2 bricks of 16^3
    kw = dict(seed=19, align="brick", min_live_fraction=0.3, augment=data.AUGMENTATIONS)
    whole = crops_of(surveys.urls[:1], crop, **kw)
    whole.read(list(range(n)))
    full = whole.surveys.fetch_stats()["bytes_fetched"]
    whole.close()
    fetched = []
    for slab in slabs(crop, 2):
        rank = crops_of(surveys.urls[:1], crop, slab=slab, **kw)
        before = rank.surveys.fetch_stats()["bytes_fetched"]
        rank.read(list(range(n)))
        fetched.append(rank.surveys.fetch_stats()["bytes_fetched"] - before)
        rank.close()
    assert all(f < 0.7 * full for f in fetched), (fetched, full)
    assert sum(fetched) == pytest.approx(full, rel=0.05)  # the group together reads each brick about once


def test_a_slab_stream_resumes_with_the_same_next_slabs(surveys):
    slab = slabs(SQUARE, 3)[1]
    kw = dict(seed=7, augment=data.AUGMENTATIONS, min_live_fraction=0.3)
    full = take(slab_stream(surveys.urls, slab, **kw), 6)
    first = slab_stream(surveys.urls, slab, workers=2, **kw)
    head = take(first, 2)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = slab_stream(surveys.urls, slab, workers=2, **kw)
    resumed.load_state_dict(state)
    tail = take(resumed, 4)
    assert all(torch.equal(a, b) for a, b in zip(head + tail, full))


def test_training_stream_takes_the_slab(surveys):
    cfg = JobConfig.from_toml(overrides=["data.crop=[24, 24, 16]", "data.batch_size=2", "data.augment=flip_inline,swap",
                                         "data.seed=9"])
    s = data.training_stream(surveys.urls, cfg.data, rank=1, world_size=2, start_batch=3, slab=(8, 16))
    try:
        assert next(s).shape == (2, 1, 8, 24, 16)
        assert s.dataset.reader.slab == (8, 16) and list(s.dataset.sample_indices(3)) == [14, 15]
    finally:
        s.close()


@pytest.mark.parametrize("slab", [(0, 0), (8, 4), (-4, 8), (16, 32)])
def test_a_slab_outside_the_crop_is_an_error(surveys, slab):
    with pytest.raises(SFMError, match="slab"):
        crops_of(surveys.urls, SQUARE, slab=slab)


def test_crop_slab_maps_rows_to_the_mirrored_source_range():
    c = data.Crop(0, (10, 20, 30), (8, 8, 4), flip_inline=True)
    assert c.slab(0, 2) == c._replace(origin=(16, 20, 30), extent=(2, 8, 4))  # rows 0, 1 are inlines 7, 6
    s = data.Crop(0, (10, 20, 30), (8, 8, 4), flip_crossline=True, swap=True)
    assert s.slab(2, 5) == s._replace(origin=(10, 23, 30), extent=(8, 3, 4))  # rows are crosslines 5, 4, 3
    assert s.slab(2, 5).shape == (3, 8, 4)
