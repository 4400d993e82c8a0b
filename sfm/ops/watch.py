"""Retraining when new surveys land: ``sfm watch --landing URL --data-root ROOT``.

One pass (:func:`watch_once`):

1. take the watcher lease ``<data-root>/watch/lock.json`` (one pass at a time over a data root);
2. list the SEG-Y files (``.sgy``/``.segy``) in the landing prefix and find each one's content
   digest, the ``survey_id`` ingest gives it (BLAKE3-based, see :func:`sfm.formats.segy.file_digest`);
   digests are cached by (URL, size, ETag/mtime), so a file is read once, not on every pass;
3. a file is *new* when its survey is neither in the manifest nor already handled by the watcher;
   a new file that is not readable SEG-Y is quarantined at once (moved to
   ``<data-root>/quarantine/`` with ``<name>.reason.json``) and never retried;
4. the new surveys go to one run of the flow (``metaflow.Runner``) with just those surveys,
   initialised from the champion (``--init-from`` = its registry folder, the champion's own job
   config so the architecture matches) and evaluated on the champion's held-out surveys, so the new
   version's held-out metric is comparable with the champion's and the margin rule is meaningful;
   with ``--publish-event`` the same parameters are sent as an Argo Event instead, for the deployed
   flow's ``@trigger``;
5. the outcome is recorded per survey in ``<data-root>/watch/surveys/<survey_id>.json``. A failed
   run whose error names one of its files quarantines that file (the others are retried); a run
   that fails ``retrain.max_attempts`` times quarantines its files with the last error.

State lives in the data root, so a restarted watcher (or a second one over the same prefix) neither
misses nor repeats a file: a file is marked ``running`` with the run's tag before the run starts,
and a watcher that finds a ``running`` survey asks Metaflow whether a run with that tag succeeded
(then it is ``trained``) or not (then it is retried). Not handled: a watcher killed so abruptly that
its flow process outlives it and is still training when the lease expires; the next watcher then
starts a second run over the same survey.

The lease is a claim (:func:`sfm.model.registry.claim`) holding an expiry time; the holder refreshes it while
it works, and a watcher that finds it expired takes it over (one taker per expired lease). Watchers
on machines whose clocks disagree by more than a lease period can overlap; keep ``--lease`` well
above that.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import socket
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sfm import storage  # manifest and registry (pandas, jsonschema) load where used: the flow imports this module
from sfm.config import JobConfig, toml_text
from sfm.errors import SFMError
from sfm.ops.flow_files import flow_file

SEGY_SUFFIXES = (".sgy", ".segy")
# the pretrain flow is a file of the package (sfm/flows/pretrain_flow.py, what `sfm flow pretrain` runs), so an
# installed `sfm watch` runs it too
FLOW_FILE = flow_file("pretrain")
FLOW_NAME = "PretrainFlow"
DONE = ("trained", "published", "quarantined")


def log(message: str) -> None:
    print(f"sfm watch: {message}", file=sys.stderr, flush=True)


def _now() -> float:
    return time.time()


def _iso(t: float | None = None) -> str:
    return dt.datetime.fromtimestamp(_now() if t is None else t, dt.timezone.utc).isoformat(timespec="seconds")


@dataclass
class WatchOptions:
    landing: str
    data_root: str
    flow: str = str(FLOW_FILE)
    config: str = ""  # TOML job config for the runs; default: the champion's config (or sfm/default.toml)
    overrides: list[str] = field(default_factory=list)  # section.key=value on top
    held_out: str = ""  # comma-separated SEG-Y URLs; default: the champion's held-out surveys
    publish_event: bool = False
    event_url: str = ""  # Argo Events webhook; default METAFLOW_ARGO_EVENTS_WEBHOOK_URL
    lease_s: float = 600.0
    wait_s: float = 3600.0  # how long a pass waits for another watcher's lease
    poll_s: float = 2.0

    def __post_init__(self):
        self.landing = storage.normalize(self.landing)
        self.data_root = storage.normalize(self.data_root)


# ---- state under <data-root>/watch ---------------------------------------------------------------


def state_url(data_root: str, *parts: str) -> str:
    return storage.join(data_root, "watch", *parts)


def read_json(url: str) -> dict[str, Any] | None:
    return json.loads(storage.read_bytes(url)) if storage.exists(url) else None


def write_json(url: str, doc: dict[str, Any]) -> None:
    storage.write_bytes(url, json.dumps(doc, indent=1, sort_keys=True).encode())


def survey_state(data_root: str, survey_id: str) -> dict[str, Any] | None:
    return read_json(state_url(data_root, "surveys", f"{survey_id}.json"))


def set_survey_state(data_root: str, survey_id: str, **fields: Any) -> dict[str, Any]:
    doc = survey_state(data_root, survey_id) or {"survey_id": survey_id, "attempts": 0, "attempt_tags": []}
    doc.update(fields, updated_at=_iso())
    write_json(state_url(data_root, "surveys", f"{survey_id}.json"), doc)
    return doc


class Lease:
    """At most one holder per data root: a claim file with an expiry the holder keeps pushing forward."""

    def __init__(self, data_root: str, lease_s: float):
        self.data_root = data_root
        self.url = state_url(data_root, "lock.json")
        self.lease_s = float(lease_s)
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _doc(self) -> dict[str, Any]:
        return {"owner": self.owner, "expires_at": _now() + self.lease_s, "renewed_at": _iso()}

    def try_acquire(self) -> bool:
        from sfm.model import registry

        if registry.claim(self.url, self._doc()):
            return True
        held = read_json(self.url)
        if held is None or held.get("expires_at", 0) > _now():
            return False
        # expired: one taker per expired lease (the claim names the lease it replaces), then the usual claim
        token = hashlib.sha256(json.dumps(held, sort_keys=True).encode()).hexdigest()[:16]
        if registry.claim(state_url(self.data_root, "lock-breaks", token), {"owner": self.owner}):
            log(f"lease of {held.get('owner')} expired at {_iso(held.get('expires_at'))}; taking over")
            storage.remove(self.url)
            return registry.claim(self.url, self._doc())
        return False

    def acquire(self, wait_s: float, poll_s: float) -> bool:
        deadline = _now() + wait_s
        announced = False
        while not self.try_acquire():
            if _now() > deadline:
                return False
            if not announced:
                held = read_json(self.url) or {}
                log(f"another watcher ({held.get('owner', '?')}) holds {self.url}; waiting")
                announced = True
            time.sleep(poll_s)
        self._stop.clear()
        self._thread = threading.Thread(target=self._heartbeat, daemon=True, name="sfm-watch-lease")
        self._thread.start()
        return True

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            held = read_json(self.url)
            if held is None or held.get("owner") != self.owner:
                log(f"lost the lease {self.url} (now {held and held.get('owner')}); finishing the current pass")
                return
            write_json(self.url, self._doc())

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        held = read_json(self.url)
        if held is not None and held.get("owner") == self.owner:
            storage.remove(self.url)


# ---- landing files -------------------------------------------------------------------------------


@dataclass
class LandingFile:
    url: str
    name: str
    size: int
    stamp: str  # ETag or mtime: changes when the object is replaced
    survey_id: str = ""
    problem: str = ""  # why it cannot be ingested ("" when it reads as SEG-Y)


def list_landing(landing: str) -> list[LandingFile]:
    """SEG-Y files directly under ``landing``, by name."""
    fs, path = storage.filesystem(landing)
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return []
    out = []
    for e in entries:
        name = e["name"].rstrip("/").rsplit("/", 1)[-1]
        if e.get("type") != "file" or not name.lower().endswith(SEGY_SUFFIXES):
            continue
        stamp = str(e.get("ETag") or e.get("etag") or e.get("mtime") or e.get("LastModified") or "")
        out.append(LandingFile(storage.join(landing, name), name, int(e.get("size") or 0), stamp))
    return sorted(out, key=lambda f: f.name)


def identify(data_root: str, f: LandingFile) -> LandingFile:
    """Fill in the file's survey id and whether it reads as SEG-Y, from the cache or by reading it once."""
    from sfm.formats.segy import file_digest, read_layout

    key = hashlib.sha256(f"{f.url}\n{f.size}\n{f.stamp}".encode()).hexdigest()[:32]
    cache_url = state_url(data_root, "digests", f"{key}.json")
    cached = read_json(cache_url)
    if cached is None:
        with tempfile.TemporaryDirectory(prefix="sfm-watch-") as tmp:
            local = storage.local_copy(f.url, tmp)
            digest = file_digest(local)
            try:
                read_layout(local, "auto")
                problem = ""
            except SFMError as err:
                problem = str(err).replace(local, f.url)
        cached = {"url": f.url, "size": f.size, "stamp": f.stamp, "digest": digest, "problem": problem}
        write_json(cache_url, cached)
    f.survey_id, f.problem = cached["digest"][:16], cached["problem"]
    return f


