"""`sfm watch`: new surveys in the landing prefix start exactly one continued-pretraining run each;
bad files are quarantined; state in the data root survives restarts; the event can be published instead."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import PROJECT

from sfm import storage
from sfm.ops import pipeline
from sfm.model import registry
from sfm.config import JobConfig
from sfm.errors import SFMError
from sfm.ops.schedule import schedule_cron, trigger_event
from sfm.ops.watch import Lease

pytestmark = pytest.mark.long(1)

MODEL = "sfm-mae"
# keeps the watcher's flow run short: a few steps, a small evaluation, no downstream fine-tuning
FAST = ["train.max_steps=6", "train.warmup_steps=2", "train.checkpoint_every=6", "eval.crops=8",
        "eval.downstream=false"]

_CLIENT = r"""
import json, sys
from metaflow import Flow, namespace
from metaflow.exception import MetaflowNotFound
namespace(None)
try:
    runs = [{"pathspec": r.pathspec, "successful": r.successful, "tags": sorted(r.tags)} for r in Flow("PretrainFlow")]
except MetaflowNotFound:
    runs = []
print("RUNS " + json.dumps(runs))
"""


def flow_runs(env: dict, cwd: str) -> list[dict]:
    proc = subprocess.run([sys.executable, "-c", _CLIENT], env={**os.environ, **env}, cwd=cwd, capture_output=True,
                          text=True, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RUNS ")), None)
    assert line, proc.stderr
    return json.loads(line[5:])


def make_champion_root(root: Path | str) -> dict:
    """A data root as a first training would leave it: demo SEG-Y in landing, a training and a held-out
    survey ingested, and a registered champion (a freshly initialised tiny model) whose lineage names the
    held-out survey. demo-train-1 is in landing but not in the manifest: new to the watcher."""
    from sfm.ingest.survey import ingest_survey
    from sfm.model import build_model
    from sfm.model.io import save
    from sfm.model import model_config_for

    data = str(root)
    plan = pipeline.generate_demo_surveys(data)
    urls = {Path(p["url"]).stem: p["url"] for p in plan}
    cfg = JobConfig.from_toml(None, FAST)
    stores = {name: ingest_survey(urls[name], data, chunk=cfg.ingest.chunk)["store_url"]
              for name in ("demo-train-0", "demo-heldout-0")}
    export = storage.join(data, "exports", "init")
    save(build_model(model_config_for(cfg)), export)
    record = registry.register(data, MODEL, export, config=cfg.to_dict(), metrics={"masked_nmse": 1.0},
                               lineage={"run_pathspec": "PretrainFlow/setup", "manifest_version": "m2",
                                        "code_version": "test", "surveys": [stores["demo-train-0"]],
                                        "held_out_surveys": [stores["demo-heldout-0"]]})
    assert record["champion"]
    return {"root": data, "landing": storage.join(data, "landing"), "urls": urls, "stores": stores}


def watch_cmd(setup: dict, *extra: str) -> list[str]:
    return [sys.executable, "-m", "sfm.cli", "watch", "--landing", setup["landing"], "--data-root", setup["root"],
            "--once", "--lease", "60", *[a for item in FAST for a in ("--set", item)], *extra]


def state(setup: dict, survey_id: str) -> dict:
    return json.loads(Path(setup["root"], "watch", "surveys", f"{survey_id}.json").read_text())


@pytest.mark.timeout(900)
def test_two_watchers_run_one_flow_per_new_file_and_quarantine_the_bad_one(tmp_path, metaflow_env):
    setup = make_champion_root(tmp_path / "data")
    landing = Path(setup["landing"])
    (landing / "broken.sgy").write_bytes(b"this is not SEG-Y\n" * 300)
    (landing / "notes.txt").write_text("not a survey: ignored")
    env = {**os.environ, **metaflow_env}

    watchers = [subprocess.Popen(watch_cmd(setup), env=env, cwd=str(tmp_path), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [w.communicate(timeout=840) for w in watchers]
    for w, (out, err) in zip(watchers, outputs):
        assert w.returncode == 0, err[-3000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert sorted(r["status"] for r in results) == ["idle", "successful"], results  # one ran, the other found it done

    runs = flow_runs(metaflow_env, str(tmp_path))
    assert len(runs) == 1 and runs[0]["successful"], runs  # exactly one flow for the one new file
    assert "sfm-watch" in runs[0]["tags"] and f"model:{MODEL}:v2" in runs[0]["tags"]

    new_id = next(r for r in results if r["status"] == "successful")
    assert new_id["surveys"] == [setup["urls"]["demo-train-1"]] and new_id["version"] == 2
    v2 = registry.get(setup["root"], MODEL, 2)
    assert [Path(s).name for s in v2["lineage"]["surveys"]] != [Path(setup["stores"]["demo-train-0"]).name]
    assert len(v2["lineage"]["surveys"]) == 1  # just the new survey
    assert v2["lineage"]["held_out_surveys"] == [setup["stores"]["demo-heldout-0"]]  # the champion's held-out
    assert v2["lineage"]["init_from"] == registry.version_url(setup["root"], MODEL, 1)  # continued from v1
    assert v2["config"]["train"]["init_from"] == registry.version_url(setup["root"], MODEL, 1)
    assert v2["lineage"]["run_pathspec"] == runs[0]["pathspec"]
    survey_id = Path(v2["lineage"]["surveys"][0]).name.split(".")[0]
    assert state(setup, survey_id)["status"] == "trained" and state(setup, survey_id)["run"] == runs[0]["pathspec"]

    # the bad file: moved to quarantine with its reason, never retried
    assert not (landing / "broken.sgy").exists()
    reasons = list(Path(setup["root"], "quarantine").glob("*broken.sgy.reason.json"))
    assert len(reasons) == 1
    reason = json.loads(reasons[0].read_text())
    assert reason["source_url"].endswith("broken.sgy") and "SEG-Y" in reason["reason"], reason
    assert Path(str(reasons[0])[: -len(".reason.json")]).read_bytes().startswith(b"this is not SEG-Y")

    # a watcher that died after its run succeeded but before recording it: the restart records, not reruns
    path = Path(setup["root"], "watch", "surveys", f"{survey_id}.json")
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "status": "running", "run": None}))
    (landing / "broken.sgy").write_bytes(b"this is not SEG-Y\n" * 300)  # the same bad bytes land again
    again = subprocess.run(watch_cmd(setup), env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout.strip().splitlines()[-1])["status"] == "idle"
    assert len(flow_runs(metaflow_env, str(tmp_path))) == 1  # still one run: nothing missed, nothing repeated
    assert state(setup, survey_id)["status"] == "trained" and state(setup, survey_id)["run"] == runs[0]["pathspec"]
    assert (landing / "broken.sgy").exists()  # known bad content is left alone, not re-quarantined or retried
    assert len(list(Path(setup["root"], "quarantine").glob("*.reason.json"))) == 1


class _Webhook(http.server.BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Webhook.received.append(json.loads(body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.timeout(300)
def test_watch_publishes_the_new_survey_event_instead_of_running(tmp_path, metaflow_env):
    setup = make_champion_root(tmp_path / "data")
    server = http.server.HTTPServer(("127.0.0.1", 0), _Webhook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/events"
    _Webhook.received.clear()
    try:
        env = {**os.environ, **metaflow_env}
        for _ in range(2):  # the second pass finds the survey published and sends nothing
            proc = subprocess.run(watch_cmd(setup, "--publish-event", "--event-url", url), env=env, cwd=str(tmp_path),
                                  capture_output=True, text=True, timeout=240)
            assert proc.returncode == 0, proc.stderr[-3000:]
    finally:
        server.shutdown()
    assert len(_Webhook.received) == 1, _Webhook.received
    event = _Webhook.received[0]
    assert event["name"] == "sfm-new-survey"
    payload = event["payload"]
    assert payload["surveys"] == setup["urls"]["demo-train-1"]
    assert payload["init_from"] == registry.version_url(setup["root"], MODEL, 1)
    assert payload["held_out"] == setup["urls"]["demo-heldout-0"] and payload["data_root"] == setup["root"]
    assert flow_runs(metaflow_env, str(tmp_path)) == []  # nothing ran locally
    # the payload fields are exactly what the flow's @trigger maps onto its parameters
    assert set(trigger_event({})["parameters"].values()) <= set(payload)


@pytest.mark.timeout(600)
def test_watch_on_s3_quarantines_and_publishes(tmp_path, metaflow_env, s3_env):
    """The same pass with the landing prefix, data root and watcher state on S3 (moto_server)."""
    bucket = "sfm-watch"
    setup = make_champion_root(s3_env.make_bucket(bucket) + "/data")
    s3_env.client().put_object(Bucket=bucket, Key="data/landing/broken.sgy", Body=b"not SEG-Y either\n" * 300)
    server = http.server.HTTPServer(("127.0.0.1", 0), _Webhook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Webhook.received.clear()
    try:
        proc = subprocess.run(watch_cmd(setup, "--publish-event", "--event-url",
                                        f"http://127.0.0.1:{server.server_port}/events"),
                              env={**os.environ, **metaflow_env, **s3_env.env()}, cwd=str(tmp_path),
                              capture_output=True, text=True, timeout=400)
    finally:
        server.shutdown()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [e["payload"]["surveys"] for e in _Webhook.received] == [setup["urls"]["demo-train-1"]]
    keys = s3_env.keys(bucket, "data/")
    assert "data/landing/broken.sgy" not in keys
    quarantined = [k for k in keys if k.startswith("data/quarantine/")]
    assert sorted(k.rsplit("-", 1)[-1] for k in quarantined) == ["broken.sgy", "broken.sgy.reason.json"]
    assert any(k.startswith("data/watch/surveys/") for k in keys) and "data/watch/lock.json" not in keys


def test_lease_on_s3_has_one_holder(s3_env):
    root = s3_env.make_bucket("sfm-lease") + "/data"
    leases = [Lease(root, lease_s=60.0) for _ in range(3)]
    assert [lease.try_acquire() for lease in leases] == [True, False, False]
    leases[0].release()
    assert leases[2].try_acquire() and not leases[1].try_acquire()


def test_lease_is_exclusive_and_an_expired_one_is_taken_over_once(tmp_path):
    root = str(tmp_path)
    holder = Lease(root, lease_s=1.0)
    assert holder.try_acquire()
    rivals = [Lease(root, lease_s=60.0) for _ in range(3)]
    assert not any(r.try_acquire() for r in rivals)  # held and fresh
    time.sleep(1.2)  # the holder died without renewing
    won = [r.try_acquire() for r in rivals]
    assert won.count(True) == 1, won  # exactly one takes the expired lease over
    holder.release()  # a late release of the old holder must not free the new holder's lease
    assert json.loads(Path(root, "watch", "lock.json").read_text())["owner"] == rivals[won.index(True)].owner


def test_schedule_and_event_come_from_the_config():
    assert schedule_cron({}) == "0 0 ? * SUN *"  # weekly by default (Metaflow's own weekly expression)
    assert schedule_cron({"retrain": {"schedule": "daily"}}) == "0 0 * * ? *"
    assert schedule_cron({"retrain": {"schedule": "30 2 * * 1"}}) == "30 2 * * 1"
    assert schedule_cron({"retrain": {"schedule": ""}}) is None
    assert trigger_event({"retrain": {"event": "surveys-landed"}})["name"] == "surveys-landed"
    with pytest.raises(SFMError, match="event is empty"):
        trigger_event({"retrain": {"event": " "}})


def test_flow_file_is_where_the_watcher_looks():
    from sfm.ops.watch import FLOW_FILE

    assert FLOW_FILE == PROJECT / "sfm" / "flows" / "pretrain_flow.py" and FLOW_FILE.exists()


def test_a_failed_run_is_blamed_on_the_file_its_error_names():
    from sfm.ops.watch import LandingFile, attribute_failure

    files = [LandingFile("/l/a.sgy", "a.sgy", 1, "t"), LandingFile("/l/b.sgy", "b.sgy", 1, "t")]
    stderr = ("2026-11-30 [1/ingest/3] Task is starting.\n"
              "    sfm input error: /l/b.sgy: traces 17-20 repeat an (inline, crossline) cell; this looks pre-stack\n"
              "2026-11-30 Task failed.\n")
    culprit, line = attribute_failure(stderr, files)
    assert culprit is files[1] and "pre-stack" in line
    culprit, line = attribute_failure("Error: out of memory\n", files)
    assert culprit is None and line == "Error: out of memory"


def test_a_first_survey_waits_for_a_held_out_one(tmp_path, metaflow_env):
    """No champion, one new file, no --held-out: nothing to evaluate on, so the watcher waits (no run)."""
    from sfm.synth.survey import synth_survey
    from sfm.ops.watch import WatchOptions, watch_once

    landing = tmp_path / "landing"
    landing.mkdir()
    synth_survey(str(landing / "first.sgy"), shape=(16, 16, 32), seed=3)
    result = watch_once(WatchOptions(landing=str(landing), data_root=str(tmp_path / "data")))
    assert result == {"status": "waiting", "surveys": [str(landing / "first.sgy")]}
    assert not Path(tmp_path, "data", "watch", "lock.json").exists()  # the lease was released


def test_init_from_champion_resolves_and_a_wrong_architecture_is_refused(tmp_path):
    from sfm.model import build_model, mae_config
    from sfm.model.io import save

    root = str(tmp_path)
    cfg = JobConfig.from_toml(None, FAST)
    save(build_model(mae_config("tiny", crop=(32, 32, 32))), str(tmp_path / "export"))
    registry.register(root, MODEL, str(tmp_path / "export"), config=cfg.to_dict(), metrics={"masked_nmse": 1.0},
                      lineage={"run_pathspec": "x", "manifest_version": "m0", "code_version": "t", "surveys": []})
    resolved = pipeline.resolve_init_from(JobConfig.from_toml(None, FAST), "champion", root)
    assert resolved.train.init_from == registry.version_url(root, MODEL, 1)
    small = JobConfig.from_toml(None, [*FAST, "model.preset=small"])
    with pytest.raises(SFMError, match="differs from the job's model in .*embed_dim"):
        pipeline.resolve_init_from(small, "v1", root)
    with pytest.raises(SFMError, match="no exported model"):
        pipeline.resolve_init_from(JobConfig.from_toml(None, FAST), str(tmp_path / "nothing"), root)


def test_landing_names_with_commas_reach_the_flow_whole(tmp_path):
    from sfm.ops.watch import LandingFile, WatchOptions, run_parameters

    files = [LandingFile("s3://b/landing/north,2019.sgy", "north,2019.sgy", 1, "t"),
             LandingFile("s3://b/landing/south.sgy", "south.sgy", 1, "t")]
    plan = {"init_from": "", "held_out": ["s3://b/landing/held,out.sgy"]}
    params = run_parameters(WatchOptions(landing="s3://b/landing", data_root=str(tmp_path)), files, plan)
    assert storage.split_urls(params["surveys"]) == [f.url for f in files]
    assert storage.split_urls(params["held_out"]) == plan["held_out"]
    assert storage.join_urls(["a.sgy", "b.sgy"]) == "a.sgy,b.sgy"  # readable when no name needs quoting
    assert storage.split_urls(" a.sgy , b.sgy ,") == ["a.sgy", "b.sgy"]
    with pytest.raises(SFMError, match="not a JSON list of URLs"):
        storage.split_urls("[a.sgy")
