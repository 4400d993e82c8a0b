"""Training outside Metaflow: the surveys ``sfm train`` trains on, and the sbatch script that runs
``sfm train`` on every node of a Slurm allocation (``sfm slurm-script``), e.g. on SageMaker HyperPod Slurm.

``sfm train`` runs one node's share of the job (:func:`sfm.distributed.launch.run_node`): torchrun or
``accelerate launch`` (``[dist] launcher``) starts ``procs_per_node`` processes of ``python -m
sfm.train.trainer`` that rendezvous with the other nodes at ``main_addr:main_port``. All state lives under
``run_root`` (checkpoints in ``<run_root>/ckpt``), so running the same command again -- by hand, or by
Slurm after a requeue -- continues from the newest checkpoint.

The sbatch script (:func:`render_sbatch`) holds the resolved job config (an Accelerate config file it named
already mapped into it, so the nodes need not see the file) and, on every node under
``srun``, runs ``sfm train`` with the rendezvous taken from the allocation: the first host of
``scontrol show hostnames $SLURM_JOB_NODELIST``, ``$SLURM_NNODES``, ``$SLURM_NODEID`` and a port
derived from the job id. ``#SBATCH --requeue`` plus ``--signal=B:USR1@<s>`` and a trap that calls
``scontrol requeue`` put the job back in the queue before its time limit (and Slurm requeues it after
a node failure); the requeued job resumes from the last checkpoint. ``SFM_DRY_RUN=1 bash script``
runs the same per-node logic for each node in turn with ``sfm train --dry-run``, which prints the
node's launch plan instead of training.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass

from sfm import storage
from sfm.formats import manifest
from sfm.config import JobConfig
from sfm.errors import SFMError
from sfm.ingest.mdio_source import is_mdio

REQUEUE_SIGNAL = "USR1"


# ---- the surveys a job trains on ----------------------------------------------------------------------


def training_surveys(*, surveys: str = "", data_root: str = "", held_out: str = "") -> list[str]:
    """Store URLs to train on: ``surveys`` (store URLs; an MDIO store's URL stands for its registration in
    ``data_root``, :func:`_registered_mdio`), or every survey published in ``data_root``'s
    manifest except ``held_out`` (names, survey ids or store URLs); both comma-separated or a JSON list
    (:func:`sfm.storage.objects.split_urls`)."""
    named = storage.split_urls(surveys)
    if named:
        # a name ending in .zarr is a survey store (not looked into here: the trainer opens it)
        return [_registered_mdio(url, data_root) if not url.rstrip("/").endswith(".zarr") and is_mdio(url)
                else storage.normalize(url) for url in named]
    if not data_root:
        raise SFMError("name the training data: --surveys STORE_URL[,...] or --data-root ROOT (its published surveys)")
    table = manifest.read(data_root)
    if table.empty:
        raise SFMError(f"no published surveys under {storage.join(data_root, 'manifest')}; ingest some first "
                       "(sfm ingest SEG-Y... --data-root DATA_ROOT) or pass --surveys")
    skip = set(storage.split_urls(held_out))
    known = set(table["name"]) | set(table["survey_id"]) | set(table["store_url"])
    unknown = sorted(skip - known)
    if unknown:
        raise SFMError(f"--held-out {unknown[0]} is not a published survey in {data_root}; name a survey name, id or "
                       "store URL from its manifest")
    keep = table[~(table["name"].isin(skip) | table["survey_id"].isin(skip) | table["store_url"].isin(skip))]
    if keep.empty:
        raise SFMError(f"--held-out leaves no survey in {data_root} to train on; hold out fewer")
    return list(keep["store_url"])


def _registered_mdio(url: str, data_root: str) -> str:
    """The reference group an MDIO store ``url`` is registered as in ``data_root``'s manifest (by source_url)."""
    url = storage.normalize(url).rstrip("/")
    fix = f"register it first: sfm ingest {url} --data-root {data_root or 'DATA_ROOT'}"
    if not data_root:
        raise SFMError(f"--surveys {url} is an MDIO store, read through its registration: pass --data-root, and "
                       f"{fix}")
    table = manifest.read(data_root)
    rows = table[table["source_url"] == url]
    if rows.empty:
        raise SFMError(f"MDIO store {url} is not registered in {data_root}; {fix}")
    return str(rows["store_url"].iloc[-1])


# ---- the sbatch script ------------------------------------------------------------------------------


