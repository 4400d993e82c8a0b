"""``sfm registry`` and ``sfm predict``: registered models, and a task model over a whole survey."""

from __future__ import annotations

import argparse
import json
import sys

from sfm.cli.options import device, set_argument, set_values
from sfm.config import DATA_ROOT, LAYOUTS
from sfm.config_values import DEVICES
from sfm.errors import SFMError
from sfm.user_errors import deprecated


def _registry_reference(args: argparse.Namespace) -> str:
    """The model reference of `sfm registry ACTION`: the positional one, or the old --model/--version spelling (kept
    for one release, with a notice); show/load/export/sync default to the encoder's champion."""
    from sfm.config import RegistryConfig

    if args.model is None and args.version is None:
        return args.ref or ("" if args.action == "list" else RegistryConfig.model_name)
    if args.ref:
        raise SFMError(f"registry {args.action}: name the version once, as {args.ref} (--model/--version are the "
                       "old spelling)")
    version = str(args.version or "champion")
    ref = f"{args.model or RegistryConfig.model_name}:{version if not version.isdigit() else 'v' + version}"
    if args.action == "list":
        ref = args.model or ""
    old = " ".join(f"--{k} {v}" for k, v in (("model", args.model), ("version", args.version)) if v is not None)
    deprecated(f"sfm registry {args.action} {old}", f"sfm registry {args.action} {ref}")
    return ref


def _cmd_registry(args: argparse.Namespace) -> None:
    """list: one JSON line per version (every model, encoders and task models, or one model's); show: the record;
    promote: force a version to champion; load: build the model (files checked against their sha256) and, with
    --out, export it byte for byte; export: a Hugging Face model folder (with its model card), or the files byte
    for byte; sync: log a version to MLflow and move its champion alias (sfm.model.mlflow_sync). A version is named
    by a model reference or a version folder's URL (sfm.model.registry.find)."""
    from sfm.model import registry

    ref = _registry_reference(args)
    if args.action == "list":
        names = [ref.partition(":")[0]] if ref else registry.models(args.data_root)
        if not any(registry.versions(args.data_root, name) for name in names):
            print(f"sfm registry list: no model{' ' + repr(names[0]) if ref else ''} registered in {args.data_root}; "
                  f"make one with `sfm flow pretrain run --data-root {args.data_root}` (an encoder) or `sfm flow "
                  "finetune run ...` (a task model)", file=sys.stderr)
        for name in names:
            champion = registry.champion_version(args.data_root, name)
            for version in registry.versions(args.data_root, name):
                record = registry.get(args.data_root, name, version)
                task = registry.is_task_model(record)
                line = {"model": name, "kind": "task" if task else "encoder", "version": version,
                        "champion": version == champion, "created_at": record["created_at"]}
                keys = ("ap", "f1", "iou") if task else ("masked_nmse", "ft_ap_gain_b1", "ft_ap_gain_b4")
                line.update({k: record["metrics"][k] for k in keys if k in record["metrics"]})
                if task:
                    line.update(task=record["lineage"]["task"], encoder=record["lineage"]["encoder"])
                print(json.dumps({**line, "run": record["lineage"]["run_pathspec"]}))
        return
    found = registry.find(args.data_root, ref)
    if not found.name:
        raise SFMError(f"registry {args.action}: {ref} is not a registered version; name one as NAME[:vN] or by its "
                       "folder, <data-root>/registry/NAME/vN")
    root, model_name, version = found.data_root, found.name, found.version
    if args.action == "show":
        record = registry.get(root, model_name, version)
        record["champion"] = registry.champion_version(root, model_name) == version
        record["url"] = registry.version_url(root, model_name, version)
        print(json.dumps(record, indent=1))
    elif args.action == "promote":
        if ref.partition(":")[2] in ("", "champion") and not registry.is_folder_url(ref):
            raise SFMError("registry promote needs the version to promote: sfm registry promote NAME:vN")
        registry.promote(root, model_name, version, mlflow_uri=args.mlflow_uri)
        print(f"{model_name} v{version} is now the champion")
    elif args.action == "load":
        model = registry.load(root, model_name, version)
        if args.out:
            registry.export(root, model_name, version, args.out, "files")
        encoder = getattr(model, "mae", model)
        print(json.dumps({"model": model_name, "version": version, "config": encoder.cfg.to_dict(),
                          "task": model.task.to_dict() if hasattr(model, "task") else None,
                          "parameters": sum(p.numel() for p in model.parameters()), "saved_to": args.out or None}))
    elif args.action == "export":
        if not args.dir:
            raise SFMError("registry export needs the folder to write: sfm registry export NAME:vN DIR")
        files = registry.export(root, model_name, version, args.dir, args.format)
        print(json.dumps({"model": model_name, "version": version, "format": args.format, "out": args.dir,
                          "files": files}))
        if args.format == "hf":
            cls = "Segmenter" if registry.is_task_model(registry.get(root, model_name, version)) \
                else "MaskedAutoencoder3D"
            print(f"sfm registry export: {model_name} v{version} -> {args.dir} ({', '.join(files)}); load it with "
                  f"{cls}.from_pretrained({args.dir!r}), or push it with: hf upload ORG/NAME {args.dir}",
                  file=sys.stderr)
    elif args.action == "sync":
        if registry.sync_mlflow(root, model_name, version, args.mlflow_uri) is None:
            raise SFMError("registry sync: no MLflow to log to; pass --mlflow-uri or set MLFLOW_TRACKING_URI")


