"""The `sfm` console script.

Every subcommand turns a user-caused problem (an :class:`sfm.errors.SFMError`, an unreachable bucket: the rule of
:func:`sfm.user_errors.describe_user_error`) into one line on stderr and exit status 2; bugs keep their tracebacks.
"""

from __future__ import annotations

import argparse
import json
import sys

from sfm.config import INGEST_DTYPES, LAUNCHERS, STRATEGIES, IngestConfig
from sfm.errors import SFMError
from sfm.flows import FLOWS
from sfm.user_errors import exit_status


def _cmd_synth(args: argparse.Namespace) -> None:
    from sfm.synth.survey import synth_survey

    result = synth_survey(
        args.out,
        shape=tuple(args.shape),
        seed=args.seed,
        sample_format=args.format,
        endian=args.endian,
        iline_byte=args.iline_byte,
        xline_byte=args.xline_byte,
        sorting=args.sorting,
    )
    print(json.dumps(result))


def _cmd_ingest(args: argparse.Namespace) -> None:
    """One JSON line per survey on stdout, one summary line on stderr; each bad file gets its own error line."""
    import time

    from sfm.ingest.survey import ingest_survey

    IngestConfig(layout=args.layout, domain=args.domain).check_layout()  # once, before any file
    t0, read_bytes, failures = time.perf_counter(), 0, []
    for src in args.src:
        try:
            row = ingest_survey(src, args.out, iline_byte=args.iline_byte, xline_byte=args.xline_byte,
                                endian=args.endian, chunk=args.chunk, dtype=args.dtype, codec=args.codec,
                                max_sparsity=args.max_sparsity, layout=args.layout, domain=args.domain,
                                nonfinite="refuse" if args.refuse_nonfinite else "replace",
                                progress=True)
        except SFMError as err:
            if len(args.src) == 1:
                raise
            failures.append(src)
            print(f"sfm ingest: error: {err}", file=sys.stderr, flush=True)
            continue
        if row["status"] == "ingested":
            read_bytes += json.loads(row["stats_json"])["count"] * 4
        stats = json.loads(row.pop("stats_json"))
        print(json.dumps({**row, "stats": stats}, default=str), flush=True)
    seconds = time.perf_counter() - t0
    done = len(args.src) - len(failures)
    print(f"sfm ingest: {done} of {len(args.src)} survey(s) in {seconds:.1f}s, {read_bytes / 1e6:.1f} MB of samples "
          f"ingested ({read_bytes / 1e6 / max(seconds, 1e-9):.1f} MB/s)", file=sys.stderr)
    if failures:
        raise SFMError(f"{len(failures)} of {len(args.src)} sources failed (see the lines above): {', '.join(failures)}")


def _cmd_ingest_labels(args: argparse.Namespace) -> None:
    """One JSON line: the label set's manifest row and whether it was ingested or existed."""
    from sfm.ingest.labels import ingest_labels

    row = ingest_labels(args.labels, args.survey, args.out, ignore=args.ignore, variable=args.variable, name=args.name)
    row.pop("label_mask")
    print(json.dumps(row, default=str))
    print(f"sfm ingest-labels: {row['name']} -> {row['store_url']} ({row['status']}): {row['labelled_voxels']} "
          f"labelled voxels on {row['labelled_inlines']} inlines, classes {row['classes']}, {row['seconds']:.1f}s",
          file=sys.stderr)


