"""The three Metaflow flows, packaged: each module here holds one flow class, its steps and its parameters, the one
copy of that flow's code.

    sfm flow pretrain run             # SEG-Y -> survey stores -> pretraining -> evaluation -> a registered encoder
    sfm flow finetune run ...         # labelled surveys + an encoder -> a registered task model
    sfm flow predict run ...          # a task model over a whole survey

``sfm flow NAME ARGS`` runs ``python <this folder>/NAME_flow.py ARGS`` (:func:`sfm.ops.flow_files.flow_command`),
so an installed package (the image, ``pip install``) runs every flow from any folder; Metaflow starts each step with
the same file.
A checkout also has ``flows/NAME_flow.py``: an entry point that subclasses the class here (``metaflow.Runner`` runs
the flow class its file defines) and runs it, so ``python flows/NAME_flow.py run`` is the same flow.

Nothing here imports a flow module: a flow module run as a script defines its class in ``__main__``, and importing
it again would make a second class.
"""

from sfm.ops.flow_files import FLOWS, flow_command, flow_file

__all__ = ["FLOWS", "flow_command", "flow_file"]
