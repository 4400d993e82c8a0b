"""Drive ``flows/pretrain_flow.py`` with ``metaflow.Runner`` and read results with the Client API.

The Client API is read in a fresh subprocess with the run's environment: Metaflow fixes its
datastore and S3 endpoint settings when it is first imported, so one test process cannot read runs
from several datastores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

from conftest import FLOW

_CLIENT_SCRIPT = r"""
import json, sys
from metaflow import Run, namespace
namespace(None)
run = Run(sys.argv[1])
steps = {}
for st in run:
    steps[st.id] = [t.successful for t in st]
out = {"successful": run.successful, "finished": run.finished, "steps": steps, "tags": sorted(run.tags)}
if run.successful:
    data = run["end"].task.data
    out.update({k: getattr(data, k) for k in ("train_summary", "metrics", "model_name", "model_version",
                                                 "root", "run_root", "champion", "train_stores", "held_out_stores")})
print("CLIENT-JSON " + json.dumps(out, default=str))
"""


@dataclass
class FlowResult:
    status: str  # "successful" | "failed"
    stdout: str
    stderr: str
    pathspec: str


def run_flow(env: dict[str, str], *, top_level: dict | None = None, cwd: str | None = None, resume: bool = False,
             **params) -> FlowResult:
    """Run (or resume) the flow and wait for it."""
    from metaflow import Runner

    with Runner(str(FLOW), show_output=True, env=env, cwd=cwd, **(top_level or {})) as runner:
        result = runner.resume(**params) if resume else runner.run(**params)
        return FlowResult(result.status, result.stdout, result.stderr, result.run.pathspec)


def client_view(pathspec: str, env: dict[str, str], cwd: str | None = None) -> dict:
    proc = subprocess.run([sys.executable, "-c", _CLIENT_SCRIPT, pathspec], env={**os.environ, **env},
                          capture_output=True, text=True, cwd=cwd, timeout=300)
    for line in proc.stdout.splitlines():
        if line.startswith("CLIENT-JSON "):
            return json.loads(line[len("CLIENT-JSON "):])
    raise AssertionError(f"client read failed:\n{proc.stdout}\n{proc.stderr}")


FAST_JOB = {
    "data": {"batch_size": 4},
    "train": {"log_every": 5, "warmup_steps": 5, "keep_checkpoints": 2, "threads_per_process": 1},
    "eval": {"crops": 4, "batch_size": 4, "downstream": False},
}


def fast_job_toml(**sections: dict) -> str:
    """The one fast-job config of the flow tests (small batches, a short evaluation, no downstream
    fine-tuning) with ``sections`` merged on top, e.g. ``fast_job_toml(train={"max_steps": 25})``."""
    from sfm.config import toml_text

    merged = {name: dict(values) for name, values in FAST_JOB.items()}
    for name, values in sections.items():
        merged.setdefault(name, {}).update(values)
    return toml_text(merged)


_TASKS_SCRIPT = r"""
import json, sys
from metaflow import Run, namespace
namespace(None)
out = []
for task in Run(sys.argv[1])[sys.argv[2]]:
    data = task.data if task.successful else None
    out.append({"id": task.id, "successful": task.successful, "origin": task.origin_pathspec,
                "part": getattr(data, "part", None) if data is not None else None})
print("CLIENT-JSON " + json.dumps(out, default=str))
"""


def task_view(pathspec: str, env: dict[str, str], step: str, cwd: str | None = None) -> list[dict]:
    """The tasks of ``step`` in run ``pathspec``: id, successful, origin (the pathspec a resumed run cloned
    the task from; None when it ran) and, for a successful ingest task, its ``part`` artifact."""
    proc = subprocess.run([sys.executable, "-c", _TASKS_SCRIPT, pathspec, step], env={**os.environ, **env},
                          capture_output=True, text=True, cwd=cwd, timeout=300)
    for line in proc.stdout.splitlines():
        if line.startswith("CLIENT-JSON "):
            return json.loads(line[len("CLIENT-JSON "):])
    raise AssertionError(f"client read failed:\n{proc.stdout}\n{proc.stderr}")
