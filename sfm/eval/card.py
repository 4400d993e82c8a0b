"""The evaluation report as a Metaflow card: loss curve, reconstruction, downstream value, tables.

Images are drawn with Pillow (no plotting library needed):

- the training loss against the step;
- the first held-out evaluation crop (the one :func:`sfm.eval.reconstruction.evaluate_model` scores first, handed
  over by it, not recomputed): inline, crossline and time slices of the input, of the masked input
  (hidden patches grey), of the target (every patch normalised, the loss's space) and of the
  reconstruction in that space (hidden patches predicted by the model);
- the label-efficiency plot of the downstream evaluation (average precision of fault voxels against
  the number of labelled volumes, pretrained and random initialisation, every seed) and one test
  volume's inline with its true faults and both fine-tuned networks' predictions;
- the tables: reconstruction against the baselines, fine-tuning and frozen probes per budget.

:func:`evaluation_components` returns the card components; the flow appends them to its card.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from sfm.finetune.card import colorize

SLICES = ("inline", "crossline", "time")


def slices(volume: np.ndarray) -> dict[str, np.ndarray]:
    """Middle slices of [IL, XL, T]: inline (time down, crossline across), crossline, time slice (IL x XL)."""
    i, j, k = (n // 2 for n in volume.shape)
    return {"inline": volume[i].T, "crossline": volume[:, j].T, "time": volume[:, :, k]}


def loss_curve(history: list[dict[str, Any]], size: tuple[int, int] = (640, 320)) -> Image.Image:
    """Training loss against step as a line plot with labelled axes."""
    width, height = size
    left, right, top, bottom = 60, 15, 20, 40
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    history = [h for h in history if h.get("loss") is not None]  # skipped non-finite steps have none
    steps = np.array([h["step"] for h in history], dtype=float)
    losses = np.array([h["loss"] for h in history], dtype=float)
    draw.rectangle([left, top, width - right, height - bottom], outline="black")
    draw.text((width // 2 - 30, height - 18), "step", fill="black")
    draw.text((5, top - 15), "loss", fill="black")
    if len(steps) == 0:
        draw.text((left + 10, height // 2), "no loss history", fill="black")
        return img
    lo, hi = float(losses.min()), float(losses.max())
    hi = hi if hi > lo else lo + 1.0
    s0, s1 = float(steps.min()), float(steps.max())
    s1 = s1 if s1 > s0 else s0 + 1.0

    def xy(step: float, loss: float) -> tuple[float, float]:
        x = left + (step - s0) / (s1 - s0) * (width - left - right)
        y = height - bottom - (loss - lo) / (hi - lo) * (height - top - bottom)
        return x, y

    for frac in (0.0, 0.5, 1.0):
        value = lo + frac * (hi - lo)
        _, y = xy(s0, value)
        draw.text((5, y - 6), f"{value:.3f}", fill="black")
        step = s0 + frac * (s1 - s0)
        x, _ = xy(step, lo)
        draw.text((x - 10, height - bottom + 4), f"{step:.0f}", fill="black")
    points = [xy(s, v) for s, v in zip(steps, losses)]
    if len(points) == 1:
        points = points * 2
    draw.line(points, fill=(200, 30, 30), width=2)
    return img


def reconstruction_panels(example: dict[str, np.ndarray]) -> dict[str, dict[str, Image.Image]]:
    """{"input" | "masked input" | "target" | "reconstruction": {slice name: image}} for the crop
    ``example`` (filled by :func:`sfm.eval.reconstruction.evaluate_model`)."""
    x, vis = example["input"], example["visible"]
    clip = float(np.percentile(np.abs(x), 98)) or 1.0
    clip_t = float(np.percentile(np.abs(example["target"]), 98)) or 1.0
    rows = {"input": (x, None, clip), "masked input": (x, ~vis, clip), "target": (example["target"], None, clip_t),
            "reconstruction": (example["prediction"], None, clip_t)}
    return {row: {name: colorize(plane, c, None if hidden is None else slices(hidden)[name])
                  for name, plane in slices(values).items()}
            for row, (values, hidden, c) in rows.items()}


PLOT_COLOURS = {"pretrained": (200, 30, 30), "random": (40, 70, 200)}


def label_efficiency_plot(downstream: dict[str, Any], size: tuple[int, int] = (640, 360)) -> Image.Image:
    """Average precision of fault voxels against labelled volumes (log axis), both initialisations:
    a line through the seed means and a dot per seed."""
    width, height = size
    left, right, top, bottom = 60, 140, 20, 40
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    budgets = sorted(int(b) for b in downstream["budgets"])
    runs = {init: [[r["ap"] for r in downstream["budgets"][str(b)][f"ft_{init}"]] for b in budgets]
            for init in PLOT_COLOURS}
    values = [v for per in runs.values() for seeds in per for v in seeds]
    lo, hi = min(values + [0.0]), max(values + [0.01])
    hi = hi + 0.05 * (hi - lo)
    span = math.log(budgets[-1] / budgets[0]) if len(budgets) > 1 else 1.0

    def xy(budget: float, ap: float) -> tuple[float, float]:
        frac = math.log(budget / budgets[0]) / span if len(budgets) > 1 else 0.5
        return (left + frac * (width - left - right), height - bottom - (ap - lo) / (hi - lo) * (height - top - bottom))

    draw.rectangle([left, top, width - right, height - bottom], outline="black")
    draw.text((left + (width - left - right) // 2 - 50, height - 18), "labelled volumes", fill="black")
    draw.text((5, top - 15), "AP (fault voxels)", fill="black")
    for frac in (0.0, 0.5, 1.0):
        value = lo + frac * (hi - lo)
        draw.text((5, xy(budgets[0], value)[1] - 6), f"{value:.3f}", fill="black")
    for b in budgets:
        draw.text((xy(b, lo)[0] - 4, height - bottom + 4), str(b), fill="black")
    for k, (init, colour) in enumerate(PLOT_COLOURS.items()):
        means = [xy(b, float(np.mean(seeds))) for b, seeds in zip(budgets, runs[init])]
        if len(means) > 1:
            draw.line(means, fill=colour, width=2)
        for b, seeds in zip(budgets, runs[init]):
            for v in seeds:
                cx, cy = xy(b, v)
                draw.ellipse([cx - 3, cy - 3, cx + 3, cy + 3], outline=colour)
        draw.line([width - right + 10, top + 10 + 18 * k, width - right + 30, top + 10 + 18 * k], fill=colour, width=2)
        draw.text((width - right + 35, top + 4 + 18 * k), init, fill="black")
    return img


def fault_panels(example: dict[str, Any]) -> dict[str, Image.Image]:
    """The inline of a test volume that most faults cross: amplitude, with true faults, and each
    network's prediction."""
    i = int(np.argmax(example["faults"].reshape(example["faults"].shape[0], -1).sum(axis=1)))
    amplitude = example["amplitude"][i].T
    clip = float(np.percentile(np.abs(amplitude), 98)) or 1.0
    gray = np.clip(amplitude / clip * 0.5 + 0.5, 0, 1)

    def overlay(mask: np.ndarray) -> Image.Image:
        rgb = np.stack([gray, gray, gray], axis=-1)
        rgb[mask] = (1.0, 0.1, 0.1)
        out = Image.fromarray((rgb * 255).round().astype(np.uint8), mode="RGB")
        return out.resize((out.width * 2, out.height * 2), Image.NEAREST)

    panels = {"amplitude": overlay(np.zeros_like(gray, bool)), "true faults": overlay(example["faults"][i].T > 0)}
    for init in PLOT_COLOURS:
        if init in example:
            panels[f"{init}: fault probability"] = colorize(example[init][i].T * 2 - 1, 1.0)
    return panels


