"""What each step of the fine-tune flow (``sfm flow finetune``) does: one function per step, no Metaflow imports.

    arms = resolve_arms("sfm-mae", data_root, cfg, compare=False)    # start: the networks to train
    pairs = plan_pairs(surveys, labels, held_out, ...)          # start: every survey with its labels and role
    pairs = ingest_pairs(pairs, data_root, cfg.ingest)          # ingest: surveys and labels published
    job = node_job(cfg, pairs, arms, task, run_root)            # launch
    summary = finetune_node(job, nodes=N, node_index=K, ...)    # finetune: 1..N nodes x [dist] procs_per_node ranks
    metrics, figures = evaluate(job, summary)                   # evaluate: held-out AP, F1s, IoU; the card
    record = register(data_root, name, job, summary, metrics, pathspec)   # register: sfm-<name>/vN
    print(compare_table(metrics))                               # end: every arm's scores, mean +- sd over the seeds

The arms (:func:`resolve_arms`) are built alike: the pretrained encoder with the ``[finetune] head``; ``random``, the
same architecture and crop randomly initialised; ``unet``, a FaultSeg3D-style U-Net from scratch at that crop. The
baselines take the architecture of the encoder they are compared with: the one fine-tuned beside them
(``--compare``), else ``--baseline-of`` or the registry's champion; a ``[model]`` section that contradicts it is
refused. Every arm trains on the same crops for a seed, at the peak rate of its grid its validation labels prefer,
for steps that grow with the labels; the one registered is the best on the validation labels, never the test ones.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from sfm import storage
from sfm.config import DataConfig, JobConfig, ModelConfig
from sfm.distributed.job import NodeLaunch
from sfm.errors import SFMError
from sfm.finetune.job import ARMS, Arm, FinetuneJob, ranked
from sfm.formats import manifest
from sfm.model import registry

ENCODER_FIELDS = ("crop", "patch", "in_chans", "embed_dim", "depth", "num_heads", "mlp_ratio")  # what fine-tuning keeps
SCORES = ("ap", "f1", "f1_tol2", "iou", "seconds")  # what the arms are compared on


def encoder_at(ref: str, data_root: str, cfg: JobConfig, flag: str = "--encoder") -> tuple[str, str, dict[str, Any]]:
    """(URL, how lineage names it, its MAEConfig) of the encoder ``ref`` names: a model reference of the registry
    (:func:`sfm.model.registry.find`: ``sfm-mae``, its champion; ``sfm-mae:v3``; ``sfm-mae:latest``) or an exported
    encoder's folder."""
    value = str(ref).strip()
    found = registry.find(data_root, value, default_model=cfg.registry.model_name, flag=flag)
    config_url = storage.join(found.url, "config.json")
    meta = json.loads(storage.read_bytes(config_url)) if storage.exists(config_url) else {}
    if "model" not in meta or "task" in meta:
        raise SFMError(f"{flag} {value} is not an encoder (no config.json of an MAE at {found.url}); give a model "
                       f"reference such as {cfg.registry.model_name}:v1, an encoder's folder, or for a baseline random "
                       "or unet")
    return found.url, str(found), meta["model"]


def refuse_contradicting_model(cfg: JobConfig, architecture: dict[str, Any], name: str) -> None:
    """SFMError (one line) when the job config sets a ``[model]`` section or ``[data] crop`` whose encoder is not the
    architecture of ``name``, the encoder a baseline is built like; a config that sets neither says nothing."""
    if cfg.model == ModelConfig() and tuple(cfg.data.crop) == DataConfig().crop:
        return
    from sfm.model import model_config_for

    ours = model_config_for(cfg).to_dict()
    differ = [k for k in ENCODER_FIELDS if json.dumps(ours[k]) != json.dumps(architecture[k])]
    if differ:
        show = lambda arch: ", ".join(f"{k} {arch[k]}" for k in differ)  # noqa: E731
        raise SFMError(f"the config's [model]/[data] ({cfg.model.preset}: {show(ours)}) contradict the baseline's "
                       f"architecture, {name}'s ({show(architecture)}); remove them, or pass --baseline-of an encoder "
                       "of that architecture")


