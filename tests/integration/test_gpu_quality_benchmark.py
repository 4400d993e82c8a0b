"""benchmarks/gpu_quality.py runs on a bare GPU machine: torch, numpy and safetensors, no data stack.

Its smoke mode (CPU, a few steps) runs here with metaflow, zarr, segyio, boto3 and fsspec made
unimportable in the benchmark and in every worker process it spawns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.bare_gpu import bare_gpu_env

PROJECT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_gpu_quality_smoke_pretrains_and_fine_tunes_without_the_data_stack(tmp_path):
    env = bare_gpu_env(tmp_path)
    proc = subprocess.run([sys.executable, "benchmarks/gpu_quality.py", "--smoke", "--workers", "2",
                           "--data", str(tmp_path / "surveys")],
                          cwd=PROJECT, env=env, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["smoke"] and result["device"] == "cpu"
    rows = {row["name"]: row for row in result["variants"]}
    assert sorted(rows) == ["base", "half-batch"]
    assert rows["base"]["samples_seen"] == 6 * result["base"]["batch"] and rows["half-batch"]["samples_seen"] == 24
    for row in rows.values():
        assert set(row["ap"]) == {"1", "4"} and all(0 < ap < 1 for aps in row["ap"].values() for ap in aps)
        for budget, aps in row["ap"].items():
            paired = [p - q for p, q in zip(aps, result["random"][budget])]
            assert row[f"ft_ap_gain_b{budget}"] == pytest.approx(sum(paired) / len(paired), abs=1e-4)
            assert row[f"ft_min_gain_b{budget}"] == pytest.approx(min(paired), abs=1e-4)
            assert row[f"ft_all_seeds_gain_b{budget}"] == all(g > 0 for g in paired)
    assert sorted(p.name for p in (tmp_path / "surveys").iterdir()) == ["survey-0.npy", "survey-1.npy"]


def test_gpu_quality_refuses_an_unknown_setting():
    proc = subprocess.run([sys.executable, "benchmarks/gpu_quality.py", "--smoke", "--variants", "x:depth=3"],
                          cwd=PROJECT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "unknown setting 'depth'" in proc.stderr and "steps" in proc.stderr


def test_gpu_quality_refuses_a_variant_named_like_the_random_arm():
    proc = subprocess.run([sys.executable, "benchmarks/gpu_quality.py", "--smoke", "--variants", "random:steps=5"],
                          cwd=PROJECT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "'random' is the random-init arm's" in proc.stderr