def _cmd_registry(args: argparse.Namespace) -> None:
    """list: one JSON line per version (every model, encoders and task models, without a model); show: the
    record; promote: force a version to champion; load: build the model (files checked against their sha256)
    and, with --out, export it byte for byte; export: a Hugging Face model folder (with its model card), or the
    files byte for byte; sync: log a version to MLflow and move its champion alias (sfm.model.mlflow_sync)."""
    from sfm.model import registry

    if args.action == "list":
        names = [args.ref or args.model] if args.ref or args.model else registry.models(args.data_root)
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
    if args.ref and (args.model or str(args.version) != "champion"):
        raise SFMError(f"registry {args.action}: name the version once, as {args.ref} or with --model/--version")
    if args.ref:
        model_name, version = registry.resolve_reference(args.data_root, args.ref)
    else:
        model_name = args.model or "sfm-mae"
        version = registry.resolve(args.data_root, model_name, args.version)
    if args.action == "show":
        record = registry.get(args.data_root, model_name, version)
        record["champion"] = registry.champion_version(args.data_root, model_name) == version
        record["url"] = registry.version_url(args.data_root, model_name, version)
        print(json.dumps(record, indent=1))
    elif args.action == "promote":
        asked = args.ref.partition(":")[2] if args.ref else str(args.version)
        if asked in ("", "champion"):
            raise SFMError("registry promote needs the version to promote: sfm registry promote NAME:vN")
        registry.promote(args.data_root, model_name, version, mlflow_uri=args.mlflow_uri)
        print(f"{model_name} v{version} is now the champion")
    elif args.action == "load":
        model = registry.load(args.data_root, model_name, version)
        if args.out:
            registry.export(args.data_root, model_name, version, args.out, "files")
        encoder = getattr(model, "mae", model)
        print(json.dumps({"model": model_name, "version": version, "config": encoder.cfg.to_dict(),
                          "task": model.task.to_dict() if hasattr(model, "task") else None,
                          "parameters": sum(p.numel() for p in model.parameters()), "saved_to": args.out or None}))
    elif args.action == "export":
        if not args.dir:
            raise SFMError("registry export needs the folder to write: sfm registry export NAME:vN DIR")
        files = registry.export(args.data_root, model_name, version, args.dir, args.format)
        print(json.dumps({"model": model_name, "version": version, "format": args.format, "out": args.dir,
                          "files": files}))
        if args.format == "hf":
            cls = "Segmenter" if registry.is_task_model(registry.get(args.data_root, model_name, version)) \
                else "MaskedAutoencoder3D"
            print(f"sfm registry export: {model_name} v{version} -> {args.dir} ({', '.join(files)}); load it with "
                  f"{cls}.from_pretrained({args.dir!r}), or push it with: hf upload ORG/NAME {args.dir}",
                  file=sys.stderr)
    elif args.action == "sync":
        if registry.sync_mlflow(args.data_root, model_name, version, args.mlflow_uri) is None:
            raise SFMError("registry sync: no MLflow to log to; pass --mlflow-uri or set MLFLOW_TRACKING_URI")


def _cmd_predict(args: argparse.Namespace) -> None:
    """Predict a survey with a task model: one JSON line on stdout, one summary line on stderr."""
    from sfm.predict import PredictOptions, predict

    opts = PredictOptions(model=args.model, survey=args.survey, out=args.out, data_root=args.data_root,
                          output=args.output, mirror=args.mirror, layout=args.layout, segy=args.segy, parts=args.parts,
                          overlap=args.overlap, batch_size=args.batch_size, device=args.device)
    result = predict(opts, part=args.part, progress=True)  # a bar on a terminal, plain lines in a log
    print(json.dumps(result))
    done = "published" if result["published"] else f"part {args.part} of {result['parts']} written (not published yet)"
    print(f"sfm predict: {result['out']} {done}: {len(result['ran'])} part(s) run, {len(result['reused'])} reused, "
          f"{result['voxels'] / 1e6:.1f} M voxels in {result['seconds']:.1f}s "
          f"({result['voxels'] / max(result['cpu_s'], 1e-9) / 1e6:.2f} M voxels per CPU second)", file=sys.stderr)


def _cmd_watch(args: argparse.Namespace) -> None:
    """Start a flow run (or publish an Argo Event) for each batch of new surveys in the landing prefix."""
    from sfm.ops.watch import FLOW_FILE, WatchOptions, watch

    opts = WatchOptions(landing=args.landing, data_root=args.data_root, flow=args.flow or str(FLOW_FILE),
                        config=args.config, overrides=args.set, held_out=args.held_out,
                        publish_event=args.publish_event, event_url=args.event_url, lease_s=args.lease,
                        wait_s=args.wait)
    watch(opts, interval_s=args.interval, once=args.once)


