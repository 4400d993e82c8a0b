"""flows/finetune_flow.py on generated surveys and the fault labels the generator writes: ``--compare True`` on 2 ranks
(DDP), the registered encoder fine-tuned beside both baselines built like it (its architecture from random
initialisation, the U-Net from scratch), training labels on every 8th inline only (a label SEG-Y whose other traces
are missing), scored on a held-out labelled survey, the best on the validation labels registered. Mechanics only:
the scores are recorded, not judged (benchmarks/finetune.py judges them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support import ingest_cases
from support.encoders import register_tiny_encoder

from sfm.model import registry
from sfm.config import toml_text

pytestmark = pytest.mark.long(1)

FLOW = Path(__file__).resolve().parents[2] / "flows" / "finetune_flow.py"
SHAPE = (40, 40, 64)
FAST = {"train": {"threads_per_process": 1},
        "finetune": {"steps": 6, "probe_steps": 3, "validate_every": 3, "batch_size": 2, "mirror": False,
                     "validation": 0.34, "lrs": [1e-3], "lrs_random": [1e-3], "lrs_unet": [1e-3]}}

_CLIENT = r"""
import json, sys
from metaflow import Run, namespace
from metaflow.cards import get_cards
namespace(None)
run = Run(sys.argv[1])
data = run["end"].task.data
cards = get_cards(run["evaluate"].task, id="finetune")
print("CLIENT-JSON " + json.dumps({"successful": run.successful, "summary": data.summary, "metrics": data.metrics,
                                   "model": [data.model_name, data.model_version], "tags": sorted(run.tags),
                                   "card": cards[0].get() if len(cards) else ""}, default=str))
"""


def run_flow(home: Path, env: dict, *args: str) -> dict:
    proc = subprocess.run([sys.executable, str(FLOW), "--config", "config", str(home / "fast.toml"), "run", *args],
                          cwd=home, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_id = next(line.split("(run-id ")[1].split(")")[0] for line in proc.stdout.splitlines() + proc.stderr.splitlines()
                  if "(run-id " in line)
    view = subprocess.run([sys.executable, "-c", _CLIENT, f"FinetuneFlow/{run_id}"], cwd=home, env=env,
                          capture_output=True, text=True, timeout=300)
    line = next(x for x in view.stdout.splitlines() if x.startswith("CLIENT-JSON "))
    return {**json.loads(line[len("CLIENT-JSON "):]), "stdout": proc.stdout}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One flow run in a working folder (data root: the default sfm_data there): the registered encoder (sfm-mae v1,
    the champion) and both baselines, on 2 ranks."""
    from sfm.synth.survey import SegyOptions, synth_survey, write_segy

    home = tmp_path_factory.mktemp("finetune-flow")
    (home / ".metaflow").mkdir()
    (home / "fast.toml").write_text(toml_text(FAST))
    train = synth_survey(home / "train.sgy", shape=SHAPE, seed=11)
    synth_survey(home / "held.sgy", shape=SHAPE, seed=12)
    faults = np.load(train["faults"])
    write_segy(home / "train-faults.sgy", faults.astype(np.float32), SegyOptions())
    every_eighth = np.repeat(np.arange(SHAPE[0]) % 8 == 0, SHAPE[1])  # file order: inline-sorted traces
    ingest_cases.drop_traces(home / "train-faults.sgy", SHAPE[2], every_eighth)
    root = str(home / "sfm_data")
    register_tiny_encoder(home / "encoder", root)
    env = {**os.environ, "METAFLOW_USER": "sfm-test", "METAFLOW_HOME": str(home / "mfhome"),
           "METAFLOW_DEFAULT_DATASTORE": "local", "METAFLOW_DEFAULT_METADATA": "local"}
    for key in ("METAFLOW_DATASTORE_SYSROOT_LOCAL", "METAFLOW_CARD_LOCALROOT"):
        env.pop(key, None)
    common = ["--surveys", "train.sgy", "--labels", "train-faults.sgy", "--held-out", "held.sgy",
              "--held-out-labels", "held.faults.npy", "--task-name", "faults"]
    compared = run_flow(home, env, *common, "--procs-per-node", "2", "--compare", "True", "--seeds", "1")
    return {"home": home, "root": root, "env": env, "compared": compared, "faults": faults}


