"""The default `python flows/pretrain_flow.py run` (synthetic SEG-Y -> stores -> training -> evaluation -> v1,
all on local disk): the whole pipeline, its evaluation card (loss curve, slices, label efficiency, tables) and
the downstream evaluation it reports. One flow run serves every test here; the same pipeline on S3 is
checked on the run of tests/integration/test_leaks_flow_s3.py."""

from __future__ import annotations

import base64
import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.flowrun import client_view, run_flow
from support.pipeline_checks import check_pipeline, check_version_record
from PIL import Image

pytestmark = pytest.mark.long(3)

_CARD_SCRIPT = r"""
import json, sys
from metaflow import Run, namespace
from metaflow.cards import get_cards
namespace(None)
task = Run(sys.argv[1])["evaluate"].task
cards = get_cards(task, id="evaluation")
print("CARD-JSON " + json.dumps({"count": len(cards), "type": cards[0].type, "html": cards[0].get()}))
"""


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """`python flows/pretrain_flow.py run` with no parameters, in an empty folder: Metaflow keeps its
    datastore and cards in ./.metaflow (created first, so Metaflow does not adopt one further up) and the
    pipeline its outputs in ./sfm_data.

    Not METAFLOW_DATASTORE_SYSROOT_LOCAL: with it Metaflow writes local cards beside the cwd's .metaflow
    but reads them under the sysroot, so get_cards would not find them."""
    home = tmp_path_factory.mktemp("default-run")
    (home / ".metaflow").mkdir()
    env = {"METAFLOW_USER": "sfm-test", "METAFLOW_HOME": str(home / "mfhome"), "METAFLOW_DEFAULT_DATASTORE": "local",
           "METAFLOW_DEFAULT_METADATA": "local"}
    unset = ("METAFLOW_DATASTORE_SYSROOT_LOCAL", "METAFLOW_CARD_LOCALROOT")
    saved = {k: os.environ.get(k) for k in (*env, *unset)}
    for key in unset:
        os.environ.pop(key, None)
    os.environ.update(env)  # Runner reads some settings from this process's environment
    try:
        result = run_flow(env, cwd=str(home))
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    assert result.status == "successful", result.stderr[-5000:]
    return {"env": env, "cwd": str(home), "pathspec": result.pathspec, "stdout": result.stdout,
            "view": client_view(result.pathspec, env, cwd=str(home))}


@pytest.mark.timeout(1800)
def test_default_run_ingests_trains_evaluates_and_registers_v1(default_run):
    check_pipeline(default_run["view"])
    data_root = Path(default_run["view"]["root"])  # the default --data-root, sfm_data in the working folder
    assert data_root.resolve() == (Path(default_run["cwd"]) / "sfm_data").resolve()
    version_dir = data_root / "registry" / "sfm-mae" / "v1"
    files = {p.name for p in version_dir.iterdir()}
    check_version_record(json.loads((version_dir / "version.json").read_text()), files)
    assert sorted(p.name for p in (data_root / "landing").glob("*.sgy")) == [
        "demo-heldout-0.sgy", "demo-train-0.sgy", "demo-train-1.sgy"]
    assert len(list((data_root / "manifest" / "rows").glob("*.parquet"))) == 3

    from sfm.model.io import load

    model = load(str(version_dir))  # the registered weights load with one call
    assert model.cfg.crop == (32, 32, 32)


def card_components(run: dict) -> tuple[int, list[dict]]:
    """The evaluate step's cards (count) and the components of the "evaluation" card, read from its HTML."""
    env = {k: v for k, v in os.environ.items() if k not in ("METAFLOW_DATASTORE_SYSROOT_LOCAL", "METAFLOW_CARD_LOCALROOT")}
    proc = subprocess.run([sys.executable, "-c", _CARD_SCRIPT, run["pathspec"]], env={**env, **run["env"]},
                          cwd=run["cwd"], capture_output=True, text=True, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("CARD-JSON ")), None)
    assert line, proc.stderr
    card = json.loads(line[len("CARD-JSON "):])
    assert card["type"] == "blank"
    # the blank card embeds its components as base64 JSON: window.__MF_DATA__["<id>"] = "<base64>"
    blob = re.search(r'window\.__MF_DATA__\["[^"]*"\]\s*=\s*"([A-Za-z0-9+/=]+)"', card["html"])
    assert blob, "no card data in the HTML"
    found: list[dict] = []

    def walk(node):
        if isinstance(node, dict):
            if "type" in node:
                found.append(node)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(base64.b64decode(blob.group(1))))
    return card["count"], found