@dataclass
class SbatchOptions:
    data_root: str  # where the surveys' manifest is (s3://...)
    run_root: str  # checkpoints, final model, summary: the state a requeued job resumes from
    surveys: str = ""  # comma-separated store URLs instead of the manifest's surveys
    held_out: str = ""
    job_name: str = "sfm-pretrain"
    partition: str = ""
    account: str = ""
    time: str = ""  # Slurm time limit, e.g. 2-00:00:00 (empty: the partition's)
    output: str = "sfm-pretrain-%j.log"
    requeue_before_s: int = 120  # USR1 this long before the time limit requeues the job
    setup: str = ""  # shell line run on each node first, e.g. "source /fsx/venv/bin/activate"
    auto_resume: bool = False  # HyperPod: srun --auto-resume=1 replaces a faulty node and reruns the step


def render_sbatch(cfg: JobConfig, opts: SbatchOptions, command_line: str = "") -> str:
    """The sbatch script for ``[dist] nodes`` x ``procs_per_node`` processes of this job (``cfg`` resolved:
    :func:`sfm.ops.pipeline.job_config` has mapped its Accelerate config file into it and checked it)."""
    cfg.dist.check()
    nodes, procs = cfg.dist.nodes, cfg.dist.procs_per_node
    for flag, url in (("--run-root", opts.run_root), ("--data-root", opts.data_root)):
        if url and not (storage.is_s3(url) or url.startswith("/")):
            raise SFMError(f"{flag} {url} must be an s3:// URL or an absolute path on a shared filesystem: every "
                           "node (and every requeue) must see the same one")
    if not opts.data_root and not opts.surveys:
        raise SFMError("name the training data: --data-root ROOT (its published surveys) or --surveys STORE_URL[,...]")
    if opts.requeue_before_s < 10:
        raise SFMError(f"--requeue-before {opts.requeue_before_s}s is too short to requeue; use at least 60")
    from sfm.ops.cluster import node_environment

    mapped_from = cfg.dist.accelerate_config
    cfg.set("dist.accelerate_config", "")  # mapped into the config below (sfm.distributed.accelerate_config.apply)
    gpus = cfg.cluster.gpu
    q = shlex.quote
    sbatch = [f"--job-name={opts.job_name}", f"--nodes={nodes}", "--ntasks-per-node=1", "--exclusive",
              *([f"--gpus-per-node={gpus}"] if gpus else []),
              *([f"--partition={opts.partition}"] if opts.partition else []),
              *([f"--account={opts.account}"] if opts.account else []),
              *([f"--time={opts.time}"] if opts.time else []),
              f"--output={opts.output}", "--open-mode=append",
              "--requeue", f"--signal=B:{REQUEUE_SIGNAL}@{opts.requeue_before_s}"]
    env = node_environment(cfg.cluster)
    data_args = (f"--surveys {q(opts.surveys)}" if opts.surveys else f"--data-root {q(opts.data_root)}") + \
        (f" --held-out {q(opts.held_out)}" if opts.held_out else "")
    srun = "srun --nodes=\"$SLURM_NNODES\" --ntasks-per-node=1 --kill-on-bad-exit=1" + \
        (" --auto-resume=1" if opts.auto_resume else "")
    return _SBATCH.format(
        sbatch="\n".join(f"#SBATCH {line}" for line in sbatch),
        command_line=command_line or "sfm slurm-script",
        mapped=f"\n# Accelerate config {mapped_from}: its settings are in the job config below" if mapped_from else "",
        launcher=cfg.dist.launcher,
        exports="\n".join(f"export {k}={q(v)}" for k, v in env.items()) or "# (none: [cluster] sets no EFA or env)",
        config=cfg.to_toml(),
        run_root=q(opts.run_root), data_args=data_args, procs=procs,
        setup=opts.setup or ":", srun=srun, signal=REQUEUE_SIGNAL,
    )


