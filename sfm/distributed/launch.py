"""Start the training processes of one node with torchrun or ``accelerate launch`` (``[dist] launcher``),
the rendezvous given by the caller.

:func:`train_node` runs one node's share of a job: the flow's ``@parallel`` pretrain step calls it on
every node with the main node's address from ``current.parallel``, ``sfm train`` by hand or on each node
of a Slurm job (under srun). Each node runs ``procs_per_node`` processes of
``python -m sfm.train.trainer JOB.json`` (:func:`node_command`); all state lives under the job's run root,
so running the same node again continues from the newest checkpoint.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

from sfm import storage
from sfm.config import JobConfig
from sfm.errors import SFMError
from sfm.user_errors import USER_ERROR_EXIT, exit_status


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def environment_for_workers() -> Callable[[int], None]:
    """A DataLoader ``worker_init_fn`` that gives each worker this process's environment as it is now (S3
    endpoint, credentials), as a spawned process would have it: forkserver children inherit the server's,
    fixed when it started (:class:`sfm.data.loader.BatchStream`)."""
    return functools.partial(_adopt_environment, dict(os.environ))


def _adopt_environment(environ: dict[str, str], worker_id: int) -> None:
    os.environ.clear()
    os.environ.update(environ)


# where port_for draws from: below Linux's ephemeral range (32768-60999 by default), so an outgoing connection
# of this or another process (an S3 client, a data loader) cannot be holding it; the pretrain pods'
# NetworkPolicy (sfm.ops.network_policy) opens exactly this range between them
RENDEZVOUS_PORTS = range(20000, 32000)


def port_for(key: str) -> int:
    """A rendezvous port every node derives alike from a shared key (e.g. the run id), in RENDEZVOUS_PORTS."""
    return RENDEZVOUS_PORTS.start + int(hashlib.sha256(key.encode()).hexdigest(), 16) % len(RENDEZVOUS_PORTS)


def _port_taken(addr: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((addr, port))
        except OSError as err:
            return err.errno == errno.EADDRINUSE
    return False


def launch_node(job: dict[str, Any], *, nodes: int, procs_per_node: int, node_rank: int, main_addr: str,
                main_port: int, timeout_s: int | None = None, module: str = "sfm.train.trainer") -> None:
    """Run this node's share of a training job with its launcher (:func:`node_command`); raises if any of its
    processes fails. Each process runs ``python -m <module> JOB.json`` (pretraining; the fine-tune flow's is
    ``sfm.finetune.job``).

    A single-node job whose ``main_port`` is already taken on this machine (by a listener of some other
    program) rendezvouses on a free port instead: no other node has to agree on it."""
    if nodes == 1 and _port_taken(main_addr, main_port):
        main_port = free_port()
    node = NodeLaunch(nodes, procs_per_node, node_rank, main_addr, main_port)
    with tempfile.TemporaryDirectory(prefix="sfm-launch-") as tmp:
        cmd = node_command(job, node, tmp, module)
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // procs_per_node)))
        # idle OpenMP threads sleep rather than spin: on a CPU shared with other work (data loading,
        # other jobs) spinning threads starve their siblings (BENCHMARKS.md "Training (issue 5)")
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        env["PYTHONUNBUFFERED"] = "1"
        launcher = launcher_of(job)
        print(f"sfm: node {node_rank} of {nodes} starts {procs_per_node} process(es) with {launcher}: "
              f"{shlex.join(cmd)}", file=sys.stderr, flush=True)
        try:
            proc = subprocess.run(cmd, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired as err:
            raise RuntimeError(f"training on node {node_rank} exceeded {timeout_s}s") from err
        if proc.returncode != 0:
            raise SFMError(f"training failed on node {node_rank} ({launcher} exit {proc.returncode}); "
                           "see the log above, then resume the run to continue from the last checkpoint")


def job_file_main(argv: list[str] | None, module: str, command: str, run: Callable[[dict[str, Any]], Any]) -> int:
    """The ``python -m <module> JOB.json`` entry point of each process :func:`launch_node` starts: reads the
    job file and calls ``run(job)``. Returns the exit code: 2 for a wrong command line or a user error (one
    line ``sfm <command>: error: ...``, :func:`sfm.user_errors.exit_status`), 0 otherwise."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(f"usage: python -m {module} JOB.json", file=sys.stderr)
        return USER_ERROR_EXIT
    with open(argv[0]) as fh:
        job = json.load(fh)

    def run_job() -> None:  # what run returns is the process's result, not its exit status
        run(job)

    return exit_status(command, run_job)


