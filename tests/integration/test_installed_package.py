"""The package as a cluster installs it (issues 46, 55): deploy/install.sh, the script the HyperPod image's
Dockerfile runs, builds the wheel from this checkout (`pip wheel --no-deps`) and installs it into a fresh
virtual environment (dependencies from the same indexes and wheels as the test install; torch==2.13.0 is
the CPU build on this machine's disk). Then, from a folder outside the repository, with nothing of the
checkout on the path: `sfm ingest` of the F3 crop, `sfm train` for a few steps (its MFU never above 100 %),
`sfm flow pretrain show` (the packaged flow `sfm watch` runs, read by Metaflow), the demo flow run from a copy
of the checkout's entry point flows/pretrain_flow.py (small overrides keep it short), `sfm registry load` of
what it registered, and the README's "Using the model" with the packaged flows alone: a labelled survey from
`sfm synth`, `sfm flow finetune` from the demo's encoder (a few steps) and `sfm flow predict` of the survey.

One virtual environment serves the session; the install's and each command's wall time are printed
(`pytest -s`) for CI's budget.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FLOW, PROJECT

pytestmark = pytest.mark.long(3)

INSTALL = PROJECT / "deploy" / "install.sh"
DEMO_OVERRIDES = """
[synth]
train_surveys = 1
shape = [48, 48, 64]
[data]
batch_size = 4
[train]
max_steps = 4
log_every = 2
warmup_steps = 1
checkpoint_every = 4
threads_per_process = 1
[eval]
crops = 4
batch_size = 4
downstream = false
"""

def outside_env(home: Path) -> dict[str, str]:
    """This process's environment without the checkout: no PYTHONPATH, no active venv, a Metaflow home
    and local datastore of the test's own."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
           and not k.startswith("METAFLOW_")}
    env.update({"METAFLOW_USER": "sfm-test", "METAFLOW_HOME": str(home / "mfhome"),
                "METAFLOW_DEFAULT_DATASTORE": "local", "METAFLOW_DEFAULT_METADATA": "local",
                "PIP_NO_COMPILE": "1"})  # only what is imported gets compiled, when it is
    return env


