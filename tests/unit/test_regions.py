"""Many crops per fetched region (sfm.data.regions): the plan, the values, the node's shared pool,
coalesced GETs, float16 batches, and exact resume with the pool on.

Stores are real ingests (16^3 bricks) of synthetic SEG-Y files with traces missing from the file, so
regions meet holes and the surveys' far edges.
"""

from __future__ import annotations

import collections
import hashlib
import multiprocessing
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from support.crop_stores import crops_of, data_config, expected_crop, stream, surveys  # noqa: F401 (a fixture)
from sfm import data
from sfm.data import bricks, regions
from sfm.data.region_pool import RegionPool
from sfm.storage.resilient_store import open_survey_store

CROP = (16, 16, 16)


def pooled(surveys, tmp_path, k=4, batch=4, world=1, **kw) -> data.CropDataset:
    return crops_of(surveys.urls, kw.pop("crop", CROP), world=world, batch_size=batch, crops_per_region=k,
                    region_bricks=(2, 2, 2), pool_dir=str(tmp_path / "pool"), **kw)


def rank_samples(rank: int, world: int, batch: int, batches: int) -> list[list[int]]:
    return [[(b * world + rank) * batch + n for n in range(batch)] for b in range(batches)]


@pytest.mark.parametrize("k", [2, 4, 8])
def test_the_plan_gives_each_region_at_most_k_samples_of_one_rank_and_each_batch_distinct_regions(
        surveys, tmp_path, k):
    batch, world, batches = 4, 2, 40
    sampler = pooled(surveys, tmp_path, k=k, batch=batch, world=world)
    owners: dict[int, set] = collections.defaultdict(set)
    members: collections.Counter = collections.Counter()
    for rank in range(world):
        for indices in rank_samples(rank, world, batch, batches):
            anchors = [sampler.plan.regions.anchor(i) for i in indices]
            assert len(set(anchors)) == batch  # every batch draws from `batch` distinct regions
            for i, a in zip(indices, anchors):
                owners[a].add(rank)
                members[a] += 1
                c = sampler.locate(i)
                r = c.region
                assert c.survey == r.survey
                assert all(ro <= o and o + e <= ro + re for o, e, ro, re in zip(c.origin, c.extent, r.origin, r.extent))
    assert all(len(ranks) == 1 for ranks in owners.values())  # a region belongs to one rank
    assert max(members.values()) == k
    # about one region per k samples, plus the lanes' first (staggered, shorter) regions
    assert len(members) <= world * (batch * batches // k + sampler.plan.regions.lanes)
    assert len(members) >= world * batch * batches // k


def test_pooled_crops_are_the_survey_voxels(surveys, tmp_path):
    sampler = pooled(surveys, tmp_path, k=4, augment=data.AUGMENTATIONS)
    try:
        batch = sampler.read(list(range(24)))
        for i in range(24):
            np.testing.assert_allclose(batch[i, 0], expected_crop(surveys, sampler, i), rtol=1e-5, atol=1e-5)
        stats = sampler.reader.cpu_stats()
        assert stats["regions_built"] < 24 and stats["regions_built"] + stats["regions_reused"] >= 1
    finally:
        sampler.close()


def test_float16_pooled_crops_round_the_float32_ones(surveys, tmp_path):
    a = pooled(surveys, tmp_path / "a", k=4)
    b = pooled(surveys, tmp_path / "b", k=4, batch_dtype="float16")
    try:
        x, y = a.read(list(range(8))), b.read(list(range(8)))
        assert y.dtype == np.float16
        np.testing.assert_allclose(y.astype(np.float32), x, rtol=2e-3, atol=2e-3)
    finally:
        a.close(), b.close()


def test_a_slab_of_a_pooled_crop_is_those_rows_of_the_crop(surveys, tmp_path):
    whole = pooled(surveys, tmp_path, k=4)
    part = pooled(surveys, tmp_path, k=4, slab=(4, 12))
    try:
        for i in range(8):
            np.testing.assert_array_equal(part.read([i])[0, 0], whole.read([i])[0, 0, 4:12])
    finally:
        whole.close(), part.close()


def _read_in_another_process(urls, pool_dir, indices, queue):
    sampler = crops_of(urls, CROP, batch_size=4, crops_per_region=4, region_bricks=(2, 2, 2), pool_dir=pool_dir)
    out = sampler.read(indices)
    queue.put((hashlib.sha1(out.tobytes()).hexdigest(), sampler.reader.cpu_stats()))
    sampler.close()


def test_another_process_of_the_node_reads_the_regions_without_fetching_them(surveys, tmp_path):
    sampler = pooled(surveys, tmp_path, k=4)
    indices = list(range(16))
    try:
        mine = hashlib.sha1(sampler.read(indices).tobytes()).hexdigest()
        built = sampler.reader.cpu_stats()["regions_built"]
    finally:
        sampler.close()
    assert built >= 4
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_read_in_another_process, args=(surveys.urls, str(tmp_path / "pool"), indices, queue))
    proc.start()
    theirs, stats = queue.get(timeout=120)
    proc.join(30)
    assert theirs == mine
    assert stats["regions_built"] == 0 and stats["regions_reused"] == built
    assert stats["receive"] == 0.0  # nothing of the amplitude fetched


