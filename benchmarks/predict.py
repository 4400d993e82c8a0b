"""Whole-survey prediction (issue 49): CPU per voxel, peak memory against the survey's size, and on paper what a
GPU node needs to predict a 100 GB survey.

    python benchmarks/predict.py [--repeats 4,8,16,32] [--workdir DIR]

Surveys: one generated tile of 128 inlines x 64 crosslines x 1024 samples (33.5 MB of float32) repeated along
the inlines (tests/support/long_survey.py), ingested with 32^3 bricks. Each prediction is ``sfm predict`` in a
child process on one thread (``OMP_NUM_THREADS=1``), 3 parts, overlap 0.5, no mirroring:

- peak memory: the child's ``VmHWM`` for every survey size, with a narrow network (the ``tiny`` preset at a 32^3
  crop with 16-wide embeddings and one block: 0.1 kFLOP per voxel) so the sweep is quick; goal: flat;
- CPU per voxel, all of the prediction's threads (``cpu_s`` that ``sfm.predict.predict`` reports: plan, parts,
  publish; not the imports), split into the network (the calling thread's CPU inside it: all of it on one
  thread) and the rest, the loader: reading, decoding and normalising bricks, cutting windows, blending,
  converting, encoding and writing shards. Voxels per second per core = voxels / CPU seconds, for the narrow
  network and for the ``tiny`` preset itself (32^3 crop) on the smallest survey;
- bytes per voxel: the input store's amplitude shards (what a GPU node fetches from S3) and the prediction's
  shards (what it puts).

On paper (``gpu_100gb``): a 100 GB float32 survey (2,500 x 2,500 x 4,000 samples) predicted by the ``base``
preset at a 128^3 crop with the linear head, overlap 0.5: the network's FLOPs (``sfm.model.flops``: the
encoder at mask ratio 0 plus the head, times the windows per voxel), an H100's dense bf16 datasheet rate
(``sfm.model.hardware``) at the 40 % MFU the scaling model assumes, the loader CPU per voxel measured here, and
the bytes per voxel measured here. The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT))
sys.path.insert(0, str(PROJECT / "tests"))

TILE = (128, 64, 1024)
OVERLAP = 0.5
SURVEY_100GB = (2500, 2500, 4000)  # float32: 100 GB
GPU_MFU = 0.40  # as sfm.ops.scaling_model assumes for the compute


def child(args: list[str]) -> dict:
    """``sfm predict args`` on one thread in a child process: its JSON line plus its peak RSS (MB) and CPU."""
    code = ("import json, sys; from sfm.cli import main; rc = main(sys.argv[1:]); "
            "hwm = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:')); "
            "print('VMHWM', hwm); sys.exit(rc)")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(PROJECT)}
    before = os.times()
    proc = subprocess.run([sys.executable, "-c", code, "predict", *args], capture_output=True, text=True, env=env)
    after = os.times()
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-2])
    result["peak_rss_mb"] = int(lines[-1].split()[1]) / 1024
    result["process_cpu_s"] = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return result


def stored_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def save_model(path: Path, **overrides) -> dict:
    import torch

    from sfm.model import build_model, mae_config
    from sfm.model.segmenter import Segmenter, Task, save_segmenter

    torch.manual_seed(0)
    cfg = mae_config("tiny", crop=(32, 32, 32), **overrides)
    save_segmenter(Segmenter(build_model(cfg), Task()), str(path))
    return {"flops_per_voxel": forward_flops_per_voxel(cfg), "embed_dim": cfg.embed_dim, "depth": cfg.depth}


def forward_flops_per_voxel(cfg) -> float:
    """The task network's forward FLOPs per voxel of one window: the encoder on every patch (mask ratio 0) and
    the linear head (2 x embed x patch voxels per token)."""
    from sfm.model.flops import forward_flops_per_sample

    parts = forward_flops_per_sample(dataclasses.replace(cfg, mask_ratio=0.0))
    head = 2 * cfg.embed_dim * math.prod(cfg.patch) * cfg.num_patches
    return (parts["patch_embed"] + parts["encoder"] + head) / math.prod(cfg.crop)


def windows_per_voxel(shape, crop, overlap: float) -> float:
    from sfm.predict.windows import origins

    return math.prod(len(origins(n, c, overlap)) * c / n for n, c in zip(shape, crop))


def measure(workdir: Path, repeats: list[int]) -> dict:
    from support.long_survey import long_survey

    from sfm.ingest.survey import ingest_survey

    narrow = save_model(workdir / "narrow", embed_dim=16, depth=1, num_heads=1)
    tiny = save_model(workdir / "tiny")
    rows = []
    for r in repeats:
        src = long_survey(workdir / f"s{r}.sgy", TILE, r)
        store = ingest_survey(str(src), str(workdir / f"data{r}"), chunk=32)["store_url"]
        src.unlink()
        out = workdir / f"out{r}.zarr"
        result = child(["--model", str(workdir / "narrow"), "--survey", store, "--out", str(out), "--parts", "3",
                        "--overlap", str(OVERLAP), "--batch-size", "16"])
        voxels = result["voxels"]
        rows.append({"repeats": r, "survey_gb": voxels * 4 / 1e9, "voxels": voxels,
                     "peak_rss_mb": round(result["peak_rss_mb"], 1), "seconds": result["seconds"],
                     **{k: result[k] for k in ("cpu_s", "model_cpu_s", "window_cpu_s", "windows")},
                     "process_cpu_s": round(result["process_cpu_s"], 2),
                     "voxels_per_cpu_s": round(voxels / result["cpu_s"]),
                     "input_bytes_per_voxel": round(stored_bytes(Path(store) / "amplitude") / voxels, 3),
                     "output_bytes_per_voxel": round(stored_bytes(out / "probability") / voxels, 3)})
        print(json.dumps(rows[-1]), flush=True)
        if r != repeats[0]:
            shutil.rmtree(workdir / f"data{r}")
        shutil.rmtree(out)
    first = next(iter(sorted((workdir / f"data{repeats[0]}" / "surveys").glob("*.zarr"))))
    result = child(["--model", str(workdir / "tiny"), "--survey", str(first), "--out", str(workdir / "tiny.zarr"),
                    "--parts", "3", "--overlap", str(OVERLAP), "--batch-size", "16"])
    tiny_row = {"voxels": result["voxels"], "windows": result["windows"], "peak_rss_mb": round(result["peak_rss_mb"], 1),
                **{k: result[k] for k in ("cpu_s", "model_cpu_s", "window_cpu_s")},
                "flops_per_voxel_window": round(tiny["flops_per_voxel"], 1)}
    tiny_row["model_gflops_per_cpu_s"] = round(result["windows"] * 32**3 * tiny["flops_per_voxel"]
                                               / result["model_cpu_s"] / 1e9, 2)
    return {"sizes": rows, "tiny": tiny_row, "narrow_flops_per_voxel_window": round(narrow["flops_per_voxel"], 1)}


def per_voxel(rows: list[dict], tiny: dict) -> dict:
    """CPU per voxel from the sweep: the slopes against the voxels (the plan, model load and publish are a fixed
    cost), the loader split into what every voxel costs once (read, decode, normalise, convert, encode, write) and
    what each window costs per voxel it holds (cut out, blended in)."""
    import numpy as np

    voxels = np.array([r["voxels"] for r in rows], float)
    total = np.polyfit(voxels, [r["cpu_s"] for r in rows], 1)
    once = np.polyfit(voxels, [r["cpu_s"] - r["model_cpu_s"] - r["window_cpu_s"] for r in rows], 1)
    window_voxels = sum(r["windows"] for r in rows) * 32**3
    per_window_voxel = sum(r["window_cpu_s"] for r in rows) / window_voxels
    tiny_cpu = tiny["model_cpu_s"] + tiny["window_cpu_s"] + once[0] * tiny["voxels"]
    return {"narrow_ns_per_voxel": round(total[0] * 1e9, 2), "narrow_fixed_cpu_s": round(total[1], 2),
            "narrow_voxels_per_cpu_s": round(1 / total[0]),
            "loader_once_ns_per_voxel": round(once[0] * 1e9, 2),
            "loader_window_ns_per_window_voxel": round(per_window_voxel * 1e9, 3),
            "windows_per_voxel": round(window_voxels / voxels.sum(), 3),
            "tiny_voxels_per_cpu_s": round(tiny["voxels"] / tiny_cpu),
            "tiny_model_share": round(tiny["model_cpu_s"] / tiny_cpu, 3)}


def on_paper(cpu: dict, rows: list[dict]) -> dict:
    """What one GPU node needs for a 100 GB survey, from the measured loader CPU and bytes per voxel."""
    import torch

    from sfm.model import mae_config
    from sfm.model.hardware import datasheet_peak_flops

    cfg = mae_config("base", crop=(128, 128, 128))
    voxels = math.prod(SURVEY_100GB)
    windows = windows_per_voxel(SURVEY_100GB, cfg.crop, OVERLAP)
    flops = forward_flops_per_voxel(cfg) * windows
    rate = datasheet_peak_flops("NVIDIA H100", torch.bfloat16) * GPU_MFU
    gpu_s = voxels * flops / rate
    loader_ns = cpu["loader_once_ns_per_voxel"] + windows * cpu["loader_window_ns_per_window_voxel"]
    loader_core_s = voxels * loader_ns * 1e-9
    largest = rows[-1]
    bytes_in, bytes_out = voxels * largest["input_bytes_per_voxel"], voxels * largest["output_bytes_per_voxel"]
    return {"survey": list(SURVEY_100GB), "voxels": voxels, "preset": "base", "crop": list(cfg.crop), "overlap": OVERLAP,
            "windows_per_voxel": round(windows, 3), "model_kflop_per_voxel": round(flops / 1e3, 1),
            "gpu_rate_tflops": rate / 1e12, "h100_gpu_s": round(gpu_s, 1), "h100_gpu_s_mirrored": round(8 * gpu_s, 1),
            "loader_ns_per_voxel": round(loader_ns, 2), "loader_core_hours": round(loader_core_s / 3600, 2),
            "loader_cores_to_keep_one_h100_busy": round(loader_core_s / gpu_s, 1),
            "loader_cores_to_keep_one_h100_busy_mirrored": round(loader_core_s / (8 * gpu_s), 1),
            "s3_read_gb": round(bytes_in / 1e9, 1), "s3_write_gb": round(bytes_out / 1e9, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", default="4,8,16,32", help="survey sizes, in tiles of 33.5 MB")
    parser.add_argument("--workdir", default="", help="where the surveys go (default: a temporary folder)")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="sfm-predict-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    clock = time.perf_counter()
    try:
        measured = measure(workdir, [int(r) for r in args.repeats.split(",")])
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    rows = measured["sizes"]
    peaks = [r["peak_rss_mb"] for r in rows]
    cpu = per_voxel(rows, measured["tiny"])
    figures = {**measured, "cpu": cpu, "peak_rss_largest_over_smallest": round(peaks[-1] / peaks[0], 3),
               "size_largest_over_smallest": round(rows[-1]["survey_gb"] / rows[0]["survey_gb"], 2),
               "gpu_100gb": on_paper(cpu, rows), "load_average": os.getloadavg(),
               "seconds": round(time.perf_counter() - clock, 1)}
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