def _cmd_flow(args: argparse.Namespace) -> None:
    """Run a packaged flow: this process becomes ``python sfm/flows/NAME_flow.py ARGS``
    (:func:`sfm.flows.flow_command`), so Metaflow has the terminal, the signals and the exit status."""
    import os

    from sfm.flows import flow_command

    command = flow_command(args.flow, args.args)
    sys.stdout.flush()
    os.execv(command[0], command)


def _cmd_iam_policy(args: argparse.Namespace) -> None:
    """Print the least-privilege IAM policy (JSON) for the pipeline's S3 access to one data root, or with
    --bucket-policy the policy of its bucket (TLS only; with --vpce, only through those endpoints)."""
    from sfm.storage import iam

    if args.bucket_policy:
        from sfm.storage.bucket_policy import bucket_policy

        print(iam.policy_json(bucket_policy(args.data_root, vpce=args.vpce or [],
                                            exempt_principals=args.exempt_principal or [], partition=args.partition)))
        return
    components = args.component or [*iam.COMPONENTS, *(["demo"] if args.demo else [])]
    document = iam.policy(args.data_root, landing=args.landing or [], metaflow_root=args.metaflow_root,
                          components=components, kms_key_arns=args.kms_key_arn or [], partition=args.partition,
                          vpce=args.vpce or [])
    print(iam.policy_json(document))
    size = iam.minified_size(document)
    if size > iam.MANAGED_POLICY_MAX_CHARS:
        print(f"sfm iam-policy: {size} characters is over the {iam.MANAGED_POLICY_MAX_CHARS} of a managed policy; "
              "attach it as an inline role policy (10,240) or split it with --component", file=sys.stderr)


def _cmd_network_policy(args: argparse.Namespace) -> None:
    """Print the Kubernetes NetworkPolicy (JSON) of the pretrain step's pods, for `kubectl apply -f`."""
    from sfm.ops.network_policy import network_policy

    print(json.dumps(network_policy(args.namespace, name=args.name, https_cidrs=tuple(args.https_cidr or ["0.0.0.0/0"]),
                                    extra_egress=tuple(args.allow_egress or [])), indent=2))


def _cmd_status(args: argparse.Namespace) -> int:
    """One line (or JSON) from a run's heartbeat; exit 1 when the run is stale or failed."""
    from sfm.train import health

    root = health.resolve_run_root(args.run, args.data_root)
    record = health.read_heartbeat(root)
    if record is None:
        raise SFMError(f"no heartbeat at {health.heartbeat_url(root)}; check the run and --data-root "
                       "(a run writes its first heartbeat after its first step)")
    info = health.describe(record, stale_after_s=args.stale_after)
    print(json.dumps(info, sort_keys=True) if args.json else f"{root}: {health.summary_line(info)}")
    return 1 if info["state"] in ("stale", "failed") else 0


def _job_config(args: argparse.Namespace):
    """The job of `sfm train` / `sfm slurm-script`, parsed once: the TOML config with the SECTION.KEY=VALUE
    overrides and the flags given on top (:meth:`sfm.config.JobConfig.override`, as the flows' parameters), then
    resolved as the flow's ``start`` resolves it (:func:`sfm.ops.pipeline.job_config`: the Accelerate config it
    names mapped onto it, every setting checked; a conflict is refused here, before anything starts)."""
    from sfm.ops import pipeline
    from sfm.config import JobConfig

    return pipeline.job_config(JobConfig.from_toml(args.config or None).override(
        args.overrides, nodes=args.nodes, procs_per_node=args.procs_per_node, cp=args.cp, strategy=args.strategy,
        launcher=args.launcher, accelerate_config=args.accelerate_config))