def quarantine(data_root: str, f: LandingFile, reason: str) -> str:
    """Move ``f`` to ``<data-root>/quarantine/`` beside a ``.reason.json``; record it; returns the new URL."""
    folder = storage.join(data_root, "quarantine")
    try:
        target = storage.safe_join(folder, f"{f.survey_id}-{f.name}", what="landing file name")
    except SFMError:  # a name that cannot be a path: the content id alone (the reason keeps the name)
        target = storage.join(folder, f"{f.survey_id}.segy")
    if storage.exists(f.url):
        with tempfile.TemporaryDirectory(prefix="sfm-quarantine-") as tmp:
            storage.upload(storage.local_copy(f.url, tmp), target)
    write_json(f"{target}.reason.json", {"source_url": f.url, "survey_id": f.survey_id, "reason": reason,
                                         "quarantined_at": _iso()})
    set_survey_state(data_root, f.survey_id, status="quarantined", source_url=f.url, name=f.name, reason=reason,
                     quarantined_to=target)
    try:
        storage.remove(f.url)
    except (OSError, SFMError) as err:  # a read-only landing prefix: the state alone keeps it from retrying
        log(f"could not remove {f.url} from the landing prefix ({err}); it stays quarantined by content")
    log(f"quarantined {f.url} -> {target}: {reason}")
    return target


