"""One complete flow run on S3 (data root and Metaflow datastore on moto_server), with test credentials
set and every S3 request recorded by a logging proxy. Then:

- the pipeline ran whole on S3: every step, Metaflow's datastore and the data root's surveys, manifest and
  registry (v1) in the bucket, no temporary object left;

- no credential (key id, secret, session token; raw, base64, URL-encoded or hex) appears in the run's
  output, any task log, artifact or card (read with the Client API), any object in the bucket, or any
  file the run wrote locally (Metaflow's dirs, the working directory, TMPDIR);
- every S3 call the run made is allowed by ``sfm iam-policy`` for that data root, each call by the
  policy of the component its step runs as; the policy names only the data root's and the datastore's
  prefixes and the five S3 actions the pipeline uses.
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import os
import subprocess
import sys
import zipfile
from urllib.parse import quote, quote_plus

import pytest
from conftest import TEST_ACCESS_KEY, TEST_SECRET_KEY
from support.flowrun import client_view, run_flow
from support.pipeline_checks import check_pipeline, check_version_record
from support.s3_request_log import S3RequestLog, allowed, s3_calls

from sfm.storage import iam

pytestmark = pytest.mark.long(3)

BUCKET = "sfm-leaks"
DATA_ROOT = f"s3://{BUCKET}/data"
METAFLOW_ROOT = f"s3://{BUCKET}/metaflow"
TEST_SESSION_TOKEN = "sfmtestsessiontoken0001IQoJb3JpZ2luX2VjEXAMPLE"
SECRETS = {"access key id": TEST_ACCESS_KEY, "secret key": TEST_SECRET_KEY, "session token": TEST_SESSION_TOKEN}
# Which IAM components each flow step runs as (the start step writes the demo surveys to landing/).
STEP_COMPONENTS = {"start": ("ingest", "demo"), "scan": ("ingest",), "plan_ingest": ("ingest",), "split_parts": (),
                   "ingest": ("ingest",), "join": ("ingest",), "launch": (),
                   "pretrain": ("train",), "evaluate": ("train",), "register": ("registry",), "end": ()}

_CLIENT_DUMP = r"""
import base64, json, pickle, sys
from metaflow import Run, namespace
from metaflow.cards import get_cards
namespace(None)
run = Run(sys.argv[1])
tasks = []
for st in run:
    for task in st:
        arts = {}
        for art in task:
            try:
                value = art.data
                blob = pickle.dumps(value) + repr(value).encode()
            except Exception as err:  # an artifact that cannot be read back is itself worth seeing
                blob = f"unreadable: {err!r}".encode()
            arts[art.id] = base64.b64encode(blob).decode()
        cards = [card.get() for card in get_cards(task)]
        tasks.append({"step": st.id, "pathspec": task.pathspec, "created": task.created_at.timestamp(),
                      "finished": task.finished_at.timestamp() if task.finished_at else None,
                      "stdout": task.stdout, "stderr": task.stderr, "artifacts": arts, "cards": cards})
with open(sys.argv[2], "w") as fh:
    json.dump({"successful": run.successful, "tasks": tasks}, fh)
