"""The model card of a model folder: the ``README.md`` the Hugging Face Hub shows, from the folder's config and,
for a registered version, its record (metrics and lineage).

The front matter is the Hub's metadata (``library_name``, ``pipeline_tag``, ``tags``, and ``model-index`` with
the held-out metrics), plus an ``sfm`` block with the version's identity and lineage; the text says what the
model is, what it saw, how it scored (the label-efficiency figures ``ft_ap_gain_b<N>`` among them), what it is
for and not for, and how to load it. A card is a function of its inputs: exporting a version twice writes the
same card. huggingface_hub writes the metadata (imported here, on use: :mod:`sfm.model` imports with torch alone).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from sfm.errors import redact

CARD = "README.md"
ENCODER_TAGS = ["sfm", "seismic", "geophysics", "masked-autoencoder", "vision-transformer", "3d", "pytorch"]

# what a metric name means: (pattern, description with {n} the labelled volumes); the first match wins
_GLOSSARY = [
    (r"masked_nmse", "held-out reconstruction error of the masked patches, normalised by their variance (lower is "
                     "better; 1 = predicting zero)"),
    (r"baseline_(\w+)_nmse", "the same error of the {0} baseline, for scale"),
    (r"psnr", "held-out reconstruction PSNR in dB"),
    (r"(ft|linear|knn)_ap_gain_b(\d+)", "label efficiency: {kind} AP gain over a randomly initialised encoder with "
                                        "{n} labelled volume(s), mean over seeds"),
    (r"(ft|linear|knn)_ap_random_b(\d+)", "{kind} AP from a randomly initialised encoder, {n} labelled volume(s)"),
    (r"(ft|linear|knn)_ap_b(\d+)", "{kind} AP from these weights, {n} labelled volume(s)"),
    (r"(ft|linear|knn)_min_gain_b(\d+)", "the smallest {kind} AP gain over the seeds, {n} labelled volume(s)"),
    (r"(ft|linear|knn)_all_seeds_gain_b(\d+)", "pretraining beat random initialisation on every seed ({kind}, "
                                               "{n} labelled volume(s))"),
    (r"ap", "average precision of the held-out labels"),
    (r"f1", "F1 at the chosen threshold, held-out labels"),
    (r"f1_tol2", "fault F1 with a 2-voxel tolerance at the chosen threshold (a predicted fault within 2 voxels of "
                 "a labelled one counts as right, a labelled one within 2 voxels of a prediction as found), "
                 "held-out labels"),
    (r"iou", "intersection over union at the chosen threshold, held-out labels"),
    (r"accuracy", "voxel accuracy, held-out labels"),
    (r"threshold", "the probability threshold F1 and IoU use"),
]
_KINDS = {"ft": "fine-tuned", "linear": "linear-probe", "knn": "k-NN probe"}


def describe_metric(name: str) -> str:
    """What a metric of a version record means ("" for one the glossary does not know)."""
    for pattern, text in _GLOSSARY:
        match = re.fullmatch(pattern, name)
        if match:
            groups = match.groups()
            if len(groups) == 2:
                return text.format(kind=_KINDS[groups[0]], n=groups[1])
            return text.format(*groups)
    return ""


def headline_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The version's top-level numeric metrics (finite numbers and booleans as 0/1), in name order."""
    out = {}
    for name, value in sorted(metrics.items()):
        if isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, (int, float)) and math.isfinite(value):
            out[name] = float(value)
    return out


def parameter_count(weights: bytes) -> int:
    """Parameters in a safetensors file, read from its header (no tensor is loaded)."""
    size = int.from_bytes(weights[:8], "little")
    header = json.loads(weights[8:8 + size])
    return sum(math.prod(t["shape"]) for key, t in header.items() if key != "__metadata__")


