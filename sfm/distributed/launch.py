"""Start the training processes of one node with torchrun or ``accelerate launch`` (``[dist] launcher``),
the rendezvous given by the caller.

:func:`run_node` runs one node's share of a job: the flow's ``@parallel`` pretrain step calls it on every node
with the main node's address from ``current.parallel``, ``sfm train`` by hand or on each node of a Slurm job
(under srun), the fine-tune flow's ``@parallel`` step with a :class:`sfm.finetune.job.FinetuneJob`. Each node runs
``procs_per_node`` processes of ``python -m <job.module> JOB.json`` (:func:`node_command`), each of which reads
the typed job once (:func:`job_file_main`); all state lives under the job's run root, so running the same node
again continues from the newest checkpoint.
"""

from __future__ import annotations

import dataclasses
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
from typing import Any, Callable, TypeVar

from sfm import storage
from sfm.distributed.job import JobFile, NodeLaunch
from sfm.errors import SFMError
from sfm.user_errors import USER_ERROR_EXIT, exit_status

Job = TypeVar("Job", bound=JobFile)


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


def launch_node(job: JobFile, node: NodeLaunch, timeout_s: int | None = None) -> None:
    """Run ``node``'s share of ``job`` with its launcher (:func:`node_command`); raises if any of its processes
    fails. Each process runs ``python -m <job.module> JOB.json``.

    A single-node job whose ``main_port`` is already taken on this machine (by a listener of some other
    program) rendezvouses on a free port instead: no other node has to agree on it."""
    if node.nodes == 1 and _port_taken(node.main_addr, node.main_port):
        node = dataclasses.replace(node, main_port=free_port())
    with tempfile.TemporaryDirectory(prefix="sfm-launch-") as tmp:
        cmd = node_command(job, node, tmp)
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // node.procs_per_node)))
        # idle OpenMP threads sleep rather than spin: on a CPU shared with other work (data loading,
        # other jobs) spinning threads starve their siblings (BENCHMARKS.md "Training (issue 5)")
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        env["PYTHONUNBUFFERED"] = "1"
        launcher = job.config.dist.launcher
        print(f"sfm: node {node.node_rank} of {node.nodes} starts {node.procs_per_node} process(es) with {launcher}: "
              f"{shlex.join(cmd)}", file=sys.stderr, flush=True)
        try:
            proc = subprocess.run(cmd, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired as err:
            raise RuntimeError(f"training on node {node.node_rank} exceeded {timeout_s}s") from err
        if proc.returncode != 0:
            raise SFMError(f"training failed on node {node.node_rank} ({launcher} exit {proc.returncode}); "
                           "see the log above, then resume the run to continue from the last checkpoint")


def run_node(job: JobFile, node: NodeLaunch, timeout_s: int | None = None) -> dict[str, Any] | None:
    """Run ``node``'s processes of ``job`` (:func:`launch_node`); node 0 then returns the run's summary
    (``summary.json`` under the job's run root, written by rank 0), the other nodes None."""
    launch_node(job, node, timeout_s)
    if node.node_rank != 0:
        return None
    return json.loads(storage.read_bytes(storage.join(job.run_root, "summary.json")))


def job_file_main(argv: list[str] | None, job_type: type[Job], command: str, run: Callable[[Job], Any]) -> int:
    """The ``python -m <module> JOB.json`` entry point of each process :func:`launch_node` starts: reads the
    job file as a ``job_type`` (``job_type.read``: the process's one parse of its config) and calls ``run(job)``.
    Returns the exit code: 2 for a wrong command line or a user error (one line ``sfm <command>: error: ...``,
    :func:`sfm.user_errors.exit_status`), 0 otherwise."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(f"usage: python -m {job_type.module} JOB.json", file=sys.stderr)
        return USER_ERROR_EXIT

    def run_job() -> None:  # what run returns is the process's result, not its exit status
        run(job_type.read(argv[0]))

    return exit_status(command, run_job)


# what starts a node's ranks: torchrun or accelerate launch, run by sfm.distributed.rank_launcher so that a failed
# rank is reported in one line rather than in the launcher's traceback
RANK_LAUNCHER = (sys.executable, "-m", "sfm.distributed.rank_launcher")


def node_command(job: JobFile, node: NodeLaunch, folder: str) -> list[str]:
    """The command that starts ``node``'s processes of ``job`` (``python -m <job.module> JOB.json`` each), its files
    written to ``folder``: the job file, and for ``dist.launcher = "accelerate"`` the Accelerate launch config
    (:func:`sfm.distributed.accelerate_launch.launch_config`), given as a file so that no ``default_config.yaml``
    of the node's applies."""
    job_path = os.path.join(folder, "job.json")
    with open(job_path, "w") as fh:
        fh.write(job.to_json())
    trainer = ["-m", job.module, job_path]
    cfg = job.config
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