# ---- what to do with a file -----------------------------------------------------------------------


def run_succeeded(tag: str) -> dict[str, Any] | None:
    """The successful flow run tagged ``tag`` ({"pathspec", "tags"}), if any, via the Client API."""
    from metaflow import Flow, namespace
    from metaflow.exception import MetaflowNotFound

    namespace(None)
    try:
        runs = list(Flow(FLOW_NAME).runs(tag))
    except MetaflowNotFound:
        return None
    for run in runs:
        if run.successful:
            return {"pathspec": run.pathspec, "tags": sorted(run.tags)}
    return None


def registered_version(tags: list[str]) -> int | None:
    for tag in tags:
        if tag.startswith("model:"):
            return int(tag.rsplit(":v", 1)[-1])
    return None


def pending_files(data_root: str, files: list[LandingFile], max_attempts: int) -> list[LandingFile]:
    """The files a run must take now (one per survey), after quarantining the unreadable ones."""
    from sfm.formats import manifest

    in_manifest = set(manifest.read(data_root)["survey_id"])
    chosen: dict[str, LandingFile] = {}
    for f in files:
        identify(data_root, f)
        if f.survey_id in chosen:
            continue
        state = survey_state(data_root, f.survey_id)
        status = state["status"] if state else None
        if status in DONE:
            continue
        if status == "running":  # a watcher died during its run, or its run is still being recorded
            done = next((r for r in map(run_succeeded, reversed(state["attempt_tags"])) if r), None)
            if done:
                set_survey_state(data_root, f.survey_id, status="trained", run=done["pathspec"],
                                 version=registered_version(done["tags"]))
                log(f"{f.name}: its run {done['pathspec']} had succeeded; recorded as trained")
                continue
        if state is None and f.survey_id in in_manifest:
            continue  # ingested before, by a flow run or `sfm ingest`, not by a watcher pass
        if f.problem:
            quarantine(data_root, f, f.problem)
            continue
        if state and state["attempts"] >= max_attempts:
            quarantine(data_root, f, f"{state['attempts']} runs failed; last: {state.get('reason', '?')}")
            continue
        chosen[f.survey_id] = f
    return list(chosen.values())


