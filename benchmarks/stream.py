"""Streaming benchmark (issue 4): crops from S3 servers on loopback, side by side in one run.

    python benchmarks/stream.py [--shape 256 256 256] [--batch 8] [--batches 12] [--rounds 3] [--codec zstd:1]

One synthetic survey (sfm.synth.survey) is ingested by sfm.ingest.survey into a temporary data root on each of two
S3 servers started here on loopback: ``moto_server`` (Python, in memory) and ``rclone serve s3``
(Go, disk-backed; answers ranged GETs with 200, which obstore refuses), with 128^3 bricks (the
ingest default) and, for the bytes-per-request comparison, 64^3 bricks. For each server:

(a) raw: bytes/s of parallel GETs of the store's amplitude objects, one request per stored brick
    (its byte range from the shard index: the GETs a reader of this store makes), with obstore
    (ranged; whole objects against rclone), s3fs (ranged) and sfm's own transport (sfm.storage.ranged_get,
    ranged), at 1-64 connections. The best client and connection count then also reads fixed
    strides of one uncompressed brick's size (fewer, larger requests); the raw limit is the faster
    of the two (rclone serves the stored bricks' ranges at half the server CPU per GB).
(b) loader: ``sfm.data.loader`` reading 128^3 crops with brick-aligned origins in this process: bytes/s it
    fetched from storage (counted by its store wrapper) and crop bytes/s it delivered (float32);
    goals fetched/raw >= 0.8 and delivered/fetched >= 0.5. The default loader (client "auto":
    bricks over sfm.storage.ranged_get) and the same loader with every read through the general client
    (obstore; s3fs against rclone) alternate with the raw trial over ``--rounds`` rounds (medians),
    so background load hits all alike. Also: the default loader with origins anywhere (read
    amplification), and with 2 DataLoader worker processes.
(c) the loader's batches/s over the training step's batches/s (small preset at 128^3, one forward,
    backward and AdamW step on CPU, same batch size); goal >= 3.

CPU seconds per GB (this process; the server from /proc) show where a 2-core machine's time goes,
and what a node needs for the reference's 4-5 GB/s. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT))

ACCESS_KEY = "sfmbenchaccesskey0001"
SECRET_KEY = "sfmbenchsecretkey0001notasecretvalue"
MB = 1e6
REFERENCE_NODE_BYTES_PER_S = 4.5e9  # the reference system's 4-5 GB/s per GPU node


# ---- servers ------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(port: int, proc: subprocess.Popen, what: str) -> None:
    deadline = time.time() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"{what} did not start")
            time.sleep(0.2)


class Server:
    def __init__(self, name: str, workdir: Path):
        self.name, self.port = name, _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        log = open(workdir / f"{name}.log", "wb")
        if name == "moto":
            exe = shutil.which("moto_server")
            cmd = [exe] if exe else [sys.executable, "-m", "moto.server"]
            self.proc = subprocess.Popen([*cmd, "-H", "127.0.0.1", "-p", str(self.port)], stdout=log,
                                         stderr=subprocess.STDOUT)
        else:
            root = workdir / "rclone-root"
            root.mkdir()
            self.proc = subprocess.Popen(
                [shutil.which("rclone"), "serve", "s3", "--addr", f"127.0.0.1:{self.port}", "--auth-key",
                 f"{ACCESS_KEY},{SECRET_KEY}", "--config", "/dev/null", str(root)],
                stdout=log, stderr=subprocess.STDOUT)
        _wait(self.port, self.proc, name)
        if name == "moto":
            urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=10)

    def use(self) -> None:
        """Point this process (and the loader's worker processes) at this server."""
        os.environ.update({
            "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1",
            "SFM_S3_ENDPOINT_URL": self.endpoint, "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
            "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",
        })

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # nothing to flush: the data are thrown away with the work folder
            self.proc.wait()


# ---- (a) raw GETs ---------------------------------------------------------------------------------

def list_objects(store_url: str) -> list[tuple[str, int]]:
    """(key, size) of the amplitude objects (shards) of a survey store on S3."""
    from sfm import storage

    fs, path = storage.filesystem(store_url)
    return sorted((p, int(info["size"])) for p, info in fs.find(f"{path}/amplitude/c", detail=True).items())


def stored_brick_ranges(store_url: str, objects) -> dict[str, list[tuple[int, int]]]:
    """For each amplitude object (shard), the (start, end) byte range of every brick stored in it, as
    the loader locates them (``BrickReader._locate`` on the shard index): exactly its GETs, one per brick."""
    import itertools

    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    from sfm import data
    from sfm.data.bricks import BrickReader

    _, amp = data.read_survey_info(store_url)
    reader = BrickReader.for_array(amp)
    ranges = {}
    for path, _size in objects:
        shard = tuple(int(c) for c in path.rsplit("/c/", 1)[1].split("/"))
        index = sync(reader._shard_index(shard, default_buffer_prototype()))
        inner = itertools.product(*(range(n) for n in reader.per_shard))
        where = [reader._locate(tuple(s * n + i for s, n, i in zip(shard, reader.per_shard, b)), index) for b in inner]
        ranges[path] = sorted((start, end) for _, start, end in filter(None, where))
    return ranges


def plan_requests(objects, ranged: bool, total: float, bricks: dict | None = None,
                  bytes_per_request: int = 0) -> list[tuple[str, int, int]]:
    """(path, start, end) requests covering the objects, repeated up to ``total`` bytes: whole objects,
    or one per stored brick (``bricks``, from :func:`stored_brick_ranges`), or ``bytes_per_request``
    strides."""
    one_pass = []
    for path, size in objects:
        if not ranged:
            one_pass.append((path, 0, size))
        elif bricks is not None:
            one_pass += [(path, start, end) for start, end in bricks[path]]
        else:
            one_pass += [(path, start, min(size, start + bytes_per_request)) for start in range(0, size,
                                                                                             bytes_per_request)]
    passes = max(1, round(total / sum(e - s for _, s, e in one_pass)))
    return one_pass * passes


def raw_obstore(requests, connections: int, ranged: bool) -> int:
    import obstore
    from obstore.store import S3Store

    from sfm import storage

    bucket = requests[0][0].split("/", 1)[0]
    store = S3Store(bucket, endpoint=storage.s3_endpoint_url(), region="us-east-1",
                    client_options={"allow_http": True, "pool_max_idle_per_host": str(connections)})

    async def run() -> int:
        gate = asyncio.Semaphore(connections)

        async def one(path, start, end) -> int:
            key = path.split("/", 1)[1]
            async with gate:
                if ranged:
                    return len(await obstore.get_range_async(store, key, start=start, end=end))
                return len(await (await obstore.get_async(store, key)).bytes_async())

        return sum(await asyncio.gather(*(one(*r) for r in requests)))

    return asyncio.run(run())


def raw_http(requests, connections: int) -> int:
    """sfm's own transport (sfm.storage.ranged_get): one blocking ranged GET per thread into that thread's buffer."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from sfm.storage.ranged_get import S3RangeReader

    reader = S3RangeReader(requests[0][0].split("/", 1)[0])
    local = threading.local()

    def one(request) -> int:
        path, start, end = request
        if getattr(local, "buffer", None) is None or local.buffer.size < end - start:
            local.buffer = np.empty(end - start, np.uint8)
        return len(reader.read_into(path.split("/", 1)[1], start, end, local.buffer))

    with ThreadPoolExecutor(connections) as pool:
        return sum(pool.map(one, requests))


def raw_s3fs(requests, connections: int) -> int:
    from fsspec.asyn import sync

    from sfm import storage

    fs, _ = storage.filesystem(f"s3://{requests[0][0]}")

    async def run() -> int:
        gate = asyncio.Semaphore(connections)

        async def one(path, start, end) -> int:
            async with gate:
                return len(await fs._cat_file(path, start=start, end=end))

        return sum(await asyncio.gather(*(one(*r) for r in requests)))

    return sync(fs.loop, run)


def raw_function(client: str, requests, connections: int, ranged: bool):
    """A no-argument function doing ``requests`` with ``client`` over ``connections``; returns bytes read."""
    if client == "obstore":
        return lambda: raw_obstore(requests, connections, ranged)
    if client == "s3fs":
        return lambda: raw_s3fs(requests, connections)
    return lambda: raw_http(requests, connections)


def timed(fn, server: Server):
    """(result, seconds, client CPU seconds, server CPU seconds) of ``fn()``."""
    c0, s0, t0 = time.process_time(), server.cpu_seconds(), time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0, time.process_time() - c0, server.cpu_seconds() - s0


# ---- (b) the loader ---------------------------------------------------------------------------------

def loader_trial(stream, batches: int, server: Server) -> dict:
    """Fetched and delivered bytes/s over ``batches`` batches of a warm stream (workers=0: counters here).

    First the batches read ahead while the stream waited are drained, so the clock starts, as it
    stops, with the read-ahead pipeline catching up rather than full.
    """
    for _ in range(stream.dataset.prefetch + 1):
        next(stream)
    before = stream.dataset.surveys.fetch_stats()
    nbytes = 0

    def run():
        nonlocal nbytes
        for _ in range(batches):
            nbytes += next(stream).numel() * 4

    http0 = http_client_cpu_seconds()
    _, seconds, client_cpu, server_cpu = timed(run, server)
    http = http_client_cpu_seconds() - http0
    after = stream.dataset.surveys.fetch_stats()
    fetched = after["bytes_fetched"] - before["bytes_fetched"]
    requests = after["requests"] - before["requests"]
    crops = batches * stream.dataset.batch_size
    gb = max(fetched / 1e9, 1e-9)
    return {"fetched_bytes_per_s": fetched / seconds, "delivered_bytes_per_s": nbytes / seconds,
            "delivered_over_fetched": nbytes / fetched if fetched else None, "requests_per_crop": requests / crops,
            "bytes_per_request": fetched / max(1, requests), "retries": after["retries"] - before["retries"],
            "client_cpu_s_per_gb": client_cpu / gb, "obstore_http_cpu_s_per_gb": http / gb,
            "server_cpu_s_per_gb": server_cpu / gb, "seconds": seconds}


def http_client_cpu_seconds() -> float:
    """CPU seconds of this process's obstore HTTP threads (tokio's runtime), to split the loader's CPU
    into the HTTP client (what raw GETs cost too) and the rest (decode, normalise, Python)."""
    total = 0
    for task in os.listdir("/proc/self/task"):
        try:
            if Path(f"/proc/self/task/{task}/comm").read_text().startswith("tokio"):
                fields = Path(f"/proc/self/task/{task}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
        except OSError:  # the thread ended
            pass
    return total / os.sysconf("SC_CLK_TCK")


def settle(stream) -> None:
    """Wait until the stream's read-ahead is done: a raw trial must not share the machine with it."""
    last = -1
    while True:
        now = stream.dataset.surveys.fetch_stats()["bytes_fetched"]
        if now == last:
            return
        last = now
        time.sleep(0.5)


