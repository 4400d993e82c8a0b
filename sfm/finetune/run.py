"""What each step of ``flows/finetune_flow.py`` does: one function per step, no Metaflow imports.

    encoder = resolve_encoder("sfm-mae", data_root, cfg)       # start: the weights, or random
    pairs = plan_pairs(surveys, labels, held_out, ...)          # start: every survey with its labels and role
    pairs = ingest_pairs(pairs, data_root, cfg.ingest)          # ingest: sfm.ingest.labels, surveys and labels published
    job = node_job(cfg, pairs, encoder, task, run_root)          # launch
    summary = finetune_node(job, nodes=N, node_index=K, ...)    # finetune: 1..N nodes x [dist] procs_per_node ranks
    metrics, figures = evaluate(job, summary)                   # evaluate: held-out AP, F1, IoU; the card
    record = register(data_root, name, job, summary, metrics, pathspec)   # register: sfm-<name>/vN
"""

from __future__ import annotations

import json
from typing import Any

from sfm import storage
from sfm.config import JobConfig
from sfm.distributed.job import NodeLaunch
from sfm.errors import SFMError
from sfm.finetune.job import FinetuneJob
from sfm.formats import manifest
from sfm.model import registry


def resolve_encoder(encoder: str, data_root: str, cfg: JobConfig) -> dict[str, Any]:
    """What ``--encoder`` names: ``random`` (the config's architecture, randomly initialised: the baseline), or an
    encoder by model reference or folder (:func:`sfm.model.registry.find`: ``sfm-mae``, ``sfm-mae:v3``,
    ``sfm-mae:latest``, an exported encoder's URL). Returns {"url": the weights ("" for random), "encoder": how
    lineage names it, "version": N or None}."""
    from sfm.model import model_config_for

    value = str(encoder).strip()
    if value == "random":
        model_config_for(cfg)  # the architecture makes a model
        return {"url": "", "encoder": "random", "version": None}
    ref = registry.find(data_root, value, default_model=cfg.registry.model_name, flag="--encoder")
    config_url = storage.join(ref.url, "config.json")
    if not storage.exists(config_url) or "task" in json.loads(storage.read_bytes(config_url)):
        raise SFMError(f"--encoder {value} is not an encoder (no config.json of an MAE at {ref.url}); give a model "
                       f"reference such as {cfg.registry.model_name}:v1, an exported encoder's folder, or random")
    return {"url": ref.url, "encoder": str(ref), "version": ref.version or None}


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


def check_task(task: str, cfg: JobConfig) -> None:
    """``--task`` (binary or classes:N) valid with the config's head, or SFMError: the flow's start checks it."""
    from sfm.model.segmenter import Task

    try:
        Task.parse(task, head=cfg.finetune.head)
    except ValueError as err:
        raise SFMError(f"--task {task}: {err}") from None


def node_job(cfg: JobConfig, pairs: list[dict[str, Any]], encoder: dict[str, Any], task: str,
             run_root: str) -> FinetuneJob:
    """The job every rank reads (:mod:`sfm.finetune.job`), after checking the task."""
    check_task(task, cfg)
    return FinetuneJob(cfg, encoder["url"], encoder["encoder"], task, run_root,
                       [(p["store_url"], p["label_url"]) for p in pairs], [p["role"] for p in pairs],
                       [p["label_id"] for p in pairs])


def finetune_node(job: FinetuneJob, *, nodes: int, node_index: int, main_addr: str,
                  rendezvous_key: str) -> dict[str, Any] | None:
    """Launch this node's fine-tuning processes, ``[dist] procs_per_node`` of them
    (:func:`sfm.distributed.launch.run_node`); node 0 returns the run's summary."""
    from sfm.distributed import launch

    node = NodeLaunch(nodes, job.config.dist.procs_per_node, node_index, main_addr, launch.port_for(rendezvous_key))
    node.check(job.run_root)
    return launch.run_node(job, node)


def evaluate(job: FinetuneJob, summary: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The task model's scores on the held-out labels (:func:`sfm.finetune.scores.held_out_scores`; a binary
    task's threshold chosen on the validation labels), and the figures of the card: the first held-out
    part's amplitude, labels and prediction."""
    from sfm.predict.volume_predict import predict
    from sfm.finetune.samples import LabelledSurveys, finetune_data, split_roles
    from sfm.finetune.scores import held_out_scores, threshold_of
    from sfm.model.segmenter import load_segmenter
    from sfm.train.trackers import log_scores

    cfg = job.config
    ft = cfg.finetune
    net = load_segmenter(summary["model_url"])
    surveys = LabelledSurveys(list(job.pairs), finetune_data(cfg, net.crop))
    split = split_roles(surveys, job.roles, ft.validation, ft.held_out)
    threshold, chosen_on = None, "the held-out labels (no validation labels)"
    if split.validation and net.task.kind == "binary":
        parts = [surveys.read_part(p) for p in split.validation]
        threshold = threshold_of([predict(net, a, augment=ft.test_augment) for a, _ in parts], [lab for _, lab in parts])
        chosen_on = "the validation labels"
    parts = [surveys.read_part(p) for p in split.test]
    probs = [predict(net, a, augment=ft.test_augment) for a, _ in parts]
    metrics = held_out_scores(probs, [lab for _, lab in parts], threshold)
    metrics.update(chosen_step=summary["chosen_step"], steps=summary["steps"], threshold_chosen_on=chosen_on,
                   validation_score=max((s for _, s in summary["validation"]), default=None),
                   held_out_parts=len(parts))
    first = split.test[0]
    figures = {"amplitude": parts[0][0], "labels": parts[0][1], "prediction": probs[0], "axis": first.axis,
               "survey": job.pairs[first.survey][0], "task": net.task.to_dict()}
    log_scores(cfg, job.run_root, "sfm-finetune", metrics, summary["steps"], "held_out")  # beside the losses
    return metrics, figures


def register(data_root: str, name: str, job: FinetuneJob, summary: dict[str, Any], metrics: dict[str, Any],
             run_pathspec: str) -> dict[str, Any]:
    """Register the task model as ``sfm-<name>`` with lineage to its encoder and label sets and its held-out
    scores; the champion is the version with the best held-out AP (by ``[registry] margin``)."""
    cfg = job.config
    model_name = f"sfm-{name}"
    roles = job.roles
    lineage = {"run_pathspec": run_pathspec, "manifest_version": manifest.version(data_root),
               "code_version": registry.code_version(), "task": job.task, "encoder": job.encoder,
               "encoder_url": job.encoder_url,
               "surveys": [s for (s, _), r in zip(job.pairs, roles) if r == "train"],
               "held_out_surveys": [s for (s, _), r in zip(job.pairs, roles) if r == "test"],
               "labels": [{"label_id": i, "survey": s, "role": r}
                          for i, (s, _), r in zip(job.label_ids, job.pairs, roles)]}
    record = registry.register(data_root, model_name, summary["model_url"], config=cfg.to_dict(), metrics=metrics,
                               lineage=lineage, champion=registry.Champion("ap", cfg.registry.margin))
    print(f"sfm register: {model_name} v{record['version']}{' (champion)' if record['champion'] else ''}: held-out "
          f"AP {metrics['ap']:.4f}, F1 {metrics['f1']:.4f}, IoU {metrics['iou']:.4f} "
          f"(encoder {lineage['encoder']}) at {registry.version_url(data_root, model_name, record['version'])}")
    return record