def test_the_compare_run_registers_the_best_arm_with_lineage_and_every_arms_held_out_scores(runs):
    root, run = runs["root"], runs["compared"]
    assert run["model"] == ["sfm-faults", 1] and "model:sfm-faults:v1" in run["tags"]
    summary = run["summary"]
    assert summary["world_size"] == 2 and [k["arm"] for k in summary["kept"]] == ["pretrained", "random", "unet"]
    record = registry.get(root, "sfm-faults", 1)
    best = max(summary["kept"], key=lambda k: k["validation_score"])
    assert record["lineage"]["arm"] == best["arm"] == summary["arm"]  # the best on the validation labels
    assert record["lineage"]["encoder"] == {"pretrained": "sfm-mae:v1", "random": "random", "unet": "unet"}[best["arm"]]
    assert [c["arm"] for c in record["lineage"]["chosen"]] == ["pretrained", "random", "unet"]
    assert registry.is_task_model(record) and record["lineage"]["task"] == "binary"
    roles = {lab["role"]: lab["label_id"] for lab in record["lineage"]["labels"]}
    assert set(roles) == {"train", "test"} and roles["train"] != roles["test"]
    metrics = record["metrics"]
    held_voxels = int(np.load(Path(runs["home"]) / "held.faults.npy").size)
    assert metrics == run["metrics"] and metrics["voxels"] == held_voxels
    assert all(0 <= metrics[k] <= 1 for k in ("ap", "f1", "f1_tol2", "iou"))
    assert list(metrics["arms"]) == ["pretrained", "random", "unet"] and len(record["lineage"]["held_out_surveys"]) == 1
    # the end step prints every arm's scores, mean +- sd over the seeds
    table = run["stdout"][run["stdout"].index("held-out scores per arm"):]
    assert all(f" {arm} " in table for arm in ("pretrained", "random", "unet")) and " +- " in table
    net = registry.load(root, "sfm-faults", 1)
    assert net.task.kind == "binary" and net(torch.zeros(1, 1, *net.crop)).shape == (1, 1, *net.crop)


def test_labels_on_every_eighth_inline_train_and_the_card_shows_a_held_out_line(runs):
    from sfm.formats import manifest

    rows = {r["label_id"]: r for r in manifest.label_rows(runs["root"])}
    train_id = next(lab["label_id"] for lab in registry.get(runs["root"], "sfm-faults", 1)["lineage"]["labels"]
                    if lab["role"] == "train")
    assert rows[train_id]["labelled_inlines"] == 5  # inlines 0, 8, 16, 24, 32 of 40
    assert rows[train_id]["labelled_voxels"] == 5 * SHAPE[1] * SHAPE[2]
    import base64
    import io
    import re

    from PIL import Image

    blob = re.search(r'window\.__MF_DATA__\["[^"]*"\]\s*=\s*"([A-Za-z0-9+/=]+)"', runs["compared"]["card"])
    data = base64.b64decode(blob.group(1)).decode()
    found = []

    def walk(node):  # every component of the card, wherever it sits
        if isinstance(node, dict):
            found.append(node)
            [walk(v) for v in node.values()]
        elif isinstance(node, list):
            [walk(v) for v in node]

    walk(json.loads(data))
    images = {c["label"]: Image.open(io.BytesIO(base64.b64decode(c["src"].split(",", 1)[1])))
              for c in found if c.get("type") == "image"}
    arms = ("pretrained", "random", "unet")  # each arm's probability, and what it picks at its threshold
    assert set(images) == {"amplitude", "labels", *(f"{kind} ({arm})" for arm in arms
                                                    for kind in ("prediction", "picked"))}, sorted(images)
    assert {im.size for im in images.values()} == {(4 * SHAPE[1], 4 * SHAPE[2])}  # one held-out inline, time down
    assert "Every arm on the held-out labels" in data and "F1 at 2 voxels" in data


def test_the_registry_lists_task_models_beside_encoders_from_the_default_data_root(runs):
    proc = subprocess.run([sys.executable, "-m", "sfm.cli", "registry", "list"], cwd=runs["home"], env=runs["env"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    listed = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(x["model"], x["kind"], x["version"]) for x in listed] == [("sfm-faults", "task", 1),
                                                                        ("sfm-mae", "encoder", 1)]
    assert listed[0]["encoder"] == registry.get(runs["root"], "sfm-faults", 1)["lineage"]["encoder"]
    assert "ap" in listed[0]
