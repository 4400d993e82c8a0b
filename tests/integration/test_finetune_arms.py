"""Fine-tuning's arms and what ships (sfm.finetune.run's steps in one process, ``sfm predict`` as users run it):
the pretrained encoder, random initialisation of its architecture and a U-Net from scratch, built alike and compared
on paired seeds; the registered held-out score is the score of what ``sfm predict`` writes; ``sfm predict`` takes a
SEG-Y it has not seen. Mechanics only: which arm wins is benchmarks/finetune.py's question."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.encoders import register_tiny_encoder

from sfm.config import JobConfig
from sfm.errors import SFMError
from sfm.model import registry

pytestmark = pytest.mark.long(1)

SHAPE = (40, 40, 64)
FAST = ["finetune.steps=4", "finetune.probe_steps=2", "finetune.validate_every=2", "finetune.batch_size=2",
        "finetune.lrs=[0.001]", "finetune.lrs_random=[0.001]", "finetune.lrs_unet=[0.001, 0.003]",
        "train.threads_per_process=1"]


def sfm(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "METAFLOW_USER": "sfm-test", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "sfm.cli", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """A registered tiny encoder (sfm-mae v1, the champion), then --compare's steps: the three arms fine-tuned on a
    generated survey's fault labels (every 4th inline), validated on a fraction of those lines, scored on a second
    survey, the best registered as sfm-faults v1."""
    from sfm.finetune import job as ftjob
    from sfm.finetune import run
    from sfm.ingest.labels import ingest_pairs
    from sfm.synth.survey import synth_survey

    home = tmp_path_factory.mktemp("arms")
    train, held = synth_survey(home / "train.sgy", shape=SHAPE, seed=11), synth_survey(home / "held.sgy", shape=SHAPE,
                                                                                      seed=12)
    sparse = np.load(train["faults"]).astype(np.uint8)
    sparse[np.arange(SHAPE[0]) % 4 != 0] = 255  # labels on every 4th inline
    np.save(home / "train-labels.npy", sparse)
    root = str(home / "data")
    register_tiny_encoder(home / "encoder", root)
    cfg = JobConfig.from_toml(None, FAST)
    cfg.validate()
    pairs = ingest_pairs(run.plan_pairs(train["segy"], str(home / "train-labels.npy"), held["segy"], held["faults"]),
                         root, cfg.ingest)
    arms = run.resolve_arms("champion", root, cfg, compare=True)
    job = run.node_job(cfg, pairs, arms, "binary", str(home / "run"))
    summary = ftjob.finetune_runs(job)
    metrics, figures = run.evaluate(job, summary)
    record = run.register(root, "faults", job, summary, metrics, "FinetuneFlow/1")
    return {"home": home, "root": root, "cfg": cfg, "job": job, "summary": summary, "metrics": metrics,
            "figures": figures, "record": record, "pairs": pairs, "held": held}


def test_the_arms_are_built_alike_and_fine_tuned_on_the_same_crops(compared):
    job, summary = compared["job"], compared["summary"]
    pretrained, random, unet = job.arms
    assert [a.kind for a in job.arms] == ["pretrained", "random", "unet"]
    assert pretrained.encoder == "sfm-mae:v1" and random.reference == unet.reference == "sfm-mae:v1"
    assert pretrained.crop == random.crop == unet.crop == (32, 32, 32)  # the encoder's crop for every arm
    from sfm.model import load

    assert random.model == load(pretrained.url).cfg.to_dict()  # the same architecture, randomly initialised
    runs = {(r["arm"], r["lr"]) for r in summary["runs"]}
    assert runs == {("pretrained", 1e-3), ("random", 1e-3), ("unet", 1e-3), ("unet", 3e-3)}  # each arm its grid
    assert [r["probe_steps"] for r in summary["runs"]] == [2, 2, 0, 0]  # LP-FT for an encoder; the U-Net whole
    nets = {k["arm"]: registry_net(k["model_url"]) for k in summary["kept"]}
    assert nets["unet"].mae is None and nets["unet"].task.head == "unet" and nets["unet"].crop == unet.crop
    assert nets["random"].task.head == nets["pretrained"].task.head == compared["cfg"].finetune.head == "unetr"
    best = max(summary["kept"], key=lambda k: k["validation_score"])
    assert summary["model_url"] == best["model_url"]  # registered: the best on the validation labels


def registry_net(url: str):
    from sfm.model.segmenter import load_segmenter

    return load_segmenter(url)


def test_the_compare_output_shows_every_arm_with_its_spread_and_the_registered_version_records_it(compared):
    from sfm.finetune import run
    from sfm.finetune.card import finetune_components

    metrics, record = compared["metrics"], compared["record"]
    assert list(metrics["arms"]) == ["pretrained", "random", "unet"]
    for arm in metrics["arms"].values():
        assert arm["seeds"] == [0] and {"ap", "f1", "f1_tol2", "iou", "seconds"} <= set(arm)
        assert all(arm[k]["sd"] == 0.0 for k in ("ap", "f1_tol2"))  # one seed: no spread
    table = run.compare_table(metrics)
    assert [line.split()[0] for line in table.splitlines()] == ["pretrained", "random", "unet"]
    assert all("f1_tol2 " in line and " +- " in line for line in table.splitlines())
    assert set(metrics) >= {"ap_pretrained_minus_random", "ap_pretrained_minus_unet", "f1_tol2", "runs"}
    chosen = record["lineage"]["chosen"]
    assert [(c["arm"], c["rates"]) for c in chosen] == [("pretrained", [1e-3]), ("random", [1e-3]),
                                                        ("unet", [1e-3, 3e-3])]
    assert record["metrics"]["arms"] == metrics["arms"] and record["lineage"]["arm"] == compared["summary"]["arm"]
    components = finetune_components(metrics, compared["summary"], compared["figures"])
    text = json.dumps([getattr(c, "_data", None) or getattr(c, "_text", "") for c in components], default=str,
                      ensure_ascii=False)
    assert all(arm in text for arm in ("pretrained", "random", "unet")) and "±" in text
    card = registry.RegisteredModel(compared["root"], "sfm-faults").folder(1)["README.md"].decode()  # the model card
    assert "## Against the baselines" in card and all(f"| {arm} | 1 |" in card for arm in ("pretrained", "unet"))


def test_the_registered_held_out_score_is_the_score_of_what_sfm_predict_writes(compared, tmp_path):
    """``sfm predict`` over the whole held-out survey with the registered model (its own overlap and mirroring),
    scored against the held-out labels by the same scorer at the registered threshold: the registered figures."""
    import zarr

    from sfm.finetune.scores import held_out_scores

    home, root, metrics = compared["home"], compared["root"], compared["record"]["metrics"]
    held = next(p for p in compared["pairs"] if p["role"] == "test")
    proc = sfm("predict", "--model", "sfm-faults", "--survey", held["survey_id"], "--out", str(tmp_path / "pred"),
               "--data-root", root, cwd=home)
    assert proc.returncode == 0, proc.stderr[-3000:]
    probability = np.asarray(zarr.open_group(str(tmp_path / "pred"), mode="r")["probability"][...])
    labels = np.load(compared["held"]["faults"]).astype(np.uint8)
    again = held_out_scores([probability], [labels], metrics["threshold"])
    for key in ("ap", "f1", "f1_tol2", "iou", "voxels"):
        assert again[key] == pytest.approx(metrics[key], abs=1e-5), key


def test_classes_of_a_binary_model_are_picked_at_the_threshold_its_f1_was_scored_at(compared, tmp_path):
    """The registered model records the threshold its held-out F1 used (chosen on the validation labels), and
    ``sfm predict --output classes`` marks faults from it, not from 0.5 (class-balanced training puts most of a
    fault block above 0.5); ``--threshold`` overrides it; the store says which it used."""
    import zarr

    home, root, metrics = compared["home"], compared["root"], compared["record"]["metrics"]
    folder = registry.RegisteredModel(root, "sfm-faults").folder(1)
    assert json.loads(folder["config.json"])["predict"]["threshold"] == metrics["threshold"]
    held = next(p for p in compared["pairs"] if p["role"] == "test")
    common = ["--model", "sfm-faults", "--survey", held["survey_id"], "--data-root", root]
    outputs = {}
    for name, extra in (("probability", []), ("classes", ["--output", "classes"]),
                        ("classes-0.5", ["--output", "classes", "--threshold", "0.5"])):
        proc = sfm("predict", *common, "--out", str(tmp_path / name), *extra, cwd=home)
        assert proc.returncode == 0, proc.stderr[-3000:]
        group = zarr.open_group(str(tmp_path / name), mode="r")
        outputs[name] = (np.asarray(group[name.split("-")[0]][...]), group.attrs["prediction"])
    probability = outputs["probability"][0]
    for name, threshold in (("classes", metrics["threshold"]), ("classes-0.5", 0.5)):
        classes, attrs = outputs[name]
        assert attrs["threshold"] == pytest.approx(threshold)
        assert np.array_equal(classes, (probability >= threshold).astype(np.uint8)), name


def test_sfm_predict_ingests_a_segy_it_has_not_seen_and_writes_the_prediction(compared, tmp_path):
    from sfm.formats import manifest
    from sfm.synth.survey import synth_survey

    home, root = compared["home"], compared["root"]
    made = synth_survey(tmp_path / "new.sgy", shape=(36, 44, 64), seed=21)
    before = set(manifest.read(root)["survey_id"])
    proc = sfm("predict", "--model", "sfm-faults:v1", "--survey", made["segy"], "--out", str(tmp_path / "pred"),
               "--data-root", root, cwd=home)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (new,) = [r for r in manifest.read(root).to_dict("records") if r["survey_id"] not in before]  # ingested first
    assert f"sfm predict: survey {new['survey_id']} (" in proc.stderr and new["store_url"] in proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["published"] and result["out"] == str(tmp_path / "pred")
    import zarr

    assert zarr.open_group(str(tmp_path / "pred"), mode="r")["probability"].shape == (36, 44, 64)
    missing = sfm("predict", "--model", "sfm-faults", "--survey", str(tmp_path / "nothing.sgy"), "--out",
                  str(tmp_path / "other"), "--data-root", root, cwd=home)
    assert missing.returncode != 0 and missing.stderr.strip().count("\n") == 0
    assert "--survey" in missing.stderr and "nothing there" in missing.stderr


def test_a_baseline_takes_the_champions_architecture_and_refuses_a_config_that_contradicts_it(compared):
    from sfm.finetune import run

    root, cfg = compared["root"], compared["cfg"]
    (random,) = run.resolve_arms("random", root, cfg)
    (unet,) = run.resolve_arms("unet", root, cfg, baseline_of="sfm-mae:v1")
    assert random.reference == unet.reference == "sfm-mae:v1" and random.crop == unet.crop == (32, 32, 32)
    mini = JobConfig.from_toml(None, FAST + ["model.preset=mini", "data.crop=[32, 32, 64]"])
    with pytest.raises(SFMError, match=r"contradict the baseline's architecture, sfm-mae:v1's \(crop \[32, 32, 32\]"):
        run.resolve_arms("random", root, mini)
    with pytest.raises(SFMError, match="--compare runs an encoder's arm"):
        run.resolve_arms("unet", root, cfg, compare=True)
    tiny = JobConfig.from_toml(None, FAST + ["model.preset=tiny", "data.crop=[32, 32, 32]"])
    assert run.resolve_arms("random", root, tiny)[0].model == random.model  # agreeing is not contradicting