"""


# ---- the scanner -----------------------------------------------------------------------------------------

def encoded_forms(secret: str) -> set[bytes]:
    """The secret as it would appear raw, URL-encoded, hex, or inside any base64 text (3 alignments x 2 alphabets)."""
    raw = secret.encode()
    forms = {raw, quote(secret).encode(), quote_plus(secret).encode(), raw.hex().encode(), raw.hex().upper().encode()}
    for offset in range(3):
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            text = encode(b"\0" * offset + raw)
            forms.add(text[4 if offset else 0: len(text) - 4])  # the stable middle, whatever surrounds it
    return {f for f in forms if len(f) >= 12}


FORMS = {name: encoded_forms(value) for name, value in SECRETS.items()}


def layers(blob: bytes, depth: int = 0):
    """``blob`` and what it decodes to: gzip, zip members, zstd/blosc chunks, parquet tables."""
    yield blob
    if depth >= 3 or len(blob) < 4:
        return
    decoded: list[bytes] = []
    try:
        if blob[:2] == b"\x1f\x8b":
            decoded.append(gzip.decompress(blob))
        elif blob[:4] == b"PK\x03\x04":
            with zipfile.ZipFile(io.BytesIO(blob)) as zf:
                decoded.extend(zf.read(name) for name in zf.namelist())
        elif blob[:4] == b"\x28\xb5\x2f\xfd":
            from numcodecs import Zstd

            decoded.append(bytes(Zstd().decode(blob)))
        elif blob[:4] == b"PAR1":
            import pyarrow.parquet as pq  # no thread pools: they can abort the process at exit

            table = pq.read_table(io.BytesIO(blob), use_threads=False, pre_buffer=False)
            decoded.append(json.dumps(table.to_pylist(), default=str).encode())
    except Exception:  # not what the magic bytes suggested: the raw bytes were scanned already
        pass
    for inner in decoded:
        yield from layers(inner, depth + 1)


def leaks_in(blob: bytes) -> list[str]:
    found = []
    for layer in layers(blob):
        for name, forms in FORMS.items():
            if any(form in layer for form in forms):
                found.append(name)
    return sorted(set(found))


def test_scanner_finds_planted_secrets():
    """The scan can fail: each encoding of each secret, also inside gzip, zip and parquet, is found."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name, secret in SECRETS.items():
        for form in (secret, base64.b64encode(b"ab" + secret.encode()).decode(), quote(secret),
                     secret.encode().hex()):
            assert leaks_in(f"prefix {form} suffix".encode()) == [name]
            assert leaks_in(gzip.compress(f"x{form}y".encode())) == [name]
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as zf:
            zf.writestr("data.pkl", gzip.compress(secret.encode()))
        assert leaks_in(buf.getvalue()) == [name]
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist([{"v": secret}]), buf, compression="snappy")
        assert name in leaks_in(buf.getvalue())
    assert leaks_in(b"s3://sfm-leaks/data/surveys/abc.zarr") == []


