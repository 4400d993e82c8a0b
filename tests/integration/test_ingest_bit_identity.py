"""An ingest's store equals, byte for byte, what the ingest wrote at commit 8602f67 (issue 47), in one task and
in 1, 2 and 3 parts: the real F3 crop and a generated survey with holes, dead traces and NaN samples, in
float32, int8 and float16, in the sfm and mdio layouts, and an MDIO-layout store's registration (its reference
group). The digests are ``tests/data/ingest_digests.json``, made by ``tests/support/ingest_digests.py``
(which says how to regenerate them).

Compared: the sha256 of every object of the store by its relative path, what the data root holds under
``surveys/`` (no staging left behind) and the manifest row. Left out, because they depend on the clock: the
row's ``ingested_at`` (and so the row's parquet object, which holds it). Masked, because they depend on where
the test runs: the source's path and the data root, wherever they appear in a ``zarr.json`` or the row.
The sources themselves are checked first (the generated survey comes from ``sfm synth``'s path).
"""

from __future__ import annotations

import json

import pytest
from support import ingest_digests as proof

TODAY = json.loads(proof.FIXTURE.read_text())


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    return proof.sources(tmp_path_factory.mktemp("sources"))


def test_sources_are_the_recorded_ones(sources):
    assert {name: proof.source_digest(path) for name, path in sources.items()} == TODAY["sources"]


@pytest.mark.parametrize("n_parts", [0, *proof.PART_COUNTS], ids=lambda n: f"parts{n}" if n else "one-task")
@pytest.mark.parametrize("case", list(proof.CASES))
def test_store_equals_the_recorded_one(case, n_parts, sources, tmp_path):
    source = sources[proof.CASES[case][0]]
    root = tmp_path / "root"
    row = proof.ingest(case, source, root, n_parts)
    assert proof.record(row, source, root) == TODAY["cases"][case]
