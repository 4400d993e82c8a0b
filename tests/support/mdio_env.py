"""The real MDIO library, in an environment of its own, for tests that read or write MDIO stores.

``multidimio`` cannot be installed beside sfm (it pins fsspec < 2026.2; sfm's s3fs needs 2026.9), so the
tests build it a virtual environment once, ``multidimio==MDIO_VERSION`` from PyPI, at ``$SFM_MDIO_VENV``
or ``~/.cache/sfm-tests/multidimio-<version>``, and run ``tests/support/mdio_tool.py`` there. Building
it needs PyPI (about 250 MB, 30-60 s); a failure to build fails the tests that need it, naming the
log, rather than skipping them.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

MDIO_VERSION = "1.1.3"
TOOL = Path(__file__).with_name("mdio_tool.py")


def venv_dir() -> Path:
    default = Path.home() / ".cache" / "sfm-tests" / f"multidimio-{MDIO_VERSION}"
    return Path(os.environ.get("SFM_MDIO_VENV") or default)


def mdio_python() -> Path:
    """The MDIO environment's python, building the environment first if it is not there (once: a lock
    keeps concurrent test processes from building it twice; ``.complete`` is written last)."""
    root = venv_dir()
    python = root / "bin" / "python"
    if (root / ".complete").exists():
        return python
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / ".complete").exists():
            log = root.parent / f"{root.name}.log"
            with open(log, "w") as out:
                steps = [[sys.executable, "-m", "venv", "--clear", str(root)],
                         [str(python), "-m", "pip", "install", "-q", f"multidimio=={MDIO_VERSION}"]]
                for cmd in steps:
                    if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=900).returncode:
                        raise RuntimeError(f"could not build the MDIO test environment ({' '.join(cmd)}); see {log}")
            (root / ".complete").write_text(MDIO_VERSION)
    return python


def run_tool(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> str:
    """Run ``mdio_tool.py args`` in the MDIO environment (one worker process, SEG-Y file headers kept);
    returns its stdout, raising with its output when it fails."""
    settings = {"MDIO__IMPORT__CPU_COUNT": "1", "MDIO__EXPORT__CPU_COUNT": "1",
                "MDIO__IMPORT__SAVE_SEGY_FILE_HEADER": "true", "PYTHONPATH": "", **(env or {})}
    proc = subprocess.run([str(mdio_python()), str(TOOL), *args], capture_output=True, text=True,
                          env={**os.environ, **settings}, timeout=timeout)
    if proc.returncode:
        raise AssertionError(f"mdio_tool {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def segy_to_mdio(src: Path, dst: Path, domain: str = "time", chunks: tuple[int, int, int] | None = None,
                 file_header: bool = True) -> Path:
    """``mdio.segy_to_mdio`` of ``src`` into ``dst`` (PostStack3DTime or PostStack3DDepth template)."""
    args = ["from-segy", str(src), str(dst), "--domain", domain]
    if chunks:
        args += ["--chunks", ",".join(str(c) for c in chunks)]
    run_tool(*args, env={"MDIO__IMPORT__SAVE_SEGY_FILE_HEADER": "true" if file_header else "false"})
    return Path(dst)


def mdio_to_segy(src: Path | str, dst: Path, sample_format: str = "spec") -> Path:
    """``mdio.mdio_to_segy`` of the store ``src`` into the SEG-Y file ``dst``: samples as IBM floats (the rev 1
    spec's, ``sample_format`` "spec"), or in the format its binary header names ("store")."""
    run_tool("to-segy", str(src), str(dst), "--sample-format", sample_format)
    return Path(dst)


def describe(src: Path | str) -> dict:
    """What ``mdio.open_mdio`` sees in ``src``: dims, shape, root attributes, variables, statsV1, coordinates."""
    for line in run_tool("describe", str(src)).splitlines():
        if line.startswith("MDIO-JSON "):
            return json.loads(line[len("MDIO-JSON "):])
    raise AssertionError(f"mdio_tool describe {src} printed no result")
