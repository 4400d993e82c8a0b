"""Where the packaged flows are (:func:`flow_file`) and the command that runs one (:func:`flow_command`): what
``sfm flow NAME`` and ``sfm watch`` start. The flows themselves are modules of :mod:`sfm.flows`, a layer above;
this module names their files without importing them.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

FLOWS = ("pretrain", "finetune", "predict")


def flow_file(name: str) -> Path:
    """The packaged file of flow ``name`` (one of :data:`FLOWS`), also inside an installed wheel."""
    if name not in FLOWS:
        raise ValueError(f"no flow {name!r}; one of {', '.join(FLOWS)}")
    return Path(str(resources.files("sfm") / "flows" / f"{name}_flow.py"))


def flow_command(name: str, args: list[str]) -> list[str]:
    """The command line of ``sfm flow NAME ARGS``: this interpreter running the packaged flow file with Metaflow's
    arguments, where ``--config NAME FILE`` may name a packaged config (``--config config quality_cpu``:
    :func:`sfm.config.config_file`) and a repeated ``--set`` becomes one (``--set a.b=1 --set c.d=2``: ``--set
    'a.b=1;c.d=2'``, as the flows read it; Metaflow would keep only the last)."""
    from sfm.config import config_file

    out: list[str] = []
    sets: list[str] = []
    at = 0  # where the joined --set value goes
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--config" and i + 2 < len(args):
            out += [arg, args[i + 1], str(config_file(args[i + 2]))]
            i += 3
        elif arg.startswith("--set=") or (arg == "--set" and i + 1 < len(args)):
            if not sets:
                out += ["--set", ""]
                at = len(out) - 1
            sets.append(arg[len("--set="):] if arg.startswith("--set=") else args[i + 1])
            out[at] = ";".join(sets)
            i += 1 if arg.startswith("--set=") else 2
        else:
            out.append(arg)
            i += 1
    return [sys.executable, str(flow_file(name)), *out]