@pytest.mark.timeout(1800)
def test_default_run_card_shows_loss_curve_slices_and_metrics(default_run):
    count, components = card_components(default_run)
    assert count == 1
    images = {c["label"]: Image.open(io.BytesIO(base64.b64decode(c["src"].split(",", 1)[1])))
              for c in components if c["type"] == "image"}
    rows, slices = ("input", "masked input", "target", "reconstruction"), ("inline", "crossline", "time")
    expected = {f"{row}: {name} slice" for row in rows for name in slices}
    assert expected <= set(images), sorted(images)
    loss = next(im for label, im in images.items() if label.startswith("training loss"))
    assert loss.size == (640, 320)
    d, h, w = default_run["view"]["metrics"]["crop"]
    scale = images["input: time slice"].width // h
    assert images["input: inline slice"].size == (h * scale, w * scale)  # crossline across, time down
    assert images["input: crossline slice"].size == (d * scale, w * scale)
    assert images["input: time slice"].size == (h * scale, d * scale)
    pixels = {label: images[label].convert("RGB").tobytes() for label in expected}
    assert len(set(pixels.values())) == len(pixels)  # masked input, target and reconstruction differ from the input
    masked = np.asarray(images["masked input: time slice"].convert("RGB"))
    assert (masked == 140).all(axis=-1).mean() > 0.3  # hidden patches are grey (0.55 of white)

    # the downstream evaluation: label-efficiency plot, a test volume's faults, the table per budget
    m = default_run["view"]["metrics"]
    plot = images["label efficiency: AP against labelled volumes"]
    assert plot.size == (640, 360)
    assert {"amplitude", "true faults", "pretrained: fault probability", "random: fault probability"} <= set(images)
    truth = np.asarray(images["true faults"].convert("RGB"))
    red = (truth[..., 0] == 255) & (truth[..., 1] < 40) & (truth[..., 2] < 40)
    assert red.mean() > 0.005  # the labelled planes are drawn in red
    text = json.dumps([c for c in components if c["type"] != "image"])
    for needle in ("Training loss", "trilinear interpolation", "per-survey mean", "NMSE", "labelled volumes",
                   "AP pretrained", "kNN AP pre / rnd", f"{m['masked_nmse']:.4f}", f"{m['ft_ap_b1']:.4f}",
                   f"{m['ft_ap_random_b4']:.4f}", "Peak fine-tuning rates tried"):
        assert needle in text, needle


@pytest.mark.timeout(1800)
def test_default_run_metrics_against_every_baseline(default_run):
    m = default_run["view"]["metrics"]
    assert m["baseline_zero_nmse"] == pytest.approx(1.0, abs=1e-3)  # normalised patches: zero scores 1 exactly
    assert m["masked_nmse"] < m["baseline_zero_nmse"] < m["baseline_mean_nmse"]
    for key in ("masked_psnr", "baseline_interp_nmse"):
        assert math.isfinite(m[key]) and m[key] > 0, key
    assert not any(key.startswith("voxel_") for key in m)  # no voxel-space figure the model does not make


@pytest.mark.timeout(1800)
def test_default_run_reports_the_downstream_evaluation(default_run):
    """The demo reports the same evaluation as the quality configuration, at its small budgets,
    whatever its figures are: every budget and seed fine-tuned from both initialisations, scores
    in range, the frozen probes beside them. (Whether pretraining wins is benchmarks/quality.py's
    question, on a model trained long enough to answer it.)"""
    m = default_run["view"]["metrics"]
    d = m["downstream"]
    assert d["recipe"]["budgets"] == [1, 4] and d["recipe"]["seeds"] == 3 and d["test_volumes"] == 4
    prevalence = d["test_fault_fraction"]
    assert 0.01 < prevalence < 0.3
    for b in (1, 4):
        runs = d["budgets"][str(b)]
        assert len(runs["ft_pretrained"]) == len(runs["ft_random"]) == len(runs["linear_pretrained"]) == 3
        assert len(runs["knn_pretrained"]) == len(runs["knn_random"]) == 1
        for score in runs["ft_pretrained"] + runs["ft_random"] + runs["linear_random"] + runs["knn_random"]:
            assert 0 <= score["ap"] <= 1 and 0 <= score["iou"] <= score["f1"] <= 1
        # the random baseline learns something: better than ranking voxels at random (AP = prevalence)
        assert m[f"ft_ap_random_b{b}"] > prevalence
        gains = [p["ap"] - r["ap"] for p, r in zip(runs["ft_pretrained"], runs["ft_random"])]
        assert m[f"ft_ap_gain_b{b}"] == pytest.approx(sum(gains) / 3)
        assert m[f"ft_all_seeds_gain_b{b}"] == all(g > 0 for g in gains)
    print(f"demo downstream: {({k: round(v, 4) for k, v in m.items() if k.startswith('ft_ap')})}")


def test_the_demo_ends_saying_where_the_model_is_and_what_its_gain_means(default_run):
    """The last lines a newcomer reads: the registered version's folder and how to export it, and that the tiny
    demo model's gain means nothing, with the command that measures the gain and its last measured figure."""
    from sfm.ops.pipeline import QUALITY_COMMAND, QUALITY_GAINS

    ends = [line for line in default_run["stdout"].splitlines() if "/end/" in line]  # the end step's lines
    tail = [line for line in ends if "Task finished successfully" not in line][-3:]  # without Metaflow's own
    version_dir = Path(default_run["view"]["root"]) / "registry" / "sfm-mae" / "v1"
    assert any(f"registered sfm-mae v1 (champion) at {version_dir}" in line
               and "sfm registry export sfm-mae:v1 DIR" in line for line in tail), tail
    assert "tiny model is too small for pretraining to help" in tail[-1] and tail[-1].endswith(QUALITY_COMMAND)
    assert all(f"{gain} at {n} labelled volume" in tail[-1] for n, gain in QUALITY_GAINS.items()), tail[-1]


def test_the_demo_points_to_the_gain_the_report_holds():
    """The figure the demo's last line quotes is the quality table's current fine-tuned gain (BENCHMARKS.md)."""
    from sfm.ops.pipeline import QUALITY_GAINS

    report = (Path(__file__).resolve().parents[2] / "BENCHMARKS.md").read_text()
    for n, gain in QUALITY_GAINS.items():
        row = "fine-tuned AP gain at 1 labelled volume" if n == 1 else f"the same at {n} volumes"
        line = next(line for line in report.splitlines() if line.startswith(f"| {row}"))
        assert line.split("|")[2].strip().startswith(gain), (line, gain)
