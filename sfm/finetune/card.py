"""The fine-tune flow's Metaflow card: every arm's held-out scores (mean ± sd over the seeds), and a labelled line
of the held-out survey with its amplitude, its labels and each arm's prediction, drawn with Pillow (no plotting
library): a 2D slice as a blue-white-red image (:func:`colorize`), an RGB array as an image (:func:`picture`), both
enlarged ``SCALE`` times with square pixels; the evaluation's card (sfm.eval.card) and benchmarks/finetune.py draw
with them too."""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from sfm.config import LABEL_IGNORE

SCALE = 4  # screen pixels per voxel in the slice images


def colorize(values: np.ndarray, clip: float, hidden: np.ndarray | None = None) -> Image.Image:
    """A 2D array [rows, cols] as a blue-white-red image (symmetric ``clip``); ``hidden`` voxels grey."""
    v = np.clip(np.nan_to_num(values) / max(clip, 1e-12), -1.0, 1.0)
    red = np.where(v > 0, 1.0, 1.0 + v)
    green = 1.0 - np.abs(v)
    blue = np.where(v < 0, 1.0, 1.0 - v)
    rgb = np.stack([red, green, blue], axis=-1)
    if hidden is not None:
        rgb[hidden] = 0.55
    img = Image.fromarray((rgb * 255).round().astype(np.uint8), mode="RGB")
    return img.resize((img.width * SCALE, img.height * SCALE), Image.NEAREST)


def picture(rgb: np.ndarray) -> Image.Image:
    """An RGB array [rows, cols, 3] of values in 0..1 as an image, enlarged as :func:`colorize` enlarges."""
    img = Image.fromarray((np.clip(rgb, 0, 1) * 255).round().astype(np.uint8), mode="RGB")
    return img.resize((img.width * SCALE, img.height * SCALE), Image.NEAREST)


PALETTE = np.array([(0.15, 0.15, 0.15), (0.95, 0.15, 0.1), (0.1, 0.45, 0.95), (0.1, 0.75, 0.2), (0.95, 0.75, 0.1),
                    (0.7, 0.2, 0.8), (0.1, 0.8, 0.8), (0.6, 0.4, 0.2)])  # class k: PALETTE[k % 8]
UNLABELLED = (0.82, 0.82, 0.82)


def section(volume: np.ndarray, axis: int, index: int) -> np.ndarray:
    """Line ``index`` along ``axis`` of [IL, XL, NS] (or of [C, IL, XL, NS]) with time down: [NS, n] or [C, NS, n]."""
    plane = np.take(volume, index, axis=axis + volume.ndim - 3)
    return np.swapaxes(plane, -1, -2)


def classes_image(classes: np.ndarray) -> Image.Image:
    """Integer classes [rows, cols] in the palette; 255 (not interpreted) light grey."""
    rgb = PALETTE[classes.astype(np.int64) % len(PALETTE)]
    rgb[classes == LABEL_IGNORE] = UNLABELLED
    return picture(rgb)


def picked(gray: np.ndarray, probability: np.ndarray, threshold: float) -> Image.Image:
    """What a binary model picks on a line: the grey amplitude [rows, cols] (0..1) with the voxels whose
    ``probability`` [rows, cols] reaches ``threshold`` (the model's own, chosen as its scores were) in red."""
    rgb = np.stack([gray] * 3, axis=-1)
    rgb[probability >= threshold] = PALETTE[1]
    return picture(rgb)


def line_panels(figures: dict[str, Any]) -> dict[str, Image.Image]:
    """The held-out line with the most labels (of those, the one with the most labels above class 0: a fault
    to see): amplitude (grey), labels, and each arm's prediction (class 1's probability for a binary task, the
    most probable class otherwise): ``prediction`` alone for one arm, ``prediction (ARM)`` for several. A binary
    arm with its threshold in ``figures["thresholds"]`` also shows what it picks there (:func:`picked`):
    ``picked`` / ``picked (ARM)``. A probability scaled 0..1 can look like a whole block under class-balanced
    training; the picked voxels are what its F1 scores."""
    labels, axis = figures["labels"], figures["axis"]
    across = tuple(a for a in range(3) if a != axis)
    labelled = (labels != LABEL_IGNORE).sum(axis=across)
    raised = ((labels != LABEL_IGNORE) & (labels > 0)).sum(axis=across)
    index = int(np.lexsort((raised, labelled))[-1])
    amplitude = section(figures["amplitude"], axis, index)
    clip = float(np.percentile(np.abs(amplitude), 98)) or 1.0
    gray = np.clip(amplitude / clip * 0.5 + 0.5, 0, 1)
    panels = {"amplitude": picture(np.stack([gray] * 3, axis=-1)),
              "labels": classes_image(section(labels, axis, index))}
    predictions = figures.get("predictions") or {"": figures["prediction"]}
    thresholds = figures.get("thresholds") or {}
    for arm, probs in predictions.items():
        prediction = section(probs, axis, index)
        name = "" if len(predictions) == 1 else f" ({arm})"
        image = colorize(prediction * 2 - 1, 1.0) if prediction.ndim == 2 else classes_image(prediction.argmax(axis=0))
        panels[f"prediction{name}"] = image
        if prediction.ndim == 2 and thresholds.get(arm) is not None:
            panels[f"picked{name}"] = picked(gray, prediction, thresholds[arm])
    return panels


