"""benchmarks/gpu_strategies.py runs on a bare GPU machine: torch and sfm's model, step and strategies, no data
stack. Its smoke mode (CPU, gloo at world size 1, tiny shapes) runs here with metaflow, zarr, segyio, boto3 and
fsspec made unimportable in the script and in the process it starts for each strategy: one torch strategy and one
DeepSpeed strategy, the two ways benchmarks/strategies.py (whose code it runs) builds a step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.bare_gpu import bare_gpu_env

PROJECT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_gpu_strategies_smoke_measures_a_torch_and_a_deepspeed_strategy_without_the_data_stack(tmp_path):
    env = bare_gpu_env(tmp_path)
    proc = subprocess.run([sys.executable, "benchmarks/gpu_strategies.py", "--smoke",
                           "--strategies", "fsdp2-full,deepspeed-zero3"],
                          cwd=PROJECT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["smoke"] and result["device"] == "cpu" and result["world_size"] == 1
    assert sorted(result["strategies"]) == ["deepspeed-zero3", "fsdp2-full"]
    params = result["params"]
    for name, row in result["strategies"].items():
        assert row["applied"] and row["samples_per_s"] > 0 and row["peak_rss_mb"] > 0, (name, row)
        # one rank holds everything: float32 weights, gradients and AdamW's two moments (4 x 4 bytes per
        # parameter), and DeepSpeed its float32 masters and buckets besides
        assert row["state_bytes_per_rank"] >= 16 * params, (name, row)
    assert result["strategies"]["deepspeed-zero3"]["state_bytes_per_rank"] > \
        result["strategies"]["fsdp2-full"]["state_bytes_per_rank"]
