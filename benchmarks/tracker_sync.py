"""Live tracker sync benchmark (issue 56): the training step with the trackers' files copied to the run root while
the run runs (``train.tracker_sync_s``) against copied only at its end, side by side in one run.

    python benchmarks/tracker_sync.py [--repeats 7] [--steps 300] [--sync-s 1] [--s3]

One synthetic survey is generated and ingested; the same job (the embedded default's tiny model, 32^3 crops, batch
4, one process, every step logged to TensorBoard: the most the event files can grow) is trained ``--repeats`` times
each way, alternating: sync on (``tracker_sync_s = --sync-s``) and off (``tracker_sync_s = 0``: one copy at the
end). A run's step time is its summary's (samples per step over samples/s: the logged windows, checkpoints and
start-up left out). While each run trains, this process watches the event file in the run root and counts the sizes
it sees it take: the copies it saw land (on: about one per ``--sync-s``; off: the last only). ``--s3`` puts the run
root on a loopback S3 server (moto_server, started here), each copy a whole-object PUT.

The last line is one JSON object: step_ms_sync_on and step_ms_sync_off (medians over the repeats), ratio (on / off,
the goal <= 1.02), ratio_paired_median (the median of each repeat's on / off: the two runs of a repeat ran back to
back, so the machine's load changed least between them), the per-run step times, the copies seen per run, and the
run root's kind. Beside them, what a copy costs the sync thread (copy_wall_ms, copy_cpu_ms: the last sync-on run's
event file grown in 40 steps and copied after each, event_file_kb its size) and the share of one core that takes at
one copy per ``--sync-s`` (sync_thread_core_share): the slowdown's bound where the step times are too noisy to show it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT))


def make_store(workdir: Path) -> str:
    from sfm.ingest.survey import ingest_survey
    from sfm.synth.survey import synth_survey

    synth_survey(str(workdir / "s.sgy"), shape=(64, 64, 96), seed=11)
    return ingest_survey(str(workdir / "s.sgy"), str(workdir / "data"), chunk=32)["store_url"]


def start_moto(workdir: Path) -> tuple[subprocess.Popen, dict[str, str]]:
    """moto_server on a free loopback port, and the environment that points the trainer at it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = shutil.which("moto_server")
    cmd = [exe] if exe else [sys.executable, "-m", "moto.server"]
    proc = subprocess.Popen([*cmd, "-H", "127.0.0.1", "-p", str(port)], stdout=open(workdir / "moto.log", "wb"),
                            stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
           "SFM_S3_ENDPOINT_URL": endpoint, "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
           "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required"}
    import urllib.request

    for _ in range(300):
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    os.environ.update(env)
    from sfm import storage

    storage.boto_client().create_bucket(Bucket="bench")
    return proc, env


def event_sizes(run_root: str) -> int | None:
    """The size of the run root's TensorBoard event file (the scalars' one), or None while there is none."""
    from sfm import storage

    folder = storage.join(run_root, "tensorboard", "sfm-pretrain")
    sizes = [size for name, size in storage.list_tree(folder) if "/" not in name and "tfevents" in name]
    return sizes[0] if sizes else None


def train_once(store: str, run_root: str, workdir: Path, name: str, steps: int, sync_s: float,
               env: dict[str, str]) -> dict:
    config = {"data": {"batch_size": 4, "crop": [32, 32, 32]},
              "train": {"max_steps": steps, "checkpoint_every": steps, "log_every": 1, "warmup_steps": 5,
                        "threads_per_process": 1, "trackers": ["tensorboard"], "tracker_sync_s": sync_s}}
    job = workdir / f"{name}.json"
    job.write_text(json.dumps({"config": config, "surveys": [store], "run_root": run_root}))
    log = workdir / f"{name}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "sfm.train.trainer", str(job)], cwd=PROJECT, stdout=fh,
                                stderr=subprocess.STDOUT, env={**os.environ, **env, "OMP_NUM_THREADS": "1"})
    seen = set()
    while proc.poll() is None:
        size = event_sizes(run_root)
        if size is not None:
            seen.add(size)
        time.sleep(0.25)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{log.read_text()[-3000:]}")
    seen.add(event_sizes(run_root))
    from sfm import storage

    summary = json.loads(storage.read_bytes(storage.join(run_root, "summary.json")))
    return {"step_ms": 1000 * config["data"]["batch_size"] / summary["samples_per_s"], "copies_seen": len(seen)}