def _cmd_train(args: argparse.Namespace) -> None:
    """Train one node's share of a job (outside Metaflow: by hand, or on each node of a Slurm job)."""
    import dataclasses

    from sfm import storage
    from sfm.distributed import launch
    from sfm.distributed.job import NodeLaunch, node_job
    from sfm.ops import slurm

    cfg = _job_config(args)
    run_root = storage.normalize(args.run_root)
    surveys = slurm.training_surveys(surveys=args.surveys, data_root=args.data_root, held_out=args.held_out)
    node = NodeLaunch(nodes=cfg.dist.nodes, procs_per_node=cfg.dist.procs_per_node, node_rank=args.node_rank,
                      main_addr=args.main_addr, main_port=args.main_port or launch.port_for(run_root))
    job = node_job(cfg, surveys, run_root, node)
    if args.dry_run:  # the launch plan: the command, its launch files, the job, the cluster environment
        import os
        import tempfile

        from sfm.ops.cluster import node_environment

        env = {key: os.environ.get(key) for key in node_environment(cfg.cluster)}
        with tempfile.TemporaryDirectory(prefix="sfm-launch-") as tmp:
            command = launch.node_command(job, node, tmp)
            files = {name: open(os.path.join(tmp, name)).read() for name in sorted(os.listdir(tmp))
                     if name != "job.json"}
        print(json.dumps({"launch_node": dataclasses.asdict(node), "command": command, "launch_files": files,
                          "job": job.to_dict(), "environment": env}))
        return
    result = launch.run_node(job, node)
    if result is not None:
        print(json.dumps({k: result.get(k) for k in ("steps", "resumed_from_step", "world_size", "initial_loss",
                                                     "final_loss", "samples_per_s", "model_url")}))


def _cmd_slurm_script(args: argparse.Namespace) -> None:
    """Write the sbatch script that runs `sfm train` on every node of a Slurm allocation."""
    import shlex

    from sfm import storage
    from sfm.ops import slurm

    cfg = _job_config(args)
    opts = slurm.SbatchOptions(
        data_root=storage.normalize(args.data_root) if args.data_root else "", run_root=storage.normalize(args.run_root),
        surveys=args.surveys, held_out=args.held_out,
        job_name=args.job_name, partition=args.partition, account=args.account, time=args.time, output=args.log,
        requeue_before_s=args.requeue_before, setup=args.setup, auto_resume=args.auto_resume)
    script = slurm.render_sbatch(cfg, opts, command_line=shlex.join(["sfm", *sys.argv[1:]]))
    if args.out == "-":
        sys.stdout.write(script)
        return
    storage.write_bytes(args.out, script.encode())
    print(f"sfm slurm-script: wrote {args.out} ({cfg.dist.nodes} node(s) x {cfg.dist.procs_per_node} process(es)); "
          f"submit with: sbatch {args.out}", file=sys.stderr)


def _job_arguments(p: argparse.ArgumentParser) -> None:
    """What `sfm train` and `sfm slurm-script` share: the job config, the data, the run root, the size."""
    p.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE", help="config overrides, e.g. train.max_steps=500")
    p.add_argument("--config", default="", help="TOML job config (default: sfm/default.toml)")
    p.add_argument("--data-root", default="", help="train on every survey published in this data root's manifest")
    p.add_argument("--surveys", default="", help="comma-separated survey store URLs to train on instead")
    p.add_argument("--held-out", default="", help="with --data-root: comma-separated survey names/ids to leave out")
    p.add_argument("--run-root", required=True, help="where checkpoints, the final model and the summary go; "
                   "a run started again with the same run root resumes from its newest checkpoint")
    # each flag below sets its key of the job config (sfm.config.PARAMETERS); not given: the config's value
    p.add_argument("--nodes", type=int, help="nodes in the job (default: the config's [dist] nodes)")
    p.add_argument("--procs-per-node", type=int,
                   help="training processes per node, one per GPU (default: the config's [dist] procs_per_node)")
    p.add_argument("--cp", type=int, help="context-parallel ranks per volume; nodes x procs-per-node must "
                   "divide by it (default: the config's [dist] cp)")
    p.add_argument("--strategy", choices=STRATEGIES,
                   help="data-parallel strategy (default: the config's [dist] strategy; deepspeed-*: the deepspeed extra)")
    p.add_argument("--launcher", choices=LAUNCHERS,
                   help="what starts each node's processes: torchrun, or accelerate (accelerate launch) "
                   "(default: the config's [dist] launcher)")
    p.add_argument("--accelerate-config", metavar="FILE",
                   help="an Accelerate config file (as `accelerate config` writes it) mapped onto the job: precision, "
                   "machines, processes, FSDP2 or DeepSpeed ZeRO stage; a conflicting one is refused "
                   "(default: the config's [dist] accelerate_config)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sfm", description="Seismic foundation model pipeline")
    parser.add_argument("--allow-insecure-s3", action="store_true",
                        help="allow a plain-http S3 endpoint off loopback (same as SFM_ALLOW_INSECURE_S3=1)")
    sub = parser.add_subparsers(dest="command", required=True)

    _add_data_commands(sub)
    _add_model_commands(sub)
    _add_predict_command(sub)
    _add_run_commands(sub)
    return parser


