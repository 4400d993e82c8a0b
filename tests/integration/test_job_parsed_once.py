"""A job's config is parsed once per process, at the process's entry, then passed typed: ``sfm train`` (the CLI)
parses its TOML once, the launcher not at all, and each rank once, when it reads its job file; every flow task
once (its config expressions and ``start``; the other steps read the typed job artifact). Counted in real
processes (:mod:`support.parse_count`), so a parse added mid-way, anywhere, fails here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import PROJECT, free_port
from support.flowrun import fast_job_toml, run_flow
from support.parse_count import counting_env, parse_counts
from support.training import make_survey_store


def kind_of(argv: list[str]) -> str:
    text = " ".join(argv)
    if "sfm.distributed.rank_launcher" in text or "rank_launcher.py" in text:
        return "launcher"
    if argv and argv[0].endswith(("sfm/train/trainer.py", "sfm/finetune/job.py")):
        return "rank"
    if argv and argv[0].endswith(("sfm/cli/__main__.py", "sfm/cli/__init__.py")):
        return "cli"
    return text


@pytest.mark.timeout(400)
def test_sfm_train_and_each_rank_parse_the_job_once(tmp_path, tmp_path_factory):
    store = make_survey_store(tmp_path_factory, seed=4)
    env = counting_env(tmp_path / "count", PROJECT)
    proc = subprocess.run([sys.executable, "-m", "sfm.cli", "train", "--surveys", store, "--run-root",
                           str(tmp_path / "run"), "--procs-per-node", "2", "--main-port", str(free_port()),
                           "--set", "train.max_steps=2;train.warmup_steps=1;train.threads_per_process=1",
                           "--set", "data.batch_size=2", "--set", "data.crop=[32, 32, 32]"],
                          cwd=PROJECT, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=380)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["steps"] == 2
    counts = parse_counts(tmp_path / "count")
    by_kind: dict[str, list[int]] = {}
    for c in counts:
        by_kind.setdefault(kind_of(c["argv"]), []).append(c["calls"])
    assert by_kind.get("cli") == [1] and by_kind.get("launcher") == [0], counts
    assert by_kind.get("rank") == [1, 1], counts  # two ranks, each one parse


@pytest.mark.timeout(600)
def test_each_flow_task_parses_the_config_once(tmp_path, metaflow_env):
    (tmp_path / "job.toml").write_text(fast_job_toml(train={"max_steps": 2, "warmup_steps": 1, "checkpoint_every": 2},
                                                     synth={"train_surveys": 1, "shape": [40, 40, 48]}))
    env = {**metaflow_env, **counting_env(tmp_path / "count", PROJECT)}
    result = run_flow(env, top_level={"config": [("config", str(tmp_path / "job.toml"))]}, cwd=str(tmp_path),
                      data_root=str(tmp_path / "data"))
    assert result.status == "successful", result.stderr[-3000:]
    counts = parse_counts(tmp_path / "count")
    tasks = [c for c in counts if "step" in c["argv"]]
    steps = {c["argv"][c["argv"].index("step") + 1] for c in tasks}
    assert {"start", "scan", "ingest", "pretrain", "evaluate", "register", "end"} <= steps, steps
    assert all(c["calls"] == 1 for c in tasks), [(c["argv"][c["argv"].index("step") + 1], c["calls"]) for c in tasks]
    assert all(c["calls"] <= 1 for c in counts), counts  # the run's own process, the launcher and the rank alike
