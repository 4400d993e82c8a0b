"""Normalised bricks kept in memory (sfm.data.brick_cache, ``data.cache_mb``): the crops are exactly the
uncached loader's, bricks are read once while they fit, the budget holds, and each process keeps its own.

Stores are real ingests (16^3 bricks) of synthetic SEG-Y files with traces missing from the file, so crops
meet holes and the surveys' far edges (partial bricks).
"""

from __future__ import annotations

import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from support.crop_stores import crops_of, expected_crop, stream, surveys  # noqa: F401  (surveys: a fixture)
from sfm import data
from sfm.data.brick_cache import BrickCache

CROP = (16, 16, 16)
SAMPLES = list(range(48))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cached_crops_are_the_uncached_ones_bit_for_bit(surveys, dtype):
    plain = crops_of(surveys.urls, CROP, seed=5, augment=data.AUGMENTATIONS, batch_dtype=dtype)
    cached = crops_of(surveys.urls, CROP, seed=5, augment=data.AUGMENTATIONS, batch_dtype=dtype, cache_mb=64)
    try:
        want = plain.read(SAMPLES)
        first = cached.read(SAMPLES)
        again = cached.read(SAMPLES)  # now from the cache alone
        assert first.dtype == np.dtype(dtype)
        assert first.tobytes() == want.tobytes() and again.tobytes() == want.tobytes()
        if dtype == "float32":
            for i in SAMPLES[:12]:
                np.testing.assert_allclose(first[i, 0], expected_crop(surveys, cached, i), rtol=1e-5, atol=1e-5)
        stats = cached.reader.cpu_stats()
        assert stats["cache_hits"] > stats["cache_misses"] > 0
        assert plain.reader.cpu_stats()["cache_hits"] == 0
    finally:
        plain.close(), cached.close()


def test_each_brick_is_fetched_once_while_the_surveys_fit(surveys):
    cached = crops_of(surveys.urls, CROP, seed=1, cache_mb=64)
    try:
        cached.read(SAMPLES)
        fetched = cached.surveys.fetch_stats()["requests"]
        assert fetched > 0
        cached.read(SAMPLES)
        assert cached.surveys.fetch_stats()["requests"] == fetched  # every brick those crops touch is cached
        cached.read([n + 1000 for n in SAMPLES])  # other crops: only bricks not seen yet are fetched
        touched = {(c.survey, *(range(o // 16, (o + n - 1) // 16 + 1) for o, n in zip(c.origin, c.extent)))
                   for c in map(cached.locate, SAMPLES + [n + 1000 for n in SAMPLES])}
        bricks = {(s, i, j, k) for s, *axes in touched for i in axes[0] for j in axes[1] for k in axes[2]}
        assert cached.reader.cpu_stats()["cache_misses"] == len(bricks)  # each read once, by one of the 8 threads
    finally:
        cached.close()


def test_past_its_budget_the_cache_drops_the_least_recently_used():
    cache = BrickCache(3 * 4096)
    built = []

    def brick(key):
        def build():
            built.append(key)
            return np.full(1024, key, np.float32)  # 4 KiB
        return build

    for key in (1, 2, 3):
        cache.get(key, brick(key))
    cache.get(1, brick(1))  # 1 is now the most recent
    cache.get(4, brick(4))  # evicts 2
    assert cache.nbytes <= 3 * 4096 and len(cache) == 3
    cache.get(1, brick(1)), cache.get(3, brick(3)), cache.get(2, brick(2))
    assert built == [1, 2, 3, 4, 2]
    assert not cache.get(4, brick(4)).flags.writeable  # shared between threads: read-only
    huge = cache.get(9, lambda: np.zeros(8192, np.float32))  # larger than the budget: returned, not kept
    assert huge.size == 8192 and len(cache) == 3


def test_threads_wanting_one_brick_read_it_once_and_a_failed_read_is_tried_again():
    cache, calls, gate = BrickCache(1 << 20), [], threading.Event()

    def build():
        calls.append(1)
        gate.wait(10)
        return np.arange(4, dtype=np.float32)

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(cache.get, "brick", build) for _ in range(8)]
        time.sleep(0.2)  # all eight are asking now
        gate.set()
        got = [f.result() for f in futures]
    assert len(calls) == 1 and all(g is got[0] for g in got)

    def gone():
        raise OSError("store gone")

    with pytest.raises(OSError, match="store gone"):
        cache.get("other", gone)
    assert len(cache) == 1 and cache.get("other", lambda: np.ones(2, np.float32)).sum() == 2


def test_a_tight_budget_still_gives_the_same_crops(surveys):
    plain = crops_of(surveys.urls, CROP, seed=2, augment=data.AUGMENTATIONS)
    tight = crops_of(surveys.urls, CROP, seed=2, augment=data.AUGMENTATIONS, cache_mb=1)  # 64 bricks of 16 KiB
    try:
        assert tight.read(SAMPLES).tobytes() == plain.read(SAMPLES).tobytes()
        assert 0 < tight.reader.cpu_stats()["cache_mb"] <= 1
    finally:
        plain.close(), tight.close()


def test_a_worker_process_starts_with_its_own_empty_cache(surveys):
    cached = crops_of(surveys.urls, CROP, seed=3, cache_mb=64)
    try:
        cached.read(SAMPLES[:8])
        copy = pickle.loads(pickle.dumps(cached))  # what a spawned DataLoader worker gets
        assert copy.reader._cache is None and copy.reader.cpu_stats()["cache_hits"] == 0
        assert copy.read(SAMPLES[:8]).tobytes() == cached.read(SAMPLES[:8]).tobytes()
        copy.close()
    finally:
        cached.close()


def take(s: data.BatchStream, n: int) -> list:
    try:
        return [next(s) for _ in range(n)]
    finally:
        s.close()


def test_batches_through_worker_processes_with_the_cache_are_the_plain_ones(surveys):
    plain = take(stream(surveys.urls, seed=4, augment=data.AUGMENTATIONS), 6)
    cached = take(stream(surveys.urls, seed=4, augment=data.AUGMENTATIONS, workers=2, cache_mb=32), 6)
    assert all(a.numpy().tobytes() == b.numpy().tobytes() for a, b in zip(plain, cached))