def _add_data_commands(sub) -> None:
    """synth, ingest: SEG-Y in, survey stores out."""
    p = sub.add_parser("synth", help="write a synthetic post-stack SEG-Y survey and its fault labels")
    p.add_argument("out", help="output SEG-Y path (fault labels are written beside it)")
    p.add_argument("--shape", type=int, nargs=3, metavar=("IL", "XL", "NS"), default=[64, 64, 128])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", type=int, choices=[1, 3, 5, 8], default=5, help="SEG-Y sample format code")
    p.add_argument("--endian", choices=["big", "little"], default="big")
    p.add_argument("--iline-byte", type=int, default=189)
    p.add_argument("--xline-byte", type=int, default=193)
    p.add_argument("--sorting", choices=["inline", "crossline"], default="inline")
    p.set_defaults(func=_cmd_synth)

    p = sub.add_parser("ingest", help="SEG-Y files -> Zarr v3 survey stores, published in the manifest; MDIO v1 "
                       "stores are registered, read in place (nothing copied)")
    p.add_argument("src", nargs="+", help="SEG-Y files or MDIO v1 stores (.mdio; local paths or s3:// URLs)")
    p.add_argument("--out", required=True, help="data root (local path or s3://bucket/prefix)")
    p.add_argument("--iline-byte", type=int, default=None, help="trace-header byte of the inline number")
    p.add_argument("--xline-byte", type=int, default=None, help="trace-header byte of the crossline number")
    p.add_argument("--endian", choices=["auto", "big", "little"], default="auto")
    p.add_argument("--chunk", type=int, default=128, help="brick edge in voxels (default 128: 128^3 bricks)")
    p.add_argument("--dtype", choices=INGEST_DTYPES, default=IngestConfig.dtype,
                   help="float32 is lossless; float16 stores standardised values, int8 values quantised over the "
                        "0.1-99.9 percentile range (saturating beyond it); both record the transform")
    p.add_argument("--codec", default=IngestConfig.codec,
                   help=f"Blosc compressor of the bricks, cname[:clevel] (default {IngestConfig.codec}; lz4 decodes "
                        "about twice as fast and stores 5-25 %% more bytes)")
    p.add_argument("--max-sparsity", type=float, default=10.0,
                   help="largest allowed ratio of grid cells to traces (default 10)")
    p.add_argument("--refuse-nonfinite", action="store_true",
                   help="fail on NaN/inf samples instead of replacing them by 0 and counting them")
    p.add_argument("--layout", default=IngestConfig.layout,
                   help="sfm (default), or mdio: also what MDIO's tools read and export")
    p.add_argument("--domain", default=IngestConfig.domain,
                   help="the sample axis, time (default) or depth: its name in the mdio layout")
    p.set_defaults(func=_cmd_ingest)

    p = sub.add_parser("ingest-labels", help="a label volume aligned with a published survey (SEG-Y with its "
                       "geometry, .npy on its grid, or a Zarr/MDIO integer variable) -> a label store in the manifest")
    p.add_argument("labels", help="the label file or store (local path or s3:// URL)")
    p.add_argument("--survey", required=True, help="the survey it labels: its survey id in --out, or its store URL")
    p.add_argument("--out", default="sfm_data", help="data root holding the survey (default sfm_data, as the flows)")
    p.add_argument("--ignore", type=int, default=None, help="the value of samples nobody interpreted (255 always is)")
    p.add_argument("--variable", default="", help="Zarr/MDIO: the variable holding the labels (default: the only "
                   "integer 3-D one)")
    p.add_argument("--name", default="", help="display name (default: the file name)")
    p.set_defaults(func=_cmd_ingest_labels)