def downstream_table(metrics: dict[str, Any]) -> list[list[str]]:
    """Rows per budget: fine-tuned AP (pretrained, random, gain, every seed), F1 and IoU, frozen probes' AP,
    and the fine-tuning step early stopping kept for each seed."""
    rows = []
    for b in metrics["downstream"]["recipe"]["budgets"]:
        row = [str(b), f"{metrics[f'ft_ap_b{b}']:.4f}", f"{metrics[f'ft_ap_random_b{b}']:.4f}",
               f"{metrics[f'ft_ap_gain_b{b}']:+.4f}", "yes" if metrics[f"ft_all_seeds_gain_b{b}"] else "no",
               f"{metrics[f'ft_f1_b{b}']:.3f} / {metrics[f'ft_f1_random_b{b}']:.3f}",
               f"{metrics[f'ft_iou_b{b}']:.3f} / {metrics[f'ft_iou_random_b{b}']:.3f}"]
        for kind in ("linear", "knn"):
            key = f"{kind}_ap_b{b}"
            row.append(f"{metrics[key]:.4f} / {metrics[f'{kind}_ap_random_b{b}']:.4f}" if key in metrics else "-")
        runs = metrics["downstream"]["budgets"][str(b)]
        kept = [[f"{r.get('steps')}" + (f" at {r['lr']:g}" if "lr" in r else "") for r in runs[f"ft_{init}"]]
                for init in ("pretrained", "random")]
        row.append(" / ".join(",".join(steps) for steps in kept))
        rows.append(row)
    return rows


