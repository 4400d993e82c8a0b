"""The flow trains on MDIO v1 stores as they are (issue 19): --surveys and --held-out name stores written by
the real MDIO library; they are registered (reference groups, manifest rows), nothing of their data is
copied, they are left unchanged; a malformed one fails the run in start with one line."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from support.flowrun import client_view, fast_job_toml, run_flow

from sfm.formats import manifest

pytestmark = pytest.mark.integration


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.timeout(900)
def test_flow_trains_on_mdio_stores_read_in_place(tmp_path, metaflow_env, mdio_stores):
    train, held = mdio_stores["f3"][0], mdio_stores["holes"][0]
    before = {p: tree_digest(Path(p)) for p in (train, held)}
    config = tmp_path / "job.toml"
    config.write_text(fast_job_toml(data={"crop": [16, 16, 32]}, train={"max_steps": 2}))
    data_root = tmp_path / "data"
    result = run_flow(metaflow_env, top_level={"config": [("config", str(config))]}, cwd=str(tmp_path),
                      surveys=str(train), held_out=str(held), data_root=str(data_root))
    assert result.status == "successful", result.stderr[-4000:]
    view = client_view(result.pathspec, metaflow_env, cwd=str(tmp_path))
    stores = view["train_stores"] + view["held_out_stores"]
    assert len(view["train_stores"]) == len(view["held_out_stores"]) == 1
    for store, source in zip(stores, (train, held)):
        attrs = json.loads((Path(store) / "zarr.json").read_text())["attributes"]
        assert attrs["source_kind"] == "mdio" and attrs["amplitude_url"] == str(source)
    assert view["train_summary"]["steps"] == 2
    assert {p: tree_digest(Path(p)) for p in (train, held)} == before  # the MDIO stores unchanged
    assert not [p for p in data_root.rglob("*") if "amplitude" in p.parts]  # nothing copied
    rows = manifest.read(str(data_root))
    assert sorted(rows["source_url"]) == sorted([str(train), str(held)])
    assert all(c.startswith("mdio-blake3:") for c in rows["checksum"])
    assert not (data_root / "surveys" / "ingest-parts").exists()  # staging removed


@pytest.mark.timeout(300)
def test_flow_refuses_a_malformed_mdio_store_in_start(tmp_path, metaflow_env, mdio_stores):
    broken = tmp_path / "broken.mdio"
    shutil.copytree(mdio_stores["holes"][0], broken)
    shutil.rmtree(broken / "trace_mask")
    data_root = tmp_path / "data"
    result = run_flow(metaflow_env, cwd=str(tmp_path), data_root=str(data_root),
                      surveys=str(mdio_stores["f3"][0]), held_out=str(broken))
    assert result.status == "failed"
    output = result.stdout + result.stderr
    assert [line for line in output.splitlines() if f"MDIO store {broken}: the live-trace array 'trace_mask' is "
            "missing" in line], output[-3000:]
    assert "Traceback" not in output and "/scan/" not in output, output[-3000:]  # failed in start
    assert not (data_root / "surveys").exists() and not (data_root / "manifest").exists()