def model_card(config: dict[str, Any], record: dict[str, Any] | None = None, *, weights: bytes | None = None) -> str:
    """The README.md of a model folder. ``config``: its config.json (``model``, and ``task`` for a task model);
    ``record``: the registry version record (metrics, lineage), when the model is registered; ``weights``: its
    model.safetensors, for the parameter count."""
    from huggingface_hub import EvalResult, ModelCardData

    task = config.get("task")
    arch = config.get("model")
    name = f"{record['model_name']} v{record['version']}" if record else ("sfm task model" if task else "sfm encoder")
    pipeline_tag = "image-segmentation" if task else "image-feature-extraction"
    metrics = headline_metrics(record["metrics"]) if record else {}
    lineage = record["lineage"] if record else {}
    results = [EvalResult(task_type=pipeline_tag, dataset_type="seismic", dataset_name=_held_out_name(lineage),
                          metric_type=key, metric_value=value, metric_name=describe_metric(key) or key)
               for key, value in metrics.items()]
    if arch is None:  # the U-Net of a task model without an encoder
        arch = {"unet_widths": [task["width"] * 2 ** k for k in range(3)], "crop": config.get("crop")}
    identity = {"kind": "task" if task else "encoder", "architecture": arch}
    if record:
        identity.update(model=record["model_name"], version=record["version"], created_at=record["created_at"],
                        lineage=lineage)
    if task:
        identity["task"] = task
    data = ModelCardData(library_name="sfm", pipeline_tag=pipeline_tag, model_name=name,
                         tags=ENCODER_TAGS + (["image-segmentation"] if task else []),
                         eval_results=results or None, sfm=identity)
    sections = [f"# {name}", _summary(config.get("model"), task, weights, config.get("crop")),
                _data_section(lineage, task), _metrics_section(metrics), _arms_section(record),
                _lineage_section(record), _use_section(task), _load_section(task, record)]
    return redact("---\n" + data.to_yaml() + "\n---\n\n" + "\n\n".join(s for s in sections if s) + "\n")


def _held_out_name(lineage: dict[str, Any]) -> str:
    held = lineage.get("held_out_surveys") or []
    return "held-out surveys: " + ", ".join(_short(s) for s in held) if held else "held-out data"


def _short(url: str) -> str:
    """A survey store URL by its last path part (the survey id), as the card lists it."""
    return str(url).rstrip("/").rpartition("/")[2] or str(url)


def _summary(arch: dict[str, Any] | None, task: dict[str, Any] | None, weights: bytes | None,
             crop: list[int] | None = None) -> str:
    size = f" {parameter_count(weights) / 1e6:.2f} M parameters." if weights is not None else ""
    if arch is None:  # a task model without an encoder: the from-scratch U-Net
        w = task["width"]
        return (f"A seismic segmentation model: a FaultSeg3D-style 3D U-Net (levels of {w}, {2 * w} and {4 * w} "
                f"channels, two 3x3x3 convolutions per level) trained from scratch on "
                f"{'x'.join(map(str, crop or []))}-voxel crops (inline x crossline x sample) for a {task['kind']} task "
                f"of {task['classes']} classes: the baseline a pretrained encoder is measured against. It maps an "
                f"amplitude volume [N, 1, D, H, W] to per-voxel logits [N, C, D, H, W].{size}")
    shape = (f"a 3D Vision Transformer (ViT) encoder of {arch['depth']} blocks, width {arch['embed_dim']}, "
             f"{arch['num_heads']} heads, over {'x'.join(map(str, arch['patch']))} patches of "
             f"{'x'.join(map(str, arch['crop']))}-voxel crops (inline x crossline x sample)")
    if task:
        return (f"A seismic segmentation model: {shape}, pretrained as a masked autoencoder (MAE) and fine-tuned with "
                f"a {task['head']} head for a {task['kind']} task of {task['classes']} classes. It maps an amplitude "
                f"volume [N, 1, D, H, W] to per-voxel logits [N, C, D, H, W].{size}")
    return (f"A seismic foundation model: {shape}, pretrained as a masked autoencoder (MAE: He et al., 2021) on "
            f"post-stack 3D seismic surveys, with its light reconstruction decoder "
            f"({arch['decoder_depth']} block(s), width {arch['decoder_embed_dim']}). Its encoder turns an amplitude "
            f"volume [N, 1, D, H, W] into one feature vector per patch [N, L, E] for downstream tasks.{size}")


def _data_section(lineage: dict[str, Any], task: dict[str, Any] | None) -> str:
    if not lineage:
        return ""
    lines = ["## Training data", "", "Surveys it trained on:", *[f"- `{s}`" for s in lineage.get("surveys", [])]]
    held = lineage.get("held_out_surveys") or []
    lines += ["", "Held out (never trained on; the metrics below are measured there):", *[f"- `{s}`" for s in held]]
    if task and lineage.get("labels"):
        lines += ["", "Label sets:", *[f"- `{lab['label_id']}` on `{_short(lab['survey'])}` ({lab['role']})"
                                       for lab in lineage["labels"]]]
    return "\n".join(lines)


