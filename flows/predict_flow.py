"""The predict flow as a checkout runs it: ``python flows/predict_flow.py run ...`` is ``sfm flow predict run ...``.

Its code, parameters and commands are in sfm/flows/predict_flow.py. The class below is that flow, subclassed
here because metaflow.Runner runs the flow class its file defines.
"""

from sfm.flows import predict_flow


class PredictFlow(predict_flow.PredictFlow):
    pass


if __name__ == "__main__":
    PredictFlow()