def resolve_arms(encoder: str, data_root: str, cfg: JobConfig, *, compare: bool = False,
                 baseline_of: str = "") -> list[Arm]:
    """The arms ``--encoder`` names: ``random`` or ``unet`` (a baseline, built like ``--baseline-of``'s encoder, by
    default the registry's champion; without a registered encoder, the config's architecture), or an encoder
    (:func:`encoder_at`), with ``compare`` followed by both baselines built like it."""
    value = str(encoder).strip()
    if value in ("random", "unet"):
        if compare:
            raise SFMError(f"--compare runs an encoder's arm beside both baselines; give --encoder the encoder "
                           f"({cfg.registry.model_name}, NAME:vN or a folder), not {value}")
        if baseline_of or registry.champion_version(data_root, cfg.registry.model_name) is not None:
            _, name, architecture = encoder_at(baseline_of or cfg.registry.model_name, data_root, cfg,
                                               "--baseline-of")
            refuse_contradicting_model(cfg, architecture, name)
        else:  # nothing registered to compare with: the config's architecture
            from sfm.model import model_config_for

            name, architecture = "the config's [model]", model_config_for(cfg).to_dict()
        crop = tuple(architecture["crop"])
        return [Arm("random", "random", crop, model=architecture, reference=name) if value == "random"
                else Arm("unet", "unet", crop, reference=name)]
    if baseline_of:
        raise SFMError("--baseline-of names the encoder a baseline is built like; pass it with --encoder random or "
                       "unet (with --compare the baselines are built like --encoder)")
    url, name, architecture = encoder_at(value, data_root, cfg)
    arms = [Arm("pretrained", name, tuple(architecture["crop"]), url=url)]
    if compare:
        arms += [Arm("random", "random", arms[0].crop, model=architecture, reference=name),
                 Arm("unet", "unet", arms[0].crop, reference=name)]
    return arms


def plan_pairs(surveys: str, labels: str, held_out: str = "", held_out_labels: str = "", validation: str = "",
               validation_labels: str = "") -> list[dict[str, str]]:
    """Every labelled survey with its role: ``surveys``/``labels`` train, ``validation`` pairs stop early,
    ``held_out`` pairs are scored (a fraction in ``held_out`` instead holds out labelled lines: see
    :func:`held_out_fraction`). Surveys: SEG-Y/MDIO to ingest, survey ids or survey store URLs; labels:
    label files to ingest, or label ids."""
    out = []
    for role, names, files in (("train", surveys, labels), ("validation", validation, validation_labels),
                               ("test", "" if held_out_fraction(held_out) else held_out, held_out_labels)):
        names, files = storage.split_urls(names), storage.split_urls(files)
        if len(names) != len(files):
            flag = {"train": "--surveys / --labels", "validation": "--validation / --validation-labels",
                    "test": "--held-out / --held-out-labels"}[role]
            raise SFMError(f"{flag} name {len(names)} survey(s) and {len(files)} label set(s); pair them one to one")
        out += [{"survey": s, "labels": lab, "role": role} for s, lab in zip(names, files)]
    if not any(p["role"] == "train" for p in out):
        raise SFMError("no labelled survey to fine-tune on; pass --surveys and --labels")
    return out


def held_out_fraction(held_out: str) -> float | None:
    """``--held-out`` as a fraction of the labelled lines (e.g. 0.2), or None when it names surveys."""
    try:
        value = float(held_out)
    except ValueError:
        return None
    if not 0 < value < 1:
        raise SFMError(f"--held-out {held_out} is not a fraction of the labelled lines; give one in (0, 1) or surveys")
    return value


def check_task(task: str, cfg: JobConfig, arms: list[Arm]) -> None:
    """``--task`` (binary or classes:N) and the config's head valid for every arm, or SFMError: the flow's start
    checks them before anything is ingested, and :func:`node_job` again."""
    from sfm.model.segmenter import HEADS

    head = cfg.finetune.head
    if head not in HEADS or not HEADS[head].reads_encoder:
        fix = "pass --encoder unet for the U-Net from scratch" if head in HEADS else "use one of " + ", ".join(
            h for h in HEADS if HEADS[h].reads_encoder)
        raise SFMError(f"finetune.head = {head!r} is not a head over an encoder; {fix}")
    for arm in arms:
        try:
            arm.task(task, cfg.finetune)
        except ValueError as err:
            raise SFMError(f"--task {task}: {err}") from None
        if arm.kind == "unet" and any(c % 4 for c in arm.crop):
            raise SFMError(f"--encoder unet pools twice, so its crop (the encoder's, {list(arm.crop)}) must be a "
                           "multiple of 4 along every axis; compare with an encoder of such a crop (--baseline-of)")


