"""Brick cache benchmark (``data.cache_mb``): loader CPU per sample and pretraining time with and
without normalised bricks kept in memory, side by side in one run.

    python benchmarks/brick_cache.py [--config sfm/configs/quality_cpu.toml] [--surveys 8] [--steps 300]

Surveys of the configuration's ``[synth] shape`` are generated (sfm.synth.survey) and ingested with its
``[ingest] chunk``. Then, on the configuration's crops, batch size and augmentation:

- the loader alone (sfm.data.crop_dataset, read threads, this process): CPU ms per sample over
  ``--samples`` samples, without the cache, with it while it fills (the first pass) and with it warm;
- pretraining (``sfm train`` of the configuration, ``--steps`` steps, twice each way, alternating):
  seconds per step and process CPU seconds per step, and whether both ways trained on the same
  batches (identical loss histories: the cache must not change a value).

The last line is one JSON object: loader_cpu_ms_per_sample (off / on_cold / on_warm),
train_seconds_per_step (off / on, the faster of each way's runs), train_cpu_seconds_per_step,
train_speedup, same_losses, cache_mb_used.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT))


def make_stores(workdir: Path, config: dict, surveys: int) -> list[str]:
    """``surveys`` synthetic surveys of the configuration's shape, ingested into ``workdir``/data."""
    shape = [str(n) for n in config.get("synth", {}).get("shape", [128, 128, 256])]
    chunk = str(config.get("ingest", {}).get("chunk", 128))
    sgy = []
    for seed in range(surveys):
        path = workdir / f"survey-{seed}.sgy"
        subprocess.run([sys.executable, "-m", "sfm.cli", "synth", str(path), "--shape", *shape,
                        "--seed", str(1000 + seed)], check=True, cwd=PROJECT, stdout=subprocess.DEVNULL)
        sgy.append(str(path))
    subprocess.run([sys.executable, "-m", "sfm.cli", "ingest", "--out", str(workdir / "data"), "--chunk", chunk,
                    *sgy], check=True, cwd=PROJECT, stdout=subprocess.DEVNULL)
    return sorted(str(p) for p in (workdir / "data" / "surveys").glob("*.zarr"))


def loader_cpu(urls: list[str], cfg, samples: int) -> dict:
    """CPU ms per sample of reading ``samples`` crops, batch by batch: no cache, a filling one, a warm one."""
    from sfm import data
    from sfm.config import DataConfig

    def crops(cache_mb: int):
        d = cfg.data
        return data.crop_dataset(urls, DataConfig(crop=d.crop, seed=d.seed, min_live_fraction=d.min_live_fraction,
                                                  read_threads=d.read_threads, augment=d.augment, cache_mb=cache_mb))

    def cpu_ms(s, first: int) -> float:
        batch = cfg.data.batch_size
        start = time.process_time()
        for b in range(first, first + samples, batch):
            s.read(list(range(b, b + batch)))
        return (time.process_time() - start) * 1e3 / samples

    plain = crops(0)
    try:
        cpu_ms(plain, 10**6)  # warm-up: imports, the thread pool, the page cache
        off = cpu_ms(plain, 0)
    finally:
        plain.close()
    cached = crops(cfg.data.cache_mb or 1024)
    try:
        cold = cpu_ms(cached, 0)
        warm = cpu_ms(cached, samples)  # other crops, of bricks already cached
        used = cached.reader.cpu_stats()["cache_mb"]
    finally:
        cached.close()
    return {"off": off, "on_cold": cold, "on_warm": warm, "cache_mb_used": used}


def train(urls: list[str], config_path: Path, root: Path, steps: int, cache_mb: int) -> dict:
    """One ``sfm train`` of the configuration: seconds and CPU seconds per step, and its losses."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-m", "sfm.cli", "train", "--config", str(config_path),
                    "--surveys", ",".join(urls), "--run-root", str(root), f"train.max_steps={steps}",
                    f"train.checkpoint_every={steps + 1}", "train.snapshots=[]", f"data.cache_mb={cache_mb}"],
                   check=True, cwd=PROJECT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": str(PROJECT)})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    summary = json.loads((root / "summary.json").read_text())
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"seconds_per_step": summary["seconds"] / steps, "cpu_seconds_per_step": cpu / steps,
            "losses": [h["loss"] for h in summary["history"]]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(PROJECT / "sfm" / "configs" / "quality_cpu.toml"))
    parser.add_argument("--surveys", type=int, default=8)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workdir", default="")
    args = parser.parse_args()

    from sfm.config import JobConfig

    config_path = Path(args.config)
    config = tomllib.loads(config_path.read_text())
    cfg = JobConfig.from_toml(config_path)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="sfm-brick-cache-"))
    workdir.mkdir(parents=True, exist_ok=True)
    urls = make_stores(workdir, config, args.surveys)
    cache_mb = cfg.data.cache_mb or 1024
    print(f"brick_cache: {len(urls)} surveys of {config.get('synth', {}).get('shape')} in {workdir}", file=sys.stderr)

    loader = loader_cpu(urls, cfg, args.samples)
    print(f"brick_cache: loader {loader}", file=sys.stderr)
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for repeat in range(args.repeats):
        for way, mb in (("off", 0), ("on", cache_mb)):
            run = train(urls, config_path, workdir / f"train-{way}-{repeat}", args.steps, mb)
            runs[way].append(run)
            print(f"brick_cache: train {way} {repeat}: {run['seconds_per_step'] * 1e3:.1f} ms/step, "
                  f"{run['cpu_seconds_per_step'] * 1e3:.1f} CPU ms/step", file=sys.stderr)
    best = {way: min(r["seconds_per_step"] for r in rs) for way, rs in runs.items()}
    cpu = {way: min(r["cpu_seconds_per_step"] for r in rs) for way, rs in runs.items()}
    same = all(r["losses"] == runs["off"][0]["losses"] for rs in runs.values() for r in rs)
    print(json.dumps({
        "benchmark": "brick_cache", "config": str(config_path.relative_to(PROJECT) if config_path.is_relative_to(PROJECT)
                                                  else config_path),
        "surveys": len(urls), "crop": list(cfg.data.crop), "batch_size": cfg.data.batch_size, "steps": args.steps,
        "loader_cpu_ms_per_sample": {k: round(v, 3) for k, v in loader.items() if k != "cache_mb_used"},
        "loader_cpu_ratio_warm_vs_off": round(loader["on_warm"] / loader["off"], 4),
        "cache_mb_used": round(loader["cache_mb_used"], 1),
        "train_seconds_per_step": {k: round(v, 5) for k, v in best.items()},
        "train_cpu_seconds_per_step": {k: round(v, 5) for k, v in cpu.items()},
        "train_speedup": round(best["off"] / best["on"], 4),
        "same_losses": same,
    }))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