def make_stream(url: str, batch: int, *, align: str = "brick", workers: int = 0, threads: int = 8,
                client: str = "auto"):
    from sfm import data
    from sfm.config import DataConfig
    from sfm.distributed.launch import environment_for_workers

    cfg = DataConfig(crop=(128, 128, 128), batch_size=batch, seed=0, min_live_fraction=0.5, read_threads=threads,
                     align=align, augment="", client=client, prefetch=2)
    cfg.check()
    return data.BatchStream(data.crop_dataset([url], cfg), workers=workers, worker_init=environment_for_workers())


def cpu_breakdown(url: str) -> dict:
    """CPU seconds per GB of crop for each stage of the loader's work on one brick of ``url``: the
    store codec's decode, the normalisation pass, and a plain copy (the floor of any decode)."""
    import numpy as np
    from zarr.core.sync import sync

    from sfm import data
    from sfm.data.bricks import BrickReader

    info, amp = data.read_survey_info(url)
    reader = BrickReader.for_array(amp)
    payload = sync(reader._fetch([(0, 0, 0)]))[0]
    brick = reader._decode(payload).copy()
    out = np.empty(brick.shape, np.float32)
    gb = out.nbytes / 1e9

    def per_gb(fn, n=8) -> float:
        fn()
        t0 = time.process_time()
        for _ in range(n):
            fn()
        return (time.process_time() - t0) / n / gb

    return {"codec": reader.compressor, "compression_ratio": len(payload) / brick.nbytes,
            "decode_cpu_s_per_gb": per_gb(lambda: reader._decode(payload)),
            "normalise_cpu_s_per_gb": per_gb(lambda: info.normalise_into(brick, out)),
            "copy_cpu_s_per_gb": per_gb(lambda: np.copyto(out, brick))}


