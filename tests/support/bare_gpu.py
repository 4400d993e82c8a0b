"""The environment of a bare GPU machine, where the GPU benchmarks run: torch, but no data stack.

:func:`bare_gpu_env` gives this process's environment with metaflow, zarr, segyio, boto3, fsspec and their kin
made unimportable (a ``sitecustomize`` on ``PYTHONPATH``), in a process started with it and in every process
that one starts."""

from __future__ import annotations

import os
from pathlib import Path

BANNED = ("metaflow", "zarr", "segyio", "boto3", "botocore", "fsspec", "s3fs", "obstore", "numcodecs")


def bare_gpu_env(tmp_path: Path) -> dict[str, str]:
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import importlib.abc, sys\n"
        f"BANNED = {BANNED!r}\n"
        "class Ban(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in BANNED:\n"
        "            raise ImportError(f'{name} is not on a bare GPU machine')\n"
        "sys.meta_path.insert(0, Ban())\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), os.environ.get("PYTHONPATH", "")])}