def _add_model_commands(sub) -> None:
    """registry, watch, iam-policy, network-policy: registered models, retraining, the S3 and network policies."""
    p = sub.add_parser("registry", help="list, show, promote, load, export or sync (to MLflow) registered model "
                       "versions (encoders and task models)")
    p.add_argument("action", choices=["list", "show", "promote", "load", "export", "sync"])
    p.add_argument("ref", nargs="?", default="", metavar="NAME[:vN]", help="the model version: NAME (its champion), "
                   "NAME:vN, NAME:N, NAME:latest or NAME:champion (instead of --model and --version)")
    p.add_argument("dir", nargs="?", default="", metavar="DIR",
                   help="with export: the folder to write (local or s3://)")
    p.add_argument("--data-root", default="sfm_data", help="the flows' data root (default sfm_data)")
    p.add_argument("--model", default="", help="sfm-mae, a task model (sfm-<task>); default: list every model, "
                   "show/promote/load/export/sync sfm-mae")
    p.add_argument("--version", default="champion", help="N, vN, latest or champion")
    p.add_argument("--out", default="", help="with load: export the model to this folder")
    p.add_argument("--format", choices=["hf", "files"], default="hf", help="with export: hf, a Hugging Face model "
                   "folder with a model card (default); files, the registered files byte for byte")
    p.add_argument("--mlflow-uri", default="", help="with promote and sync: the MLflow tracking server (default: "
                   "the version's [registry] mlflow_uri, else MLFLOW_TRACKING_URI)")
    p.set_defaults(func=_cmd_registry)
    p = sub.add_parser("watch", help="retrain when new SEG-Y lands: one flow run per batch of new surveys")
    p.add_argument("--landing", required=True, help="prefix where SEG-Y files arrive (local path or s3://)")
    p.add_argument("--data-root", required=True, help="the data root (manifest, registry, watcher state)")
    p.add_argument("--once", action="store_true", help="one pass, then exit (default: a pass every --interval)")
    p.add_argument("--interval", type=float, default=300.0, help="seconds between passes")
    p.add_argument("--config", default="", help="TOML job config for the runs (default: the champion's)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="config override, repeatable, e.g. --set train.max_steps=500")
    p.add_argument("--held-out", default="", help="comma-separated SEG-Y URLs to evaluate on "
                   "(default: the champion's held-out surveys)")
    p.add_argument("--flow", default="", help="the pretrain flow file (default: the package's, "
                   "sfm/flows/pretrain_flow.py)")
    p.add_argument("--publish-event", action="store_true",
                   help="publish the config's [retrain] event to Argo Events instead of running locally")
    p.add_argument("--event-url", default="", help="Argo Events webhook (default: METAFLOW_ARGO_EVENTS_WEBHOOK_URL)")
    p.add_argument("--lease", type=float, default=600.0, help="seconds a watcher's lease lasts without renewal")
    p.add_argument("--wait", type=float, default=3600.0, help="seconds a pass waits for another watcher's lease")
    p.set_defaults(func=_cmd_watch)

    p = sub.add_parser("flow", help="run a flow of the package from any folder: sfm flow NAME [METAFLOW ARGUMENTS], "
                       "e.g. sfm flow finetune run --surveys ... (python flows/NAME_flow.py ... in a checkout)")
    p.add_argument("flow", choices=FLOWS, help="pretrain (SEG-Y to a registered encoder), finetune (labelled surveys "
                   "to a task model) or predict (a task model over a survey)")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="Metaflow's arguments: [--config config "
                   "FILE|NAME] [--with DECORATOR] run [PARAMETERS] | resume | card view STEP | ...; NAME: a packaged "
                   "config (sfm/configs/: quality_cpu, hyperpod_p5en; default)")
    p.set_defaults(func=_cmd_flow)

    p = sub.add_parser("iam-policy", help="print the least-privilege IAM policy for a data root on S3")
    p.add_argument("--data-root", required=True, help="s3://bucket/prefix the pipeline writes to")
    p.add_argument("--landing", action="append", help="s3:// prefix new SEG-Y arrives in (repeatable; "
                   "default <data-root>/landing)")
    p.add_argument("--metaflow-root", default="", help="Metaflow's S3 datastore root "
                   "(METAFLOW_DATASTORE_SYSROOT_S3), to grant the flow its artifacts, logs and cards")
    p.add_argument("--component", action="append", choices=["ingest", "train", "registry", "watcher", "demo"],
                   help="only these components (repeatable; default: ingest, train, registry, watcher)")
    p.add_argument("--demo", action="store_true", help="also let the embedded demo write <data-root>/landing")
    p.add_argument("--kms-key-arn", action="append", help="KMS key of an SSE-KMS bucket (repeatable)")
    p.add_argument("--partition", default="aws", help="ARN partition (aws, aws-cn, aws-us-gov)")
    p.add_argument("--vpce", action="append", help="VPC endpoint id (vpce-...) every S3 grant is limited to "
                   "(aws:SourceVpce; repeatable)")
    p.add_argument("--bucket-policy", action="store_true", help="print instead the data root bucket's policy: "
                   "deny requests without TLS and, with --vpce, from outside those endpoints")
    p.add_argument("--exempt-principal", action="append", metavar="ARN", help="with --bucket-policy --vpce: a "
                   "role or user still allowed from outside the endpoints, e.g. the administrators' (repeatable)")
    p.set_defaults(func=_cmd_iam_policy)

    p = sub.add_parser("network-policy", help="print the Kubernetes NetworkPolicy isolating the pretrain pods (EKS)")
    p.add_argument("--namespace", required=True, help="the flow's namespace (METAFLOW_KUBERNETES_NAMESPACE)")
    p.add_argument("--name", default="sfm-pretrain")
    p.add_argument("--https-cidr", action="append", help="where HTTPS may go (repeatable; default 0.0.0.0/0), "
                   "e.g. the ranges of the region's S3 prefix list")
    p.add_argument("--allow-egress", action="append", metavar="CIDR:PORT",
                   help="more egress, e.g. the Metaflow metadata service (repeatable)")
    p.set_defaults(func=_cmd_network_policy)


