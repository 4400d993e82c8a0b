"""The data path delivers today's crops bit for bit: every alignment, augmentation, batch dtype, brick cache
and region setting, slab reads, ranks, epochs and DataLoader workers, against the sha256 digests in
tests/data/crop_digests.json (made by tests/support/crop_digests.py on the same stores)."""

from __future__ import annotations

import json

import pytest

from support.crop_digests import CASES, FIXTURE, build_stores, case_digest, store_digest

RECORDED = json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    return build_stores(tmp_path_factory.mktemp("crop-digests"))


def test_the_stores_are_the_recorded_ones(stores):
    """What the crops are cut from: if this fails, ingest or the generator changed, not the data path."""
    got = {f"{kind}-{n}": store_digest(url) for kind, urls in stores.urls.items() for n, url in enumerate(urls)}
    assert got == RECORDED["stores"]


def test_every_case_is_recorded():
    assert sorted(RECORDED["cases"]) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_crops_are_the_recorded_ones(stores, name):
    assert case_digest(stores, name) == RECORDED["cases"][name], f"case {name}: {CASES[name]}"