def _cmd_predict(args: argparse.Namespace) -> None:
    """Predict a survey with a task model: one JSON line on stdout, one summary line on stderr. The settings are the
    job config's [predict] (--config), the flags given, then --set, as the predict flow's."""
    from sfm.config import JobConfig
    from sfm.ingest.survey import survey_store
    from sfm.predict import PredictOptions, predict

    settings = JobConfig.from_toml(args.config or None).override(
        set_values(args), output=args.output, mirror=args.mirror, layout=args.layout, parts=args.parts,
        overlap=args.overlap, batch_size=args.batch_size, device=args.device, threshold=args.threshold).predict
    survey = survey_store(args.survey, args.data_root)  # a survey id, a store, or a SEG-Y / MDIO ingested first
    opts = PredictOptions.of(settings, model=args.model, survey=survey, out=args.out, data_root=args.data_root,
                             segy=args.segy)
    result = predict(opts, part=args.part, progress=True)  # a bar on a terminal, plain lines in a log
    print(json.dumps(result))
    done = "published" if result["published"] else f"part {args.part} of {result['parts']} written (not published yet)"
    print(f"sfm predict: {result['out']} {done}: {len(result['ran'])} part(s) run, {len(result['reused'])} reused, "
          f"{result['voxels'] / 1e6:.1f} M voxels in {result['seconds']:.1f}s "
          f"({result['voxels'] / max(result['cpu_s'], 1e-9) / 1e6:.2f} M voxels per CPU second)", file=sys.stderr)


def add_commands(sub) -> None:
    """registry, predict: registered models, and predicting a survey with a task model (docs/predict.md)."""
    p = sub.add_parser("registry", help="list, show, promote, load, export or sync (to MLflow) registered model "
                       "versions (encoders and task models)")
    p.add_argument("action", choices=["list", "show", "promote", "load", "export", "sync"])
    p.add_argument("ref", nargs="?", default="", metavar="MODEL", help="the model version: a reference, NAME (its "
                   "champion), NAME:vN, NAME:latest or NAME:champion, or a version folder's URL "
                   "(<data-root>/registry/NAME/vN); default: list every model, the others sfm-mae's champion")
    p.add_argument("dir", nargs="?", default="", metavar="DIR",
                   help="with export: the folder to write (local or s3://)")
    p.add_argument("--data-root", default=DATA_ROOT, help=f"the registry's data root (default {DATA_ROOT})")
    p.add_argument("--out", default="", help="with load: export the model's files to this folder")
    p.add_argument("--format", choices=["hf", "files"], default="hf", help="with export: hf, a Hugging Face model "
                   "folder with a model card (default); files, the registered files byte for byte")
    p.add_argument("--mlflow-uri", default="", help="with promote and sync: the MLflow tracking server (default: "
                   "the version's [registry] mlflow_uri, else MLFLOW_TRACKING_URI)")
    # the old spelling of MODEL, kept for one release (sfm registry show --model sfm-mae --version 3)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--version", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_registry)

    from sfm.config import PREDICT_OUTPUTS, PredictConfig

    p = sub.add_parser("predict", help="predict a whole survey with a task model, into a store on its grid "
                       "(and optionally a SEG-Y)")
    p.add_argument("--model", required=True, help="a model reference of the registry in --data-root (sfm-faults: "
                   "its champion, sfm-faults:v3, sfm-faults:latest), or a task model's folder URL")
    p.add_argument("--survey", required=True, help="a survey id or store URL (what `sfm ingest` printed), or a SEG-Y "
                   "file / MDIO store, ingested into --data-root first")
    p.add_argument("--out", required=True, help="the prediction store's URL (local path or s3://); must not exist")
    p.add_argument("--data-root", default=DATA_ROOT, help="where --model NAME is registered and --survey "
                   f"published or ingested (default {DATA_ROOT})")
    p.add_argument("--config", default="", help="TOML job config whose [predict] section holds the settings below "
                   "(a file, or a packaged config's name; default: sfm/default.toml)")
    # each flag below sets its key of [predict] (sfm.config.PARAMETERS); not given: the config's value
    p.add_argument("--output", choices=PREDICT_OUTPUTS, help="probability (float32; binary tasks: of class 1) or "
                   f"classes (uint8); default: the config's, {PredictConfig.output}")
    p.add_argument("--mirror", action=argparse.BooleanOptionalAction, default=None, help="test-time mirroring: each "
                   "window also seen flipped along the inlines and crosslines (and swapped), averaged; 4-8x the work "
                   "(default: the config's, else as the task model's held-out scores were measured)")
    p.add_argument("--layout", choices=LAYOUTS, help="sfm (default), or mdio: also what MDIO's tools read and export "
                   "(needs a survey ingested with --layout mdio, or an MDIO store)")
    p.add_argument("--segy", default="", help="also write a SEG-Y here, with the source's trace headers")
    p.add_argument("--parts", type=int, help="split the survey into this many parts (runs of whole shard rows) for "
                   f"separate tasks or GPUs (default: the config's, {PredictConfig.parts})")
    p.add_argument("--part", type=int, default=None, help="run only this part (0..parts-1) and publish nothing; "
                   "without it every part not yet written runs, then the store is published")
    p.add_argument("--overlap", type=float, help="overlap of neighbouring windows, a fraction of the crop (default: "
                   "the config's, else as the task model's held-out scores were measured, 0.5 for one that records "
                   "none)")
    p.add_argument("--threshold", type=float, help="--output classes of a binary task: class 1 where its "
                   "probability reaches this (default: the config's, else the threshold the task model's F1 was scored "
                   "at, chosen on its validation labels where it had any; 0.5 for a model that records none)")
    p.add_argument("--batch-size", type=int, help="windows per network call (default: the config's, "
                   f"{PredictConfig.batch_size})")
    p.add_argument("--device", type=device, metavar="{" + ",".join(DEVICES) + "}",
                   help="auto (a GPU if there is one), cpu, cuda or cuda:N (default: the config's, auto)")
    set_argument(p)
    p.set_defaults(func=_cmd_predict)