# ---- the run -----------------------------------------------------------------------------------


def run_plan(opts: WatchOptions) -> dict[str, Any]:
    """The job config, the model to continue from and the held-out surveys of the next run.

    Config: ``--config`` if given, else the champion's own job config (so the architecture matches the
    weights it continues from), else sfm/default.toml; ``--set`` overrides go on top. Held out:
    ``--held-out`` if given, else the champion's held-out surveys (their SEG-Y sources, found through
    the manifest), so the new version is scored on the same surveys as the champion it must beat.
    """
    from sfm.model import registry
    from sfm.formats import manifest

    cfg = JobConfig.from_toml(opts.config or None, opts.overrides)
    model_name = cfg.registry.model_name
    champion = registry.champion_version(opts.data_root, model_name)
    record = registry.get(opts.data_root, model_name, champion) if champion else None
    if not opts.config and record is not None:
        with tempfile.TemporaryDirectory(prefix="sfm-watch-") as tmp:
            path = os.path.join(tmp, "champion.toml")
            Path(path).write_text(toml_text(record["config"]))
            cfg = JobConfig.from_toml(path, opts.overrides)
    held_out = storage.split_urls(opts.held_out)
    if not held_out and record is not None:
        rows = manifest.read(opts.data_root)
        sources = dict(zip(rows["store_url"], rows["source_url"]))
        held_out = [sources[s] for s in record["lineage"].get("held_out_surveys", []) if s in sources]
    init_from = registry.version_url(opts.data_root, model_name, champion) if champion else ""
    cfg.set("train.init_from", init_from)
    return {"config": cfg, "init_from": init_from, "held_out": held_out, "champion": champion,
            "model_name": model_name}


def attribute_failure(stderr: str, files: list[LandingFile]) -> tuple[LandingFile | None, str]:
    """The file a failed run's error names (if exactly one does) and the error line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()] or lines[-1:]
    for line in reversed(errors):
        named = [f for f in files if f.url in line or f.name in line]
        if len(named) == 1:
            return named[0], line
    return None, errors[-1] if errors else "the run failed without output"


def run_parameters(opts: WatchOptions, files: list[LandingFile], plan: dict[str, Any]) -> dict[str, str]:
    """The flow parameters of a run over ``files`` (landing names may hold commas: see join_urls)."""
    params = {"surveys": storage.join_urls([f.url for f in files]), "data_root": opts.data_root,
              "init_from": plan["init_from"]}
    if plan["held_out"]:
        params["held_out"] = storage.join_urls(plan["held_out"])
    return params


def start_run(opts: WatchOptions, files: list[LandingFile], plan: dict[str, Any], tag: str) -> dict[str, Any]:
    """Run the flow over ``files`` and wait; returns {"status", "pathspec", "tags", "stderr"}."""
    from metaflow import Runner

    params = run_parameters(opts, files, plan)
    with tempfile.TemporaryDirectory(prefix="sfm-watch-") as tmp:
        config_path = os.path.join(tmp, "job.toml")
        Path(config_path).write_text(plan["config"].to_toml())
        with Runner(opts.flow, show_output=True, env=dict(os.environ), config=[("config", config_path)]) as runner:
            result = runner.run(tags=[tag, "sfm-watch"], **params)
            run = result.run
            return {"status": result.status, "pathspec": run.pathspec, "tags": sorted(run.tags),
                    "stderr": result.stderr}


def publish(opts: WatchOptions, files: list[LandingFile], plan: dict[str, Any], tag: str) -> str:
    """Send the new-survey event for the deployed flow's ``@trigger``; returns the event id."""
    from metaflow.integrations import ArgoEvent
    from metaflow.metaflow_config import ARGO_EVENTS_WEBHOOK_URL

    url = opts.event_url or ARGO_EVENTS_WEBHOOK_URL
    if not url:
        raise SFMError("--publish-event needs the Argo Events webhook: pass --event-url or set "
                       "METAFLOW_ARGO_EVENTS_WEBHOOK_URL")
    payload = {"held_out": "", **run_parameters(opts, files, plan), "sfm_watch_tag": tag}
    try:
        return ArgoEvent(plan["config"].retrain.event, url=url).publish(payload=payload, ignore_errors=False)
    except Exception as err:
        raise SFMError(f"publishing event {plan['config'].retrain.event!r} to {url} failed: {err}; "
                       "check the webhook URL") from err


