"""Receive cost: client CPU seconds per GB received by three S3 transports, on the same brick ranges.

    python benchmarks/receive.py [--shape 256 256 256] [--connections 8] [--min-mb 256] [--rounds 3]

On one survey store, each transport GETs the byte range of every stored brick (from the shard
index, as the loader locates them: :func:`stream.stored_brick_ranges`), the list repeated until
``min_bytes`` are read, over ``connections`` parallel requests:

- ``own``: sfm's transport, :mod:`sfm.storage.ranged_get` (blocking ``http.client`` GETs read into
  a buffer each thread reuses; :func:`stream.raw_http`);
- ``obstore``: ranged GETs where the server answers them with 206; ``rclone serve s3`` answers with
  200, which obstore refuses, and then it GETs whole objects (the same bytes per GB, fewer requests);
  the output says which and why;
- ``s3torchconnector``: AWS's CRT-based client (``S3Client`` pointed at the endpoint, path-style
  addressing, credentials from the environment), one ranged read per brick; where it cannot be
  installed, pointed at the server or read the ranges right, the output holds the reason instead.

Each transport's first range is checked against the bytes sfm's transport read. The transports
alternate within each of ``rounds`` rounds (medians), so background load hits all alike. CPU is
this process's (``time.process_time``: every thread, the clients' native ones included), the
server's excluded. Run alone, it ingests a synthetic survey into ``rclone serve s3`` on loopback
and prints, as its last line, one JSON object. :func:`receive_cost` is the entry point for other
benchmarks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # stream.py: the servers and the raw GETs

from stream import MB, Server, list_objects, plan_requests, raw_http, raw_obstore, stored_brick_ranges  # noqa: E402

TRANSPORTS = ("own", "obstore", "s3torchconnector")


class CrtTransport:
    """s3torchconnector's ``S3Client`` (mountpoint-s3-client over the AWS CRT) reading byte ranges.

    Args:
        endpoint_url: the S3 endpoint, addressed path-style (``endpoint/bucket/key``) as loopback servers need.
        sizes: object size by ``bucket/key``, given so that no read starts with a HEAD.
    """

    def __init__(self, endpoint_url: str, sizes: dict[str, int]):
        from s3torchconnector import S3ClientConfig, S3ReaderConstructor
        from s3torchconnector._s3client import S3Client  # the client its datasets and checkpoints build

        from sfm.storage.clients import s3_region

        self.endpoint_url, self.region, self.sizes = endpoint_url, s3_region(), sizes
        self.client = S3Client(self.region, endpoint=endpoint_url,
                               s3client_config=S3ClientConfig(force_path_style=True))
        self.one_get_per_read = S3ReaderConstructor.range_based(buffer_size=0)

    def read_into(self, path: str, start: int, end: int, out) -> int:
        """Bytes ``[start, end)`` of ``bucket/key`` ``path`` into ``out``: one ranged GET; returns their count."""
        from s3torchconnectorclient._mountpoint_s3_client import ObjectInfo

        bucket, key = path.split("/", 1)
        info = ObjectInfo(key, "", self.sizes[path], 0, None, None)
        reader = self.client.get_object(bucket, key, object_info=info, reader_constructor=self.one_get_per_read)
        reader.seek(start)
        return reader.readinto(memoryview(out)[:end - start])

    def describe(self) -> dict:
        return {"client": "s3torchconnector._s3client.S3Client (mountpoint-s3-client over the AWS CRT)",
                "endpoint": self.endpoint_url, "region": self.region, "force_path_style": True,
                "credentials": "the CRT's default chain (here AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)",
                "reader": "S3ReaderConstructor.range_based(buffer_size=0): one ranged GET per read, object size "
                          "given (no HEAD)",
                "checksums": "S3ClientConfig has none to set; its GETs send no x-amz-checksum-mode"}


def raw_crt(requests, connections: int, transport: CrtTransport) -> int:
    """Bytes read by ``requests`` through s3torchconnector, ``connections`` threads each into its own buffer."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    local = threading.local()

    def one(request) -> int:
        path, start, end = request
        if getattr(local, "buffer", None) is None or local.buffer.size < end - start:
            local.buffer = np.empty(end - start, np.uint8)
        return transport.read_into(path, start, end, local.buffer)

    with ThreadPoolExecutor(connections) as pool:
        return sum(pool.map(one, requests))