def node_job(cfg: JobConfig, pairs: list[dict[str, Any]], arms: list[Arm], task: str, run_root: str) -> FinetuneJob:
    """The job every rank reads (:mod:`sfm.finetune.job`), after checking the task and the head each arm takes."""
    check_task(task, cfg, arms)
    return FinetuneJob(cfg, list(arms), task, run_root, [(p["store_url"], p["label_url"]) for p in pairs],
                       [p["role"] for p in pairs], [p["label_id"] for p in pairs])


def finetune_node(job: FinetuneJob, *, nodes: int, node_index: int, main_addr: str,
                  rendezvous_key: str) -> dict[str, Any] | None:
    """Launch this node's fine-tuning processes, ``[dist] procs_per_node`` of them
    (:func:`sfm.distributed.launch.run_node`); node 0 returns the run's summary."""
    from sfm.distributed import launch

    node = NodeLaunch(nodes, job.config.dist.procs_per_node, node_index, main_addr, launch.port_for(rendezvous_key))
    node.check(job.run_root)
    return launch.run_node(job, node)


def evaluate(job: FinetuneJob, summary: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every kept run's scores on the held-out labels (:func:`sfm.finetune.scores.held_out_scores`; a binary
    task's threshold chosen on the validation labels), predicted as ``sfm predict`` predicts (the recipe's overlap
    and mirroring), and the figures of the card. The metrics are the registered model's (the best on the
    validation labels: ``summary["best"]``), with ``runs`` (every arm and seed) and ``arms`` (each arm's mean and
    sd over the seeds: :func:`spread`) beside them; the figures: the first held-out part's amplitude, labels and
    each arm's prediction (its best seed on the validation labels) with the threshold its scores used. A binary
    task model records that threshold beside its overlap and mirroring, for ``sfm predict --output classes``."""
    from sfm.finetune.samples import LabelledSurveys, finetune_data, split_roles
    from sfm.finetune.scores import held_out_scores, threshold_of
    from sfm.model.segmenter import load_segmenter, record_predict_settings
    from sfm.train.trackers import log_scores

    cfg = job.config
    ft = cfg.finetune
    surveys = LabelledSurveys(list(job.pairs), finetune_data(cfg, job.arms[0].crop))
    split = split_roles(surveys, job.roles, ft.validation, ft.held_out)
    validation = [surveys.read_part(p, ft.overlap) for p in split.validation]
    test = [surveys.read_part(p, ft.overlap) for p in split.test]
    runs, predictions, thresholds = [], {}, {}
    for kept in summary["kept"]:
        net = load_segmenter(kept["model_url"])
        threshold, chosen_on = None, "the held-out labels (no validation labels)"
        if validation and net.task.kind == "binary":
            threshold = threshold_of([p.predict(net, ft.mirror) for p in validation], [p.labels for p in validation])
            chosen_on = "the validation labels"
        probs = [p.predict(net, ft.mirror) for p in test]
        scores = held_out_scores(probs, [p.labels for p in test], threshold)
        if "threshold" in scores:  # a binary task's: sfm predict --output classes marks class 1 from it
            record_predict_settings(kept["model_url"], threshold=scores["threshold"])
        runs.append({**{k: kept[k] for k in ("arm", "seed", "lr", "steps", "steps_run", "chosen_step",
                                              "validation_score", "seconds", "encoder")},
                     **scores, "threshold_chosen_on": chosen_on})
        arm_best = max((r for r in summary["kept"] if r["arm"] == kept["arm"]),
                       key=lambda r: ranked(r["validation_score"]))
        if kept is arm_best:
            predictions[kept["arm"]] = probs[0]
            thresholds[kept["arm"]] = scores.get("threshold")  # a binary task's; None for classes
    best = runs[summary["best"]]
    metrics = {**{k: v for k, v in best.items() if k not in ("encoder",)}, "held_out_parts": len(test),
               "runs": runs, "arms": spread(runs)}
    metrics.update(margins(runs))
    first = split.test[0]
    figures = {"amplitude": test[0].box_amplitude(), "labels": test[0].labels, "predictions": predictions,
               "thresholds": thresholds,
               "prediction": predictions[best["arm"]], "axis": first.axis, "survey": job.pairs[first.survey][0],
               "task": job.arms[[a.kind for a in job.arms].index(best["arm"])].task(job.task, ft).to_dict()}
    log_scores(cfg, job.run_root, "sfm-finetune", metrics, summary["steps"], "held_out")  # beside the losses
    return metrics, figures


def spread(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per arm (in :data:`sfm.finetune.job.ARMS` order): the seeds and, for each of :data:`SCORES` the runs hold,
    its mean and sample standard deviation over the seeds (0 for one seed)."""
    out = {}
    for arm in [a for a in ARMS if any(r["arm"] == a for r in runs)]:
        mine = [r for r in runs if r["arm"] == arm]
        out[arm] = {"seeds": [r["seed"] for r in mine], "lr": [r["lr"] for r in mine],
                    "chosen_step": [r["chosen_step"] for r in mine]}
        for key in (k for k in SCORES if all(k in r for r in mine)):
            values = np.array([r[key] for r in mine], float)
            out[arm][key] = {"mean": float(values.mean()), "sd": float(values.std(ddof=1)) if len(values) > 1 else 0.0}
    return out