def _add_predict_command(sub) -> None:
    """predict: a task model over a whole survey, into a prediction store (docs/predict.md)."""
    from sfm.predict.parts import LAYOUTS, OUTPUTS, PredictOptions

    p = sub.add_parser("predict", help="predict a whole survey with a task model, into a store on its grid "
                       "(and optionally a SEG-Y)")
    p.add_argument("--model", required=True, help="NAME[:vN|:latest|:champion] in the registry (e.g. sfm-faults:v3; "
                   "NAME alone: its champion), or an exported task model's folder URL")
    p.add_argument("--survey", required=True, help="a survey id or store URL (what `sfm ingest` printed), or a SEG-Y "
                   "file / MDIO store, ingested into --data-root first")
    p.add_argument("--out", required=True, help="the prediction store's URL (local path or s3://); must not exist")
    p.add_argument("--data-root", default=PredictOptions.data_root, help="where --model NAME is registered and "
                   f"--survey published or ingested (default {PredictOptions.data_root}, the flows' default)")
    p.add_argument("--output", choices=OUTPUTS, default=PredictOptions.output,
                   help="probability (float32; binary tasks: of class 1) or classes (uint8)")
    p.add_argument("--mirror", action=argparse.BooleanOptionalAction, default=PredictOptions.mirror,
                   help="test-time mirroring: each window also seen flipped along the inlines and crosslines (and "
                   "swapped), averaged; 4-8x the work (default: as the task model's scores were measured)")
    p.add_argument("--layout", choices=LAYOUTS, default=PredictOptions.layout,
                   help="sfm (default), or mdio: also what MDIO's tools read and export (needs a survey ingested "
                        "with --layout mdio, or an MDIO store)")
    p.add_argument("--segy", default=PredictOptions.segy, help="also write a SEG-Y here, with the source's trace "
                   "headers")
    p.add_argument("--parts", type=int, default=PredictOptions.parts, help="split the survey into this many parts "
                   "(runs of whole shard rows) for separate tasks or GPUs")
    p.add_argument("--part", type=int, default=None, help="run only this part (0..parts-1) and publish nothing; "
                   "without it every part not yet written runs, then the store is published")
    p.add_argument("--overlap", type=float, default=PredictOptions.overlap,
                   help="overlap of neighbouring windows, a fraction of the crop (default: as the task model's "
                   "scores were measured, 0.5 for a model that records none)")
    p.add_argument("--batch-size", type=int, default=PredictOptions.batch_size, help="windows per network call")
    p.add_argument("--device", default=PredictOptions.device, help="auto (a GPU if there is one), cpu, cuda or cuda:N")
    p.set_defaults(func=_cmd_predict)


