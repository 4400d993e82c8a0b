"""Loader benchmark (issue 17): CPU and S3 bytes per 128^3 sample, side by side in one run.

    python benchmarks/loader.py [--shape 640 640 384] [--batch 16] [--train-steps 300] [--seeds 2]

One synthetic survey (sfm.synth.survey) is ingested three times (float32, float16, int8 stores; 128^3
bricks, the ingest default) onto ``rclone serve s3`` on loopback. Each configuration then streams
batches of 128^3 crops in this process (sfm.data.loader, read threads, no worker processes) for a
steady-state window after a warm-up of one whole lane cycle, and reports per sample: S3 MB and GETs
(counted by the store wrapper), loader CPU ms (this process's CPU time: the server runs in its own
process and is excluded), split into receive / decode / normalise / copy (thread CPU time measured
inside the reader), and the fraction of distinct regions per batch. Rows: brick-aligned and
voxel-aligned crops with a fetch per crop; the region pool with k = 4, 8, 16, 32 crops per region on
float16 and int8 stores (float16 batches); k = 32 on the float32 store; and k = 32 on the int8 store
with int8 batches (normalised on the device, ``sfm.data.int8_batch``).

Then, on the same brick ranges, the receive cost per GB of sfm's transport, obstore and AWS's CRT
(``benchmarks/receive.py``); and the statistical check: the tiny preset trained ``--train-steps``
steps on 32^3 crops of 32^3-brick stores (the region : crop ratio of 128^3 crops in 256^3 regions)
with k = 1, 8, 32 and 32 with four times the lanes on the same seeds (int8 store, int8 batches), and
validation loss (fixed held-out crops and masks) at equal steps; also k = 1 on the int8 store against
the float32 store (float16 batches). Rows also for k = 32 with four times the lanes (regions in
flight), with float16 and with int8 batches.

The last line is one JSON object; at its top level the figures of the configuration that
``sfm/configs/hyperpod_p5en.toml`` ships: cpu_ms_per_sample, s3_mb_per_sample, gets_per_sample,
distinct_region_fraction, val_loss_ratio_k_vs_1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT))
sys.path.insert(0, str(PROJECT / "benchmarks"))

from receive import rclone_with_survey, receive_cost  # noqa: E402

CROP = (128, 128, 128)
AUGMENT = ("flip_inline", "flip_crossline", "swap")
CLUSTER_CONFIG = PROJECT / "sfm" / "configs" / "hyperpod_p5en.toml"
MB = 1e6


def stream_for(url: str, *, batch: int, align: str = "voxel", k: int = 1, dtype: str = "float32",
               pool_dir: str = "", crop=CROP, seed: int = 0, threads: int = 4, lanes: int = 0):
    from sfm import data
    from sfm.config import DataConfig

    cfg = DataConfig(crop=crop, batch_size=batch, seed=seed, align=align, augment=",".join(AUGMENT),
                     read_threads=threads, crops_per_region=k, region_bricks=(2, 2, 2), regions_in_flight=lanes,
                     pool_dir=pool_dir, batch_dtype=dtype)
    cfg.check()
    return data.BatchStream(data.crop_dataset([url], cfg), workers=0, pin_memory=False)


def distinct_fraction(plan, batches: range, batch: int) -> float:
    """Mean over ``batches`` of (distinct regions in the batch) / (batch size) of a crop plan; 1.0 with a
    fetch per crop."""
    if plan.regions is None:
        return 1.0
    ds = [len({plan.regions.anchor(b * batch + n) for n in range(batch)}) / batch for b in batches]
    return statistics.mean(ds)


def measure(label: str, url: str, *, batch: int, align: str = "voxel", k: int = 1, store: str = "float32",
            dtype: str = "float32", lanes: int = 0) -> dict:
    """One row: steady-state figures per sample of one loader configuration."""
    from sfm.data.region_pool import region_bytes

    pool_dir = tempfile.mkdtemp(prefix="sfm-bench-pool-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    stream = stream_for(url, batch=batch, align=align, k=k, dtype=dtype, pool_dir=pool_dir, lanes=lanes)
    dataset = stream.dataset
    regions = dataset.plan.regions
    lanes = regions.lanes if regions else batch
    # steady state: the warm-up fills the pool (its default budget), so its files are being recycled
    slots = dataset.reader.regions.budget_bytes // max(
        region_bytes(g.extent, dataset.reader.dtype) for g in regions.grids) if k > 1 else 0
    warm = max(1, (slots + lanes) * k // batch)
    count = max(4, k * lanes // batch)  # one lane cycle: every lane starts about one region
    try:
        for _ in range(warm):
            next(stream)
        f0, c0 = dataset.surveys.fetch_stats(), dataset.reader.cpu_stats()
        p0, t0 = time.process_time(), time.perf_counter()
        for _ in range(count):
            next(stream)
        p1, t1 = time.process_time(), time.perf_counter()
        f1, c1 = dataset.surveys.fetch_stats(), dataset.reader.cpu_stats()
    finally:
        stream.close()
        shutil.rmtree(pool_dir, ignore_errors=True)
    n = count * batch
    row = {"config": label, "store_dtype": store, "batch_dtype": dtype, "align": align, "crops_per_region": k,
           "lanes": lanes, "samples": n, "s3_mb_per_sample": (f1["bytes_fetched"] - f0["bytes_fetched"]) / MB / n,
           "gets_per_sample": (f1["requests"] - f0["requests"]) / n,
           "cpu_ms_per_sample": (p1 - p0) * 1e3 / n, "wall_ms_per_sample": (t1 - t0) * 1e3 / n,
           "regions_built": c1["regions_built"] - c0["regions_built"],
           "distinct_region_fraction": distinct_fraction(dataset.plan, range(warm, warm + count), batch)}
    for phase in ("receive", "decode", "normalise", "copy"):
        row[f"{phase}_ms_per_sample"] = (c1[phase] - c0[phase]) * 1e3 / n
    print(f"  {label:28s} {row['s3_mb_per_sample']:7.2f} MB {row['gets_per_sample']:6.3f} GETs "
          f"{row['cpu_ms_per_sample']:7.2f} ms CPU per sample (receive {row['receive_ms_per_sample']:.2f}, decode "
          f"{row['decode_ms_per_sample']:.2f}, normalise {row['normalise_ms_per_sample']:.2f}, copy "
          f"{row['copy_ms_per_sample']:.2f}), distinct {row['distinct_region_fraction']:.2f}",
          file=sys.stderr, flush=True)
    return row


def loader_rows(stores: dict[str, str], batch: int) -> list[dict]:
    rows = [measure("brick-aligned, k=1", stores["float32"], batch=batch, align="brick"),
            measure("voxel-aligned, k=1", stores["float32"], batch=batch)]
    for k in (4, 8, 16, 32):
        for store in ("float16", "int8"):
            rows.append(measure(f"pool k={k}, {store} store", stores[store], batch=batch, k=k, store=store,
                                dtype="float16"))
    rows.append(measure("pool k=32, float32 store", stores["float32"], batch=batch, k=32))
    rows.append(measure("pool k=32, int8 store, int8 batch", stores["int8"], batch=batch, k=32, store="int8",
                        dtype="int8"))
    for dtype in ("float16", "int8"):
        rows.append(measure(f"pool k=32, int8 store, {dtype} batch, {4 * batch} lanes", stores["int8"], batch=batch,
                            k=32, store="int8", dtype=dtype, lanes=4 * batch))
    return rows


# ---- the statistical check ----------------------------------------------------------------------

def validation_loss(model, batches) -> float:
    import torch

    model.eval()
    with torch.no_grad():
        losses = [float(model(x, noise=noise)[0]) for x, noise in batches]
    model.train()
    return statistics.mean(losses)


def train_tiny(url: str, val, *, k: int, seed: int, steps: int, batch: int, dtype: str, crop=(64, 64, 64),
               lr: float = 1.5e-3, lanes: int = 0) -> float:
    """The tiny preset trained ``steps`` steps from seed ``seed`` on ``url`` with ``k`` crops per region;
    its validation loss on ``val``."""
    import torch

    from sfm.model.presets import build_model, mae_config
    from sfm.train.step import lr_at

    torch.manual_seed(seed)
    model = build_model(mae_config("tiny", crop=crop))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.05)
    pool = tempfile.mkdtemp(prefix="sfm-bench-pool-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    stream = stream_for(url, batch=batch, k=k, dtype=dtype, pool_dir=pool, crop=crop, seed=seed, threads=2,
                        lanes=lanes)
    gen = torch.Generator().manual_seed(seed)
    try:
        for step in range(steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, lr=lr, min_lr=1e-5, warmup_steps=20, max_steps=steps)
            x = next(stream).float()
            loss, _, _ = model(x, noise=torch.rand(x.shape[0], model.cfg.num_patches, generator=gen))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    finally:
        stream.close()
        shutil.rmtree(pool, ignore_errors=True)
    return validation_loss(model, val)


def statistical_check(workdir: Path, args) -> dict:
    """Validation loss at equal steps: k = 1, 8, 32 and 32 with four times the lanes (int8 store), and
    float32 against int8 at k = 1; 32^3 crops of 32^3-brick stores, so regions are 64^3."""
    import torch

    from sfm import data
    from sfm.config import DataConfig
    from sfm.ingest import survey as ingest
    from sfm.synth.survey import synth_survey
    from sfm.model.presets import mae_config

    crop = (32, 32, 32)
    train_sgy, val_sgy = str(workdir / "train.sgy"), str(workdir / "val.sgy")
    synth_survey(train_sgy, shape=tuple(args.train_shape), seed=1)
    synth_survey(val_sgy, shape=(96, 96, 96), seed=2)
    stores = {d: ingest.ingest_survey(train_sgy, str(workdir / f"local-{d}"), chunk=32, dtype=d)["store_url"]
              for d in ("float32", "int8")}
    val_url = ingest.ingest_survey(val_sgy, str(workdir / "local-val"), chunk=32)["store_url"]
    held_out = data.crop_dataset([val_url], DataConfig(crop=crop, seed=99, augment=""))
    gen = torch.Generator().manual_seed(99)
    patches = mae_config("tiny", crop=crop).num_patches
    val = [(torch.from_numpy(held_out.read(list(range(i, i + 8)))), torch.rand(8, patches, generator=gen))
           for i in range(0, 64, 8)]
    held_out.close()
    b = args.train_batch
    cases = {"float32_k1": ("float32", 1, 0), "int8_k1": ("int8", 1, 0), "int8_k8": ("int8", 8, 0),
             "int8_k32": ("int8", 32, 0), f"int8_k32_lanes{4 * b}": ("int8", 32, 4 * b)}
    batch_dtype = {"float32": "float16", "int8": "int8"}  # int8 stores: int8 batches, as the cluster config ships
    runs: dict[str, list[float]] = {}
    for key, (store, k, lanes) in cases.items():
        runs[key] = []
        for seed in range(args.seeds):
            t0 = time.perf_counter()
            runs[key].append(train_tiny(stores[store], val, k=k, seed=seed, steps=args.train_steps, batch=b,
                                        dtype=batch_dtype[store], crop=crop, lr=args.train_lr, lanes=lanes))
            print(f"  tiny {key} seed {seed}: val loss {runs[key][-1]:.4f} ({time.perf_counter() - t0:.0f} s)",
                  file=sys.stderr, flush=True)
    mean = {key: statistics.mean(v) for key, v in runs.items()}
    base = mean["int8_k1"]
    return {"steps": args.train_steps, "batch": b, "lr": args.train_lr, "seeds": args.seeds, "crop": list(crop),
            "bricks": list(crop), "region_bricks": [2, 2, 2], "val_crops": 64, "val_loss": runs, "val_loss_mean": mean,
            # what was learned: a model predicting nothing scores 1.0 (norm_pix_loss)
            "learned_fraction_of_k1": {key: (1 - v) / (1 - base) for key, v in mean.items()},
            "ratio_vs_k1": {key: v / base for key, v in mean.items()},
            "ratio_int8_vs_float32_k1": base / mean["float32_k1"]}


# ---- per node ------------------------------------------------------------------------------------

def node_table(row: dict) -> list[dict]:
    """Cores and S3 GB/s one 8 x H200 node needs at each preset's modelled samples/s (sfm.ops.scaling_model,
    1 node, fsdp2-zero2, micro-batch 32, MFU 40 %)."""
    from sfm.ops import scaling_model

    out = []
    for r in scaling_model.table(presets=("base", "large", "huge")):
        if r["nodes"] == 1 and r["strategy"] == "fsdp2-zero2":
            rate = r["samples_per_s"]
            out.append({"preset": r["preset"], "samples_per_s": rate,
                        "loader_cores": rate * row["cpu_ms_per_sample"] / 1e3,
                        "s3_GBps": rate * row["s3_mb_per_sample"] / 1e3,
                        "gets_per_s": rate * row["gets_per_sample"]})
    return out


def shipped_row(rows: list[dict], batch: int) -> dict:
    config = tomllib.loads(CLUSTER_CONFIG.read_text())
    data_cfg = config.get("data", {})
    want = {"crops_per_region": int(data_cfg.get("crops_per_region", 1)),
            "batch_dtype": data_cfg.get("batch_dtype", "float32"),
            "store_dtype": config.get("ingest", {}).get("dtype", "float32"), "align": data_cfg.get("align", "voxel"),
            "lanes": int(data_cfg.get("regions_in_flight", 0)) or batch}
    for row in rows:
        if all(row[key] == value for key, value in want.items()):
            return row
    raise SystemExit(f"no benchmark row matches {CLUSTER_CONFIG}'s data settings {want}")


def main() -> int:
    import torch

    torch.set_num_threads(1)  # as in a DataLoader worker: the loader's CPU is counted, not an idle thread pool's
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs=3, default=[640, 640, 384])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--train-shape", type=int, nargs=3, default=[192, 192, 128])
    parser.add_argument("--train-lr", type=float, default=3e-3)
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--train-batch", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--receive-mb", type=float, default=256)
    args = parser.parse_args()

    from sfm.ingest import survey as ingest
    workdir = Path(tempfile.mkdtemp(prefix="sfm-bench-loader-"))
    server = None
    results: dict = {"shape": args.shape, "batch": args.batch, "crop": list(CROP), "cpus": os.cpu_count(),
                     "load_average_at_start": os.getloadavg()[0]}
    try:
        server, segy = rclone_with_survey(workdir, args.shape)
        stores = {d: ingest.ingest_survey(segy, f"s3://bench/{d}", dtype=d)["store_url"]
                  for d in ("float32", "float16", "int8")}
        print("[loader] per-sample figures, rclone serve s3 on loopback:", file=sys.stderr, flush=True)
        rows = loader_rows(stores, args.batch)
        print("[receive] the same brick ranges through three transports ...", file=sys.stderr, flush=True)
        results["receive"] = receive_cost(server.endpoint, stores["float32"], min_bytes=args.receive_mb * MB)
        server.stop()
        print("[check] tiny preset, validation loss at equal steps ...", file=sys.stderr, flush=True)
        results["statistical_check"] = statistical_check(workdir, args)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    results["rows"] = rows
    ship = shipped_row(rows, args.batch)
    check = results["statistical_check"]
    k, lanes = ship["crops_per_region"], ship["lanes"] // args.batch
    key = "int8_k1" if k == 1 else f"int8_k{k}" + (f"_lanes{lanes * args.train_batch}" if lanes > 1 else "")
    ratio = check["ratio_vs_k1"].get(key, float("nan"))
    results["per_node"] = node_table(ship)
    results["load_average_at_end"] = os.getloadavg()[0]
    summary = {"config": ship["config"], "cpu_ms_per_sample": ship["cpu_ms_per_sample"],
               "s3_mb_per_sample": ship["s3_mb_per_sample"], "gets_per_sample": ship["gets_per_sample"],
               "distinct_region_fraction": ship["distinct_region_fraction"], "val_loss_ratio_k_vs_1": ratio}
    summary["goals_met"] = {"cpu_ms_per_sample<=5": summary["cpu_ms_per_sample"] <= 5,
                            "s3_mb_per_sample<=1.1": summary["s3_mb_per_sample"] <= 1.1,
                            "distinct_region_fraction>=0.95": summary["distinct_region_fraction"] >= 0.95,
                            "val_loss_within_2%": abs(ratio - 1) <= 0.02}
    print(json.dumps({**summary, **results}, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
