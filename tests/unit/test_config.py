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
                          (dict(config={"data": {"client": "curl"}}), "data.client = 'curl' is not valid")):
        config = kwargs.pop("config", {})
        with pytest.raises(SFMError, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
            pipeline.job_config(config, **kwargs)
    pipeline.job_config({})  # the defaults pass
