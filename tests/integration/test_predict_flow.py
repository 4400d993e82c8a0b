"""flows/predict_flow.py (issue 49): one task per part; a part that fails mid-way (after some of its shards)
fails the run with nothing published, and `resume` runs that part alone (the other cloned) and publishes
the store an uninterrupted prediction writes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from conftest import PROJECT
from support import ingest_cases as cases
from support.flowrun import task_view

from sfm.ingest.survey import ingest_survey
from sfm.model import build_model, mae_config
from sfm.model.segmenter import Segmenter, Task, save_segmenter
from sfm.predict import PredictOptions, predict

FLOW = PROJECT / "flows" / "predict_flow.py"


def run(env, cwd, resume=False, **params):
    from metaflow import Runner

    with Runner(str(FLOW), show_output=True, env=env, cwd=str(cwd)) as runner:
        result = runner.resume() if resume else runner.run(**params)
        return result.status, result.run.pathspec, result.stdout + result.stderr  # the tasks' lines and the runtime's


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_failed_part_is_resumed_alone_and_the_store_equals_an_uninterrupted_run(tmp_path, metaflow_env):
    src = cases.write(tmp_path / "s.sgy", cases.volume((80, 20, 24), seed=4))
    store = ingest_survey(str(src), str(tmp_path / "data"), chunk=16)["store_url"]  # 5 shard rows
    torch.manual_seed(0)
    save_segmenter(Segmenter(build_model(mae_config("tiny", crop=(16, 16, 16))), Task()), str(tmp_path / "model"))
    params = {"model": str(tmp_path / "model"), "survey": store, "parts": 2}
    out = tmp_path / "flow.zarr"
    blocked = out / "probability" / "c" / "3" / "0" / "0"  # a shard of part 1's second row cannot be written
    blocked.mkdir(parents=True)
    status, failed, log = run(metaflow_env, tmp_path, out=str(out), **params)
    assert status == "failed", log[-3000:]
    tasks = task_view(failed, metaflow_env, "predict", cwd=str(tmp_path))
    assert sorted(t["successful"] for t in tasks) == [False, True]  # part 1 failed (its retry too)
    assert not (out / "zarr.json").exists() and (out / "probability" / "c" / "2").exists()  # mid-way, unpublished

    blocked.rmdir()
    status, resumed, log = run(metaflow_env, tmp_path, resume=True)
    assert status == "successful", log[-3000:]
    tasks = task_view(resumed, metaflow_env, "predict", cwd=str(tmp_path))
    ran = [t["part"]["part"] for t in tasks if t["origin"] is None]
    cloned = [t["part"]["part"] for t in tasks if t["origin"] is not None]
    assert ran == [1] and cloned == [0]
    assert "predict part 2/2: window " in log  # the part's progress, in plain lines: a task has no terminal

    whole = predict(PredictOptions(out=str(tmp_path / "whole.zarr"), **params))
    assert whole["published"]
    mine, theirs = files(out), files(tmp_path / "whole.zarr")
    assert mine == theirs  # shards, arrays and the root zarr.json, byte for byte
    assert np.isfinite(whole["stats"]["mean"])
