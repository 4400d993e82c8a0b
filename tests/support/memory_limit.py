"""A hard memory limit for one child process: a cgroup v1 memory controller group under this process's own.

The kernel charges the group everything its processes allocate (anonymous memory, the page cache of the
files they read and write) and, at the limit, first reclaims that cache, then kills the process (SIGKILL):
what a container's or a Slurm job's limit does. RLIMIT_AS is no substitute: torch maps gigabytes of
address space it never touches. Needs root and the v1 memory controller (mounted at /sys/fs/cgroup/memory).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

MEMORY = Path("/sys/fs/cgroup/memory")


def available() -> str:
    """"" when a limited group can be made here, else why not."""
    if not (MEMORY / "memory.limit_in_bytes").exists():
        return f"no cgroup v1 memory controller at {MEMORY}"
    if not os.access(own_group(), os.W_OK):
        return f"{own_group()} is not writable (not root?)"
    return ""


def own_group() -> Path:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return MEMORY / path.lstrip("/")
    return MEMORY


class MemoryLimit:
    """``with MemoryLimit(bytes) as limit: subprocess.run(..., preexec_fn=limit.enter)``; afterwards
    :attr:`peak` (bytes charged at most) and :attr:`oom_kills`."""

    def __init__(self, limit_bytes: int):
        self.limit = int(limit_bytes)
        self.path = own_group() / f"sfm-test-{uuid.uuid4().hex[:8]}"
        self.peak = 0
        self.oom_kills = 0

    def __enter__(self) -> "MemoryLimit":
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(str(self.limit))
        if (self.path / "memory.memsw.limit_in_bytes").exists():  # no swapping past the limit either
            (self.path / "memory.memsw.limit_in_bytes").write_text(str(self.limit))
        return self

    def enter(self) -> None:
        """Move the calling process (a child, between fork and exec) into the group."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def __exit__(self, *exc) -> None:
        self.peak = int((self.path / "memory.max_usage_in_bytes").read_text())
        control = dict(line.split() for line in (self.path / "memory.oom_control").read_text().splitlines())
        self.oom_kills = int(control.get("oom_kill", 0))
        self.path.rmdir()  # its processes have exited; their charges move to the parent