def copy_cost(events: bytes, workdir: Path, dest: str, copies: int = 40) -> dict[str, float]:
    """What one copy costs the sync thread: a local event file of ``events``' first half grows by ``copies`` equal
    steps to its whole; each step is copied to ``dest`` (sfm.train.trackers.FolderSync.sync). Medians of the wall
    and CPU (this process) milliseconds per copy."""
    from sfm.train.trackers import FolderSync

    src = workdir / "copy-cost" / "sfm-pretrain"
    src.mkdir(parents=True)
    path = src / "events.out.tfevents.0.bench.0.0"
    half = len(events) // 2
    path.write_bytes(events[:half])
    sync = FolderSync(str(src.parent), dest, every_s=0)
    sync.sync()
    walls, cpus = [], []
    for k in range(1, copies + 1):
        with open(path, "ab") as fh:
            fh.write(events[half + (k - 1) * (len(events) - half) // copies:half + k * (len(events) - half) // copies])
        w0, c0 = time.perf_counter(), time.process_time()
        assert sync.sync() == 1
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return {"wall_ms": round(1000 * statistics.median(walls), 3), "cpu_ms": round(1000 * statistics.median(cpus), 3),
            "file_kb": round(len(events) / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="runs each way, alternating")
    parser.add_argument("--steps", type=int, default=300, help="steps per run")
    parser.add_argument("--sync-s", type=float, default=1.0, help="tracker_sync_s of the sync-on runs")
    parser.add_argument("--s3", action="store_true", help="the run roots on a loopback S3 server (moto_server)")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="sfm-bench-sync-"))
    moto, env = (start_moto(workdir) if args.s3 else (None, {}))
    try:
        store = make_store(workdir)
        runs: dict[str, list[dict]] = {"on": [], "off": []}
        for r in range(args.repeats):
            for way in ("on", "off") if r % 2 == 0 else ("off", "on"):
                root = f"s3://bench/run-{way}-{r}" if args.s3 else str(workdir / f"run-{way}-{r}")
                result = train_once(store, root, workdir, f"{way}-{r}", args.steps,
                                    args.sync_s if way == "on" else 0.0, env)
                runs[way].append(result)
                print(f"repeat {r} sync {way:>3}: {result['step_ms']:.1f} ms per step, {result['copies_seen']} "
                      "copies seen in the run root", file=sys.stderr, flush=True)
        from sfm import storage

        last_on = f"s3://bench/run-on-{args.repeats - 1}" if args.s3 else str(workdir / f"run-on-{args.repeats - 1}")
        folder = storage.join(last_on, "tensorboard", "sfm-pretrain")
        name = next(n for n, _ in storage.list_tree(folder) if "/" not in n and "tfevents" in n)
        cost = copy_cost(storage.read_bytes(storage.join(folder, name)), workdir,
                         "s3://bench/copy-cost" if args.s3 else str(workdir / "copy-cost-dest"))
        on = statistics.median(x["step_ms"] for x in runs["on"])
        off = statistics.median(x["step_ms"] for x in runs["off"])
        paired = statistics.median(a["step_ms"] / b["step_ms"] for a, b in zip(runs["on"], runs["off"]))
        print(json.dumps({"step_ms_sync_on": round(on, 2), "step_ms_sync_off": round(off, 2),
                          "ratio": round(on / off, 4), "ratio_paired_median": round(paired, 4),
                          "sync_s": args.sync_s, "steps": args.steps, "copy_wall_ms": cost["wall_ms"],
                          "copy_cpu_ms": cost["cpu_ms"], "event_file_kb": cost["file_kb"],
                          "sync_thread_core_share": round(cost["cpu_ms"] / (1000 * args.sync_s), 5),
                          "run_root": "s3 (moto_server, loopback)" if args.s3 else "local disk",
                          "step_ms_per_run": {w: [round(x["step_ms"], 2) for x in v] for w, v in runs.items()},
                          "copies_seen_per_run": {w: [x["copies_seen"] for x in v] for w, v in runs.items()}}))
    finally:
        if moto is not None:
            moto.terminate()
            moto.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