def evaluation_components(model_url: str, held_out_stores: list[str], train_summary: dict[str, Any],
                          metrics: dict[str, Any], figures: dict[str, dict]) -> list:
    """Metaflow card components: title, loss curve, the slices, the downstream plot and the tables.
    ``figures``: {"reconstruction": evaluate_model's example, "faults": evaluate_downstream's example}."""
    from metaflow.cards import Image as CardImage
    from metaflow.cards import Markdown, Table

    from sfm.eval.reconstruction import metrics_table

    history = train_summary.get("history") or []
    components: list = [
        Markdown(f"# Evaluation of `{model_url}`\n\n{train_summary.get('steps', '?')} training steps; "
                 f"held-out surveys: {', '.join(held_out_stores)}"),
        Markdown("## Training loss"),
        CardImage.from_pil_image(loss_curve(history), label="training loss (masked-patch MSE, normalised patches)"),
        Markdown("## One held-out crop\n\nMiddle inline, crossline and time slices of the first evaluation crop. "
                 "Grey: hidden patches. Target and reconstruction are in the loss's space (every patch "
                 "normalised); the reconstruction shows the model's prediction on hidden patches."),
    ]
    panels = reconstruction_panels(figures["reconstruction"])
    rows = [[Markdown(f"**{row}**")] + [CardImage.from_pil_image(images[name], label=f"{row}: {name} slice")
                                        for name in SLICES] for row, images in panels.items()]
    components.append(Table(rows, headers=["", *[f"{name} slice" for name in SLICES]]))
    components.append(Markdown("## Masked-patch reconstruction (held-out surveys)\n\nNMSE: lower is better, "
                               "in the loss's space (every patch normalised)."))
    components.append(Table(metrics_table(metrics), headers=["predictor", "NMSE", "PSNR dB"]))
    if "downstream" in metrics:
        separate = metrics["downstream"].get("validation_volumes", 0)
        stopping = (f"{separate} separate labelled volume{'s' if separate > 1 else ''}" if separate else
                    "the held-out last part of each labelled volume's inlines")
        recipe = metrics["downstream"].get("recipe", {}).get("finetune", {})
        grid = lambda key: ", ".join(f"{r:g}" for r in recipe[key])  # noqa: E731
        rates = (f" Peak fine-tuning rates tried, the one the validation labels prefer kept per run: pretrained "
                 f"{grid('lrs')}, random {grid('lrs_random')}." if "lrs" in recipe else "")
        components.append(Markdown(
            "## Downstream: fault segmentation fine-tuned from the pretrained encoder and from random "
            "initialisation\n\nAverage precision of fault voxels on held-out labelled volumes (higher is better), "
            "per number of labelled training volumes; every seed is a dot. F1 / IoU at the threshold chosen on "
            "the training volumes. Frozen probes: linear head / kNN on the frozen tokens, pretrained / random. "
            f"Both inits stop early on {stopping} (steps kept per seed).{rates}"))
        components.append(CardImage.from_pil_image(label_efficiency_plot(metrics["downstream"]),
                                                   label="label efficiency: AP against labelled volumes"))
        components.append(Table(downstream_table(metrics), headers=[
            "labelled volumes", "AP pretrained", "AP random", "gain", "every seed gained", "F1 pre / rnd",
            "IoU pre / rnd", "linear probe AP pre / rnd", "kNN AP pre / rnd", "steps kept (at lr) pre / rnd"]))
        if figures.get("faults"):
            faults = figures["faults"]
            components.append(Markdown(f"### One test volume (middle inline), fine-tuned on {faults['budget']} "
                                       "labelled volume(s), seed 0"))
            images = fault_panels(faults)
            components.append(Table([[CardImage.from_pil_image(im, label=name) for name, im in images.items()]],
                                    headers=list(images)))
    return components


__all__ = ["evaluation_components", "loss_curve", "reconstruction_panels", "label_efficiency_plot", "fault_panels",
           "downstream_table", "slices"]
