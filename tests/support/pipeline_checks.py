"""What every complete run of the default pipeline must show, whichever run a test has (the local default
run of tests/integration/test_evaluate_default_run.py, the S3 run of tests/integration/test_leaks_flow_s3.py):
every step successful, three surveys ingested, a falling loss, the model beating the zero baseline and
registered as v1, the champion."""

from __future__ import annotations

EXPECTED_STEPS = {"start", "scan", "plan_ingest", "split_parts", "ingest", "join", "launch", "pretrain", "evaluate", "register", "end"}


def check_pipeline(view: dict, trained: bool = True) -> None:
    """``trained``: the run trained the default number of steps, so its loss fell and it beats the zero baseline."""
    assert view["successful"], view
    assert set(view["steps"]) == EXPECTED_STEPS
    assert all(all(flags) and flags for flags in view["steps"].values()), view["steps"]
    assert view["steps"]["ingest"] == [True, True, True]  # two training surveys + one held out
    history = [h["loss"] for h in view["train_summary"]["history"]]
    assert len(history) == view["train_summary"]["steps"]
    if trained:
        first, last = sum(history[:20]) / 20, sum(history[-20:]) / 20
        assert last < first * 0.95, f"loss did not fall: first 20 steps {first:.4f}, last 20 {last:.4f}"
        metrics = view["metrics"]
        assert metrics["masked_nmse"] < metrics["baseline_zero_nmse"], metrics
    assert len(view["train_stores"]) == 2 and len(view["held_out_stores"]) == 1
    assert not set(view["train_stores"]) & set(view["held_out_stores"])
    assert view["model_version"] == 1 and view["champion"] is True
    assert f"model:{view['model_name']}:v1" in view["tags"]


def check_version_record(record: dict, files: set[str], trained: bool = True) -> None:
    assert {"model.safetensors", "config.json", "version.json"} <= files
    assert record["version"] == 1
    assert record["lineage"]["run_pathspec"].startswith("PretrainFlow/")
    assert record["lineage"]["manifest_version"].startswith("m3-")
    assert record["metrics"]["masked_nmse"] > 0
    if trained:
        assert record["metrics"]["masked_nmse"] < record["metrics"]["baseline_zero_nmse"]
    assert record["config"]["model"]["preset"] == "tiny"