# ---- the run -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def s3_run(s3_server, tmp_path_factory):
    """Run the flow once; returns its output, the Client API dump and the recorded S3 requests."""
    tmp = tmp_path_factory.mktemp("leakrun")
    cwd, tmpdir = tmp / "cwd", tmp / "tmpdir"
    cwd.mkdir()
    tmpdir.mkdir()
    # checkpoint often enough that old checkpoints are pruned (DeleteObject); a short evaluation
    toml = "[train]\ncheckpoint_every = 10\n[eval]\ncrops = 4\ndownstream = false\n"
    config = tmp / "job.toml"
    config.write_text(toml)
    s3_server.make_bucket(BUCKET)
    with S3RequestLog(s3_server.endpoint) as proxy, pytest.MonkeyPatch.context() as mp:
        env = {
            **s3_server.env(),
            "AWS_SESSION_TOKEN": TEST_SESSION_TOKEN,
            "SFM_S3_ENDPOINT_URL": proxy.endpoint, "METAFLOW_S3_ENDPOINT_URL": proxy.endpoint,
            "METAFLOW_USER": "sfm-test", "METAFLOW_HOME": str(tmp / "mfhome"),
            "METAFLOW_DEFAULT_DATASTORE": "s3", "METAFLOW_DATASTORE_SYSROOT_S3": METAFLOW_ROOT,
            "METAFLOW_DEFAULT_METADATA": "local", "METAFLOW_DATASTORE_SYSROOT_LOCAL": str(tmp / "mfroot"),
            "TMPDIR": str(tmpdir),
        }
        for key, value in env.items():
            mp.setenv(key, value)
        result = run_flow(env, cwd=str(cwd), max_steps=30, data_root=DATA_ROOT,
                          top_level={"datastore": "s3", "decospecs": ["card"], "config": [("config", str(config))]})
        run_requests = proxy.snapshot()
        dump_path = tmp / "client_dump.json"
        proc = subprocess.run([sys.executable, "-c", _CLIENT_DUMP, result.pathspec, str(dump_path)],
                              env={**os.environ, **env}, cwd=str(cwd), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        # read back past the proxy, which stops with this block
        direct = {**env, "SFM_S3_ENDPOINT_URL": s3_server.endpoint, "METAFLOW_S3_ENDPOINT_URL": s3_server.endpoint}
        view = client_view(result.pathspec, direct, cwd=str(cwd)) if result.status == "successful" else None
    return {"result": result, "client": json.loads(dump_path.read_text()), "requests": run_requests, "tmp": tmp,
            "client_output": proc.stdout + proc.stderr, "view": view}


@pytest.mark.timeout(1200)
def test_the_whole_pipeline_runs_on_s3(s3_run, s3_server):
    """Every step; the data root and Metaflow's datastore in the bucket; v1 registered there. (30 steps:
    whether the loss falls is checked on the local default run.)"""
    assert s3_run["result"].status == "successful", s3_run["result"].stderr[-3000:]
    view = s3_run["view"]
    check_pipeline(view, trained=False)
    assert view["root"] == DATA_ROOT
    keys = s3_server.keys(BUCKET)
    assert any(k.startswith("metaflow/PretrainFlow/") for k in keys), "Metaflow's datastore is not on S3"
    version_keys = {k.rsplit("/", 1)[-1] for k in keys if k.startswith("data/registry/sfm-mae/v1/")}
    record = json.loads(s3_server.client().get_object(Bucket=BUCKET, Key="data/registry/sfm-mae/v1/version.json")
                        ["Body"].read())
    check_version_record(record, version_keys, trained=False)
    assert sum(k.startswith("data/manifest/rows/") for k in keys) == 3
    assert any(k.startswith("data/surveys/") and k.endswith("zarr.json") for k in keys)
    assert not any(k.rsplit("/", 1)[-1].startswith(".") and "tmp" in k for k in keys)


@pytest.mark.timeout(1200)
def test_flow_run_leaks_no_credentials(s3_run, s3_server):
    result, client = s3_run["result"], s3_run["client"]
    assert result.status == "successful", result.stderr[-3000:]
    assert client["successful"]
    # the run really used the test credentials, so finding none below means something
    assert any(TEST_ACCESS_KEY in r.headers.get("authorization", "") for r in s3_run["requests"])
    assert any(r.headers.get("x-amz-security-token") == TEST_SESSION_TOKEN for r in s3_run["requests"])

    leaks: list[str] = []

    def scan(label: str, blob: bytes | str) -> None:
        found = leaks_in(blob.encode() if isinstance(blob, str) else blob)
        if found:
            leaks.append(f"{label}: {', '.join(found)}")

    scan("flow stdout", result.stdout)
    scan("flow stderr", result.stderr)
    scan("client output", s3_run["client_output"])
    tasks = client["tasks"]
    assert {t["step"] for t in tasks} == set(STEP_COMPONENTS)
    n_artifacts = n_cards = 0
    for task in tasks:
        scan(f"{task['pathspec']} stdout", task["stdout"])
        scan(f"{task['pathspec']} stderr", task["stderr"])
        for name, blob in task["artifacts"].items():
            scan(f"{task['pathspec']} artifact {name}", base64.b64decode(blob))
            n_artifacts += 1
        for n, html in enumerate(task["cards"]):
            scan(f"{task['pathspec']} card {n}", html)
            n_cards += 1
    assert n_cards >= len(tasks), "every task should have its default card"
    assert n_artifacts > 50
    assert any("sfm train:" in t["stderr"] for t in tasks), "task logs were not read"

    client = s3_server.client()
    keys = s3_server.keys(BUCKET)
    for key in keys:
        scan(f"s3://{BUCKET}/{key}", client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    assert any(k.startswith("metaflow/") for k in keys) and any(k.startswith("data/checkpoints/") for k in keys)
    assert any("mf.cards" in k for k in keys)

    files = [p for p in s3_run["tmp"].rglob("*") if p.is_file() and p.name != "client_dump.json"]
    for path in files:
        scan(str(path), path.read_bytes())
    assert any(".metaflow" in p.parts for p in files), "the local metadata was not scanned"

    assert not leaks, "credentials leaked into:\n" + "\n".join(leaks)


# ---- IAM: every call the run made is allowed, per component -----------------------------------------------

def _full_policy() -> dict:
    return iam.policy(DATA_ROOT, metaflow_root=METAFLOW_ROOT, components=(*iam.COMPONENTS, "demo"))


@pytest.mark.timeout(1200)
def test_iam_policy_allows_every_call_of_the_run_and_nothing_else(s3_run):
    assert s3_run["result"].status == "successful"
    calls = [c for r in s3_run["requests"] for c in s3_calls(r)]
    assert len(calls) > 100
    full = _full_policy()
    denied = sorted({str(c) for c in calls if not allowed(full, c)})
    assert not denied, "calls the policy does not allow:\n" + "\n".join(denied[:40])

    # each data-root call falls inside one task and is allowed by the policy of that step's component(s)
    windows = [(t["created"] - 0.5, (t["finished"] or 1e18) + 0.5, t["step"]) for t in s3_run["client"]["tasks"]]
    per_step = {step: iam.policy(DATA_ROOT, components=comps) for step, comps in STEP_COMPONENTS.items()}
    data_calls = [c for c in calls if c.resource.startswith(f"arn:aws:s3:::{BUCKET}/data/")
                  or (c.prefix or "").startswith("data/")]
    assert data_calls
    problems = []
    for call in data_calls:
        steps = {step for lo, hi, step in windows if lo <= call.request.t <= hi}
        if not steps:
            problems.append(f"outside every task: {call}")
        elif not any(allowed(per_step[s], call) for s in steps):
            problems.append(f"in {sorted(steps)}: {call}")
    assert not problems, "calls outside their component's policy:\n" + "\n".join(sorted(set(problems))[:40])

    # the run exercised each kind of grant, so the checks above covered them
    kinds = {(c.action, c.resource.split("/")[2] if "/" in c.resource else "") for c in data_calls}
    for action, area in [("s3:GetObject", "landing"), ("s3:PutObject", "surveys"), ("s3:PutObject", "manifest"),
                         ("s3:PutObject", "checkpoints"), ("s3:DeleteObject", "checkpoints"),
                         ("s3:PutObject", "registry"), ("s3:GetObject", "checkpoints")]:
        assert (action, area) in kinds, f"the run made no {action} on data/{area}/"

    # the checks can fail: the same calls against another data root, or without the registry grant
    other = iam.policy(f"s3://{BUCKET}/other", metaflow_root=f"s3://{BUCKET}/mf2", components=(*iam.COMPONENTS, "demo"))
    assert not any(allowed(other, c) for c in calls)
    register_writes = [c for c in data_calls if c.action == "s3:PutObject" and "/data/registry/" in c.resource]
    no_registry = iam.policy(DATA_ROOT, components=("ingest", "train", "watcher"))
    assert register_writes and not any(allowed(no_registry, c) for c in register_writes)


def test_iam_policy_names_only_the_data_root_and_datastore():
    full = _full_policy()
    for st in full["Statement"]:
        assert st["Effect"] == "Allow"
        assert set(st["Action"]) <= {"s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload", "s3:DeleteObject",
                                     "s3:ListBucket"}, st
        for resource in st["Resource"]:
            if st["Action"] == ["s3:ListBucket"]:
                assert resource == f"arn:aws:s3:::{BUCKET}"
                prefixes = st["Condition"]["StringLike"]["s3:prefix"]
                assert prefixes and all(p.startswith(("data/", "metaflow")) and p not in ("data/", "data/*")
                                        for p in prefixes), st
            else:
                assert resource.startswith((f"arn:aws:s3:::{BUCKET}/data/", f"arn:aws:s3:::{BUCKET}/metaflow/")), st
                area = resource.split("/")[1:3]
                assert area[0] == "metaflow" or area[1] in ("landing", "surveys", "manifest", "checkpoints",
                                                            "registry", iam.WATCH_STATE, iam.WATCH_QUARANTINE), st
    assert iam.minified_size(full) < iam.MANAGED_POLICY_MAX_CHARS