def _add_run_commands(sub) -> None:
    """status, train, slurm-script: running training outside Metaflow and watching it."""
    p = sub.add_parser("status", help="a training run's progress from its heartbeat")
    p.add_argument("run", help="run root (s3://.../checkpoints/RUN or a local path) or a run name "
                   "(PretrainFlow-ID or PretrainFlow/ID, with --data-root)")
    p.add_argument("--data-root", default="", help="data root holding checkpoints/<run>/")
    p.add_argument("--stale-after", type=float, default=600.0, help="seconds without a heartbeat before a "
                   "running job counts as stale (default 600)")
    p.add_argument("--json", action="store_true", help="print the heartbeat as JSON")
    p.set_defaults(func=_cmd_status)
    p = sub.add_parser("train", help="train one node's share of a job (every node runs it; rendezvous at --main-addr)")
    _job_arguments(p)
    p.add_argument("--node-rank", type=int, default=0, help="this node's index, 0..nodes-1")
    p.add_argument("--main-addr", default="127.0.0.1", help="address of node 0, where the nodes rendezvous")
    p.add_argument("--main-port", type=int, default=0, help="rendezvous port (default: derived from --run-root)")
    p.add_argument("--dry-run", action="store_true", help="print this node's launch plan (JSON) instead of training")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("slurm-script", help="write an sbatch script running `sfm train` on every node (HyperPod Slurm)")
    _job_arguments(p)
    p.add_argument("--out", default="-", help="file to write (default: stdout)")
    p.add_argument("--job-name", default="sfm-pretrain")
    p.add_argument("--partition", default="")
    p.add_argument("--account", default="")
    p.add_argument("--time", default="", help="time limit, e.g. 2-00:00:00; the job requeues itself before it")
    p.add_argument("--log", default="sfm-pretrain-%j.log", help="Slurm output file (appended across requeues)")
    p.add_argument("--requeue-before", type=int, default=120, help="seconds before the time limit to requeue")
    p.add_argument("--setup", default="", help="shell line each node runs first, e.g. 'source /fsx/venv/bin/activate'")
    p.add_argument("--auto-resume", action="store_true",
                   help="HyperPod: srun --auto-resume=1 (replace a faulty node and rerun the step)")
    p.set_defaults(func=_cmd_slurm_script)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.allow_insecure_s3:
        import os

        from sfm.storage.security import INSECURE_ENV

        os.environ[INSECURE_ENV] = "1"
    return exit_status(args.command, lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
