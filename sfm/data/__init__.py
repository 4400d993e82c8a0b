"""Survey stores to training batches, in the order data flows: open a survey's store with retries
(:mod:`.store`), read bricks (:mod:`.bricks`), know a survey (:mod:`.survey`), plan and read crops
(:mod:`.crops`), batch them for one rank and resume exactly (:mod:`.loader`)."""

from sfm.data.crops import ALIGNMENTS, AUGMENTATIONS, Crop, CropSampler, brick_tiles
from sfm.data.loader import BatchStream, CropDataset, training_stream
from sfm.storage.resilient_store import CLIENTS, ResilientStore, open_survey_store
from sfm.storage.retry import is_transient
from sfm.data.survey import CropOrigins, SurveyInfo, read_survey_info

__all__ = ["ALIGNMENTS", "AUGMENTATIONS", "CLIENTS", "BatchStream", "Crop", "CropDataset", "CropOrigins",
           "CropSampler", "ResilientStore", "SurveyInfo", "brick_tiles", "is_transient", "open_survey_store",
           "read_survey_info", "training_stream"]