def _exit_at_once():
    pass


def fill_with(value):
    return lambda a: a.fill(value)


def total(region: np.ndarray) -> float:
    return float(region.sum())


def test_a_dead_builders_lock_is_taken_over_and_a_stuck_one_after_the_wait(tmp_path):
    pool = RegionPool(str(tmp_path), budget_bytes=1 << 30, wait_seconds=0.3)
    region = regions.Region(0, (0, 0, 0), (4, 4, 4))
    name = RegionPool.name("survey", region, np.float32)
    ctx = multiprocessing.get_context("spawn")
    dead = ctx.Process(target=_exit_at_once)
    dead.start()
    dead.join()
    (tmp_path / f"{name}.lock").write_text(f"{dead.pid} {time.time()}")
    assert pool.use(name, (4, 4, 4), np.float32, fill_with(3.0), total) == 3.0 * 64 and pool.built == 1
    assert (tmp_path / f"{name}.region").exists() and not (tmp_path / f"{name}.lock").exists()
    other = RegionPool.name("survey", region._replace(origin=(4, 0, 0)), np.float32)
    (tmp_path / f"{other}.lock").write_text(f"{os.getpid()} {time.time()}")  # alive (this process), stuck
    started = time.monotonic()
    assert pool.use(other, (4, 4, 4), np.float32, fill_with(1.0), total) == 64.0  # waits, then takes over
    assert time.monotonic() - started >= 0.3 and (tmp_path / f"{other}.region").exists()


def test_past_its_budget_the_pool_recycles_the_oldest_file(tmp_path):
    shape = (16, 16, 16)
    size = 4096 + 16 ** 3 * 4
    pool = RegionPool(str(tmp_path), budget_bytes=3 * size)
    names = [RegionPool.name("s", regions.Region(0, (16 * n, 0, 0), shape), np.float32) for n in range(5)]
    inodes = []
    for n, name in enumerate(names):
        assert pool.use(name, shape, np.float32, fill_with(n), total) == n * 16 ** 3
        os.utime(tmp_path / f"{name}.region", (n, n))  # distinct ages
        inodes.append(os.stat(tmp_path / f"{name}.region").st_ino)
    assert sorted(p.stem for p in tmp_path.glob("*.region")) == sorted(names[-3:])
    assert inodes[3] == inodes[0] and inodes[4] == inodes[1]  # the oldest files took the new regions
    # the recycled name is gone: using it again builds it anew, with its own values
    assert pool.use(names[0], shape, np.float32, fill_with(7.0), total) == 7.0 * 16 ** 3


def test_a_region_built_in_a_recycled_old_file_survives_another_builders_scan(tmp_path):
    # a pool left by an earlier run: its files keep the time of their last use, and a file recycled
    # for a new region keeps it too while the region is built; another builder must not take that
    # builder's temporary file for a dead one's
    shape = (8, 8, 8)
    size = 4096 + 8 ** 3 * 4
    pool = RegionPool(str(tmp_path), budget_bytes=size)
    old, first, second = (RegionPool.name("s", regions.Region(0, (8 * n, 0, 0), shape), np.float32) for n in range(3))
    assert pool.use(old, shape, np.float32, fill_with(1.0), total) == 512.0
    an_hour_ago = time.time() - 3600
    os.utime(tmp_path / f"{old}.region", (an_hour_ago, an_hour_ago))

    def build_first(array):  # while it builds, another thread of the node builds another region
        assert pool.use(second, shape, np.float32, fill_with(3.0), total) == 3.0 * 512
        array.fill(2.0)

    assert pool.use(first, shape, np.float32, build_first, total) == 2.0 * 512
    assert (tmp_path / f"{first}.region").exists() and not list(tmp_path.glob("*.tmp"))
    assert pool.use(first, shape, np.float32, fill_with(9.0), total) == 2.0 * 512  # found, not rebuilt


def test_a_read_of_a_region_recycled_under_it_is_done_again(tmp_path):
    shape = (8, 8, 8)
    pool = RegionPool(str(tmp_path), budget_bytes=1 << 30)
    name = RegionPool.name("s", regions.Region(0, (0, 0, 0), shape), np.float32)
    other = RegionPool.name("s", regions.Region(0, (8, 0, 0), shape), np.float32)
    builds = []

    def build(a):
        builds.append(1)
        a.fill(2.0)

    reads = []

    def read(region):
        reads.append(float(region.sum()))
        if len(reads) == 1:  # another process recycles the file while this one reads it
            path = tmp_path / f"{name}.region"
            os.rename(path, tmp_path / f"{other}.region")
            with open(tmp_path / f"{other}.region", "r+b") as f:
                f.seek(8)
                f.write(other.encode())
        return reads[-1]

    assert pool.use(name, shape, np.float32, build, read) == 2.0 * 512
    assert len(reads) == 2 and len(builds) == 2  # the first read was thrown away; the region rebuilt