# ---- (c) the training step ------------------------------------------------------------------------

def train_step_batches_per_s(batch: int, steps: int = 2) -> dict:
    import torch

    from sfm.model import build_model, mae_config

    torch.manual_seed(0)
    model = build_model(mae_config("small", crop=(128, 128, 128)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, 1, 128, 128, 128)

    def step():
        loss, _, _ = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    seconds = (time.perf_counter() - t0) / steps
    return {"seconds_per_step": seconds, "batches_per_s": 1 / seconds, "threads": torch.get_num_threads()}


# ---- the run --------------------------------------------------------------------------------------

def bench_server(server: Server, segy: str, args) -> dict:
    from sfm import data
    from sfm.ingest import survey as ingest

    server.use()
    import boto3

    boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1", aws_access_key_id=ACCESS_KEY,
                 aws_secret_access_key=SECRET_KEY).create_bucket(Bucket="bench")
    out: dict = {"server": server.name}
    stores = {}
    for brick in (128, 64):
        t0 = time.perf_counter()
        row = ingest.ingest_survey(segy, f"s3://bench/c{brick}", chunk=brick, codec=args.codec)
        stores[brick] = row["store_url"]
        out[f"ingest_{brick}_seconds"] = time.perf_counter() - t0
    ranged_obstore = server.name != "rclone"  # obstore refuses rclone's 200 answers to ranged GETs

    for brick, url in stores.items():
        objects = list_objects(url)
        bricks = stored_brick_ranges(url, objects)
        res: dict = {"objects": len(objects), "object_bytes": sum(s for _, s in objects) / len(objects),
                     "sweep": {}}
        info, amplitude = data.read_survey_info(url)
        res["store"] = {"bricks": list(info.bricks), "shards": list(amplitude.shards or ()),
                        "codec": str(amplitude.metadata.codecs[0].to_dict())[:200]}
        sweep = {}
        for client in ("obstore", "s3fs", "http"):
            ranged = client != "obstore" or ranged_obstore
            requests = plan_requests(objects, ranged, args.raw_mb * MB / 4, bricks)
            for conn in (1, 4, 16, 64):
                fn = raw_function(client, requests, conn, ranged)
                nbytes, seconds, ccpu, scpu = timed(fn, server)
                sweep[(client, conn)] = nbytes / seconds
                res["sweep"][f"{client}{' ranged' if ranged else ' whole objects'} x{conn}"] = {
                    "bytes_per_s": nbytes / seconds, "bytes_per_request": nbytes / len(requests),
                    "client_cpu_s_per_gb": ccpu / (nbytes / 1e9), "server_cpu_s_per_gb": scpu / (nbytes / 1e9)}
        best_client, best_conn = max(sweep, key=sweep.get)
        ranged = best_client != "obstore" or ranged_obstore
        best = raw_function(best_client, plan_requests(objects, ranged, args.raw_mb * MB, bricks), best_conn, ranged)
        # for comparison with earlier runs: the same client, ranged GETs of one uncompressed brick's size
        # (4 * brick^3 bytes) at fixed strides, fewer and larger than the stored bricks
        strided = raw_function(best_client, plan_requests(objects, ranged, args.raw_mb * MB,
                                                          bytes_per_request=4 * brick**3), best_conn, ranged)

        # the loader as configured by default ("auto": bricks over sfm.storage.ranged_get) and, for comparison, with
        # every read through the general client (obstore, or s3fs where the server refuses obstore)
        streams = {"auto": make_stream(url, args.batch),
                   "general": make_stream(url, args.batch, client="obstore" if ranged_obstore else "fsspec")}
        for stream in streams.values():
            next(stream)  # warm: stores open, shard indexes cached, connections up
        raws, raws_strided, raw_cpu, loads = [], [], [], {name: [] for name in streams}
        for _ in range(args.rounds if brick == 128 else 1):  # alternate: background load hits all alike
            for stream in streams.values():
                settle(stream)
            nbytes, seconds, ccpu, scpu = timed(best, server)
            raws.append(nbytes / seconds)
            raw_cpu.append((ccpu + scpu) / (nbytes / 1e9))
            nbytes, seconds, _, _ = timed(strided, server)
            raws_strided.append(nbytes / seconds)
            for name, stream in streams.items():
                loads[name].append(loader_trial(stream, args.batches, server))
        per_brick, per_stride = statistics.median(raws), statistics.median(raws_strided)
        raw = max(per_brick, per_stride)  # the limit: the better way of reading the same objects
        res["raw"] = {"client": f"{best_client}{' ranged' if ranged else ' whole objects'}", "connections": best_conn,
                      "bytes_per_s": raw, "per_brick_bytes_per_s": per_brick, "per_brick_rounds": raws,
                      "per_brick_client_plus_server_cpu_s_per_gb": statistics.median(raw_cpu),
                      "fixed_stride_bytes_per_s": per_stride, "fixed_stride_rounds": raws_strided,
                      "fixed_stride_bytes": 4 * brick**3}
        for name, stream in streams.items():
            store = stream.dataset.surveys.store(0)
            client = {"ObjectStore": "obstore", "FsspecStore": "s3fs"}.get(type(store._store).__name__, "?")
            stream.close()
            loader = {k: statistics.median(t[k] for t in loads[name]) for k in loads[name][0]}
            loader["client"] = f"http (bricks) + {client}" if store.range_reader is not None else client
            loader["fetched_over_raw"] = loader["fetched_bytes_per_s"] / raw
            res["loader" if name == "auto" else "loader_general_client"] = loader
        if brick == 128:
            res["cpu_breakdown"] = cpu_breakdown(url)
            unaligned = make_stream(url, args.batch, align="voxel")
            next(unaligned)
            res["loader_unaligned"] = loader_trial(unaligned, max(2, args.batches // 2), server)
            unaligned.close()
            workers = make_stream(url, args.batch, workers=2)
            for _ in range(6):  # workers started, their read-ahead drained
                next(workers)
            t0 = time.perf_counter()
            for _ in range(args.batches):
                next(workers)
            seconds = time.perf_counter() - t0
            workers.close()
            res["loader_2_workers"] = {"delivered_bytes_per_s": args.batches * args.batch * 4 * 128**3 / seconds}
        out[f"bricks_{brick}"] = res
    return out


def main() -> int:
    from sfm.config import IngestConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs=3, default=[256, 256, 256])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=48, help="batches per loader trial")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--raw-mb", type=float, default=1024, help="MB per timed raw trial (a quarter per sweep point)")
    parser.add_argument("--train-steps", type=int, default=2)
    parser.add_argument("--codec", default=IngestConfig.codec, help="Blosc codec of the stores, cname[:clevel]")
    args = parser.parse_args()

    from sfm.synth.survey import synth_survey

    workdir = Path(tempfile.mkdtemp(prefix="sfm-bench-stream-"))
    servers = []
    try:
        segy = str(workdir / "bench.sgy")
        synth_survey(segy, shape=tuple(args.shape), seed=0)
        results = {"shape": args.shape, "batch": args.batch, "crop": [128, 128, 128], "codec": args.codec,
                   "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg()[0], "servers": {}}
        for name in ("moto", "rclone"):
            server = Server(name, workdir)
            servers.append(server)
            print(f"[{name}] ingesting and measuring ...", file=sys.stderr, flush=True)
            results["servers"][name] = bench_server(server, segy, args)
            server.stop()
        print("[train] small preset, one step ...", file=sys.stderr, flush=True)
        train = train_step_batches_per_s(args.batch, args.train_steps)
        results["train_step"] = train
        summary = {}
        for name, r in results["servers"].items():
            main_store = r["bricks_128"]
            loader_batches_per_s = main_store["loader"]["delivered_bytes_per_s"] / (args.batch * 4 * 128**3)
            summary[name] = {
                "raw_bytes_per_s": main_store["raw"]["bytes_per_s"],
                "raw_sweep_best_bytes_per_s": max(v["bytes_per_s"] for v in main_store["sweep"].values()),
                "raw_per_brick_bytes_per_s": main_store["raw"]["per_brick_bytes_per_s"],
                "raw_fixed_stride_bytes_per_s": main_store["raw"]["fixed_stride_bytes_per_s"],
                # the loader and the server share this machine's cores: with all of them busy they fetch at
                # most cores / (loader + server CPU per GB); over raw, the most fetched/raw can be here
                "cpu_bound_ceiling": os.cpu_count() / (main_store["loader"]["client_cpu_s_per_gb"] + main_store[
                    "loader"]["server_cpu_s_per_gb"]) / 1e-9 / main_store["raw"]["bytes_per_s"],
                "raw_client_cpu_s_per_gb": min(v["client_cpu_s_per_gb"] for v in main_store["sweep"].values()),
                "fetched_bytes_per_s": main_store["loader"]["fetched_bytes_per_s"],
                "delivered_bytes_per_s": main_store["loader"]["delivered_bytes_per_s"],
                "fetched_over_raw": main_store["loader"]["fetched_over_raw"],
                "loader_client": main_store["loader"]["client"],
                "general_client": main_store["loader_general_client"]["client"],
                "general_client_fetched_over_raw": main_store["loader_general_client"]["fetched_over_raw"],
                "raw_client": f"{main_store['raw']['client']} x{main_store['raw']['connections']}",
                "delivered_over_fetched": main_store["loader"]["delivered_over_fetched"],
                "unaligned_delivered_over_fetched": main_store["loader_unaligned"]["delivered_over_fetched"],
                "loader_batches_per_s": loader_batches_per_s,
                "loader_over_train": loader_batches_per_s / train["batches_per_s"],
                "loader_client_cpu_s_per_gb": main_store["loader"]["client_cpu_s_per_gb"],
                "loader_obstore_http_cpu_s_per_gb": main_store["loader"]["obstore_http_cpu_s_per_gb"],
                "decode_cpu_s_per_gb": main_store["cpu_breakdown"]["decode_cpu_s_per_gb"],
                "server_cpu_s_per_gb": main_store["loader"]["server_cpu_s_per_gb"],
                "cores_for_reference_node":
                    REFERENCE_NODE_BYTES_PER_S / 1e9 * main_store["loader"]["client_cpu_s_per_gb"],
            }
            summary[name]["goals_met"] = {
                "fetched_over_raw>=0.8": summary[name]["fetched_over_raw"] >= 0.8,
                "delivered_over_fetched>=0.5": summary[name]["delivered_over_fetched"] >= 0.5,
                "loader_over_train>=3": summary[name]["loader_over_train"] >= 3,
            }
        results["summary"] = summary
        results["load_average_at_end"] = os.getloadavg()[0]
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    for name, s in summary.items():
        print(f"{name}: raw {s['raw_bytes_per_s'] / MB:.0f} MB/s, "
              f"loader fetched {s['fetched_bytes_per_s'] / MB:.0f} MB/s "
              f"({s['fetched_over_raw']:.2f} of raw), delivered {s['delivered_bytes_per_s'] / MB:.0f} MB/s "
              f"(delivered/fetched {s['delivered_over_fetched']:.2f}, unaligned "
              f"{s['unaligned_delivered_over_fetched']:.2f}), loader/train {s['loader_over_train']:.1f}, "
              f"CPU-bound ceiling of fetched/raw {s['cpu_bound_ceiling']:.2f}",
              file=sys.stderr)
    print(json.dumps(results, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