def process(opts: WatchOptions, files: list[LandingFile], plan: dict[str, Any]) -> dict[str, Any]:
    """Train on (or publish) ``files`` as one run and record the outcome per survey."""
    tag = f"sfm-watch:{uuid.uuid4().hex[:12]}"
    for f in files:
        state = survey_state(opts.data_root, f.survey_id) or {"attempts": 0, "attempt_tags": []}
        set_survey_state(opts.data_root, f.survey_id, status="running", source_url=f.url, name=f.name,
                         attempts=state["attempts"] + 1, attempt_tags=state["attempt_tags"] + [tag])
    names = ", ".join(f.name for f in files)
    if opts.publish_event:
        event_id = publish(opts, files, plan, tag)
        for f in files:
            set_survey_state(opts.data_root, f.survey_id, status="published", event_id=event_id)
        log(f"published {plan['config'].retrain.event!r} for {names} (event {event_id})")
        return {"published": [f.url for f in files], "event_id": event_id}
    held = ", ".join(plan["held_out"]) or "the flow's default"
    log(f"training on {names} from {plan['init_from'] or 'scratch'}; held out: {held}")
    result = start_run(opts, files, plan, tag)
    if result["status"] == "successful":
        version = registered_version(result["tags"])
        for f in files:
            set_survey_state(opts.data_root, f.survey_id, status="trained", run=result["pathspec"], version=version)
        log(f"run {result['pathspec']} registered {plan['model_name']} v{version} from {names}")
        return {"run": result["pathspec"], "status": "successful", "version": version,
                "surveys": [f.url for f in files]}
    culprit, line = attribute_failure(result["stderr"], files)
    for f in files:
        if culprit is f:
            quarantine(opts.data_root, f, line)
        else:  # a failure named another file does not count against this one
            state = survey_state(opts.data_root, f.survey_id)
            attempts = state["attempts"] - (1 if culprit is not None else 0)
            set_survey_state(opts.data_root, f.survey_id, status="failed", attempts=attempts, reason=line,
                             run=result["pathspec"])
    log(f"run {result['pathspec']} failed: {line}")
    return {"run": result["pathspec"], "status": "failed", "error": line}


def watch_once(opts: WatchOptions) -> dict[str, Any]:
    """One pass under the lease; returns what it did."""
    lease = Lease(opts.data_root, opts.lease_s)
    if not lease.acquire(opts.wait_s, opts.poll_s):
        raise SFMError(f"another watcher held {lease.url} for {opts.wait_s:.0f} s; try again later")
    try:
        plan = run_plan(opts)
        files = pending_files(opts.data_root, list_landing(opts.landing), plan["config"].retrain.max_attempts)
        if not files:
            log(f"nothing new in {opts.landing}")
            return {"status": "idle"}
        if not plan["held_out"] and plan["champion"] is None and len(files) < 2:
            log(f"{files[0].name} waits: a first model needs a held-out survey; pass --held-out or land another")
            return {"status": "waiting", "surveys": [f.url for f in files]}
        return process(opts, files, plan)
    finally:
        lease.release()


def watch(opts: WatchOptions, interval_s: float, once: bool = False) -> None:
    """Pass after pass, ``interval_s`` apart (one pass with ``once``). A pass that fails on a user-fixable
    problem (an unreachable webhook, a bad config) ends a one-pass watcher; a long-running one logs it
    and tries again at the next pass."""
    while True:
        try:
            print(json.dumps(watch_once(opts)), flush=True)
        except SFMError as err:
            if once:
                raise
            log(f"error: {err}; next pass in {interval_s:.0f} s")
        if once:
            return
        time.sleep(interval_s)


__all__ = ["WatchOptions", "watch", "watch_once", "Lease", "list_landing"]
