"""The evaluation report as a Metaflow card: loss curve, slices of one held-out crop, metrics tables.

Images are drawn with Pillow (no plotting library needed):

- the training loss against the step;
- for the first held-out evaluation crop (the same crop and mask :func:`sfm.evaluate.evaluate_model`
  scores first): an inline, a crossline and a time slice of the input, of the masked input (hidden
  patches grey) and of the reconstruction (visible patches as given, hidden ones predicted by the
  model and brought back to amplitudes the way the voxel-space metric does: interpolated level,
  visible scale; no statistic of a hidden patch is used);
- the metrics table (target and voxel space, every baseline) and the fault probe.

:func:`evaluation_components` returns the card components; the flow appends them to its card.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw

from sfm.config import JobConfig

SCALE = 4  # screen pixels per voxel in the slice images
SLICES = ("inline", "crossline", "time")


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


def reconstruction_panels(model, store_urls: list[str], cfg: JobConfig) -> dict[str, dict[str, Image.Image]]:
    """{"input" | "masked input" | "reconstruction": {slice name: image}} for the first evaluation crop."""
    from sfm.data import CropSampler
    from sfm.evaluate import predictions, survey_mean_standardised, visible_voxels

    sampler = CropSampler(store_urls, tuple(model.cfg.crop), seed=cfg.eval.seed,
                          min_live_fraction=cfg.data.min_live_fraction)
    state = torch.get_rng_state()
    torch.manual_seed(cfg.eval.seed)  # the mask evaluate_model draws for its first batch
    model.eval()
    try:
        imgs = torch.from_numpy(sampler.read_many(list(range(min(cfg.eval.batch_size, cfg.eval.crops)))))
        with torch.no_grad():
            _, pred, mask = model(imgs)
            means = torch.tensor([survey_mean_standardised(sampler, i) for i in range(imgs.shape[0])])
            _, voxel_preds = predictions(model, imgs, pred, mask, means)
            visible = visible_voxels(model, imgs, mask)
    finally:
        torch.set_rng_state(state)
        sampler.close()
    grid = model.grid_shape(imgs)
    recon = model.unpatchify(voxel_preds["model"], grid)[:, 0]
    x = imgs[0, 0].numpy()
    vis = visible[0].numpy()
    rec = np.where(vis, x, recon[0].numpy())
    clip = float(np.percentile(np.abs(x), 98)) or 1.0
    rows = {"input": (x, None), "masked input": (x, ~vis), "reconstruction": (rec, None)}
    return {row: {name: colorize(plane, clip, None if hidden is None else slices(hidden)[name])
                  for name, plane in slices(values).items()}
            for row, (values, hidden) in rows.items()}


def evaluation_components(model_url: str, held_out_stores: list[str], cfg: JobConfig, train_summary: dict[str, Any],
                          metrics: dict[str, Any]) -> list:
    """Metaflow card components: title, loss curve, the slices table, the metrics tables."""
    from metaflow.cards import Image as CardImage
    from metaflow.cards import Markdown, Table

    from sfm.evaluate import metrics_table
    from sfm.model.io import load

    model = load(model_url)
    history = train_summary.get("history") or []
    components: list = [
        Markdown(f"# Evaluation of `{model_url}`\n\n{train_summary.get('steps', '?')} training steps; "
                 f"held-out surveys: {', '.join(held_out_stores)}"),
        Markdown("## Training loss"),
        CardImage.from_pil_image(loss_curve(history), label="training loss (masked-patch MSE, normalised patches)"),
        Markdown("## One held-out crop\n\nMiddle inline, crossline and time slices of the first evaluation crop. "
                 "Grey: hidden patches. Reconstruction: visible patches as given, hidden patches predicted "
                 "(level from interpolation, scale from the visible voxels)."),
    ]
    panels = reconstruction_panels(model, held_out_stores, cfg)
    rows = [[Markdown(f"**{row}**")] + [CardImage.from_pil_image(images[name], label=f"{row}: {name} slice")
                                        for name in SLICES] for row, images in panels.items()]
    components.append(Table(rows, headers=["", *[f"{name} slice" for name in SLICES]]))
    components.append(Markdown("## Masked-patch reconstruction (held-out surveys)\n\nNMSE: lower is better; "
                               "target space = per-patch normalised (the loss's space), voxel space = "
                               "standardised amplitudes."))
    components.append(Table(metrics_table(metrics),
                            headers=["predictor", "target NMSE", "target PSNR dB", "voxel NMSE", "voxel PSNR dB"]))
    if "probe_f1" in metrics:
        components.append(Markdown("## Fault probe (frozen encoder, synthetic labelled volumes)"))
        components.append(Table([
            ["pretrained encoder", f"{metrics['probe_f1']:.3f}", f"{metrics['probe_iou']:.3f}"],
            ["random encoder", f"{metrics['probe_random_f1']:.3f}", f"{metrics['probe_random_iou']:.3f}"],
            ["every patch a fault", f"{metrics['probe_all_positive_f1']:.3f}", "-"],
        ], headers=["features", "F1", "IoU"]))
    return components


__all__ = ["evaluation_components", "loss_curve", "reconstruction_panels", "colorize", "slices"]