def _metrics_section(metrics: dict[str, float]) -> str:
    if not metrics:
        return ""
    rows = [f"| `{k}` | {v:.4g} | {describe_metric(k)} |" for k, v in metrics.items()]
    return "\n".join(["## Evaluation", "", "| metric | value | meaning |", "| --- | --- | --- |", *rows])


def _arms_section(record: dict[str, Any] | None) -> str:
    """A task model's comparison with the baselines it was fine-tuned beside (the fine-tune flow's ``arms``): each
    arm's held-out scores, mean ± sd over the paired seeds, and the rates and steps its validation labels chose."""
    arms = (record or {}).get("metrics", {}).get("arms")
    if not arms:
        return ""
    keys = [k for k in ("ap", "f1", "f1_tol2", "iou", "seconds") if all(k in a for a in arms.values())]
    rows = [f"| {arm} | {len(a['seeds'])} | " + " | ".join(f"{a[k]['mean']:.4g} ± {a[k]['sd']:.2g}" for k in keys)
            + f" | {', '.join(f'{lr:g}' for lr in a['lr'])} | {', '.join(map(str, a['chosen_step']))} |"
            for arm, a in arms.items()]
    return "\n".join(["## Against the baselines", "",
                      "Held-out scores of every arm fine-tuned in the same run (pretrained encoder, the same "
                      "architecture from random initialisation, a U-Net from scratch), mean ± sd over the paired "
                      "seeds, each at the rate its validation labels chose; this version is the best of them on the "
                      "validation labels.", "",
                      f"| arm | seeds | {' | '.join(keys)} | rate | step kept |",
                      "| --- | --- | " + " | ".join("---" for _ in keys) + " | --- | --- |", *rows])


def _lineage_section(record: dict[str, Any] | None) -> str:
    if not record:
        return ""
    lineage = record["lineage"]
    items = {"registered": f"{record['model_name']} v{record['version']} at {record['created_at']}",
             "encoder": lineage.get("encoder"), "encoder weights": lineage.get("encoder_url"),
             "task": lineage.get("task"), "arm": lineage.get("arm"),
             "a baseline built like": lineage.get("baseline_of"), "continued from": lineage.get("init_from"),
             "run": lineage.get("run_pathspec"), "manifest version": lineage.get("manifest_version"),
             "code": lineage.get("code_version")}
    rows = [f"- {k}: `{v}`" for k, v in items.items() if v]
    return "\n".join(["## Lineage", "", *rows])


def _use_section(task: dict[str, Any] | None) -> str:
    if task:
        use = ("Intended use: predicting the labelled feature on surveys like the ones it was fine-tuned on "
               "(`sfm predict` slides it over a whole survey), as a first pass an interpreter reviews.")
    else:
        use = ("Intended use: the encoder of seismic task models (fault, horizon or facies segmentation), fine-tuned "
               "with a few labelled volumes (`sfm flow finetune run --encoder THIS_FOLDER ...`), or features for "
               "probes.")
    limits = ("Limits: it has seen only the surveys listed above; amplitudes are standardised per survey as the "
              "training loader does, so feed volumes through sfm's loader or standardise them the same way. Its "
              "scores hold on the held-out data named here, not on other acquisitions, processing or domains "
              "(depth against time). It is not a substitute for an interpreter's judgement.")
    return "\n".join(["## Intended use and limits", "", use, "", limits])


def _load_section(task: dict[str, Any] | None, record: dict[str, Any] | None) -> str:
    cls, module = ("Segmenter", "sfm.model.segmenter") if task else ("MaskedAutoencoder3D", "sfm.model.mae")
    use = ("probabilities = model.probabilities(model(volume))  # [N, 1, D, H, W] -> [N, C, D, H, W]" if task else
           "features = model.encode(volume)  # [N, 1, D, H, W] -> [N, L, E]")
    lines = ["## How to load", "", "```python", f"from {module} import {cls}", "",
             f'model = {cls}.from_pretrained("THIS_FOLDER_OR_HUB_REPO")', use, "```"]
    if record:
        ref = f"{record['model_name']}:v{record['version']}"
        lines += ["", f"From the registry it came from: `sfm registry export {ref} DIR` writes this folder, "
                  f"`sfm registry show {ref}` prints its full record."]
    if task:
        lines += ["", "A whole survey: `sfm predict --model THIS_FOLDER --survey STORE_URL --out PREDICTION_URL`."]
    return "\n".join(lines)
