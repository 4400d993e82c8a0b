"""MDIO stores as training input (issue 19): registering one and streaming crops from it, beside sfm's own store
of the same survey, in one run.

    python benchmarks/mdio.py [--shape 320 320 256] [--batch 8]

One synthetic survey (sfm.synth.survey) is written as SEG-Y, converted by the real MDIO library (multidimio
1.1.3 in its own environment, tests/support/mdio_env.py; MDIO's 128^3 chunks, Blosc zstd 5) and ingested by
sfm (float32, 128^3 bricks in shards), both onto ``rclone serve s3`` on loopback. Then:

- the conversion's CPU seconds per GB of SEG-Y, MDIO's (its processes, children of this one) against sfm's
  ingest (this process);
- registering the MDIO store in place (``sfm.ingest.mdio_register.register_mdio``: validation, the content
  identity, the statistics over every chunk): CPU seconds per GB of amplitude and wall seconds;
- the loader on both stores, 128^3 crops (benchmarks/loader.py's rows): a fetch per crop, voxel-aligned, and
  the region pool with k = 32 crops per region (float16 batches): CPU ms, S3 MB and GETs per sample.

The last line is one JSON object: ``register_cpu_s_per_gb``, ``mdio_ingest_cpu_s_per_gb``,
``sfm_ingest_cpu_s_per_gb``, and per loader row ``cpu_ms_per_sample`` / ``s3_mb_per_sample`` /
``gets_per_sample`` for each store, with ``mdio_over_sfm_cpu`` ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT))
sys.path.insert(0, str(PROJECT / "benchmarks"))
sys.path.insert(0, str(PROJECT / "tests"))

from loader import measure  # noqa: E402
from receive import rclone_with_survey  # noqa: E402

GB = 1e9


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def convert_with_mdio(segy: str, dst: Path) -> dict:
    """The real MDIO's segy_to_mdio, on as many processes as it likes; its CPU seconds (children of this one)."""
    from support.mdio_env import mdio_python, run_tool

    mdio_python()  # build the environment first: not part of the figure
    c0, t0 = children_cpu(), time.perf_counter()
    run_tool("from-segy", segy, str(dst), env={"MDIO__IMPORT__CPU_COUNT": str(os.cpu_count() or 1)})
    return {"cpu_s": children_cpu() - c0, "wall_s": time.perf_counter() - t0}


def timed(call) -> tuple:
    p0, t0 = time.process_time(), time.perf_counter()
    out = call()
    return out, time.process_time() - p0, time.perf_counter() - t0


def main() -> int:
    import torch

    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs=3, default=[320, 320, 256])
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()

    from sfm.ingest import survey as ingest
    from sfm.ingest.mdio_register import register_mdio

    workdir = Path(tempfile.mkdtemp(prefix="sfm-bench-mdio-"))
    server = None
    il, xl, ns = args.shape
    amplitude_gb = il * xl * ns * 4 / GB
    results: dict = {"shape": args.shape, "batch": args.batch, "cpus": os.cpu_count(), "amplitude_gb": amplitude_gb,
                     "load_average_at_start": os.getloadavg()[0]}
    try:
        server, segy = rclone_with_survey(workdir, args.shape)
        segy_gb = os.path.getsize(segy) / GB
        mdio = convert_with_mdio(segy, workdir / "rclone-root" / "bench" / "survey.mdio")
        row, cpu, wall = timed(lambda: ingest.ingest_survey(segy, "s3://bench/sfm"))
        results["mdio_ingest_cpu_s_per_gb"] = mdio["cpu_s"] / segy_gb
        results["mdio_ingest_wall_s"] = mdio["wall_s"]
        results["sfm_ingest_cpu_s_per_gb"] = cpu / segy_gb
        results["sfm_ingest_wall_s"] = wall
        ref, cpu, wall = timed(lambda: register_mdio("s3://bench/survey.mdio", "s3://bench/ref"))
        stats = json.loads(ref["stats_json"])
        results["register_cpu_s_per_gb"] = cpu / amplitude_gb
        results["register_wall_s"] = wall
        results["register_fraction_read"] = stats["fraction_read"]
        results["register_mb_read"] = stats["bytes_read"] / 1e6
        print(f"[register] {cpu:.2f} CPU-s, {wall:.2f} s for {amplitude_gb:.3f} GB of amplitude; "
              f"ingest: MDIO {mdio['cpu_s']:.1f} CPU-s, sfm {results['sfm_ingest_cpu_s_per_gb'] * segy_gb:.1f} CPU-s",
              file=sys.stderr, flush=True)
        stores = {"sfm": row["store_url"], "mdio": ref["store_url"]}
        rows = {}
        for label, kwargs in (("voxel-aligned, k=1", {}), ("pool k=32, float16 batch", {"k": 32, "dtype": "float16"})):
            for kind, url in stores.items():
                rows[f"{kind}: {label}"] = measure(f"{kind}: {label}", url, batch=args.batch, **kwargs)
        results["rows"] = rows
        for label in ("voxel-aligned, k=1", "pool k=32, float16 batch"):
            key = "k1" if label.startswith("voxel") else "k32"
            for kind in ("sfm", "mdio"):
                r = rows[f"{kind}: {label}"]
                for figure in ("cpu_ms_per_sample", "s3_mb_per_sample", "gets_per_sample"):
                    results[f"{kind}_{key}_{figure}"] = r[figure]
            results[f"mdio_over_sfm_cpu_{key}"] = (rows[f"mdio: {label}"]["cpu_ms_per_sample"]
                                                   / rows[f"sfm: {label}"]["cpu_ms_per_sample"])
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    results["load_average_at_end"] = os.getloadavg()[0]
    print(json.dumps(results, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
