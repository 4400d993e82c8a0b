"""``sfm train``, ``sfm slurm-script``, ``sfm status``, ``sfm flow``, ``sfm watch``: running jobs outside and
inside Metaflow, and watching them."""

from __future__ import annotations

import argparse
import json
import sys

from sfm.cli.options import set_argument, set_values
from sfm.config import DATA_ROOT, LAUNCHERS, STRATEGIES
from sfm.errors import SFMError
from sfm.ops.flow_files import FLOWS


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
    """The job of `sfm train` / `sfm slurm-script`, parsed once: the TOML config with the flags given and the
    ``--set`` values on top (:meth:`sfm.config.JobConfig.override`, as the flows' parameters), then resolved as the
    flow's ``start`` resolves it (:func:`sfm.ops.pipeline.job_config`: the Accelerate config it names mapped onto
    it, every setting checked, ``train.init_from`` found; a conflict is refused here, before anything starts)."""
    from sfm.config import JobConfig
    from sfm.ops import pipeline

    cfg = pipeline.job_config(JobConfig.from_toml(args.config or None).override(
        set_values(args), nodes=args.nodes, procs_per_node=args.procs_per_node, cp=args.cp, strategy=args.strategy,
        launcher=args.launcher, accelerate_config=args.accelerate_config))
    return pipeline.resolve_init_from(cfg, args.data_root)


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
    p.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)  # the old spelling of --set (one release)
    p.add_argument("--config", default="", help="TOML job config: a file, or a packaged config's name "
                   "(quality_cpu, hyperpod_p5en; default: sfm/default.toml)")
    set_argument(p)
    p.add_argument("--data-root", default=DATA_ROOT, help="train on every survey published in this data root's "
                   f"manifest (default {DATA_ROOT}); with --surveys, where their MDIO stores are registered")
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


def _cmd_flow(args: argparse.Namespace) -> None:
    """Run a packaged flow: this process becomes ``python sfm/flows/NAME_flow.py ARGS``
    (:func:`sfm.ops.flow_files.flow_command`), so Metaflow has the terminal, the signals and the exit status."""
    import os

    from sfm.ops.flow_files import flow_command

    command = flow_command(args.flow, args.args)
    sys.stdout.flush()
    os.execv(command[0], command)


def _cmd_watch(args: argparse.Namespace) -> None:
    """Start a flow run (or publish an Argo Event) for each batch of new surveys in the landing prefix."""
    from sfm.ops.watch import FLOW_FILE, WatchOptions, watch

    opts = WatchOptions(landing=args.landing, data_root=args.data_root, flow=args.flow or str(FLOW_FILE),
                        config=args.config, overrides=args.set, held_out=args.held_out,
                        publish_event=args.publish_event, event_url=args.event_url, lease_s=args.lease,
                        wait_s=args.wait)
    watch(opts, interval_s=args.interval, once=args.once)


def add_commands(sub) -> None:
    """status, train, slurm-script, flow, watch: running training and the flows, and watching them."""
    p = sub.add_parser("status", help="a training run's progress from its heartbeat")
    p.add_argument("run", help="run root (s3://.../checkpoints/RUN or a local path) or a run name "
                   "(PretrainFlow-ID or PretrainFlow/ID, with --data-root)")
    p.add_argument("--data-root", default=DATA_ROOT, help=f"data root holding checkpoints/<run>/ (default {DATA_ROOT})")
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

    p = sub.add_parser("flow", help="run a flow of the package from any folder: sfm flow NAME [METAFLOW ARGUMENTS], "
                       "e.g. sfm flow finetune run --surveys ... (python flows/NAME_flow.py ... in a checkout)")
    p.add_argument("flow", choices=FLOWS, help="pretrain (SEG-Y to a registered encoder), finetune (labelled surveys "
                   "to a task model) or predict (a task model over a survey)")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="Metaflow's arguments: [--config config "
                   "FILE|NAME] [--with DECORATOR] run [PARAMETERS] | resume | card view STEP | ...; NAME: a packaged "
                   "config (sfm/configs/: quality_cpu, hyperpod_p5en; default)")
    p.set_defaults(func=_cmd_flow)

    p = sub.add_parser("watch", help="retrain when new SEG-Y lands: one flow run per batch of new surveys")
    p.add_argument("--landing", required=True, help="prefix where SEG-Y files arrive (local path or s3://)")
    p.add_argument("--data-root", default=DATA_ROOT, help=f"the data root (manifest, registry, watcher state; "
                   f"default {DATA_ROOT})")
    p.add_argument("--once", action="store_true", help="one pass, then exit (default: a pass every --interval)")
    p.add_argument("--interval", type=float, default=300.0, help="seconds between passes")
    p.add_argument("--config", default="", help="TOML job config for the runs: a file, or a packaged config's name "
                   "(default: the champion's)")
    set_argument(p)
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