@contextlib.contextmanager
def _endpoint(endpoint_url: str):
    """sfm's clients (and so :func:`stream.raw_http` and :func:`stream.raw_obstore`) at ``endpoint_url``."""
    before = os.environ.get("SFM_S3_ENDPOINT_URL")
    os.environ["SFM_S3_ENDPOINT_URL"] = endpoint_url
    try:
        yield
    finally:
        if before is None:
            del os.environ["SFM_S3_ENDPOINT_URL"]
        else:
            os.environ["SFM_S3_ENDPOINT_URL"] = before


def _at_least(one_pass: list, min_bytes: float) -> list:
    """``one_pass`` of (path, start, end) requests repeated until it reads ``min_bytes``."""
    return one_pass * max(1, math.ceil(min_bytes / sum(end - start for _, start, end in one_pass)))


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"


def _transports(endpoint_url: str, objects, bricks, connections: int, min_bytes: float) -> dict:
    """name -> (no-argument function returning bytes read, its description), or a reason string where a
    transport cannot read the brick ranges. Each reads the first brick once first (connections up)."""
    import numpy as np

    from sfm.storage.clients import range_reader

    per_brick = _at_least(plan_requests(objects, True, 0, bricks), min_bytes)
    path, start, end = per_brick[0]
    reference = bytes(range_reader(path.split("/", 1)[0]).read_into(path.split("/", 1)[1], start, end,
                                                                    np.empty(end - start, np.uint8)))
    ranged = {"reads": "ranged GETs, one per stored brick", "requests": len(per_brick)}
    out = {"own": (lambda: raw_http(per_brick, connections),
                   {**ranged, "client": "sfm.storage.ranged_get.S3RangeReader (http.client, readinto a "
                                        "buffer per thread)"})}

    obstore = {"client": "obstore.store.S3Store (get_range_async / get_async, asyncio)"}
    try:
        raw_obstore(per_brick[:1], 1, ranged=True)
        out["obstore"] = (lambda: raw_obstore(per_brick, connections, ranged=True), {**obstore, **ranged})
    except Exception as err:  # rclone answers a range with 200, which obstore refuses: whole objects
        whole = _at_least(plan_requests(objects, False, 0), min_bytes)
        out["obstore"] = (lambda: raw_obstore(whole, connections, ranged=False),
                          {**obstore, "reads": "whole objects (GET without a range)", "requests": len(whole),
                           "why_not_ranged": _first_line(err)})

    try:
        crt = CrtTransport(endpoint_url, dict(objects))
        got = np.empty(end - start, np.uint8)
        got = bytes(got[:crt.read_into(path, start, end, got)])
        if got != reference:
            raise ValueError(f"s3://{path} bytes {start}-{end - 1}: read {len(got)} bytes, not the "
                             f"{len(reference)} bytes sfm's transport read")
        out["s3torchconnector"] = (lambda: raw_crt(per_brick, connections, crt), {**crt.describe(), **ranged})
    except Exception as err:  # not installed, not pointable at the server, or the wrong bytes
        out["s3torchconnector"] = _first_line(err)
    return out


def _trial(fn) -> dict:
    """Bytes, wall seconds and this process's user and system CPU seconds of ``fn()``."""
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    nbytes = fn()
    seconds, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    return {"bytes": nbytes, "seconds": seconds, "user_s": r1.ru_utime - r0.ru_utime,
            "system_s": r1.ru_stime - r0.ru_stime}


