"""Local-store loader benchmark: loader CPU per sample reading bricks by ``os.preadv`` on the loader's own
threads (``sfm.storage.ranged_file.LocalRangeReader``, the default for stores on a file system) against
zarr's own local reads (its event loop, a thread per read), side by side in one run.

    python benchmarks/local_reads.py [--surveys 8] [--shape 128 128 256] [--batches 150] [--rounds 3]

``--surveys`` synthetic surveys (sfm.synth.survey) are ingested by ``sfm ingest`` into a temporary data
root with the bricks and codec of ``sfm/configs/quality_cpu.toml``; both loaders then stream that
configuration's batches (its crop, batch size and augmentations; read threads, no worker processes)
for ``--batches`` batches after a warm-up, alternating over ``--rounds`` rounds (medians), so that
background load hits both alike. Figures per sample: loader CPU ms (this process's CPU time, all its
threads) and wall ms. On a CPU-bound node the loader's CPU is taken from the training step's cores, so
CPU ms per sample is the figure that carries: a node delivering S samples/s spends S x cpu_ms / 1000
cores on reading.

The last line is one JSON object: cpu_ms_per_sample_preadv, cpu_ms_per_sample_zarr, cpu_ratio
(preadv / zarr), wall_ms_per_sample_preadv, wall_ms_per_sample_zarr, and the settings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT))
CONFIG = PROJECT / "sfm" / "configs" / "quality_cpu.toml"


def ingest(workdir: Path, surveys: int, shape: list[int], job) -> list[str]:
    """Synthesise and ingest ``surveys`` surveys; the store URLs."""
    segys = []
    for seed in range(surveys):
        path = workdir / f"survey-{seed}.sgy"
        subprocess.run([sys.executable, "-m", "sfm.cli", "synth", str(path), "--seed", str(seed), "--shape",
                        *map(str, shape)], check=True, capture_output=True)
        segys.append(str(path))
    root = workdir / "data"
    subprocess.run([sys.executable, "-m", "sfm.cli", "ingest", "--out", str(root), "--chunk", str(job.ingest.chunk),
                    "--codec", job.ingest.codec, *segys], check=True, capture_output=True)
    return sorted(str(p) for p in (root / "surveys").glob("*.zarr"))


def measure(stores: list[str], job, batches: int, preadv: bool) -> tuple[float, float]:
    """(loader CPU ms, wall ms) per sample over ``batches`` batches after a warm-up."""
    import sfm.data.survey as survey
    from sfm.data.loader import training_stream
    from sfm.storage.resilient_store import open_survey_store

    def opener(*args, **kwargs):
        store = open_survey_store(*args, **kwargs)
        if not preadv:
            store.range_reader = None  # every read through zarr's LocalStore
        return store

    survey.open_survey_store = opener
    try:
        stream = training_stream(stores, job.data)
        batch = iter(stream)
        for _ in range(10):
            next(batch)
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(batches):
            next(batch)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        stream.close()
    finally:
        survey.open_survey_store = open_survey_store
    samples = batches * job.data.batch_size
    return 1000 * cpu / samples, 1000 * wall / samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--surveys", type=int, default=8)
    parser.add_argument("--shape", type=int, nargs=3, default=[128, 128, 256])
    parser.add_argument("--batches", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from sfm.config import JobConfig

    job = JobConfig.from_toml(str(CONFIG))
    with tempfile.TemporaryDirectory(prefix="sfm-local-reads-") as tmp:
        stores = ingest(Path(tmp), args.surveys, args.shape, job)
        runs: dict[str, list[tuple[float, float]]] = {"preadv": [], "zarr": []}
        for r in range(args.rounds):
            for name in ("preadv", "zarr") if r % 2 == 0 else ("zarr", "preadv"):
                runs[name].append(measure(stores, job, args.batches, preadv=name == "preadv"))
                cpu, wall = runs[name][-1]
                print(f"round {r} {name}: {cpu:.2f} CPU-ms, {wall:.2f} wall-ms per sample", flush=True)
    med = {name: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v)) for name, v in runs.items()}
    print(json.dumps({
        "cpu_ms_per_sample_preadv": round(med["preadv"][0], 2), "cpu_ms_per_sample_zarr": round(med["zarr"][0], 2),
        "cpu_ratio": round(med["preadv"][0] / med["zarr"][0], 3),
        "wall_ms_per_sample_preadv": round(med["preadv"][1], 2), "wall_ms_per_sample_zarr": round(med["zarr"][1], 2),
        "surveys": args.surveys, "shape": args.shape, "batches": args.batches, "rounds": args.rounds,
        "crop": list(job.data.crop), "batch": job.data.batch_size, "chunk": job.ingest.chunk, "codec": job.ingest.codec,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
