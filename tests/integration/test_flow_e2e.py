"""The whole pipeline on the embedded default: synthetic SEG-Y -> stores -> training -> evaluation -> v1.

Run twice: with everything on local disk, and with both the data root and Metaflow's datastore on
an S3 server (moto_server) reached over HTTP on loopback.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.flowrun import client_view, run_flow

EXPECTED_STEPS = {"start", "scan", "plan_ingest", "split_parts", "ingest", "join", "launch", "pretrain", "evaluate", "register", "end"}


def _check_pipeline(view: dict) -> None:
    assert view["successful"], view
    assert set(view["steps"]) == EXPECTED_STEPS
    assert all(all(flags) and flags for flags in view["steps"].values()), view["steps"]
    assert view["steps"]["ingest"] == [True, True, True]  # two training surveys + one held out
    history = [h["loss"] for h in view["train_summary"]["history"]]
    assert len(history) == view["train_summary"]["steps"]
    first, last = sum(history[:20]) / 20, sum(history[-20:]) / 20
    assert last < first * 0.95, f"loss did not fall: first 20 steps {first:.4f}, last 20 {last:.4f}"
    metrics = view["metrics"]
    assert metrics["masked_nmse"] < metrics["baseline_zero_nmse"], metrics
    assert len(view["train_stores"]) == 2 and len(view["held_out_stores"]) == 1
    assert not set(view["train_stores"]) & set(view["held_out_stores"])
    assert view["model_version"] == 1 and view["champion"] is True
    assert f"model:{view['model_name']}:v1" in view["tags"]


def _check_version_record(record: dict, files: set[str]) -> None:
    assert {"model.safetensors", "config.json", "version.json"} <= files
    assert record["version"] == 1
    assert record["lineage"]["run_pathspec"].startswith("PretrainFlow/")
    assert record["lineage"]["manifest_version"].startswith("m3-")
    assert record["metrics"]["masked_nmse"] < record["metrics"]["baseline_zero_nmse"]
    assert record["config"]["model"]["preset"] == "tiny"


@pytest.mark.timeout(600)
def test_default_pipeline_local(tmp_path, metaflow_env):
    data_root = tmp_path / "data"
    result = run_flow(metaflow_env, cwd=str(tmp_path), data_root=str(data_root))
    assert result.status == "successful", result.stderr
    view = client_view(result.pathspec, metaflow_env, cwd=str(tmp_path))
    _check_pipeline(view)

    version_dir = data_root / "registry" / "sfm-mae" / "v1"
    files = {p.name for p in version_dir.iterdir()}
    _check_version_record(json.loads((version_dir / "version.json").read_text()), files)
    assert sorted(p.name for p in (data_root / "landing").glob("*.sgy")) == [
        "demo-heldout-0.sgy", "demo-train-0.sgy", "demo-train-1.sgy"]
    assert len(list((data_root / "manifest" / "rows").glob("*.parquet"))) == 3

    from sfm.model.io import load

    model = load(str(version_dir))  # the registered weights load with one call
    assert model.cfg.crop == (32, 32, 32)


@pytest.mark.timeout(600)
def test_default_pipeline_on_s3(tmp_path, metaflow_env, s3_env):
    bucket = "sfm-e2e"
    s3_env.make_bucket(bucket)
    env = {**metaflow_env, **s3_env.env(), "METAFLOW_DEFAULT_DATASTORE": "s3",
           "METAFLOW_DATASTORE_SYSROOT_S3": f"s3://{bucket}/metaflow"}
    result = run_flow(env, top_level={"datastore": "s3"}, cwd=str(tmp_path),
                                data_root=f"s3://{bucket}/data")
    assert result.status == "successful", result.stderr
    view = client_view(result.pathspec, env, cwd=str(tmp_path))
    _check_pipeline(view)
    assert view["root"] == f"s3://{bucket}/data"

    keys = s3_env.keys(bucket)
    assert any(k.startswith("metaflow/PretrainFlow/") for k in keys), "Metaflow's datastore is not on S3"
    version_keys = {k.rsplit("/", 1)[-1] for k in keys if k.startswith("data/registry/sfm-mae/v1/")}
    record = json.loads(s3_env.client().get_object(Bucket=bucket, Key="data/registry/sfm-mae/v1/version.json")
                        ["Body"].read())
    _check_version_record(record, version_keys)
    assert sum(k.startswith("data/manifest/rows/") for k in keys) == 3
    assert any(k.startswith("data/surveys/") and k.endswith("zarr.json") for k in keys)
    assert not any(Path(k).name.startswith(".") and "tmp" in k for k in keys)