def receive_cost(endpoint_url: str, store_url: str, connections: int = 8, min_bytes: float = 256e6, *,
                 rounds: int = 3) -> dict:
    """Client CPU seconds per GB received and wall GB/s of sfm's transport, obstore and s3torchconnector
    reading the stored bricks' byte ranges of the survey store ``store_url`` (``s3://...``) from the
    S3 server at ``endpoint_url`` (credentials from the environment), ``connections`` requests at a
    time, at least ``min_bytes`` per trial; medians of ``rounds`` rounds in which the transports alternate.

    Returns ``{"own" | "obstore" | "s3torchconnector": {"cpu_s_per_gb", "gb_per_s", "requests", "reads",
    "client", ...}}``; a transport that cannot read the ranges is ``{"skipped": reason}``.
    """
    with _endpoint(endpoint_url):
        objects = list_objects(store_url)
        bricks = stored_brick_ranges(store_url, objects)
        transports = _transports(endpoint_url, objects, bricks, connections, min_bytes)
        runnable = [name for name in TRANSPORTS if not isinstance(transports[name], str)]
        trials: dict[str, list[dict]] = {name: [] for name in runnable}
        for r in range(rounds):
            for name in runnable[r % len(runnable):] + runnable[:r % len(runnable)]:
                trials[name].append(_trial(transports[name][0]))
    result: dict = {"endpoint": endpoint_url, "store_url": store_url, "connections": connections,
                    "min_bytes": min_bytes, "rounds": rounds, "objects": len(objects),
                    "bricks": sum(len(b) for b in bricks.values()),
                    "brick_bytes_mean": sum(e - s for b in bricks.values() for s, e in b) / sum(
                        len(b) for b in bricks.values())}
    for name in TRANSPORTS:
        if name not in trials:
            result[name] = {"skipped": transports[name]}
            continue
        gb = [t["bytes"] / 1e9 for t in trials[name]]
        result[name] = {
            "cpu_s_per_gb": statistics.median((t["user_s"] + t["system_s"]) / g for t, g in zip(trials[name], gb)),
            "system_cpu_s_per_gb": statistics.median(t["system_s"] / g for t, g in zip(trials[name], gb)),
            "gb_per_s": statistics.median(g / t["seconds"] for t, g in zip(trials[name], gb)),
            **transports[name][1], "bytes_per_trial": trials[name][0]["bytes"], "trials": trials[name]}
    return result


def rclone_with_survey(workdir: Path, shape) -> tuple:
    """A synthetic survey of ``shape`` written as SEG-Y in ``workdir``, and ``rclone serve s3`` started
    there on loopback with a bucket "bench", this process pointed at it: (server, SEG-Y path)."""
    from sfm.synth.survey import synth_survey
    from sfm.storage.clients import boto_client

    segy = str(workdir / "bench.sgy")
    synth_survey(segy, shape=tuple(shape), seed=0)
    server = Server("rclone", workdir)
    server.use()
    boto_client().create_bucket(Bucket="bench")
    return server, segy


def main() -> int:
    from sfm.config import IngestConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs=3, default=[256, 256, 256])
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--min-mb", type=float, default=256, help="MB at least per transport and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--codec", default=IngestConfig.codec, help="Blosc codec of the store, cname[:clevel]")
    args = parser.parse_args()

    from sfm.ingest import survey as ingest

    workdir = Path(tempfile.mkdtemp(prefix="sfm-bench-receive-"))
    server = None
    try:
        server, segy = rclone_with_survey(workdir, args.shape)
        store_url = ingest.ingest_survey(segy, "s3://bench", codec=args.codec)["store_url"]
        print(f"[rclone] {store_url}: measuring ...", file=sys.stderr, flush=True)
        load = os.getloadavg()[0]
        result = receive_cost(server.endpoint, store_url, args.connections, args.min_mb * MB, rounds=args.rounds)
        result.update({"server": "rclone serve s3", "shape": args.shape, "codec": args.codec, "cpus": os.cpu_count(),
                       "load_average_at_start": load, "load_average_at_end": os.getloadavg()[0]})
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    for name in TRANSPORTS:
        r = result[name]
        print(f"{name}: " + (f"skipped ({r['skipped']})" if "skipped" in r else
                             f"{r['cpu_s_per_gb']:.2f} CPU s/GB, {r['gb_per_s']:.2f} GB/s, {r['reads']}"),
              file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
