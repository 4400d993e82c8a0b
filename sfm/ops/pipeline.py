"""What each step of the pretrain flow (``sfm/flows/pretrain_flow.py``) does: one function per step, no Metaflow
imports.

The flow stays a thin card of the design; everything here can be called and tested on its own.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from sfm import storage
from sfm.model import registry
from sfm.formats import manifest
from sfm.config import JobConfig, SynthConfig
from sfm.errors import SFMError

HELD_OUT_SEED = 500  # generated held-out surveys: seeds 500, 501, ...; training surveys 0, 1, ...


def job_config(cfg: JobConfig) -> JobConfig:
    """The job as it will run: ``cfg`` (the TOML config with the flow's parameters or the CLI's arguments on top,
    :meth:`JobConfig.override`) with the Accelerate config file it names mapped onto it
    (:func:`sfm.distributed.accelerate_config.apply`), every section checked, and the model layer's check: a
    conflict or a bad setting is refused here, before any work. Changes ``cfg`` and returns it."""
    from sfm.distributed import accelerate_config
    from sfm.model import model_config_for

    accelerate_config.apply(cfg)
    cfg.validate()
    model_config_for(cfg)  # the preset makes a model at the job's crop and masking
    return cfg


def plan_surveys(surveys: str, held_out: str, data_root: str, synth: SynthConfig | None = None
                 ) -> list[dict[str, Any]]:
    """The surveys to ingest, each {"url", "held_out"}; generates ``synth``'s surveys when none are named.

    Every named source is checked now (exists, reads as SEG-Y, or is an MDIO v1 store sfm can read in
    place: ``kind`` "mdio"), so a bad entry fails the run before anything is written, with a one-line
    error naming it.
    """
    from sfm.ingest.mdio_source import inspect, is_mdio
    from sfm.formats.segy import BINARY_HEADER_BYTES, TEXT_HEADER_BYTES, layout_from_header

    train_urls, held_urls = storage.split_urls(surveys), storage.split_urls(held_out)
    if not train_urls:
        if held_urls:
            raise SFMError("--held-out was given without --surveys; name the training surveys too")
        return generate_demo_surveys(data_root, synth)
    overlap = set(map(storage.normalize, train_urls)) & set(map(storage.normalize, held_urls))
    if overlap:
        raise SFMError(f"{sorted(overlap)[0]} is both a training and a held-out survey; split by survey")
    if not held_urls:
        if len(train_urls) < 2:
            raise SFMError("with one survey there is nothing to hold out; pass --held-out or a second survey")
        held_urls = train_urls[-1:]
        train_urls = train_urls[:-1]
    plan = []
    for url, held in [(u, False) for u in train_urls] + [(u, True) for u in held_urls]:
        url = storage.normalize(url)
        try:
            if is_mdio(url):  # read in place; refused now if sfm cannot train on it as it is
                inspect(url)
                plan.append({"url": url.rstrip("/"), "held_out": held, "kind": "mdio"})
                continue
            head, size = storage.read_head(url, TEXT_HEADER_BYTES + BINARY_HEADER_BYTES)
            layout_from_header(url, head, size)
        except SFMError as err:
            raise (err if url in str(err) else SFMError(f"survey {url}: {err}")) from None
        plan.append({"url": url, "held_out": held})
    return plan


def generate_demo_surveys(data_root: str, synth: SynthConfig | None = None) -> list[dict[str, Any]]:
    """Write the generated surveys (and their fault labels) into ``<data_root>/landing``: ``synth``'s
    training surveys ``demo-train-<k>`` (seed k) and held-out ``demo-heldout-<k>`` (seed 500 + k)."""
    from sfm.synth.survey import synth_survey

    synth = synth or SynthConfig()
    if synth.train_surveys < 1 or synth.held_out_surveys < 1:
        raise SFMError(f"synth.train_surveys = {synth.train_surveys} and synth.held_out_surveys = "
                       f"{synth.held_out_surveys} must both be at least 1 when no --surveys are named")
    surveys = [(f"demo-train-{k}", k, False) for k in range(synth.train_surveys)]
    surveys += [(f"demo-heldout-{k}", HELD_OUT_SEED + k, True) for k in range(synth.held_out_surveys)]
    landing = storage.join(data_root, "landing")
    plan = []
    with tempfile.TemporaryDirectory(prefix="sfm-demo-") as tmp:
        for name, seed, held in surveys:
            url = storage.join(landing, f"{name}.sgy")
            if not storage.exists(url):
                result = synth_survey(os.path.join(tmp, f"{name}.sgy"), shape=synth.shape, seed=seed)
                storage.upload(result["faults"], storage.join(landing, Path(result["faults"]).name))
                storage.upload(result["segy"], url)  # the SEG-Y last: present means complete
            plan.append({"url": url, "held_out": held})
    return plan


def plan_ingest(plan: list[dict[str, Any]], data_root: str, cfg: JobConfig, run_key: str) -> list[dict[str, Any]]:
    """The scan tasks of every planned survey (survey x part: :func:`sfm.ingest.parts.plan_scans`, ``ingest.parts``
    of them, the flow's ``--ingest-parts``), each with its survey's index and ``held_out``; a survey's parts stage
    their work under a key unique to this run and survey."""
    from sfm.ingest.parts import plan_scans

    scans = []
    for index, source in enumerate(plan):
        for scan in plan_scans(source["url"], f"{run_key}-{index}", data_root, cfg.ingest,
                               kind=source.get("kind", "segy")):
            scans.append({**scan, "survey": index, "held_out": bool(source["held_out"])})
    return scans


def scan_part(scan: dict[str, Any], cfg: JobConfig) -> dict[str, Any]:
    """One scan task: digests and header fields of one byte range of a survey."""
    from sfm.ingest.parts import scan_part as scan_range_part

    return scan_range_part(scan, cfg.ingest)


def plan_writes(scans: list[dict[str, Any]], data_root: str, cfg: JobConfig) -> list[dict[str, Any]]:
    """After every scan task: each survey's identity, geometry and store arrays, and its write tasks."""
    from sfm.ingest.parts import plan_writes as plan_survey_writes

    writes = []
    for index in sorted({s["survey"] for s in scans}):
        mine = [s for s in scans if s["survey"] == index]
        for part in plan_survey_writes(mine, data_root, cfg.ingest):
            writes.append({**part, "survey": index, "held_out": mine[0]["held_out"]})
    return writes


def ingest(part: dict[str, Any], cfg: JobConfig) -> dict[str, Any]:
    """One write task: the shards of one part of a survey (nothing for a survey published before)."""
    from sfm.ingest.parts import write_part

    return write_part(part, cfg.ingest, progress=True)  # plain lines in a flow task, a bar on a terminal


def publish(parts: list[dict[str, Any]], data_root: str) -> list[dict[str, Any]]:
    """After every write task: publish each survey once (manifest row last); small references to them,
    in plan order (ids, URLs, shape, status, held_out)."""
    from sfm.ingest.parts import publish_parts

    keep = ("survey_id", "name", "source_url", "store_url", "shape", "status")
    surveys = []
    for index in sorted({p["survey"] for p in parts}):
        mine = sorted((p for p in parts if p["survey"] == index), key=lambda p: p["part"])
        row = publish_parts(mine, data_root)
        surveys.append({**{k: row[k] for k in keep}, "held_out": bool(mine[0]["held_out"])})
    return surveys


def run_root(data_root: str, flow_name: str, run_key: str) -> str:
    """Where a flow run's training writes: checkpoints, the exported model, the summary, the heartbeat."""
    return storage.join(data_root, "checkpoints", f"{flow_name}-{run_key}")


def pretrain_node(cfg: JobConfig, *, train_stores: list[str], run_root: str, nodes: int, node_index: int,
                  main_addr: str, rendezvous_key: str) -> dict[str, Any] | None:
    """Launch this node's training processes, all writing under ``run_root`` (:func:`run_root`); node 0
    returns the training summary."""
    from sfm.distributed import launch
    from sfm.distributed.job import NodeLaunch, node_job

    node = NodeLaunch(nodes, cfg.dist.procs_per_node, node_index, main_addr, launch.port_for(rendezvous_key))
    return launch.run_node(node_job(cfg, train_stores, run_root, node), node)


def resolve_init_from(cfg: JobConfig, data_root: str) -> JobConfig:
    """Resolve ``train.init_from`` (``--init-from``) for continued pretraining and check the weights fit the job's
    model: a model reference of ``data_root``'s registry (``sfm-mae:latest``) or an exported model folder URL
    (:func:`sfm.model.registry.find`) becomes the folder's URL; "" is none.
    """
    from sfm.model.mae import MAEConfig
    from sfm.model import model_config_for

    if cfg.train.init_from:
        ref = registry.find(data_root, cfg.train.init_from, default_model=cfg.registry.model_name, flag="--init-from")
        cfg.set("train.init_from", ref.url)
    url = cfg.train.init_from
    if url:
        config_url = storage.join(url, "config.json")
        if not storage.exists(config_url):
            raise SFMError(f"--init-from {url} holds no exported model (no config.json); name a registry version "
                           "folder or an exported model")
        theirs = MAEConfig.from_dict(json.loads(storage.read_bytes(config_url))["model"]).to_dict()
        ours = model_config_for(cfg).to_dict()
        differ = sorted(k for k in ours if k not in ("crop", "mask_ratio") and ours[k] != theirs.get(k))
        if differ:
            raise SFMError(f"the model at {url} differs from the job's model in {', '.join(differ)}; run with the "
                           "config it was trained with (`sfm registry show` prints it)")
    return cfg


def evaluate(model_url: str, held_out_stores: list[str], cfg: JobConfig) -> tuple[dict[str, Any], dict[str, dict]]:
    """Held-out reconstruction metrics and baselines, plus the downstream evaluation (the encoder
    fine-tuned for fault segmentation against random initialisation, and frozen probes).

    Returns (metrics, figures): figures holds the arrays the card draws (``reconstruction``: the first
    evaluation crop; ``faults``: a test volume with both networks' predictions), not kept as artifacts.
    """
    from sfm.eval.reconstruction import evaluate_model, summarize
    from sfm.model.io import load

    model = load(model_url)
    figures: dict[str, dict] = {"reconstruction": {}, "faults": {}}
    metrics = evaluate_model(model, held_out_stores, cfg, example=figures["reconstruction"])
    print(f"sfm evaluate: {summarize(metrics)}")
    if cfg.eval.downstream:
        import torch

        from sfm.eval import downstream

        if torch.cuda.is_available():  # the fine-tuning runs on the model's device
            model.to("cuda")
        metrics.update(downstream.evaluate_downstream(model, cfg.eval, example=figures["faults"]))
        print(f"sfm evaluate: {downstream.summarize(metrics)}")
    return metrics, figures


def register(data_root: str, cfg: JobConfig, *, model_url: str, metrics: dict, run_pathspec: str,
             surveys: list[str], held_out: list[str], snapshots: dict[str, str] | None = None) -> dict[str, Any]:
    """Register the trained model with its lineage (run, manifest version, code, surveys, parent weights,
    and the models exported part-way through training: {step: URL})."""
    lineage = {
        "run_pathspec": run_pathspec, "manifest_version": manifest.version(data_root),
        "code_version": registry.code_version(), "surveys": surveys, "held_out_surveys": held_out,
        "init_from": cfg.train.init_from, "snapshots": snapshots or {},
    }
    record = registry.register(data_root, cfg.registry.model_name, model_url, config=cfg.to_dict(),
                               metrics=metrics, lineage=lineage,
                               champion=registry.Champion.of(cfg.registry))
    print(f"sfm register: {cfg.registry.model_name} v{record['version']}"
          f"{' (champion)' if record['champion'] else ''} at {registry.version_url(data_root, cfg.registry.model_name, record['version'])}")
    return record


# The gain the quality configuration last measured (BENCHMARKS.md "Quality"; a test holds the two equal), which the
# demo's closing line points a newcomer to: its own tiny model is too small for pretraining to help.
QUALITY_COMMAND = "sfm flow pretrain --config config quality_cpu run"
QUALITY_GAINS = {1: "+0.084", 4: "+0.106"}  # labelled volumes -> mean fine-tuned AP gain over random init


def closing_lines(summary: dict, metrics: dict, cfg: JobConfig, data_root: str, registered: dict) -> list[str]:
    """What a pretraining run ends with: what it trained, where the registered model is and how to load it, and
    what its downstream figure means (the demo's tiny model cannot show what pretraining buys: the quality
    configuration measures it). ``registered``: {"model_name", "version", "champion"}."""
    name, version = registered["model_name"], registered["version"]
    gains = ", ".join(f"{k[len('ft_ap_gain_b'):]} vol {v:+.3f}" for k, v in metrics.items()
                      if k.startswith("ft_ap_gain_b"))
    lines = [f"trained {summary['steps']} steps: loss {summary['initial_loss']:.4f} -> {summary['final_loss']:.4f}; "
             f"held-out masked NMSE {metrics['masked_nmse']:.4f} vs zero baseline {metrics['baseline_zero_nmse']:.4f}"
             + (f"; fine-tuned AP gain over random init: {gains}" if gains else ""),
             f"registered {name} v{version}{' (champion)' if registered['champion'] else ''} at "
             f"{storage.join(data_root, 'registry', name, f'v{version}')}; export it with: sfm registry export "
             f"{name}:v{version} DIR --data-root {data_root}"]
    if cfg.model.preset == "tiny":
        measured = ", ".join(f"{g} at {n} labelled volume{'s' if n > 1 else ''}" for n, g in QUALITY_GAINS.items())
        lines.append(f"this demo's {cfg.train.max_steps}-step tiny model is too small for pretraining to help, so its "
                     f"gain means nothing; the quality configuration measures what pretraining buys (last measured: "
                     f"{measured}; BENCHMARKS.md \"Quality\"): {QUALITY_COMMAND}")
    return lines
