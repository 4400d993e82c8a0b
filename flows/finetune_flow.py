"""The finetune flow as a checkout runs it: ``python flows/finetune_flow.py run ...`` is ``sfm flow finetune run ...``.

Its code, parameters and commands are in sfm/flows/finetune_flow.py. The class below is that flow, subclassed
here because metaflow.Runner runs the flow class its file defines.
"""

from sfm.flows import finetune_flow


class FinetuneFlow(finetune_flow.FinetuneFlow):
    pass


if __name__ == "__main__":
    FinetuneFlow()
