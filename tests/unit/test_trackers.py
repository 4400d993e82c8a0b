"""The experiment trackers (sfm.train.trackers): ``[train] trackers`` takes Accelerate's tracker names and refuses
others in one line; the folder copy brings grown files up to date and leaves unchanged ones alone; fine-tuning
logs its losses, validation and held-out scores to TensorBoard under the run root and to MLflow."""

from __future__ import annotations

import importlib.util
import os
import tempfile

import numpy as np
import pytest

from sfm.config import TRACKERS, JobConfig
from sfm.errors import SFMError


def test_the_tracker_names_are_accelerates_and_a_bad_one_is_refused_in_one_line():
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    assert set(TRACKERS) == set(LOGGER_TYPE_TO_CLASS)  # a tracker Accelerate adds is named here too
    assert JobConfig().train.trackers == ("tensorboard",)
    cfg = JobConfig.from_toml(None, ["train.trackers=mlflow"])  # one name: a list of one
    assert cfg.train.trackers == ("mlflow",)
    cfg.validate()
    with pytest.raises(SFMError) as err:
        JobConfig.from_toml(None, ['train.trackers=["tensorboard", "tensorbord"]']).validate()
    assert "'tensorbord' is not one of Accelerate's trackers" in str(err.value) and "\n" not in str(err.value)
    missing = [name for name, modules in TRACKERS.items() if not any(importlib.util.find_spec(m) for m in modules)]
    if missing:  # a tracker whose package is not here is refused before the run, not skipped by Accelerate
        with pytest.raises(SFMError, match=f"train.trackers: {missing[0]} is not installed here; pip install"):
            JobConfig.from_toml(None, [f"train.trackers={missing[0]}"]).validate()
    with pytest.raises(SFMError, match="train.tracker_sync_s = -1.0 must be >= 0"):
        JobConfig.from_toml(None, ["train.tracker_sync_s=-1"]).validate()


def test_the_folder_copy_appends_what_grew_and_leaves_the_rest(tmp_path):
    from sfm.train.trackers import FolderSync

    local, dest = tmp_path / "local", tmp_path / "run" / "tensorboard"
    (local / "proj").mkdir(parents=True)
    events = local / "proj" / "events.out.tfevents.1"
    events.write_bytes(b"a" * 100)
    sync = FolderSync(str(local), str(dest), every_s=0)  # no thread: copies on sync() and stop()
    assert sync.sync() == 1 and (dest / "proj" / events.name).read_bytes() == b"a" * 100
    inode = (dest / "proj" / events.name).stat().st_ino
    assert sync.sync() == 0  # nothing changed, nothing copied
    with open(events, "ab") as fh:
        fh.write(b"b" * 50)
    (local / "proj" / "hparams.yml").write_text("lr: 1")
    assert sync.stop() == 2
    copied = dest / "proj" / events.name
    assert copied.read_bytes() == b"a" * 100 + b"b" * 50 and copied.stat().st_ino == inode  # appended in place
    assert (dest / "proj" / "hparams.yml").read_text() == "lr: 1"
    assert sorted(p.name for p in (dest / "proj").iterdir()) == ["events.out.tfevents.1", "hparams.yml"]
    events.write_bytes(b"c" * 10)  # rewritten shorter: copied whole
    assert sync.sync() == 1 and copied.read_bytes() == b"c" * 10


def scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard shows for the event files of ``folder``, by tag: [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_fine_tuning_logs_its_losses_and_scores_to_tensorboard_and_mlflow(tmp_path, monkeypatch):
    """A fine-tune run in one process (what rank 0 and the flow's evaluate step do) with trackers tensorboard and
    mlflow (``registry.mlflow_uri``, a sqlite backend): each step's loss of the probe and of the fine-tuning, every
    validation score (each run of the arm's grid under its own name) and the held-out scores reach
    ``<run_root>/tensorboard/sfm-finetune/`` and one MLflow run."""
    from mlflow import MlflowClient

    from sfm.finetune import job as ftjob
    from sfm.finetune import run
    from sfm.ingest.labels import ingest_pairs
    from sfm.ingest.survey import ingest_survey
    from sfm.synth.survey import synth_survey

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    made = synth_survey(tmp_path / "s.sgy", shape=(40, 36, 48), seed=5)
    root = str(tmp_path / "root")
    ingest_survey(made["segy"], root, chunk=16)
    labels = np.broadcast_to((np.arange(36) >= 18)[None, :, None], (40, 36, 48)).astype(np.uint8)
    np.save(tmp_path / "labels.npy", labels)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = JobConfig.from_toml(None, ["finetune.steps=2", "finetune.probe_steps=1", "finetune.batch_size=2",
                                     "finetune.validate_every=1", "finetune.lrs_random=[1e-3, 1e-2]",
                                     "train.threads_per_process=1", 'train.trackers=["tensorboard", "mlflow"]',
                                     f"registry.mlflow_uri={uri}"])
    cfg.validate()
    pairs = ingest_pairs(run.plan_pairs(made["segy"], str(tmp_path / "labels.npy")), root, cfg.ingest)
    job = run.node_job(cfg, pairs, run.resolve_arms("random", root, cfg), "binary", str(tmp_path / "run"))
    summary = ftjob.finetune_runs(job)
    folder = tmp_path / "run" / "tensorboard" / "sfm-finetune"
    shown = scalars(folder)
    for one in summary["runs"]:
        tag = f"random/seed0/lr{one['lr']:g}"
        assert [s for s, _ in shown[f"{tag}/probe/loss"]] == [1]
        assert [s for s, _ in shown[f"{tag}/finetune/loss"]] == [1, 2]
        scores = shown[f"{tag}/finetune/validation_score"]
        assert [s for s, _ in scores] == [s for s, _ in one["validation"]] == [0, 1, 2]
        assert [v for _, v in scores] == pytest.approx([v for _, v in one["validation"]])
    metrics, _ = run.evaluate(job, summary)
    assert "MLFLOW_TRACKING_URI" not in os.environ  # the job's URI is not handed to what this process does next
    shown = scalars(folder)
    assert shown["held_out/ap"] == [(2, pytest.approx(metrics["ap"], rel=1e-6))]
    assert {"held_out/f1", "held_out/iou"} <= set(shown)
    assert not list(scratch.glob("sfm-tb-*"))  # the trackers' local folders went once copied

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("sfm-finetune").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"  # the held-out scores went to the run's own
    run_id = runs[0].info.run_id
    assert [m.step for m in client.get_metric_history(run_id, "random/seed0/lr0.001/finetune/loss")] == [1, 2]
    assert runs[0].data.metrics["held_out/ap"] == pytest.approx(metrics["ap"], rel=1e-6)
    assert runs[0].data.params["task"] == "binary" and runs[0].data.params["finetune.steps"] == "2"
    assert "registry.mlflow_uri" not in runs[0].data.params
