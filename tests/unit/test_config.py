"""The job config: every setting validated in one place, with the key and the fix in one line."""

from __future__ import annotations

import pytest


def test_job_settings_are_validated_with_the_key_and_the_fix():
    from sfm import pipeline
    from sfm.errors import SFMError

    for kwargs, words in ((dict(max_steps=-5), "train.max_steps = -5 must be at least 1; pass a positive --max-steps"),
                          (dict(preset="gigantic"), "valid presets are tiny, mini"),
                          (dict(config={"data": {"augment": "rotate"}}), "data.augment names rotate"),
                          (dict(config={"train": {"snapshots": [1.5]}}), "train.snapshots"),
                          (dict(config={"data": {"client": "curl"}}), "data.client = 'curl' is not valid"),
                          (dict(config={"data": {"batch_dtype": "int8"}}), "but ingest.dtype = 'float32'; set ingest"),
                          (dict(config={"model": {"decoder_mask_ratio": 1.0}}), "model.decoder_mask_ratio = 1.0"),
                          (dict(config={"model": {"decoder_mask_ratio": 0.5}}, cp=2, procs_per_node=2),
                           "not implemented with dist.cp = 2"),
                          (dict(config={"train": {"optimizer": "sgd"}}), "train.optimizer = 'sgd' is not valid"),
                          (dict(config={"train": {"optimizer": "muon"}}, strategy="fsdp2-full", procs_per_node=2),
                           "fsdp2-full's shards do not hold; use dist.strategy = ddp")):
        config = kwargs.pop("config", {})
        with pytest.raises(SFMError, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
            pipeline.job_config(config, **kwargs)
    pipeline.job_config({})  # the defaults pass
    assert pipeline.job_config({"model": {"decoder_mask_ratio": 0.5}}).model.decoder_mask_ratio == 0.5
    pipeline.job_config({"ingest": {"dtype": "int8"}, "data": {"batch_dtype": "int8"}})
    pipeline.job_config({"train": {"optimizer": "muon"}}, procs_per_node=2)  # DDP holds whole matrices


def test_configs_saved_by_earlier_releases_still_load():
    """A registry version or checkpoint of the release before the downstream evaluation holds the fault
    probe's keys; its config still loads (the watcher continues from such a champion)."""
    from sfm.config import JobConfig

    old = {"eval": {"crops": 8, "batch_size": 8, "seed": 1234, "probe_train_volumes": 8, "probe_test_volumes": 4},
           "ingest": {"iline_byte": 0, "xline_byte": 0, "chunk": 128, "codec": "zstd:1"}}
    cfg = JobConfig.from_dict(old)
    assert cfg.eval.crops == 8 and cfg.ingest.chunk == 128 and cfg.ingest.dtype == "float32"
    with pytest.raises(Exception, match="unknown config key"):
        JobConfig.from_dict({"eval": {"probe_volumes": 3}})
    with pytest.raises(Exception, match="'eval.probe_train_volumes' was retired; see eval.downstream"):
        JobConfig.from_toml(None, ["eval.probe_train_volumes=8"])  # a user's override is told what replaced it
