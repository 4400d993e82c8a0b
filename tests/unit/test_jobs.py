"""Typed jobs, parsed once: a pretraining and a fine-tuning job survive their job file's JSON unchanged, a flow's
config is parsed once however often its config expressions ask, and nothing but a process's entry parses a config
(the counts in real processes: tests/integration/test_job_parsed_once.py)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from sfm.config import JobConfig

PROJECT = Path(__file__).resolve().parents[2]

# every place a config is parsed (JobConfig.from_dict / from_toml), each a process's entry or its one parse
ENTRIES = {
    "sfm/config.py": {"JobConfig.from_toml"},  # the TOML file, through from_dict
    "sfm/cli/run_commands.py": {"_job_config"},  # sfm train, sfm slurm-script
    "sfm/cli/model_commands.py": {"_cmd_predict"},  # sfm predict
    "sfm/distributed/job.py": {"TrainJob.from_dict"},  # a pretraining rank's job file
    "sfm/finetune/job.py": {"FinetuneJob.from_dict"},  # a fine-tuning rank's job file
    "sfm/ops/cluster.py": {"_parsed"},  # a flow task's config (job_of: config expressions and start), cached
    "sfm/ops/watch.py": {"run_plan"},  # sfm watch: the config named, or the champion's
}


def parse_sites(path: Path) -> set[str]:
    """The functions (Class.method) of ``path`` that call JobConfig.from_dict or JobConfig.from_toml."""
    sites: set[str] = set()

    def visit(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope + [child.name] if isinstance(child, (ast.FunctionDef, ast.ClassDef)) else scope
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) and \
                    child.func.attr in ("from_dict", "from_toml") and isinstance(child.func.value, ast.Name) and \
                    (child.func.value.id == "JobConfig" or (child.func.value.id == "cls" and scope[:1] == ["JobConfig"])):
                sites.add(".".join(scope))
            visit(child, inner)

    visit(ast.parse(path.read_text()), [])
    return sites


def test_only_a_process_entry_parses_a_job_config():
    found = {}
    for path in [*sorted((PROJECT / "sfm").rglob("*.py")), *sorted((PROJECT / "flows").glob("*.py"))]:
        sites = parse_sites(path)
        if sites:
            found[str(path.relative_to(PROJECT))] = sites
    assert found == ENTRIES


def test_a_pretraining_job_survives_its_job_file(tmp_path):
    from sfm.distributed.job import TrainJob

    job = TrainJob(JobConfig().override(["data.crop=[16, 16, 32]"], max_steps=7, procs_per_node=2),
                   ["s3://b/sfm/surveys/a.zarr"], "s3://b/sfm/checkpoints/run")
    (tmp_path / "job.json").write_text(job.to_json())
    again = TrainJob.read(str(tmp_path / "job.json"))
    assert again == job and again.config.data.crop == (16, 16, 32) and again.config.train.max_steps == 7
    assert json.loads(job.to_json()) == {"config": job.config.to_dict(), "surveys": job.surveys,
                                         "run_root": job.run_root}  # what the trainer's docstring says


def test_a_fine_tuning_job_survives_its_job_file(tmp_path):
    from sfm.finetune.job import FinetuneJob

    from sfm.finetune.job import Arm

    arms = [Arm("pretrained", "sfm-mae:v2", (32, 32, 64), url="s3://b/sfm/registry/sfm-mae/v2"),
            Arm("random", "random", (32, 32, 64), model={"crop": [32, 32, 64]}, reference="sfm-mae:v2"),
            Arm("unet", "unet", (32, 32, 64), reference="sfm-mae:v2")]
    job = FinetuneJob(JobConfig().override(seed=3, seeds=2), arms, "classes:3", "/runs/ft",
                      [("s3://b/a.zarr", "s3://b/a-labels.zarr"), ("s3://b/c.zarr", "s3://b/c-l.zarr")],
                      ["train", "test"], ["lab-a", "lab-c"])
    (tmp_path / "job.json").write_text(job.to_json())
    again = FinetuneJob.read(str(tmp_path / "job.json"))
    assert again == job and again.config.finetune.seed == 3 and again.seeds == [3, 4]
    assert again.lineage_of(arms[1]) == {"encoder": "random", "arm": "random", "labels": ["lab-a", "lab-c"]}


def test_a_flow_config_is_parsed_once_per_process_and_each_reader_gets_its_own(monkeypatch):
    from sfm.ops import cluster

    calls = []
    parse = JobConfig.from_dict.__func__
    monkeypatch.setattr(JobConfig, "from_dict", classmethod(lambda cls, data=None: calls.append(1) or parse(cls, data)))
    cluster._parsed.cache_clear()
    config = {"dist": {"nodes": 3}, "train": {"max_steps": 11}}
    first = cluster.job_of(config)
    first.set("dist.nodes", 5)  # one reader's change is its own
    assert cluster.job_of(dict(config)).dist.nodes == 3 and cluster.cluster_of(config).cpu == 1
    assert cluster.job_of({"train": {"max_steps": 11}, "dist": {"nodes": 3}}).train.max_steps == 11
    assert len(calls) == 1
    assert cluster.job_of({}).dist.nodes == 1 and len(calls) == 2
