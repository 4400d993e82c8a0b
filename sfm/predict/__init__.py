"""Whole-survey prediction with a task model (``sfm predict``, sfm/flows/predict_flow.py), in the order data
flows: where the windows lie, how they blend and are mirrored (:mod:`.windows`: the one windows module, which
fine-tuning's early stopping and held-out scores and the downstream evaluation predict through too), the task model
(:mod:`.task_model`), one part streamed along the inlines (:mod:`.slabs`), the prediction store written in parts and
published atomically (:mod:`.store`), the steps (:mod:`.parts`) and the SEG-Y export (:mod:`.segy_export`)."""

from sfm.predict.parts import PredictOptions, plan_prediction, predict, publish_prediction, run_part

__all__ = ["PredictOptions", "plan_prediction", "predict", "publish_prediction", "run_part"]
