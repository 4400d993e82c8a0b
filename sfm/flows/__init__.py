"""The three Metaflow flows, packaged: each module here holds one flow class, its steps and its parameters, the one
copy of that flow's code.

    sfm flow pretrain run             # SEG-Y -> survey stores -> pretraining -> evaluation -> a registered encoder
    sfm flow finetune run ...         # labelled surveys + an encoder -> a registered task model
    sfm flow predict run ...          # a task model over a whole survey

``sfm flow NAME ARGS`` runs ``python <this folder>/NAME_flow.py ARGS`` (:func:`flow_command`), so an installed
package (the image, ``pip install``) runs every flow from any folder; Metaflow starts each step with the same file.
A checkout also has ``flows/NAME_flow.py``: an entry point that subclasses the class here (``metaflow.Runner`` runs
the flow class its file defines) and runs it, so ``python flows/NAME_flow.py run`` is the same flow.

Nothing here imports a flow module: a flow module run as a script defines its class in ``__main__``, and importing
it again would make a second class.
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
    :func:`sfm.config.config_file`)."""
    from sfm.config import config_file

    out: list[str] = []
    i = 0
    while i < len(args):
        if args[i] == "--config" and i + 2 < len(args):
            out += [args[i], args[i + 1], str(config_file(args[i + 2]))]
            i += 3
        else:
            out.append(args[i])
            i += 1
    return [sys.executable, str(flow_file(name)), *out]
