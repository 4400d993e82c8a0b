"""The pretrain flow as a checkout runs it: ``python flows/pretrain_flow.py run ...`` is ``sfm flow pretrain run ...``.

Its code, parameters and commands are in sfm/flows/pretrain_flow.py. The class below is that flow, subclassed
here because metaflow.Runner runs the flow class its file defines.
"""

from sfm.flows import pretrain_flow


class PretrainFlow(pretrain_flow.PretrainFlow):
    pass


if __name__ == "__main__":
    PretrainFlow()