def margins(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The pretrained arm's held-out AP minus each baseline's, paired by seed and averaged
    (``ap_pretrained_minus_random``, ``ap_pretrained_minus_unet``); empty without the pretrained arm."""
    by = {(r["arm"], r["seed"]): r["ap"] for r in runs}
    out = {}
    for base in ("random", "unet"):
        seeds = [s for (arm, s) in by if arm == "pretrained" and (base, s) in by]
        if seeds:
            out[f"ap_pretrained_minus_{base}"] = float(np.mean([by["pretrained", s] - by[base, s] for s in seeds]))
    return out


def compare_table(metrics: dict[str, Any]) -> str:
    """Every arm's held-out scores as text: one line per arm, mean +- sd over its seeds."""
    lines = []
    for arm, s in metrics["arms"].items():
        cells = [f"{key} {s[key]['mean']:.4f} +- {s[key]['sd']:.4f}" for key in SCORES if key in s and key != "seconds"]
        rates = ", ".join(f"{lr:g}" for lr in s["lr"])
        lines.append(f"  {arm:<10} {len(s['seeds'])} seed(s): {', '.join(cells)}; {s['seconds']['mean']:.0f} +- "
                     f"{s['seconds']['sd']:.0f} s; lr {rates}; step {', '.join(map(str, s['chosen_step']))}")
    return "\n".join(lines)


def register(data_root: str, name: str, job: FinetuneJob, summary: dict[str, Any], metrics: dict[str, Any],
             run_pathspec: str) -> dict[str, Any]:
    """Register the best run's task model (on the validation labels) as ``sfm-<name>`` with lineage to its encoder
    (and, for a baseline, the encoder it was built like), its label sets, the rates and steps chosen for every
    arm and seed, and its held-out scores; the champion is the version with the best held-out AP (by
    ``[registry] margin``)."""
    cfg = job.config
    model_name = f"sfm-{name}"
    roles = job.roles
    arm = job.arms[[a.kind for a in job.arms].index(summary["arm"])]
    lineage = {"run_pathspec": run_pathspec, "manifest_version": manifest.version(data_root),
               "code_version": registry.code_version(), "task": job.task, "encoder": arm.encoder,
               "encoder_url": arm.url, "arm": arm.kind, "baseline_of": arm.reference,
               "chosen": [{k: r[k] for k in ("arm", "seed", "lr", "rates", "steps", "steps_run", "chosen_step",
                                             "validation_score")} for r in summary["kept"]],
               "surveys": [s for (s, _), r in zip(job.pairs, roles) if r == "train"],
               "held_out_surveys": [s for (s, _), r in zip(job.pairs, roles) if r == "test"],
               "labels": [{"label_id": i, "survey": s, "role": r}
                          for i, (s, _), r in zip(job.label_ids, job.pairs, roles)]}
    record = registry.register(data_root, model_name, summary["model_url"], config=cfg.to_dict(), metrics=metrics,
                               lineage=lineage, champion=registry.Champion("ap", cfg.registry.margin))
    print(f"sfm register: {model_name} v{record['version']}{' (champion)' if record['champion'] else ''}: held-out "
          f"AP {metrics['ap']:.4f}, F1 {metrics['f1']:.4f}, IoU {metrics['iou']:.4f} ({arm.kind} arm, encoder "
          f"{lineage['encoder']}) at {registry.version_url(data_root, model_name, record['version'])}")
    return record
