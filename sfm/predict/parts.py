"""A whole-survey prediction as steps: plan, predict parts, publish. ``sfm predict`` runs them in one
process (every part not yet written, then the publish; or with ``--part K`` one part alone); the predict flow
runs each part in its own task:

    plan = plan_prediction(opts)     # one task: the model and survey checked, the store's arrays made
    run_part(plan, k)                # per task (or GPU): the shards of part k's shard rows
    publish_prediction(plan)         # one task: the SEG-Y export if asked, then the root zarr.json, last

A part is a run of whole output shard rows (:func:`sfm.formats.store_layout.split_runs`), so parts write disjoint
objects. A killed part is simply run again: what finished parts wrote (their shards and markers) is kept
and reused, because a rerun with the same model, survey and settings finds the plan it staged
(:attr:`sfm.predict.store.PredictionPlan.identity`); other settings into an unfinished store are refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass
from typing import Any

from sfm import storage
from sfm.config import DATA_ROOT, PredictConfig
from sfm.errors import SFMError
from sfm.predict import store
from sfm.predict.store import PredictionPlan


@dataclass
class PredictOptions:
    """What ``sfm predict`` and the predict flow take (see ``sfm predict --help``): the model, the survey and the
    store to write, and the settings of the job config's ``[predict]`` section (:class:`sfm.config.PredictConfig`,
    whose defaults these are)."""

    model: str  # a model reference (NAME[:vN|:latest|:champion]) in data_root's registry, or a task model's folder
    survey: str  # the survey store's URL (sfm predict and the flow find it for an id or a SEG-Y / MDIO source first:
    # sfm.ingest.survey.survey_store)
    out: str  # the prediction store's URL
    data_root: str = DATA_ROOT
    output: str = PredictConfig.output  # probability | classes
    mirror: bool | None = PredictConfig.mirror  # test-time mirroring: inline/crossline flips (and swap) averaged;
    # None: as the task model's scores were measured
    layout: str = PredictConfig.layout  # sfm | mdio
    segy: str = ""  # also export a SEG-Y with the source's trace headers here
    parts: int = PredictConfig.parts  # tasks the survey is split into (runs of whole shard rows)
    overlap: float | None = PredictConfig.overlap  # of a crop, between neighbouring windows; None: the model's
    batch_size: int = PredictConfig.batch_size  # windows per network call
    device: str = PredictConfig.device  # auto (a GPU if there is one) | cpu | cuda | cuda:N
    threshold: float | None = PredictConfig.threshold  # classes of a binary task: class 1 from this probability;
    # None: the threshold the task model's F1 was scored at

    @classmethod
    def of(cls, settings: PredictConfig, **given: Any) -> "PredictOptions":
        """The options of ``settings`` (a job's [predict]) with the model, survey, out, data root, SEG-Y given."""
        return cls(**dataclasses.asdict(settings), **given)

    def check(self) -> None:
        """Every setting valid, or SFMError naming it."""
        fields = {f.name for f in dataclasses.fields(PredictConfig)}
        PredictConfig(**{k: v for k, v in dataclasses.asdict(self).items() if k in fields}).check()
        if not self.out:
            raise SFMError("--out is required: the URL of the prediction store to write")


def device_of(name: str) -> str:
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


# ---- plan ---------------------------------------------------------------------------------------------


DEFAULT_OVERLAP = 0.5  # windows' overlap for a task model that records none (exported before it recorded one)
DEFAULT_THRESHOLD = 0.5  # a binary task's classes output for a model that records no threshold


def _survey_info(url: str):
    from sfm.data.survey import read_survey_info

    if not storage.exists(storage.join(url, "zarr.json")):
        raise SFMError(f"--survey {url} is not a survey store (no zarr.json); give a survey id, a survey store URL, "
                       "or the SEG-Y file")
    return read_survey_info(url)[0]


def store_shape(info, channels: int, output: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(shape, bricks, shards) of the predicted variable: the survey's bricks, shards of whole bricks along
    the samples (up to :data:`sfm.formats.store_layout.SHARD_BYTES`); a class axis last for several probabilities."""
    from sfm.formats.store_layout import SHARD_BYTES

    shape = tuple(int(n) for n in info.shape)
    bricks = tuple(min(int(b), n) for b, n in zip(info.bricks, shape))
    per_brick = math.prod(bricks) * (4 * channels if output == "probability" else 1)
    per_shard = max(1, min(-(-shape[2] // bricks[2]), SHARD_BYTES // per_brick))
    shards = (bricks[0], bricks[1], bricks[2] * per_shard)
    if output == "probability" and channels > 1:
        return shape + (channels,), bricks + (channels,), shards + (channels,)
    return shape, bricks, shards


def plan_prediction(opts: PredictOptions) -> PredictionPlan:
    """Check the model, the survey and the output, then make the store's arrays and stage the plan; a plan
    staged before with the same identity is returned as it is (its finished parts are reused)."""
    from sfm.formats.store_layout import split_runs
    from sfm.predict.task_model import load_task_model

    opts.check()
    out = storage.normalize(opts.out)
    if store.published(out):
        raise SFMError(f"--out {out} already holds a published store; choose another --out, or remove it first")
    model = load_task_model(opts.model, opts.data_root)
    survey = storage.normalize(opts.survey)
    info = _survey_info(survey)
    recorded = (getattr(model.net, "meta", None) or {}).get("predict") or {}  # how its scores were measured
    overlap = float(opts.overlap if opts.overlap is not None else recorded.get("overlap", DEFAULT_OVERLAP))
    mirror = bool(opts.mirror if opts.mirror is not None else recorded.get("mirror", False))
    threshold = float(opts.threshold if opts.threshold is not None else recorded.get("threshold", DEFAULT_THRESHOLD))
    crop = tuple(int(c) for c in model.net.crop)
    shape, bricks, shards = store_shape(info, model.channels, opts.output)
    rows = split_runs(-(-shape[0] // bricks[0]), int(opts.parts))
    if len(rows) < int(opts.parts):
        raise SFMError(f"--parts {opts.parts}: {survey} has only {len(rows)} shard rows of {bricks[0]} inlines; "
                       f"use at most {len(rows)} parts")
    settings = {"overlap": overlap, "mirror": mirror, "layout": opts.layout,
                "segy": storage.normalize(opts.segy) if opts.segy else "", "crop": list(crop),
                "channels": model.channels, "batch_size": int(opts.batch_size), "threshold": threshold}
    resolved = f"{model.name}:v{model.version}" if model.name else model.url
    same = {"model_sha256": model.sha256, "survey": survey, "survey_version": info.version, "output": opts.output,
            "parts": len(rows), "shape": shape, "bricks": bricks,
            **{k: settings[k] for k in ("overlap", "mirror", "layout", "segy")},
            **({"threshold": threshold} if opts.output == "classes" and model.channels == 1 else {})}
    identity = hashlib.sha256(json.dumps(same, sort_keys=True).encode()).hexdigest()[:16]
    staged = store.staged_plan(out)
    if staged is not None:
        if staged.identity != identity:
            raise SFMError(f"--out {out} holds an unfinished prediction with other settings (model, survey, output, "
                           "overlap, mirroring, threshold, layout, SEG-Y or parts); rerun with those, or remove it "
                           "first")
        return staged
    if settings["segy"] and storage.exists(settings["segy"]):
        raise SFMError(f"--segy {settings['segy']} already exists; choose another file, or remove it first")
    plan = PredictionPlan(out, survey, resolved, storage.normalize(model.data_root) if model.name else "",
                          opts.output, shape, bricks, shards, [tuple(r) for r in rows], settings, identity)
    if plan.settings["segy"]:
        from sfm.predict.segy_export import header_source

        header_source(plan)  # refused now, not after the work
    group, survey_attrs, _ = store.open_source(survey)
    plan.settings["axis"] = store.output_axis(group, survey_attrs, opts.layout)
    writer = store.create_arrays(plan)
    plan.metadata = writer.metadata()
    plan.attrs = store.root_attributes(plan, survey_attrs, model.describe())
    storage.write_bytes(storage.join(store.staging(out), "plan.json"), plan.to_json())
    return plan


# ---- parts ----------------------------------------------------------------------------------------------


def run_part(plan: PredictionPlan, part: int, device: str = "auto", progress: bool = False) -> dict[str, Any]:
    """Predict part ``part`` of ``plan`` (unless its marker says it is done) and write its marker, last; with
    ``progress``, its windows counted on stderr (a bar on a terminal, plain lines in a log: windows done of all,
    voxels/s, ETA). Returns its summary: windows, voxels, seconds (wall, CPU, in the network)."""
    from sfm.config import DataConfig
    from sfm.data import Surveys
    from sfm.predict.slabs import InlineBand, RowWriter, SlabBlender, predict_rows
    from sfm.predict.task_model import load_task_model
    from sfm.predict.windows import IDENTITY, WindowGrid, mirrorings, window_probabilities

    if not 0 <= part < len(plan.rows):
        raise SFMError(f"--part {part} is not a part of {len(plan.rows)} (0..{len(plan.rows) - 1})")
    if store.part_done(plan, part):
        return {"part": part, "reused": True}
    cpu, clock = time.process_time(), time.perf_counter()
    model = load_task_model(plan.model, plan.data_root, device_of(device))
    if plan.attrs["model"]["sha256"] != model.sha256:
        raise SFMError(f"{plan.model} changed since prediction {plan.out} was planned; remove {plan.out} and "
                       "predict again")
    lo, hi = plan.inlines(part)
    crop = tuple(plan.settings["crop"])
    data = DataConfig(crop=(1, 1, 1))
    surveys = Surveys([plan.survey], data)
    grid = WindowGrid(surveys[0].shape, crop, plan.settings["overlap"])
    starts = grid.axes[0].reaching(lo, hi)
    band = InlineBand(surveys, data, stop=starts[-1] + crop[0])
    blender = SlabBlender(surveys[0].shape, plan.bricks[0], model.channels, (lo, hi))
    writer = RowWriter(plan.group().shards(plan.variable), plan.variable, surveys[0].trace_mask, plan.shards,
                       plan.settings.get("threshold", DEFAULT_THRESHOLD))
    views = mirrorings(crop) if plan.settings["mirror"] else [IDENTITY]
    try:
        label = f"predict part {part + 1}/{len(plan.rows)}" if progress else ""
        counts = predict_rows(grid, band, blender, lambda imgs: window_probabilities(model.net, imgs, views), writer,
                              int(plan.settings["batch_size"]), label)
    finally:
        band.close()
    summary = {"part": part, "inlines": [lo, hi], "voxels": (hi - lo) * math.prod(plan.shape[1:3]), **counts,
               "cpu_s": time.process_time() - cpu, "seconds": time.perf_counter() - clock, "views": len(views)}
    store.mark_done(plan, part, {**writer.summary(), "run": summary})
    return summary


# ---- publish ---------------------------------------------------------------------------------------------


def publish_prediction(plan: PredictionPlan) -> dict[str, Any]:
    """After every part: the SEG-Y export if asked (written whole or not at all), then the store's root
    ``zarr.json``, last. Returns the root attributes."""
    store.merged_stats(plan)  # refuses while a part is missing, before any export
    if plan.settings["segy"]:
        from sfm.predict.segy_export import export_segy

        export_segy(plan, plan.settings["segy"])
    return store.publish(plan)


def predict(opts: PredictOptions, part: int | None = None, progress: bool = False) -> dict[str, Any]:
    """``sfm predict``: plan (or find the staged plan), then part ``part`` alone, or every part not yet written
    and the publish step. Returns a summary (parts run and reused, windows, voxels, seconds)."""
    clock, cpu = time.perf_counter(), time.process_time()
    plan = plan_prediction(opts)
    todo = [part] if part is not None else list(range(len(plan.rows)))
    runs = [run_part(plan, k, opts.device, progress) for k in todo]
    done = [r for r in runs if not r.get("reused")]
    result = {"out": plan.out, "parts": len(plan.rows), "ran": [r["part"] for r in done],
              "reused": [r["part"] for r in runs if r.get("reused")],
              "windows": sum(r["windows"] for r in done), "voxels": sum(r["voxels"] for r in done),
              **{k: round(sum(r[k] for r in done), 3) for k in ("model_cpu_s", "window_cpu_s")}}
    if part is None:
        attrs = publish_prediction(plan)
        result.update(published=True, variable=plan.variable, stats=attrs["stats"], segy=plan.settings["segy"] or None)
    else:
        result["published"] = False
    seconds, cpu_s = time.perf_counter() - clock, time.process_time() - cpu
    return {**result, "seconds": round(seconds, 3), "cpu_s": round(cpu_s, 3)}
