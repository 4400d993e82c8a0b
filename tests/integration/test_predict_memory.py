"""`sfm predict` streams (issue 49): a survey more than 4 times the size of the process's memory limit (a cgroup
v1 limit the kernel enforces by killing the process) is predicted whole, and sampled regions of the result (survey
edges, part borders, the middle) equal every window that reaches them run alone and blended in memory."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import zarr
from support.long_survey import long_survey
from support.memory_limit import MemoryLimit, available
from support.predict_reference import SurveyValues, blended

from sfm.ingest.survey import ingest_survey
from sfm.model import build_model, mae_config
from sfm.model.segmenter import Segmenter, Task, save_segmenter

pytestmark = pytest.mark.long(1)

LIMIT = 320 << 20
TILE, REPEATS = (128, 64, 1024), 40  # 5120 x 64 x 1024 float32: 1.34 GB
OVERLAP = 0.25


@pytest.mark.timeout(1200)
def test_a_survey_four_times_the_memory_limit_is_predicted_whole(tmp_path):
    why_not = available()
    if why_not:
        pytest.skip(f"no memory limit can be set here: {why_not}")
    src = long_survey(tmp_path / "long.sgy", TILE, REPEATS)
    store = ingest_survey(str(src), str(tmp_path / "data"), chunk=32)["store_url"]
    src.unlink()
    values = SurveyValues(store)
    shape = values.info.shape
    assert math.prod(shape) * 4 >= 4 * LIMIT, shape
    torch.manual_seed(0)  # the tiny preset made narrow: the test is of the streaming, not the network
    net = Segmenter(build_model(mae_config("tiny", crop=(32, 32, 32), embed_dim=16, depth=1, num_heads=1)), Task())
    save_segmenter(net, str(tmp_path / "model"))
    out = tmp_path / "faults.zarr"
    cmd = [sys.executable, "-m", "sfm.cli", "predict", "--model", str(tmp_path / "model"), "--survey", store,
           "--out", str(out), "--parts", "3", "--overlap", str(OVERLAP), "--batch-size", "16"]
    with MemoryLimit(LIMIT) as limit:
        proc = subprocess.run(cmd, preexec_fn=limit.enter, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=1100)
    assert proc.returncode == 0 and limit.oom_kills == 0, (proc.returncode, limit.oom_kills, proc.stderr[-3000:])
    assert limit.peak <= LIMIT
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["published"] and result["voxels"] == math.prod(shape)

    predicted = zarr.open_group(str(out), mode="r")["probability"]
    (i1, i2), n = (int(shape[0] * k / 3) // 32 * 32 for k in (1, 2)), shape  # part borders: whole shard rows
    regions = [((0, 5), (0, 5), (0, 5)), ((n[0] - 5, n[0]), (n[1] - 5, n[1]), (n[2] - 5, n[2])),
               ((i1 - 3, i1 + 3), (30, 36), (500, 506)), ((i2 - 3, i2 + 3), (0, 4), (1019, 1024)),
               ((2500, 2506), (60, 64), (0, 6))]
    net.eval()
    for box in regions:
        expected = blended(net, values, box, OVERLAP, mirror=False)[0]
        got = predicted[tuple(slice(lo, hi) for lo, hi in box)]
        np.testing.assert_allclose(got, expected, atol=2e-6, err_msg=str(box))