_SBATCH = """#!/bin/bash
# Written by: {command_line}{mapped}
# Multi-node MAE pretraining: the same `sfm train` on every node of the allocation, under srun; each
# starts its processes with {launcher}.
#   sbatch THIS_SCRIPT                 submit
#   SFM_DRY_RUN=1 bash THIS_SCRIPT     with SLURM_JOB_ID, SLURM_JOB_NODELIST, SLURM_NNODES set: print each
#                                      node's launch plan instead of training
# Requeue/resume: Slurm requeues the job after a node failure (--requeue) and this script requeues
# it itself shortly before the time limit (USR1 below); the job then continues from the newest
# checkpoint under the run root.
{sbatch}
set -euo pipefail

export SFM_RUN_ROOT={run_root}
read -r -d '' SFM_JOB_TOML <<'SFM_JOB_TOML_END' || true
{config}
SFM_JOB_TOML_END
export SFM_JOB_TOML

# NCCL / EFA settings of the nodes (job config [cluster])
{exports}

# Rendezvous from the allocation: the first node hosts it; the port follows the job id and the
# requeue count, so a requeued job never meets a half-closed socket of its previous run.
if command -v scontrol >/dev/null 2>&1; then
    HOSTS=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
else  # no Slurm on this machine (a dry run): the same expansion in Python
    HOSTS=($(python -m sfm.ops.slurm hostnames "$SLURM_JOB_NODELIST"))
fi
export MAIN_ADDR="${{HOSTS[0]}}"
export MAIN_PORT=$(( 20000 + (SLURM_JOB_ID * 16 + ${{SLURM_RESTART_COUNT:-0}}) % 20000 ))
echo "sfm: job $SLURM_JOB_ID (restart ${{SLURM_RESTART_COUNT:-0}}): $SLURM_NNODES node(s) x {procs} process(es), rendezvous $MAIN_ADDR:$MAIN_PORT, run root $SFM_RUN_ROOT" >&2

node_main() {{  # one node's share: runs on every node with its own SLURM_NODEID
    {setup}
    local cfg status=0
    cfg=$(mktemp "${{TMPDIR:-/tmp}}/sfm-job-XXXXXX.toml")
    printf '%s\\n' "$SFM_JOB_TOML" > "$cfg"
    sfm train --config "$cfg" {data_args} --run-root "$SFM_RUN_ROOT" \\
        --nodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" --procs-per-node {procs} \\
        --main-addr "$MAIN_ADDR" --main-port "$MAIN_PORT" ${{SFM_DRY_RUN:+--dry-run}} || status=$?
    rm -f "$cfg"
    return "$status"
}}

if [ -n "${{SFM_DRY_RUN:-}}" ]; then
    for ((node = 0; node < SLURM_NNODES; node++)); do
        SLURM_NODEID=$node node_main
    done
    exit 0
fi

requeue() {{
    echo "sfm: time limit near: requeueing job $SLURM_JOB_ID; it resumes from the newest checkpoint in $SFM_RUN_ROOT/ckpt" >&2
    scontrol requeue "$SLURM_JOB_ID"
}}
trap requeue {signal}

# srun in the background so the batch shell can take the signal while training runs
{srun} bash -c "$(declare -f node_main); node_main" &
srun_pid=$!
status=0
wait "$srun_pid" || status=$?
while kill -0 "$srun_pid" 2>/dev/null; do  # a trapped signal interrupted wait: keep waiting
    status=0
    wait "$srun_pid" || status=$?
done
exit "$status"
"""


# ---- Slurm hostlists ----------------------------------------------------------------------------------

_HOSTLIST_ITEM = re.compile(r"([^,\[]+)(?:\[([^\]]+)\])?([^,\[]*)")


def expand_hostlist(text: str) -> list[str]:
    """Slurm hostlist expression -> host names, as ``scontrol show hostnames`` prints them:
    ``"gpu-[01-03,7],login1"`` -> ["gpu-01", "gpu-02", "gpu-03", "gpu-7", "login1"]."""
    hosts: list[str] = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        match = _HOSTLIST_ITEM.match(text, pos)
        if not match:
            raise SFMError(f"hostlist {text!r} is not a Slurm hostlist expression (e.g. node[01-04],other)")
        prefix, ranges, suffix = match.groups()
        if ranges is None:
            hosts.append(prefix + suffix)
        else:
            for part in ranges.split(","):
                lo, _, hi = part.partition("-")
                if not lo.isdigit() or (hi and not hi.isdigit()):
                    raise SFMError(f"hostlist {text!r} has a bad range {part!r}")
                width = len(lo)
                hosts.extend(f"{prefix}{n:0{width}d}{suffix}" for n in range(int(lo), int(hi or lo) + 1))
        pos = match.end()
        if pos < len(text) and text[pos] == ",":
            pos += 1
    return hosts


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "hostnames":
        print("usage: python -m sfm.ops.slurm hostnames HOSTLIST", file=sys.stderr)
        return 2
    try:
        print("\n".join(expand_hostlist(args[1])))
    except SFMError as err:
        print(f"sfm.ops.slurm: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
