"""The fine-tuning mechanics (sfm.finetune): labelled crops that keep amplitude and labels together, held-out
lines, the loss over labelled voxels only, and the held-out scores."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from sfm.config import JobConfig
from sfm.errors import SFMError
from sfm.finetune import loop, samples, scores
from sfm.ingest.labels import ingest_labels, ingest_pairs
from sfm.ingest.survey import ingest_survey
from sfm.synth.survey import write_segy

SHAPE = (40, 36, 48)
CROP = (16, 16, 16)


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    """A survey whose labels are its own amplitude above 0.5 (class 1), on every 8th inline only."""
    tmp = tmp_path_factory.mktemp("finetune")
    amplitude = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    write_segy(tmp / "s.sgy", amplitude)
    root = str(tmp / "root")
    row = ingest_survey(str(tmp / "s.sgy"), root, chunk=16)
    labels = np.full(SHAPE, 255, np.uint8)
    labels[::8] = amplitude[::8] > 0.5
    np.save(tmp / "l.npy", labels)
    label_row = ingest_labels(str(tmp / "l.npy"), row["survey_id"], root)
    cfg = JobConfig.from_toml(None, ["finetune.batch_size=8"])
    data = samples.finetune_data(cfg, CROP)
    return samples.LabelledSurveys([(row["store_url"], label_row["store_url"])], data), amplitude, labels


def test_crops_are_drawn_where_labels_are_and_carry_them_in_every_orientation(labelled):
    surveys, _, labels = labelled
    info = surveys.surveys[0]
    threshold = (0.5 - info.mean) / info.std  # what 0.5 becomes once the survey is normalised
    crops = samples.LabelledCrops(surveys, [surveys.masks[0]])
    seen = set()
    for step in range(12):
        imgs, got = crops.batch(step)
        for n in range(len(got)):
            c = crops.plan.locate(0, step * 8 + n)
            seen.add((c.flip_inline, c.flip_crossline, c.swap, c.reverse_time, c.invert))
            labelled_voxels = got[n] != 255
            assert labelled_voxels.any()  # every crop holds some of the labels on every 8th inline
            amplitude = imgs[n, 0] * (-1 if c.invert else 1)
            assert np.array_equal(got[n][labelled_voxels], (amplitude > threshold)[labelled_voxels])
    assert len(seen) > 8  # the augmentations were drawn in many combinations
    crops.close()


def test_held_out_lines_are_the_far_end_of_the_labelled_ones(labelled):
    surveys, _, _ = labelled
    mask = surveys.masks[0]  # inlines 0, 8, 16, 24, 32
    test, validation = samples.split_lines(mask, (0.2, 0.2))
    assert np.flatnonzero(test.any(axis=1)).tolist() == [32] and np.flatnonzero(validation.any(axis=1)).tolist() == [24]
    split = samples.split_roles(surveys, ["train"], validation=0.2, held_out=0.2)
    assert np.flatnonzero(split.train[0].any(axis=1)).tolist() == [0, 8, 16]
    (part,) = split.test
    assert (part.axis, part.lo, part.hi) == (0, 32, 33)  # the held-out line
    read = surveys.read_part(part, overlap=0.5)
    assert read.labels.shape == (1, *SHAPE[1:]) and (read.labels != 255).all()  # only the held-out line is scored
    # the amplitude of every window that reaches it, on the whole survey's grid (windows at 0, 8, 16, 24 of 40)
    assert read.start == (24, 0, 0) and read.amplitude.shape == (SHAPE[0] - 24, *SHAPE[1:])
    assert read.grid.axes[0].starts == [0, 8, 16, 24] and read.box_amplitude().shape == (1, *SHAPE[1:])
    crosslines = np.zeros((12, 40), bool)
    crosslines[:, ::5] = True  # labels on every 5th crossline only: the crosslines are the lines
    (block,) = samples.split_lines(crosslines, (0.25,))
    assert samples.lines_axis(crosslines) == 1 and np.flatnonzero(block.any(axis=0)).tolist() == [30, 35]
    with pytest.raises(SFMError, match="leaves none to train on"):
        samples.split_lines(mask, (0.6, 0.4))


def test_the_loss_ignores_unlabelled_voxels_and_balances_the_classes():
    torch.manual_seed(0)
    labels = (torch.rand(2, 8, 8, 8) < 0.2).to(torch.uint8)
    logits = torch.randn(2, 1, 8, 8, 8)
    weights = loop.class_weights([0.8, 0.2])
    full = loop.masked_loss(logits, labels, weights, 255)
    # with every voxel labelled it is FaultSeg3D's balanced BCE
    assert full.item() == pytest.approx(loop.balanced_bce(logits[:, 0], labels.float(), 0.2).item(), rel=1e-5)
    hidden = labels.clone()
    hidden[:, :4] = 255
    changed = logits.clone()
    changed[:, :, :4] = 100.0  # nothing said about unlabelled voxels counts
    assert loop.masked_loss(changed, hidden, weights, 255).item() == pytest.approx(
        loop.masked_loss(logits, hidden, weights, 255).item())
    three = torch.randn(2, 3, 8, 8, 8, requires_grad=True)
    classes = torch.randint(0, 3, (2, 8, 8, 8))
    classes[0] = 255
    loss = loop.masked_loss(three, classes, loop.class_weights([0.5, 0.3, 0.2]), 255)
    loss.backward()
    assert three.grad[0].abs().sum() == 0 and three.grad[1].abs().sum() > 0  # the unlabelled sample teaches nothing


def test_held_out_scores_count_labelled_voxels_only_per_class():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, (4, 5, 6)).astype(np.uint8)
    perfect = np.stack([(labels == c).astype(np.float32) for c in range(3)])
    labels[0] = 255
    perfect[:, 0] = rng.random((3, 5, 6))  # anything where nothing is labelled
    got = scores.held_out_scores([perfect], [labels])
    assert got["ap"] == got["f1"] == got["iou"] == got["accuracy"] == 1.0
    assert set(got["per_class"]) == {"0", "1", "2"} and got["voxels"] == 3 * 5 * 6
    binary = (labels == 1).astype(np.uint8)
    binary[0] = 255
    probs = np.where(binary == 1, 0.9, 0.1).astype(np.float32)
    wrong = tuple(np.argwhere(binary == 0)[0])
    probs[wrong] = 0.95  # one false positive
    one = scores.held_out_scores([probs], [binary], threshold=0.5)
    positives = int((binary == 1).sum())
    assert one["f1"] == pytest.approx(2 * positives / (2 * positives + 1))
    assert one["iou"] == pytest.approx(positives / (positives + 1))
    assert scores.validation_score([probs], [binary]) == one["ap"] < 1.0


def test_a_classes_task_fine_tunes_from_random_init_and_scores_every_class(tmp_path, capsys):
    """The run's mechanics in one process (what each rank and the evaluate step do): three classes, held out by
    a fraction of the labelled lines, a grid of two rates of which the validation labels keep one, a model saved
    with its task and the prediction settings, scores per class; plain progress lines (stderr is not a terminal)
    with each phase's step count and loss."""
    from sfm.finetune import job as ftjob
    from sfm.finetune import run
    from sfm.synth.survey import synth_survey
    from sfm.model.segmenter import load_segmenter

    made = synth_survey(tmp_path / "s.sgy", shape=(40, 36, 48), seed=5)
    root = str(tmp_path / "root")
    ingest_survey(made["segy"], root, chunk=16)
    classes = np.broadcast_to((np.arange(36) * 3 // 36)[None, :, None], (40, 36, 48))  # thirds of the crosslines
    np.save(tmp_path / "classes.npy", classes.astype(np.uint8))
    cfg = JobConfig.from_toml(None, ["finetune.steps=2", "finetune.probe_steps=1", "finetune.batch_size=2",
                                     "finetune.validate_every=1", "finetune.lrs_random=[1e-3, 1e-2]",
                                     "train.threads_per_process=1"])
    pairs = ingest_pairs(run.plan_pairs(made["segy"], str(tmp_path / "classes.npy")), root, cfg.ingest)
    arms = run.resolve_arms("random", root, cfg)
    assert [(a.kind, a.crop, a.reference) for a in arms] == [("random", (32, 32, 32), "the config's [model]")]
    job = run.node_job(cfg, pairs, arms, "classes:3", str(tmp_path / "run"))
    summary = ftjob.finetune_runs(job)
    assert summary["steps"] == 2 and [s for s, _ in summary["validation"]] == [0, 1, 2]
    assert [r["lr"] for r in summary["runs"]] == [1e-3, 1e-2] and summary["rates"] == [1e-3, 1e-2]
    kept = max(summary["runs"], key=lambda r: r["validation_score"])
    assert summary["lr"] == kept["lr"] and summary["validation_score"] == kept["validation_score"]
    lines = capsys.readouterr().err.splitlines()
    for lr in ("0.001", "0.01"):
        name = f"fine-tune random seed 0 lr {lr}"
        assert any(line.startswith(f"{name}: linear probe: step 1/1 (100.0%), loss ") for line in lines), lines
        assert [line.split(",")[0] for line in lines if line.startswith(f"{name}: step")] == [
            f"{name}: step 1/2 (50.0%)", f"{name}: step 2/2 (100.0%)"]  # the first step, then the last at close
    net = load_segmenter(summary["model_url"])
    assert net.task.name == "classes:3" and net.meta["lineage"]["encoder"] == "random"
    assert net.meta["predict"] == {"overlap": 0.5, "mirror": False}  # what sfm predict runs it with by default
    metrics, figures = run.evaluate(job, summary)
    assert set(metrics["per_class"]) == {"0", "1", "2"} and "threshold" not in metrics
    assert metrics["lr"] == summary["lr"] and list(metrics["arms"]) == ["random"]
    assert figures["prediction"].shape[0] == 3 and figures["prediction"].shape[1:] == figures["labels"].shape
    with pytest.raises(SFMError, match="pass --task classes:3"):
        ftjob.finetune_runs(dataclasses.replace(job, task="binary"))


def test_a_fine_tuning_process_reports_a_bad_job_file_in_one_line(tmp_path, capsys):
    """``python -m sfm.finetune.job JOB.json`` (each rank the fine-tune launch starts): a user error in the job
    is one line and exit 2, as the pretraining processes' is; a wrong command line is its usage and exit 2."""
    from sfm.finetune import job as finetune_job

    bad = tmp_path / "job.json"
    bad.write_text('{"config": {"train": {"max_stepz": 3}}, "run_root": "%s"}' % (tmp_path / "run"))
    assert finetune_job.main([str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("sfm finetune: error: unknown config key 'train.max_stepz'"), err
    assert not (tmp_path / "run").exists()
    assert finetune_job.main([]) == 2
    assert capsys.readouterr().err.strip() == "usage: python -m sfm.finetune.job JOB.json"


def test_the_line_pictures_show_what_each_arm_picks_at_its_own_threshold():
    from sfm.finetune.card import PALETTE, SCALE, line_panels

    rng = np.random.default_rng(0)
    shape = (6, 5, 8)
    labels = np.full(shape, 255, np.uint8)
    labels[2] = rng.random(shape[1:]) > 0.7  # inline 2 is the only labelled line
    probs = {"pretrained": rng.random(shape).astype(np.float32), "unet": rng.random(shape).astype(np.float32)}
    figures = {"amplitude": rng.standard_normal(shape).astype(np.float32), "labels": labels, "axis": 0,
               "predictions": probs, "thresholds": {"pretrained": 0.8, "unet": 0.3}}
    panels = line_panels(figures)
    assert list(panels) == ["amplitude", "labels", "prediction (pretrained)", "picked (pretrained)",
                            "prediction (unet)", "picked (unet)"]
    red = (np.asarray(PALETTE[1]) * 255).round()
    for arm, threshold in figures["thresholds"].items():
        image = np.asarray(panels[f"picked ({arm})"])[::SCALE, ::SCALE].astype(float)  # one pixel per voxel
        assert image.shape[:2] == (shape[2], shape[1])  # time down
        shown = np.all(image == red, axis=-1)
        assert np.array_equal(shown, probs[arm][2].T >= threshold)
    # without thresholds (a classes task, or figures from before them) only the probabilities are drawn
    assert "picked (unet)" not in line_panels({**figures, "thresholds": {"unet": None}})
