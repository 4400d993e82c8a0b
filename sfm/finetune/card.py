"""The fine-tune flow's Metaflow card: the held-out scores, and a labelled line of the held-out survey with
its amplitude, its labels and the task model's prediction, drawn with Pillow (no plotting library): a 2D slice as a
blue-white-red image (:func:`colorize`), an RGB array as an image (:func:`picture`), both enlarged ``SCALE`` times with
square pixels; the evaluation's card (sfm.eval.card) draws with them too."""

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


def line_panels(figures: dict[str, Any]) -> dict[str, Image.Image]:
    """The held-out line with the most labels: amplitude (grey), labels, and the prediction (class 1's
    probability for a binary task, the most probable class otherwise)."""
    labels, axis = figures["labels"], figures["axis"]
    counts = (labels != LABEL_IGNORE).sum(axis=tuple(a for a in range(3) if a != axis))
    index = int(np.argmax(counts))
    amplitude = section(figures["amplitude"], axis, index)
    clip = float(np.percentile(np.abs(amplitude), 98)) or 1.0
    gray = np.clip(amplitude / clip * 0.5 + 0.5, 0, 1)
    prediction = section(figures["prediction"], axis, index)
    predicted = colorize(prediction * 2 - 1, 1.0) if prediction.ndim == 2 else classes_image(prediction.argmax(axis=0))
    return {"amplitude": picture(np.stack([gray] * 3, axis=-1)), "labels": classes_image(section(labels, axis, index)),
            "prediction": predicted}


def finetune_components(metrics: dict[str, Any], summary: dict[str, Any], figures: dict[str, Any],
                        lineage: dict[str, Any]) -> list:
    """Card components: what was fine-tuned from what, the held-out scores (per class for several), the
    validation scores early stopping chose from, and one held-out line."""
    from metaflow.cards import Image as CardImage
    from metaflow.cards import Markdown, Table

    task = figures["task"]
    components: list = [
        Markdown(f"# Fine-tuned `{task['kind'] if task['kind'] == 'binary' else 'classes:%d' % task['classes']}` "
                 f"segmentation ({task['head']} head) from encoder `{lineage['encoder']}`\n\n"
                 f"{summary['probe_steps']} head-only steps, then {summary['steps']} fine-tuning steps on "
                 f"{summary['world_size']} rank(s); early stopping kept step {summary['chosen_step']}."),
        Markdown("## Held-out labels\n\nOnly labelled voxels count. F1 / IoU at the threshold chosen on "
                 f"{metrics['threshold_chosen_on']}." if "threshold" in metrics else "## Held-out labels"),
    ]
    rows = [["all", f"{metrics['ap']:.4f}", f"{metrics['f1']:.4f}", f"{metrics['iou']:.4f}", str(metrics["voxels"])]]
    rows += [[f"class {c}", f"{s['ap']:.4f}", f"{s['f1']:.4f}", f"{s['iou']:.4f}", str(s["voxels"])]
             for c, s in (metrics.get("per_class") or {}).items()]
    components.append(Table(rows, headers=["", "AP", "F1", "IoU", "labelled voxels"]))
    if summary["validation"]:
        components.append(Markdown("## Early stopping"))
        components.append(Table([[str(step), f"{score:.4f}"] for step, score in summary["validation"]],
                                headers=["step", "validation score"]))
    panels = line_panels(figures)
    components.append(Markdown(f"## A held-out line of `{figures['survey']}`\n\nThe {'inline' if figures['axis'] == 0 else 'crossline'} "
                               "with the most held-out labels; grey in the labels: not interpreted."))
    components.append(Table([[CardImage.from_pil_image(im, label=name) for name, im in panels.items()]],
                            headers=list(panels)))
    return components