def timed(what: str, args: list[str], cwd: Path, env: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    t0 = time.perf_counter()
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    print(f"installed package: {what} took {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    assert proc.returncode == 0, f"{what} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture(scope="session")
def installed(tmp_path_factory) -> dict:
    """A virtual environment holding sfm as deploy/install.sh installs it, and a work folder outside the
    repository to run it from."""
    base = tmp_path_factory.mktemp("installed")
    assert PROJECT not in base.resolve().parents
    venv, work = base / "venv", base / "work"
    (work / ".metaflow").mkdir(parents=True)  # Metaflow keeps its local datastore here, not in a folder above
    env = outside_env(base)
    proc = timed("deploy/install.sh", ["bash", str(INSTALL), "--python", sys.executable, "--venv", str(venv),
                                       "--torch", "torch==2.13.0", str(PROJECT)], work, env, timeout=1500)
    assert "install.sh: sfm " in proc.stdout and "torch 2.13.0+cpu" in proc.stdout, proc.stdout
    return {"bin": venv / "bin", "work": work, "env": env}


@pytest.mark.timeout(2400)
def test_installed_package_ingests_trains_runs_the_flow_and_loads_from_the_registry(installed, segy_dir):
    bin_, work, env = installed["bin"], installed["work"], installed["env"]
    python = str(bin_ / "python")

    # the package imported is the installed one, carrying the files it reads at run time
    probe = timed("import", [python, "-c", (
        "import json, sfm; from sfm.ops.watch import FLOW_FILE; from sfm.config import CONFIGS_DIR, DEFAULT_TOML; "
        "from sfm.flows import FLOWS, flow_file; from sfm.formats.contracts import CONTRACTS_DIR; "
        "print(json.dumps({'sfm': sfm.__file__, 'flow': str(FLOW_FILE), 'toml': str(DEFAULT_TOML), "
        "'flows': {n: flow_file(n).read_text() for n in FLOWS}, "
        "'configs': {p.name: p.read_text() for p in CONFIGS_DIR.iterdir()}, "
        "'contracts': {p.name: p.read_text() for p in CONTRACTS_DIR.iterdir()}}))")], work, env, 120)
    where = json.loads(probe.stdout)
    site = Path(where["sfm"]).parent
    assert site.is_relative_to(bin_.parent), where["sfm"]
    assert Path(where["flow"]) == site / "flows" / "pretrain_flow.py"  # the flow `sfm watch` runs
    assert where["flows"] == {n: (PROJECT / "sfm" / "flows" / f"{n}_flow.py").read_text()
                              for n in ("pretrain", "finetune", "predict")}
    assert where["configs"] == {p.name: p.read_text() for p in (PROJECT / "sfm" / "configs").glob("*.toml")}
    assert Path(where["toml"]).read_bytes() == (PROJECT / "sfm" / "default.toml").read_bytes()
    assert where["contracts"] == {p.name: p.read_text() for p in (PROJECT / "sfm" / "data_contracts").glob("*.json")}

    # sfm ingest of the real F3 crop (schema-validated store attributes and manifest row)
    root = work / "sfm_data"
    timed("sfm ingest", [str(bin_ / "sfm"), "ingest", str(segy_dir / "f3.sgy"), "--data-root", str(root)],
          work, env, 300)
    (store,) = (root / "surveys").glob("*.zarr")

    # sfm train for a few steps on it (torchrun, one process)
    trained = timed("sfm train", [str(bin_ / "sfm"), "train", "--surveys", str(store), "--run-root",
                                  str(work / "run"), "--set", "train.max_steps=3", "--set", "train.log_every=1;"
                                  "train.warmup_steps=1;train.threads_per_process=1", "--set", "data.crop=[16,16,32]",
                                  "--set", "data.batch_size=2"],
                    work, env, 600)
    summary = json.loads(trained.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 3 and Path(summary["model_url"], "model.safetensors").is_file()
    written = json.loads((work / "run" / "summary.json").read_text())
    assert all(0 < h["mfu"] <= 1 for h in written["history"] if "mfu" in h)  # never above the peak
    assert written["mfu"] is None or 0 < written["mfu"] <= 1

    # the flow `sfm watch` runs is the package's own file, and Metaflow reads it as a flow
    shown = timed("sfm flow pretrain show", [str(bin_ / "sfm"), "flow", "pretrain", "show"], work, env, 300)
    assert "pretrain" in shown.stdout + shown.stderr

    # the demo flow from a copy outside the checkout: it registers sfm-mae v1 in ./sfm_data
    shutil.copy(FLOW, work / "pretrain_flow.py")
    (work / "demo_fast.toml").write_text(DEMO_OVERRIDES)
    flow = timed("the demo flow", [python, "pretrain_flow.py", "--config", "config", "demo_fast.toml", "run"],
                 work, env, 1200)
    assert "registered sfm-mae v1" in flow.stdout + flow.stderr

    loaded = timed("sfm registry load", [str(bin_ / "sfm"), "registry", "load", "sfm-mae:v1", "--data-root",
                                         str(root), "--out", str(work / "model")], work, env, 300)
    record = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert record["version"] == 1 and record["parameters"] > 0
    assert (work / "model" / "model.safetensors").is_file()

    # "Using the model" with the packaged flows: fine-tune the demo's encoder on a labelled survey, predict it
    timed("sfm synth", [str(bin_ / "sfm"), "synth", "labelled.sgy", "--shape", "40", "40", "64", "--seed", "7"],
          work, env, 120)
    ingested = timed("sfm ingest (labelled)", [str(bin_ / "sfm"), "ingest", "labelled.sgy", "--data-root", str(root)],
                     work, env, 300)
    labelled = json.loads(ingested.stdout.strip().splitlines()[-1])["store_url"]
    fast = ["--set", "finetune.steps=4;finetune.probe_steps=2;finetune.validate_every=2", "--set",
            "finetune.batch_size=2;finetune.lrs=[1e-3];train.threads_per_process=1"]  # sfm flow joins them
    tuned = timed("sfm flow finetune", [str(bin_ / "sfm"), "flow", "finetune", "run", "--surveys", labelled,
                                        "--labels", "labelled.faults.npy", "--held-out", "0.25", "--task-name",
                                        "faults", "--encoder", "sfm-mae:v1", *fast], work, env, 900)
    assert "registered sfm-faults v1" in tuned.stdout + tuned.stderr
    shown = timed("sfm registry show", [str(bin_ / "sfm"), "registry", "show", "sfm-faults:latest"], work, env, 120)
    record = json.loads(shown.stdout)
    assert record["lineage"]["encoder"] == "sfm-mae:v1" and record["config"]["finetune"]["steps"] == 4  # --set
    timed("sfm flow predict", [str(bin_ / "sfm"), "flow", "predict", "run", "--model", "sfm-faults", "--survey",
                               labelled, "--out", str(work / "faults.zarr"), "--set", "predict.overlap=0.25"],
          work, env, 600)
    import zarr

    predicted = zarr.open_group(str(work / "faults.zarr"), mode="r")
    assert predicted["probability"].shape == (40, 40, 64) and predicted.attrs["prediction"]["overlap"] == 0.25