def launcher_of(job: dict[str, Any]) -> str:
    """The job's ``dist.launcher`` (a job file's config may leave out what it does not change)."""
    return JobConfig.from_dict(job.get("config")).dist.launcher


# what starts a node's ranks: torchrun or accelerate launch, run by sfm.distributed.rank_launcher so that a failed
# rank is reported in one line rather than in the launcher's traceback
RANK_LAUNCHER = (sys.executable, "-m", "sfm.distributed.rank_launcher")


def node_command(job: dict[str, Any], node: NodeLaunch, folder: str, module: str = "sfm.train.trainer") -> list[str]:
    """The command that starts ``node``'s processes of ``job`` (``python -m <module> JOB.json`` each), its files written to ``folder``: the job file, and for ``dist.launcher = "accelerate"`` the
    Accelerate launch config (:func:`sfm.distributed.accelerate_launch.launch_config`), given as a file so
    that no ``default_config.yaml`` of the node's applies."""
    job_path = os.path.join(folder, "job.json")
    with open(job_path, "w") as fh:
        json.dump(job, fh)
    trainer = ["-m", module, job_path]
    cfg = JobConfig.from_dict(job.get("config"))
    if cfg.dist.launcher == "accelerate":
        import torch
        import yaml

        from sfm.distributed.accelerate_launch import launch_config, precision_of

        precision = precision_of(cfg.train, torch.cuda.is_available())
        config_path = os.path.join(folder, "accelerate_launch.yaml")
        with open(config_path, "w") as fh:
            yaml.safe_dump(launch_config(node, precision), fh)
        # --same_network: torchrun meets at main_addr:main_port (the file's value is read only without the flag's
        # default, which argparse always gives)
        return [*RANK_LAUNCHER, "accelerate", "--config_file", config_path, "--same_network",
                "--max_restarts", "0", *trainer]
    return [*RANK_LAUNCHER, "torchrun", f"--nnodes={node.nodes}",
            f"--nproc-per-node={node.procs_per_node}", f"--node-rank={node.node_rank}",
            f"--master-addr={node.main_addr}", f"--master-port={node.main_port}", "--max-restarts=0", *trainer]


@dataclass
class NodeLaunch:
    """Where this node sits in the job: the arguments of :func:`launch_node`."""

    nodes: int
    procs_per_node: int
    node_rank: int
    main_addr: str
    main_port: int

    def check(self, run_root: str) -> None:
        if self.nodes < 1 or self.procs_per_node < 1:
            raise SFMError(f"--nodes {self.nodes} and --procs-per-node {self.procs_per_node} must be at least 1")
        if not 0 <= self.node_rank < self.nodes:
            raise SFMError(f"--node-rank {self.node_rank} is outside 0..{self.nodes - 1}; pass this node's index")
        if not 0 < self.main_port < 65536:
            raise SFMError(f"--main-port {self.main_port} is not a TCP port; pick one in 1024..65535")
        if self.nodes > 1 and not (storage.is_s3(run_root) or run_root.startswith("/")):
            raise SFMError(f"--run-root {run_root} must be shared by all {self.nodes} nodes: an s3:// URL or an "
                           "absolute path on a shared filesystem (e.g. /fsx/...)")


def node_job(cfg: JobConfig, surveys: list[str], run_root: str, launch: NodeLaunch) -> dict[str, Any]:
    """The job file this node's processes train (:mod:`sfm.train.trainer`): ``cfg`` sized to the launch's
    nodes x processes and checked, the survey stores, the run root."""
    launch.check(run_root)
    cfg.set("dist.nodes", launch.nodes)
    cfg.set("dist.procs_per_node", launch.procs_per_node)
    cfg.validate()
    from sfm.model import model_config_for

    model_config_for(cfg)  # the model layer's check: the preset makes a model at the job's crop and masking
    return {"config": cfg.to_dict(), "surveys": list(surveys), "run_root": run_root}


def train_node(job: dict[str, Any], launch: NodeLaunch, timeout_s: int | None = None) -> dict[str, Any] | None:
    """Run this node's processes of ``job`` (:func:`node_job`); node 0 then returns the run's summary
    (``summary.json`` under the job's run root), the other nodes None."""
    launch_node(job, **vars(launch), timeout_s=timeout_s)
    if launch.node_rank != 0:
        return None
    return json.loads(storage.read_bytes(storage.join(job["run_root"], "summary.json")))
