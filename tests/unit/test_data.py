"""The crop loader on local survey stores: determinism, disjoint ranks and workers, exact resume,
normalisation, the live-trace threshold, augmentations, brick alignment and tiled reads.

The stores are real ingests of synthetic SEG-Y files with traces missing from the file.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import zarr

from support.crop_stores import crops_of, expected_crop, stream, survey_with_holes, surveys  # noqa: F401 (a fixture)
from sfm import data
from sfm.data import bricks, crop_reader
from sfm.config import JobConfig
from sfm.errors import SFMError
from sfm.storage.ranged_file import LocalRangeReader

CROP = (16, 16, 16)



def take(s: data.BatchStream, n: int) -> list[torch.Tensor]:
    try:
        return [next(s) for _ in range(n)]
    finally:
        s.close()


def digest(crop: torch.Tensor) -> str:
    return hashlib.sha1(crop.numpy().tobytes()).hexdigest()




def test_same_seed_gives_the_same_stream_and_seed_or_epoch_change_it(surveys):
    first = take(stream(surveys.urls, seed=3, augment=data.AUGMENTATIONS), 4)
    again = take(stream(surveys.urls, seed=3, augment=data.AUGMENTATIONS), 4)
    assert all(b.shape == (4, 1, *CROP) and b.dtype == torch.float32 for b in first)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    other_seed = take(stream(surveys.urls, seed=4, augment=data.AUGMENTATIONS), 1)[0]
    other_epoch = take(stream(surveys.urls, seed=3, epoch=1, augment=data.AUGMENTATIONS), 1)[0]
    assert not torch.equal(first[0], other_seed) and not torch.equal(first[0], other_epoch)


def test_two_ranks_with_two_workers_each_draw_disjoint_streams(surveys):
    """2 ranks x 2 DataLoader worker processes: no sample twice, and each rank's sequence is the one
    it would see with no workers (worker w makes every other batch, starting at w)."""
    n, batch, seen, crops = 6, 4, {}, {}
    for rank in (0, 1):
        with_workers = take(stream(surveys.urls, batch=batch, rank=rank, world=2, workers=2, seed=5), n)
        in_process = take(stream(surveys.urls, batch=batch, rank=rank, world=2, workers=0, seed=5), n)
        assert all(torch.equal(a, b) for a, b in zip(with_workers, in_process))
        dataset = crops_of(surveys.urls, CROP, seed=5, batch_size=batch, rank=rank, world=2)
        for worker in (0, 1):
            batches = list(itertools.islice(dataset.worker_batches(worker, 2), n // 2))
            assert batches == list(range(worker, n, 2))
            for b in batches:
                for j, index in enumerate(dataset.sample_indices(b)):
                    assert index not in seen, f"sample {index} drawn by {seen[index]} and {(rank, worker)}"
                    seen[index] = (rank, worker)
                    crops[digest(with_workers[b][j])] = (rank, worker, b, j)
    assert len(seen) == len(crops) == 2 * n * batch  # distinct indices and distinct crops


def test_resume_from_saved_state_continues_with_the_same_batches(surveys):
    full = take(stream(surveys.urls, seed=7, augment=("flip_inline",)), 8)
    first = stream(surveys.urls, seed=7, augment=("flip_inline",), workers=2)
    head = take(first, 3)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    assert state["batch"] == 3 and state["epoch"] == 0
    resumed = stream(surveys.urls, seed=7, augment=("flip_inline",), workers=2)
    resumed.load_state_dict(state)
    tail = take(resumed, 5)
    assert all(torch.equal(a, b) for a, b in zip(head + tail, full))

    with pytest.raises(SFMError, match="seed"):
        stream(surveys.urls, seed=8).load_state_dict(state)


def test_epochs_end_and_resume_inside_a_later_epoch(surveys):
    s = stream(surveys.urls, seed=2, num_batches=3)
    epoch0 = list(s)
    assert len(epoch0) == 3
    s.set_epoch(1)
    epoch1 = list(s)
    assert len(epoch1) == 3 and not any(torch.equal(a, b) for a, b in zip(epoch0, epoch1))
    resumed = stream(surveys.urls, seed=2, num_batches=3)
    resumed.load_state_dict({"epoch": 1, "batch": 1})
    assert all(torch.equal(a, b) for a, b in zip(list(resumed), epoch1[1:]))
    s.close()
    resumed.close()


def test_crops_are_normalised_with_the_stored_statistics(surveys):
    sampler = crops_of(surveys.urls, CROP, seed=11, min_live_fraction=0.3, augment=data.AUGMENTATIONS)
    crops = sampler.read(list(range(48)))
    located = [sampler.locate(i) for i in range(48)]
    for i in range(48):
        np.testing.assert_allclose(crops[i, 0], expected_crop(surveys, sampler, i), rtol=1e-5, atol=1e-5)
    # the test covered what it claims: both surveys, every augmentation, crops with dead traces
    assert {c.survey for c in located} == {0, 1}
    assert all(any(getattr(c, a) for c in located)
               for a in ("flip_inline", "flip_crossline", "swap", "reverse_time", "invert"))
    dead = (crops == 0).all(axis=-1).sum(axis=(1, 2, 3))
    assert dead.max() > 0
    for url, amp, live in zip(surveys.urls, surveys.amp, surveys.live):  # and the statistics are the survey's
        stats = dict(zarr.open_group(url, mode="r").attrs)["stats"]
        assert stats["mean"] == pytest.approx(amp[live].mean(), abs=1e-4)
        assert stats["std"] == pytest.approx(amp[live].std(), rel=1e-4)
    sampler.close()


def test_float16_store_decodes_to_the_same_crops(surveys, tmp_path):
    url16, _, _ = survey_with_holes(tmp_path, str(tmp_path / "root16"), shape=(48, 40, 64), seed=0, dtype="float16")
    f32 = crops_of(surveys.urls[:1], CROP, seed=13, augment=data.AUGMENTATIONS)
    f16 = crops_of([url16], CROP, seed=13, augment=data.AUGMENTATIONS)
    assert zarr.open_group(url16, mode="r")["amplitude"].dtype == np.float16
    np.testing.assert_allclose(f16.read(list(range(8))), f32.read(list(range(8))), atol=5e-3)


@pytest.mark.parametrize("threshold", [0.5, 0.9, 1.0])
def test_crops_under_the_live_threshold_never_appear(surveys, threshold):
    sampler = crops_of(surveys.urls, CROP, seed=17, min_live_fraction=threshold)
    for i in range(400):
        c = sampler.locate(i)
        live = surveys.live[c.survey][c.origin[0] : c.origin[0] + CROP[0], c.origin[1] : c.origin[1] + CROP[1]]
        assert live.mean() >= threshold, (i, c, live.mean())
    crops = sampler.read(list(range(24)))[:, 0]
    live_traces = (crops != 0).any(axis=-1).mean(axis=(1, 2))
    assert (live_traces >= threshold).all()
    sampler.close()
    # the threshold does bite: without it, crops with fewer live traces are drawn
    unfiltered = crops_of(surveys.urls, CROP, seed=17, min_live_fraction=0.0)
    fractions = [surveys.live[c.survey][c.origin[0] : c.origin[0] + 16, c.origin[1] : c.origin[1] + 16].mean()
                 for c in map(unfiltered.locate, range(400))]
    assert min(fractions) < 0.5


def test_time_reversal_and_polarity_leave_the_rest_of_the_stream_as_it_was(surveys):
    """Turning on ``reverse_time``/``invert_polarity`` adds their draws after the others: every crop keeps
    its survey, origin, flips and swap, so a run that turns them on changes only those two."""
    base = crops_of(surveys.urls, CROP, seed=5, augment=("flip_inline", "flip_crossline", "swap"))
    more = crops_of(surveys.urls, CROP, seed=5, augment=data.AUGMENTATIONS)
    located = [(base.locate(i), more.locate(i)) for i in range(64)]
    assert all(a == b._replace(reverse_time=False, invert=False) for a, b in located)
    assert not any(a.reverse_time or a.invert for a, _ in located)
    drawn = np.array([(b.reverse_time, b.invert) for _, b in located])
    assert 0.25 < drawn.mean(axis=0).min() and drawn.mean(axis=0).max() < 0.75
    x, y = base.read(list(range(8))), more.read(list(range(8)))
    for n, (_, b) in enumerate(located[:8]):
        want = x[n, 0][:, :, ::-1] if b.reverse_time else x[n, 0]
        np.testing.assert_array_equal(y[n, 0], -want if b.invert else want)
    base.close(), more.close()


def test_swap_only_when_the_crop_allows_it(surveys):
    square = crops_of(surveys.urls, (16, 16, 8), seed=1, augment=("swap",), min_live_fraction=0)
    oblong = crops_of(surveys.urls, (16, 24, 8), seed=1, augment=("swap",), min_live_fraction=0)
    assert any(square.locate(i).swap for i in range(50))
    assert not any(oblong.locate(i).swap for i in range(50))
    assert oblong.read([0]).shape == (1, 1, 16, 24, 8)


def test_brick_alignment_reads_whole_bricks_and_nothing_else(surveys):
    crop = (32, 32, 32)
    aligned = crops_of(surveys.urls[:1], crop, seed=19, align="brick", min_live_fraction=0.3)
    anywhere = crops_of(surveys.urls[:1], crop, seed=19, align="voxel", min_live_fraction=0.3)
    assert all(o % 16 == 0 for c in map(aligned.locate, range(40)) for o in c.origin)
    stats = {}
    for name, sampler in (("brick", aligned), ("voxel", anywhere)):
        before = sampler.surveys.fetch_stats()["bytes_fetched"]
        sampler.read(list(range(16)))
        stats[name] = (sampler.surveys.fetch_stats()["bytes_fetched"] - before) / (16 * 4 * 32**3)  # fetched / delivered
        sampler.close()
    # an aligned crop fetches its 8 compressed bricks (blosc makes them a little smaller than the crop);
    # an unaligned one fetches up to 27
    assert stats["brick"] <= 1.0 < 1.5 < stats["voxel"], stats


def test_large_crops_are_read_as_brick_tiles(surveys, monkeypatch):
    region = ((5, 3, 0), (40, 37, 64))
    tiles = data.brick_tiles(*region, bricks=(16, 16, 16), max_voxels=16**3)
    covered = np.zeros(region[1], dtype=int)
    for (a0, a1), (b0, b1), (c0, c1) in tiles:
        covered[a0:a1, b0:b1, c0:c1] += 1
        for axis, (lo, hi) in enumerate(((a0, a1), (b0, b1), (c0, c1))):
            assert lo == 0 or (region[0][axis] + lo) % 16 == 0  # cuts only on brick boundaries
    assert (covered == 1).all() and len(tiles) > 8

    whole = crops_of(surveys.urls, (32, 32, 48), seed=23, augment=data.AUGMENTATIONS).read([0, 1, 2])
    monkeypatch.setattr(crop_reader, "_TILE_VOXELS", 16**3)
    tiled = crops_of(surveys.urls, (32, 32, 48), seed=23, augment=data.AUGMENTATIONS)
    assert len(data.brick_tiles(tiled.locate(0).origin, tiled.locate(0).extent, (16, 16, 16))) >= 4
    np.testing.assert_array_equal(tiled.read([0, 1, 2]), whole)


def test_training_stream_follows_the_job_config(surveys):
    cfg = JobConfig.from_toml(overrides=["data.crop=[16, 16, 16]", "data.batch_size=3", "data.align=brick",
                                         "data.augment=flip_inline,swap", "data.seed=9"])
    s = data.training_stream(surveys.urls, cfg.data, rank=1, world_size=2, start_batch=5)
    try:
        batch = next(s)
        assert batch.shape == (3, 1, 16, 16, 16)
        assert s.dataset.plan.align == "brick" and s.dataset.plan.augment == ("flip_inline", "swap")
        assert list(s.dataset.sample_indices(5)) == [33, 34, 35]
        assert s.state_dict()["batch"] == 6
    finally:
        s.close()


@pytest.mark.parametrize("kwargs, match", [
    ({"crop": (64, 64, 64)}, "smaller than the crop"),
    ({"crop": (40, 40, 16), "min_live_fraction": 1.0}, "live traces"),
])
def test_surveys_no_crop_fits_are_one_line_errors(surveys, kwargs, match):
    """Settings that are valid but fit no survey (each bad setting's own error: tests/unit/test_config.py)."""
    with pytest.raises(SFMError, match=match) as err:
        s = crops_of(surveys.urls[:1], kwargs.pop("crop", CROP), **kwargs)
        s.read([0])
    assert "\n" not in str(err.value)


def test_missing_store_is_an_error_naming_it(tmp_path):
    with pytest.raises(SFMError, match="nowhere.zarr"):
        crops_of([str(tmp_path / "nowhere.zarr")], CROP)


def write_store(path, ingested: str, amplitude: np.ndarray, live: np.ndarray, **array_options) -> str:
    """The ``ingested`` survey rewritten with zarr directly, in a layout ingest does not write.

    The attributes are the ingested store's (same survey, same statistics), with the layout fields
    changed, so the store meets the survey_store contract."""
    attrs = dict(zarr.open_group(ingested, mode="r").attrs)
    group = zarr.open_group(str(path), mode="w", zarr_format=3)
    amp = group.create_array("amplitude", shape=amplitude.shape, fill_value=0, **array_options)
    amp[...] = np.where(live[:, :, None], amplitude, 0).astype(amp.dtype)
    group.create_array("trace_mask", data=live)
    dtype = str(amp.dtype)
    attrs.update(dtype=dtype, store={"bricks": list(amp.chunks), "shards": list(amp.shards or amp.chunks),
                                     "codec": "written by the test", "dtype": dtype})
    attrs.pop("amplitude_transform", None)
    if dtype == "float16":  # stored as plain float16 values: an identity transform
        attrs["amplitude_transform"] = {"kind": "standardise", "stored_dtype": "float16", "offset": 0.0,
                                        "scale": 1.0, "hole_value": 0.0}
    group.attrs.update(attrs)
    return str(path)


@pytest.mark.parametrize("layout", [
    {"chunks": (16, 16, 16), "compressors": [zarr.codecs.ZstdCodec()]},  # unsharded
    {"chunks": (16, 16, 16), "compressors": None},  # uncompressed
    {"chunks": (16, 8, 16), "shards": (32, 16, 32), "compressors": [zarr.codecs.GzipCodec()]},  # index at end
    {"chunks": (16, 16, 16), "shards": (16, 32, 64), "dtype": "float16"},
])
def test_brick_reader_reads_what_zarr_reads(surveys, tmp_path, layout, monkeypatch):
    """Sharded local stores are read by os.preadv on the loader's threads (LocalRangeReader), the rest
    through zarr's event loop; both give what zarr's own read path gives."""
    ranged = []
    read_into = LocalRangeReader.read_into
    monkeypatch.setattr(LocalRangeReader, "read_into", lambda self, *a: ranged.append(a[0]) or read_into(self, *a))
    layout = {"dtype": "float32", **layout}
    url = write_store(tmp_path / "direct.zarr", surveys.urls[0], surveys.amp[0], surveys.live[0], **layout)
    fast = crops_of([url], (24, 20, 40), seed=29, augment=data.AUGMENTATIONS, min_live_fraction=0.3)
    slow = crops_of([url], (24, 20, 40), seed=29, augment=data.AUGMENTATIONS, min_live_fraction=0.3,
                            brick_reader=False)
    assert isinstance(fast.surveys.reader(0), bricks.BrickReader) and slow.surveys.reader(0) is None
    np.testing.assert_array_equal(fast.read(list(range(12))), slow.read(list(range(12))))
    assert isinstance(fast.surveys.store(0).range_reader, LocalRangeReader)
    if "shards" in layout:
        assert ranged and all(key.startswith(url + "/amplitude/") for key in ranged)
    else:
        assert not ranged


def test_a_truncated_local_shard_fails_at_once_naming_the_survey(surveys, tmp_path):
    """A shard file cut short is a broken store, not a slow one: the read fails without retrying."""
    url = write_store(tmp_path / "cut.zarr", surveys.urls[0], surveys.amp[0], surveys.live[0], dtype="float32",
                      chunks=(16, 16, 16), shards=(32, 32, 64), compressors=None)
    index_bytes = 2 * 2 * 4 * 16 + 4  # (offset, nbytes) uint64 per brick of a shard, then a crc32c
    for shard in (tmp_path / "cut.zarr" / "amplitude").rglob("c/*/*/*"):
        with open(shard, "r+b") as fh:  # keep the index (at the end) where the reader looks for it
            index = fh.read()[-index_bytes:]
            fh.seek(0)
            fh.truncate()
            fh.write(index)
    sampler = crops_of([url], (24, 20, 40), seed=29, min_live_fraction=0.3, retry_seconds=60)
    with pytest.raises(SFMError, match=r"reading survey .*cut\.zarr.*EOFError: .* the store is truncated"):
        sampler.read(list(range(4)))
    assert sampler.surveys.store(0).retries == 0


def test_layouts_the_brick_reader_does_not_know_are_read_through_zarr(surveys, tmp_path):
    url = write_store(tmp_path / "big-endian.zarr", surveys.urls[0], surveys.amp[0], surveys.live[0],
                      chunks=(16, 16, 16), dtype="float32", serializer=zarr.codecs.BytesCodec(endian="big"))
    sampler = crops_of([url], CROP, seed=31)
    assert sampler.surveys.reader(0) is None
    np.testing.assert_allclose(sampler.read([3])[0, 0], expected_crop(
        SimpleNamespace(urls=[url], amp=surveys.amp[:1], live=surveys.live[:1]), sampler, 3), rtol=1e-5, atol=1e-5)


def test_batch_buffers_are_reused_only_once_no_tensor_holds_them(surveys):
    """In-process streams recycle batch memory (fresh 64 MB batches cost page faults): a batch the
    consumer dropped is refilled, one it still holds (or a view of it, or a numpy view) never is."""
    kept = take(stream(surveys.urls, seed=37, augment=data.AUGMENTATIONS), 12)
    s = stream(surveys.urls, seed=37, augment=data.AUGMENTATIONS)
    held, addresses = [], set()
    try:
        for n in range(12):
            batch = next(s)
            addresses.add(batch.data_ptr())
            if n % 4 == 0:
                held.append((n, batch[1:].numpy() if n % 8 else batch[2]))  # views keep the batch alive
            assert torch.equal(batch, kept[n])
            del batch
        for n, view in held:  # still what was delivered
            expected = kept[n][1:].numpy() if n % 8 else kept[n][2]
            assert np.array_equal(np.asarray(view), np.asarray(expected))
    finally:
        s.close()
    assert len(addresses) <= 2 + 3 + len(held), addresses  # reused: prefetch + in hand + held, not 12


def test_the_data_path_reads_no_environment_and_takes_its_settings_as_a_section():
    """Nothing in sfm/data reads the process environment (the launch layout and a worker's environment come
    from the caller), and no function there takes more than 8 parameters: settings travel as ``JobConfig.data``."""
    import ast
    from pathlib import Path

    package = Path(data.__file__).parent
    offenders = []
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text())
        offenders += [f"{path.name}: os.{node.attr}" for node in ast.walk(tree)
                      if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb")]
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                if len(names) + bool(a.vararg) + bool(a.kwarg) > 8:
                    offenders.append(f"{path.name}: {node.name} takes {len(names)} parameters")
    assert not offenders, offenders
