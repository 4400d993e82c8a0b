"""Start the training processes of one node with torchrun, the rendezvous given by the caller.

The flow's ``@parallel`` pretrain step calls :func:`launch_node` on every node with the main node's
address from ``current.parallel``; on Slurm the same call runs under srun. Each node runs
``procs_per_node`` processes of ``python -m sfm.train.trainer JOB.json``.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from typing import Any, Callable

from sfm.errors import SFMError


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
                main_port: int, timeout_s: int | None = None) -> None:
    """Run this node's share of the training job; raises if any of its processes fails.

    A single-node job whose ``main_port`` is already taken on this machine (by a listener of some other
    program) rendezvouses on a free port instead: no other node has to agree on it."""
    if nodes == 1 and _port_taken(main_addr, main_port):
        main_port = free_port()
    with tempfile.TemporaryDirectory(prefix="sfm-launch-") as tmp:
        job_path = os.path.join(tmp, "job.json")
        with open(job_path, "w") as fh:
            json.dump(job, fh)
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={nodes}", f"--nproc-per-node={procs_per_node}", f"--node-rank={node_rank}",
            f"--master-addr={main_addr}", f"--master-port={main_port}",
            "--max-restarts=0", "-m", "sfm.train.trainer", job_path,
        ]
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // procs_per_node)))
        # idle OpenMP threads sleep rather than spin: on a CPU shared with other work (data loading,
        # other jobs) spinning threads starve their siblings (BENCHMARKS.md "Training (issue 5)")
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        env["PYTHONUNBUFFERED"] = "1"
        try:
            proc = subprocess.run(cmd, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired as err:
            raise RuntimeError(f"training on node {node_rank} exceeded {timeout_s}s") from err
        if proc.returncode != 0:
            raise SFMError(f"training failed on node {node_rank} (torchrun exit {proc.returncode}); "
                           "see the log above, then resume the run to continue from the last checkpoint")


def run_node(job: dict[str, Any], *, nodes: int, node_rank: int, main_addr: str, main_port: int,
             timeout_s: int | None = None) -> dict[str, Any] | None:
    """:func:`launch_node` with the job config's ``procs_per_node``; node 0 then returns the run's
    summary (``summary.json`` under the job's run root), the other nodes None. The flow's pretrain
    step and ``sfm train`` (Slurm) both run a node through this."""
    from sfm import storage

    procs = int(job["config"].get("dist", {}).get("procs_per_node", 1))
    launch_node(job, nodes=nodes, procs_per_node=procs, node_rank=node_rank, main_addr=main_addr,
                main_port=main_port, timeout_s=timeout_s)
    if node_rank != 0:
        return None
    return json.loads(storage.read_bytes(storage.join(job["run_root"], "summary.json")))
