"""Survey stores to training batches, in the order data flows (stores are opened with retries by
:mod:`sfm.storage.resilient_store`): read bricks (:mod:`.bricks`), the surveys a process reads (:mod:`.survey`), plan crops
(:mod:`.crops`), read them (:mod:`.crop_reader`), batch them for one rank and resume exactly (:mod:`.loader`)."""

from sfm.config import ALIGNMENTS, AUGMENTATIONS
from sfm.data.crop_reader import CropReader, brick_tiles, region_pool_for
from sfm.data.crops import Crop, CropPlan
from sfm.data.loader import BatchStream, CropDataset, crop_dataset, training_stream
from sfm.data.survey import CropOrigins, SurveyInfo, Surveys, read_survey_info

__all__ = ["ALIGNMENTS", "AUGMENTATIONS", "BatchStream", "Crop", "CropDataset", "CropOrigins", "CropPlan",
           "CropReader", "SurveyInfo", "Surveys", "brick_tiles", "crop_dataset", "read_survey_info", "region_pool_for", "training_stream"]