def _build_and_hang(pool_dir: str, name: str, shape, started) -> None:
    def build(array):
        array.fill(9.0)  # half a region's worth of wrong values, then killed
        started.set()
        time.sleep(120)

    RegionPool(pool_dir, 1 << 30).use(name, shape, np.float32, build, total)


def test_a_worker_killed_while_building_a_region_loses_and_repeats_nothing(surveys, tmp_path):
    settings = dict(crops_per_region=4, pool_dir=str(tmp_path / "pool"))
    reference = stream(surveys.urls, batch=3, crops_per_region=4, pool_dir=str(tmp_path / "reference"))
    try:
        want = [next(reference) for _ in range(6)]
    finally:
        reference.close()
    s = stream(surveys.urls, batch=3, **settings)
    region = s.dataset.locate(0).region
    name = RegionPool.name(s.dataset.surveys[region.survey].identity, region, s.dataset.reader.dtype)
    ctx = multiprocessing.get_context("spawn")
    started = ctx.Event()
    worker = ctx.Process(target=_build_and_hang, args=(settings["pool_dir"], name, region.extent, started))
    worker.start()
    assert started.wait(60)
    os.kill(worker.pid, 9)  # SIGKILL mid-build: its lock and half-written file stay behind
    worker.join()
    assert (tmp_path / "pool" / f"{name}.lock").exists()
    try:
        got = [next(s) for _ in range(6)]
    finally:
        s.close()
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and len(got) == len(want)


def test_resume_with_the_pool_gives_the_batches_of_an_uninterrupted_run(surveys, tmp_path):
    def batches(start, n, workers):
        s = stream(surveys.urls, batch=3, workers=workers, start=start, crops_per_region=4,
                   pool_dir=str(tmp_path / "pool"))
        try:
            return [hashlib.sha1(next(s).numpy().tobytes()).hexdigest() for _ in range(n)]
        finally:
            s.close()

    straight = batches(0, 8, workers=0)
    assert batches(5, 3, workers=2) == straight[5:]
    assert batches(0, 8, workers=2) == straight


def test_float16_batch_stream_yields_float16(surveys, tmp_path):
    s = stream(surveys.urls, batch=2, batch_dtype="float16")
    try:
        assert next(s).dtype == torch.float16
    finally:
        s.close()


def test_bricks_stored_back_to_back_are_one_get(surveys):
    import zarr

    url = surveys.urls[0]
    store = open_survey_store(url)
    amp = zarr.open_group(store, mode="r")["amplitude"]
    reader = bricks.BrickReader.for_array(amp)
    assert reader is not None and reader.per_shard[2] >= 2  # several bricks per shard along the samples
    info, _ = data.read_survey_info(url)
    region = (slice(0, 16), slice(0, 16), slice(0, 32))  # two bricks of one shard
    out = np.empty((16, 16, 32), np.float32)
    reader.read_into(region, out, info.normalise_into)  # reads the shard index too
    before = store.requests
    reader.read_into(region, out, info.normalise_into)
    assert store.requests - before == 1
    expected = np.empty_like(out)
    info.normalise_into(amp[region], expected)
    np.testing.assert_array_equal(out, expected)


def test_the_pool_is_sized_for_the_ranks_of_the_node_it_is_given(surveys, tmp_path, monkeypatch):
    """Two regions per lane for each training process of the node, as the launch layout says (the trainer
    passes it down); the process environment is not read. data.pool_mb, when set, is the size."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "7")
    cfg = data_config(batch_size=4, crops_per_region=4, pool_dir=str(tmp_path / "pool"))
    one, four = (data.crop_dataset(surveys.urls, cfg, node_ranks=n) for n in (1, 4))
    largest = max(int(np.prod(g.extent)) * 4 for g in one.plan.regions.grids)
    assert one.reader.regions.budget_bytes == 2 * one.plan.regions.lanes * largest
    assert four.reader.regions.budget_bytes == 4 * one.reader.regions.budget_bytes
    given = data_config(batch_size=4, crops_per_region=4, pool_mb=3, pool_dir=str(tmp_path / "pool"))
    assert data.crop_dataset(surveys.urls, given, node_ranks=4).reader.regions.budget_bytes == 3 << 20
    assert data.crop_dataset(surveys.urls, data_config()).reader.regions is None  # one crop per region: no pool
