"""The default `python flows/pretrain_flow.py run`: its evaluation card (loss curve, slices, metrics) and the
fault probe of the encoder it trained against a random one. One flow run serves every test here."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from flowrun import client_view, run_flow
from PIL import Image

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
    return {"env": env, "cwd": str(home), "pathspec": result.pathspec,
            "view": client_view(result.pathspec, env, cwd=str(home))}


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
    rows, slices = ("input", "masked input", "reconstruction"), ("inline", "crossline", "time")
    expected = {f"{row}: {name} slice" for row in rows for name in slices}
    assert expected <= set(images), sorted(images)
    loss = next(im for label, im in images.items() if label.startswith("training loss"))
    assert loss.size == (640, 320)
    d, h, w = default_run["view"]["metrics"]["crop"]
    scale = images["input: time slice"].width // h
    assert images["input: inline slice"].size == (h * scale, w * scale)  # crossline across, time down
    assert images["input: crossline slice"].size == (d * scale, w * scale)
    assert images["input: time slice"].size == (h * scale, d * scale)
    pixels = {label: im.convert("RGB").tobytes() for label, im in images.items()}
    assert len(set(pixels.values())) == len(pixels)  # masked input and reconstruction differ from the input
    masked = np.asarray(images["masked input: time slice"].convert("RGB"))
    assert (masked == 140).all(axis=-1).mean() > 0.3  # hidden patches are grey (0.55 of white)

    text = json.dumps([c for c in components if c["type"] != "image"])
    for needle in ("Training loss", "trilinear interpolation", "per-survey mean", "target NMSE", "voxel NMSE",
                   "Fault probe", "random encoder", f"{default_run['view']['metrics']['masked_nmse']:.4f}"):
        assert needle in text, needle


@pytest.mark.timeout(1800)
def test_default_run_metrics_against_every_baseline(default_run):
    m = default_run["view"]["metrics"]
    assert m["baseline_zero_nmse"] == pytest.approx(1.0, abs=1e-3)  # normalised patches: zero scores 1 exactly
    assert m["masked_nmse"] < m["baseline_zero_nmse"] < m["baseline_mean_nmse"]
    assert m["voxel_mean_nmse"] == pytest.approx(1.0, abs=0.05)  # the standardised survey mean is ~0
    for key in ("masked_psnr", "baseline_interp_nmse", "voxel_model_nmse", "voxel_interp_nmse", "voxel_model_psnr"):
        assert m[key] == m[key] and m[key] > 0, key  # present, finite, positive


@pytest.mark.timeout(1800)
def test_fault_probe_pretrained_against_random_after_the_default_training(default_run):
    """After the default demo's training the pretrained encoder does NOT beat the random one on the
    fault probe: it scores about 0.17 F1 lower (measured 0.494 vs 0.665 with the default 8/4 probe
    volumes). The gap narrows with training: 0.574 after 650 steps and 0.593 after 1,000 steps of the
    same demo (-0.09, -0.07; `--max-steps 1000`, 46 min on a busy 2-core machine).

    Why: the demo trains a tiny model for 200 CPU steps over ~1,600 crops of 32^3 (its held-out masked
    NMSE is ~0.87 against 1.0 for predicting zero); MAE pretraining is run for hundreds of epochs.
    A random ViT is close to a random projection of each patch, which keeps nearly all of its voxels'
    information, while a briefly trained encoder has begun to keep what reconstruction needs and to
    drop the rest. The numbers are printed on every run; should pretraining start to win here, the
    last assertion fails and this statement must become `gap > 0`.
    """
    m = default_run["view"]["metrics"]
    gap = m["probe_f1"] - m["probe_random_f1"]
    print(f"probe F1 pretrained {m['probe_f1']:.3f} random {m['probe_random_f1']:.3f} gap {gap:+.3f}; "
          f"IoU {m['probe_iou']:.3f} vs {m['probe_random_iou']:.3f}; all-positive F1 {m['probe_all_positive_f1']:.3f}")
    # the probe measures something: both encoders' features find faults far better than guessing
    assert m["probe_random_f1"] > m["probe_all_positive_f1"] + 0.15
    assert m["probe_f1"] > m["probe_all_positive_f1"] + 0.05
    assert m["probe_patches_test"] == 4 * 16 * 64 and 0.05 < m["probe_fault_prevalence"] < 0.5
    # the stated shortfall: behind the random encoder, by less than 0.3 F1
    assert -0.3 < gap < 0.0, gap