def arms_table(metrics: dict[str, Any]) -> tuple[list[list[str]], list[str]]:
    """(rows, headers): each arm's held-out scores, mean +- sd over its seeds, with its rates and kept steps."""
    keys = [k for k in ("ap", "f1", "f1_tol2", "iou", "seconds") if all(k in a for a in metrics["arms"].values())]
    rows = [[arm, str(len(a["seeds"]))] + [f"{a[k]['mean']:.4f} ± {a[k]['sd']:.4f}" if k != "seconds" else
                                          f"{a[k]['mean']:.0f} ± {a[k]['sd']:.0f}" for k in keys]
            + [", ".join(f"{lr:g}" for lr in a["lr"]), ", ".join(map(str, a["chosen_step"]))]
            for arm, a in metrics["arms"].items()]
    names = {"ap": "AP", "f1": "F1", "f1_tol2": "F1 at 2 voxels", "iou": "IoU", "seconds": "seconds"}
    return rows, ["arm", "seeds"] + [names[k] for k in keys] + ["lr chosen", "step kept"]


def finetune_components(metrics: dict[str, Any], summary: dict[str, Any], figures: dict[str, Any]) -> list:
    """Card components: what was fine-tuned from what, every arm's held-out scores (mean ± sd over the seeds) and
    each run's, the registered model's per class for several, the validation scores its early stopping chose
    from, and one held-out line with each arm's prediction."""
    from metaflow.cards import Image as CardImage
    from metaflow.cards import Markdown, Table

    task = figures["task"]
    best = summary
    components: list = [
        Markdown(f"# Fine-tuned `{task['kind'] if task['kind'] == 'binary' else 'classes:%d' % task['classes']}` "
                 f"segmentation ({task['head']} head), the {best['arm']} arm, encoder `{best['encoder']}`\n\n"
                 f"Registered: the best of {len(summary['kept'])} arm/seed run(s) on the validation labels (seed "
                 f"{best['seed']}, peak rate {best['lr']:g} of {', '.join(f'{r:g}' for r in best['rates'])}): "
                 f"{best['probe_steps']} head-only steps, then up to {best['steps']} fine-tuning steps "
                 f"({best['steps_run']} run) on {summary['world_size']} rank(s); early stopping kept step "
                 f"{best['chosen_step']}."),
        Markdown("## Every arm on the held-out labels\n\nMean ± sd over the paired seeds (each arm of a seed on the "
                 "same crops), each at the rate its validation labels chose. Only labelled voxels count"
                 + (f"; F1 and F1 at a 2-voxel tolerance at the threshold chosen on {metrics['threshold_chosen_on']}."
                    if "threshold" in metrics else ".")),
    ]
    rows, headers = arms_table(metrics)
    components.append(Table(rows, headers=headers))
    margin = [f"{k.replace('ap_pretrained_minus_', 'pretrained - ')}: {metrics[k]:+.4f}" for k in
              ("ap_pretrained_minus_random", "ap_pretrained_minus_unet") if k in metrics]
    if margin:
        components.append(Markdown("Held-out AP, paired by seed: " + "; ".join(margin) + "."))
    figure = lambda value: "-" if value is None else f"{value:.4f}"  # noqa: E731
    components.append(Table([[r["arm"], str(r["seed"]), f"{r['lr']:g}", f"{r['chosen_step']} / {r['steps_run']}",
                              figure(r["validation_score"]), figure(r["ap"]), figure(r["f1"]), figure(r.get("f1_tol2")),
                              figure(r["iou"]), f"{r['seconds']:.0f}"] for r in metrics["runs"]],
                            headers=["arm", "seed", "lr", "step kept / run", "validation", "AP", "F1", "F1 at 2 voxels",
                                     "IoU", "seconds"]))
    if metrics.get("per_class"):
        components.append(Markdown("## The registered model, per class"))
        components.append(Table([[f"class {c}", f"{s['ap']:.4f}", f"{s['f1']:.4f}", f"{s['iou']:.4f}", str(s["voxels"])]
                                 for c, s in metrics["per_class"].items()],
                                headers=["", "AP", "F1", "IoU", "labelled voxels"]))
    if summary["validation"]:
        components.append(Markdown("## Early stopping of the registered model"))
        components.append(Table([[str(step), f"{score:.4f}"] for step, score in summary["validation"]],
                                headers=["step", "validation score"]))
    panels = line_panels(figures)
    components.append(Markdown(f"## A held-out line of `{figures['survey']}`\n\nThe "
                               f"{'inline' if figures['axis'] == 0 else 'crossline'} with the most held-out labels; "
                               "grey in the labels: not interpreted."))
    components.append(Table([[CardImage.from_pil_image(im, label=name) for name, im in panels.items()]],
                            headers=list(panels)))
    return components
