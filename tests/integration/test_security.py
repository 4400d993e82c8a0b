"""Security rules: https-only S3 endpoints off loopback, redacted error messages, outside names that
cannot leave the data root (landing files ingested locally and on S3, the watcher's quarantine),
and weights that never unpickle (safetensors only; optimiser state with ``weights_only=True``)."""

from __future__ import annotations

import ast
import io
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import PROJECT, TEST_ACCESS_KEY, TEST_SECRET_KEY

from sfm import storage
from sfm.train import checkpoint
from sfm.errors import SFMError
from sfm.errors import redact
from sfm.storage.security import endpoint_problem, is_loopback_host, name_problem

# AWS's documented example access key id, assembled here so that secret scanners looking for a
# committed key (AKIA + 16 characters) do not flag a test fixture
EXAMPLE_KEY_ID = "AKIA" + "IOSFODNN7EXAMPLE"

# ---- S3 endpoints ----------------------------------------------------------------------------------------


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to resolve a name or open a connection fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network traffic attempted: {args!r}")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.mark.parametrize("env_name", ["SFM_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "METAFLOW_S3_ENDPOINT_URL"])
def test_plain_http_endpoint_off_loopback_is_refused_without_traffic(monkeypatch, no_network, env_name):
    for name in storage.ENDPOINT_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("SFM_ALLOW_INSECURE_S3", raising=False)
    monkeypatch.setenv(env_name, "http://s3.internal.example:9000")
    for call in (lambda: storage.exists("s3://bucket/data/x"), lambda: storage.read_bytes("s3://bucket/k"),
                 lambda: storage.zarr_store("s3://bucket/data/surveys/a.zarr"),
                 lambda: storage.write_bytes_if_absent("s3://bucket/k", b"x")):
        with pytest.raises(SFMError) as err:
            call()
        message = str(err.value)
        assert "\n" not in message
        assert message.startswith("S3 endpoint http://s3.internal.example:9000 is plain http on a non-loopback host")
        assert "use https://" in message and "SFM_ALLOW_INSECURE_S3=1" in message and f"${env_name}" in message


def test_cli_reports_an_insecure_endpoint_on_one_line(tmp_path):
    env = {**os.environ, "SFM_S3_ENDPOINT_URL": "http://10.20.30.40:9000"}
    env.pop("SFM_ALLOW_INSECURE_S3", None)
    proc = subprocess.run([sys.executable, "-m", "sfm.cli", "ingest", "s3://bucket/landing/a.sgy", "--data-root",
                           str(tmp_path / "data")], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "sfm ingest: error: S3 endpoint http://10.20.30.40:9000 is plain http" \
        in proc.stderr
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("url", ["http://127.0.0.1:9000", "http://127.8.9.10", "http://localhost:4566",
                                 "http://LOCALHOST", "http://[::1]:9000", "http://[::ffff:127.0.0.1]:1",
                                 "https://s3.us-east-1.amazonaws.com", "https://minio.example:9000"])
def test_https_and_loopback_endpoints_are_allowed(url):
    assert endpoint_problem(url, allow_insecure=False) is None


@pytest.mark.parametrize("url,why", [
    ("http://127.0.0.1.nip.io:9000", "plain http"), ("http://0x7f.1", "plain http"), ("http://10.0.0.1", "plain http"),
    ("ftp://127.0.0.1", "not an http(s) URL"), ("127.0.0.1:9000", "not an http(s) URL"),
    (f"https://{EXAMPLE_KEY_ID}:wJalrXUtnFEMIK7MDENG@s3.example", "carries credentials"),
    ("http://[::1", "not a valid URL"),
])
def test_bad_endpoints_are_refused(url, why):
    problem = endpoint_problem(url, allow_insecure=False)
    assert problem and why in problem
    assert "wJalrXUtnFEMIK7MDENG" not in problem and EXAMPLE_KEY_ID not in problem


def test_insecure_opt_in_by_env_and_by_cli_flag(monkeypatch):
    monkeypatch.delenv("SFM_ALLOW_INSECURE_S3", raising=False)
    monkeypatch.setenv("SFM_S3_ENDPOINT_URL", "http://s3.lab:9000")
    with pytest.raises(SFMError):
        storage.s3_endpoint_url()
    monkeypatch.setenv("SFM_ALLOW_INSECURE_S3", "1")
    assert storage.s3_endpoint_url() == "http://s3.lab:9000"
    monkeypatch.delenv("SFM_ALLOW_INSECURE_S3")
    from sfm.cli import main

    assert main(["--allow-insecure-s3", "iam-policy", "--data-root", "s3://acme-data/sfm"]) == 0
    assert os.environ["SFM_ALLOW_INSECURE_S3"] == "1" and storage.s3_endpoint_url() == "http://s3.lab:9000"
    assert is_loopback_host("127.0.0.53") and not is_loopback_host("127.0.0.1.evil.com")


def test_every_configured_endpoint_is_checked(monkeypatch):
    """Metaflow's own endpoint is checked too, even when sfm's points elsewhere."""
    monkeypatch.delenv("SFM_ALLOW_INSECURE_S3", raising=False)
    for name in storage.ENDPOINT_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SFM_S3_ENDPOINT_URL", "https://s3.example")
    assert storage.s3_endpoint_url() == "https://s3.example"
    monkeypatch.setenv("METAFLOW_S3_ENDPOINT_URL", "http://minio.lab:9000")
    with pytest.raises(SFMError, match=r"plain http .*\$METAFLOW_S3_ENDPOINT_URL"):
        storage.s3_endpoint_url()


# ---- credentials never in messages -----------------------------------------------------------------------

def test_redact_removes_every_kind_of_credential(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", TEST_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET_KEY)
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnop")
    text = (f"key {TEST_ACCESS_KEY} secret {TEST_SECRET_KEY} at https://user:pw0rd@host/x and "
            f"s3://{EXAMPLE_KEY_ID}:abc@bucket/k presigned https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA1"
            "&X-Amz-Signature=deadbeef&X-Amz-Security-Token=tok token hf_abcdefghijklmnop")
    clean = redact(text)
    for secret in (TEST_ACCESS_KEY, TEST_SECRET_KEY, "pw0rd", "user:", EXAMPLE_KEY_ID, "deadbeef", "=tok",
                   "hf_abcdefghijklmnop", "AKIA1"):
        assert secret not in clean, (secret, clean)
    assert "https://***@host/x" in clean and "s3://***@bucket/k" in clean
    assert redact("s3://bucket/data/surveys/abc.zarr 128 MB") == "s3://bucket/data/surveys/abc.zarr 128 MB"


def test_sfm_errors_and_storage_errors_carry_no_credentials(monkeypatch, no_network):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET_KEY)
    assert TEST_SECRET_KEY not in str(SFMError(f"failed with {TEST_SECRET_KEY}"))
    url = f"s3://{TEST_ACCESS_KEY}:{TEST_SECRET_KEY}@bucket/data"
    for call in (lambda: storage.normalize(url), lambda: storage.exists(f"{url}/x"), lambda: storage.zarr_store(url)):
        with pytest.raises(SFMError) as err:
            call()
        assert TEST_SECRET_KEY not in str(err.value) and TEST_ACCESS_KEY not in str(err.value)
        assert "carries credentials in the URL" in str(err.value) and "s3://***@bucket/data" in str(err.value)
    monkeypatch.setenv("SFM_S3_ENDPOINT_URL", f"https://{TEST_ACCESS_KEY}:{TEST_SECRET_KEY}@s3.example")
    with pytest.raises(SFMError) as err:
        storage.exists("s3://bucket/x")
    assert TEST_SECRET_KEY not in str(err.value) and "https://***@s3.example" in str(err.value)


# ---- outside names ------------------------------------------------------------------------------------------

BAD_NAMES = ["..", "../x", "..\\x", "a/b", "%2e%2e", "%2E%2e%2Fx", "%252e%252e", "．．", "a\nb", "a\x00b", "a\rb",
             "x\u202egpj.sgy", "\u2028", ".hidden", "", "a" * 201]
GOOD_NAMES = ["survey A.sgy", "Überfahrt – 3D (2019).sgy", "f3_v2-final.segy", "日本海.sgy", "100%.sgy", "a..b"]


def test_safe_join_refuses_names_that_could_leave_the_folder():
    for name in BAD_NAMES:
        assert name_problem(name), name
        with pytest.raises(SFMError, match="cannot be used in a storage path") as err:
            storage.safe_join("s3://bucket/data/quarantine", name, what="landing file name")
        assert "\n" not in str(err.value)
    for name in GOOD_NAMES:
        assert storage.safe_join("s3://bucket/data", name) == f"s3://bucket/data/{name}"
    with pytest.raises(SFMError, match="would leave"):
        storage.join("/data/root", "checkpoints/../../etc")
    assert storage.join("/data/root", "a..b/c") == "/data/root/a..b/c"


SEGY_FILES = ["small.sgy", "small-lsb.sgy", "f3.sgy", "Format1msb.sgy", "Format5lsb.sgy", "Format8msb.sgy"]


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _ingest_or_refuse(url: str, data_root: str) -> str:
    from sfm.ingest.survey import ingest_survey

    try:
        row = ingest_survey(url, data_root, chunk=32)
    except SFMError as err:
        assert "\n" not in str(err)
        return "refused"
    assert row["store_url"].startswith(f"{data_root}/surveys/") and row["survey_id"] in row["store_url"]
    return row["status"]


@pytest.mark.timeout(300)
def test_odd_landing_file_names_stay_inside_the_data_root_locally(tmp_path, segy_dir, monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    landing, data = tmp_path / "landing", tmp_path / "data"
    (landing / "sub").mkdir(parents=True)
    names = ["survey A ü.sgy", "%2e%2e%2f%2e%2e%2fescape.sgy", "line\nbreak.sgy", "..sgy", ".hidden.sgy"]
    urls = []
    for name, src in zip(names, SEGY_FILES):
        shutil.copyfile(segy_dir / src, landing / name)
        urls.append(str(landing / name))
    shutil.copyfile(segy_dir / SEGY_FILES[5], tmp_path / "outside.sgy")
    urls.append(str(landing / "sub" / ".." / ".." / "outside.sgy"))  # a source path that climbs: only read
    before = _tree(tmp_path)
    outcomes = [_ingest_or_refuse(url, str(data)) for url in urls]
    assert outcomes.count("ingested") >= 5, outcomes
    new = _tree(tmp_path) - before
    allowed = ("data", "data/surveys", "data/manifest")
    outside = [p for p in new if p not in allowed and not p.startswith(tuple(f"{a}/" for a in allowed[1:]))]
    assert not outside, outside
    assert not any(tmp.iterdir()), "temporary files were left behind"
    from sfm.formats import manifest

    rows = manifest.read(str(data))
    # the name is metadata only (paths come from the content hash), with control characters replaced:
    # a newline in a landing file's name must not forge a line in the flow's log
    assert "line_break" in set(rows["name"]) and not any("\n" in n for n in rows["name"])
    assert all(re.fullmatch(r"[0-9a-f]{16}", sid) for sid in rows["survey_id"])


@pytest.mark.timeout(300)
def test_odd_landing_object_names_stay_inside_the_data_root_on_s3(s3_env, segy_dir, tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    bucket = "sfm-odd-names"
    s3_env.make_bucket(bucket)
    client = s3_env.client()
    keys = ["data/landing/survey A ü.sgy", "data/landing/..%2f..%2fescape.sgy", "data/landing/%2e%2e/x.sgy",
            "data/landing/d/../../../zz/evil.sgy", "data/landing/..", "data/landing/x\u202egpj.sgy"]
    for key, src in zip(keys, SEGY_FILES):
        client.put_object(Bucket=bucket, Key=key, Body=(segy_dir / src).read_bytes())
    before = set(s3_env.keys(bucket))
    outcomes = [_ingest_or_refuse(f"s3://{bucket}/{key}", f"s3://{bucket}/data") for key in keys]
    assert outcomes.count("ingested") >= 3, outcomes
    new = set(s3_env.keys(bucket)) - before
    assert new and all(k.startswith(("data/surveys/", "data/manifest/")) for k in new), sorted(new)
    assert all(".." not in k.split("/") for k in new)
    assert not any(tmp.iterdir())

    client.put_object(Bucket=bucket, Key="data/landing/dir/../../../../escape.txt", Body=b"x")
    with pytest.raises(SFMError, match="outside"):
        storage.download(f"s3://{bucket}/data/landing/dir", tmp_path / "dl")
    assert not (tmp_path / "escape.txt").exists() and not Path("/escape.txt").exists()


def test_watcher_quarantine_keeps_odd_names_inside_the_data_root(tmp_path, segy_dir):
    from sfm.ops.watch import LandingFile, quarantine

    landing, data = tmp_path / "landing", tmp_path / "data"
    landing.mkdir()
    results = {}
    for name in ["ok name ü.sgy", "line\nbreak.sgy", "%2e%2e%2fx.sgy", "x\u202egpj.sgy"]:
        (landing / name).write_bytes(b"not segy")
        f = LandingFile(str(landing / name), name, 8, "stamp", survey_id="0123456789abcdef")
        try:
            results[name] = quarantine(str(data), f, "test")
        except SFMError as err:
            results[name] = f"refused: {err}"
    assert results["ok name ü.sgy"] == f"{data}/quarantine/0123456789abcdef-ok name ü.sgy"
    assert all(r.startswith(("refused", str(data))) for r in results.values()), results
    inside = {str(p.relative_to(tmp_path)).split("/")[0] for p in tmp_path.rglob("*")}
    assert inside <= {"landing", "data"}


# ---- weights never unpickle ----------------------------------------------------------------------------------

class _Payload:
    """Unpickling this runs code: it creates the file ``path`` (a harmless stand-in for an attack)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def _pickle_bytes(marker: Path) -> bytes:
    buf = io.BytesIO()
    torch.save({"optimizer": {"state": _Payload(str(marker))}, "scheduler": {}}, buf)
    return buf.getvalue()


def test_malicious_pickles_in_a_checkpoint_are_refused(tmp_path, caplog):
    from accelerate import PartialState

    from sfm.config import TrainConfig

    marker = tmp_path / "pwned"
    payload = _pickle_bytes(marker)
    torch.load(io.BytesIO(payload), weights_only=False)  # the payload is real: a plain unpickle runs it
    assert marker.exists()
    marker.unlink()

    root = str(tmp_path / "ckpt")
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for step in (1, 2):
        checkpoint.save(root, step, model.state_dict(), opt.state_dict(), sched.state_dict(), {}, keep=5)
    (tmp_path / "ckpt" / "step-000002" / "optimizer.pt").write_bytes(payload)
    with pytest.raises(Exception, match="(?i)weights.only|unpickl|global"):
        checkpoint.load(checkpoint.step_dir(root, 2), rank=0)
    checkpointer = checkpoint.Checkpointer(root, PartialState(cpu=True),
                                           checkpoint.StepState(model, model, opt, sched, sharded=False), TrainConfig())
    assert checkpointer.load() == checkpoint.step_dir(root, 1)
    assert "step-000002 is unreadable" in caplog.text
    assert not marker.exists()

    (tmp_path / "ckpt" / "step-000001" / "model.safetensors").write_bytes(payload)  # weights as a pickle
    with pytest.raises(Exception):
        checkpoint.load(checkpoint.step_dir(root, 1), rank=0)
    assert not marker.exists()


def test_exported_model_weights_load_only_from_safetensors(tmp_path):
    from sfm.model import build_model, mae_config
    from sfm.model.io import load, save

    model = build_model(mae_config("tiny"))
    save(model, str(tmp_path / "export"))
    assert load(str(tmp_path / "export")).cfg == model.cfg
    marker = tmp_path / "pwned"
    (tmp_path / "export" / "model.safetensors").write_bytes(_pickle_bytes(marker))
    with pytest.raises(Exception):
        load(str(tmp_path / "export"))
    assert not marker.exists()


_UNPICKLERS = {("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"), ("dill", "load"), ("dill", "loads"),
               ("cloudpickle", "load"), ("cloudpickle", "loads"), ("joblib", "load"), ("torch.jit", "load"),
               ("marshal", "loads"), ("shelve", "open")}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def test_no_code_path_unpickles_untrusted_bytes():
    """Every torch.load in sfm/ and flows/ passes weights_only=True; nothing else unpickles or allows pickles."""
    files = sorted((PROJECT / "sfm").rglob("*.py")) + sorted((PROJECT / "flows").glob("*.py"))
    problems, torch_loads = [], 0
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(PROJECT)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.ImportFrom) and node.module in ("pickle", "dill", "cloudpickle", "joblib"):
                if any(a.name in ("load", "loads", "Unpickler") for a in node.names):
                    problems.append(f"{where}: from {node.module} import load")
            if not isinstance(node, ast.Call):
                continue
            name = _dotted(node.func)
            module, _, attr = name.rpartition(".")
            keywords = {k.arg: k.value for k in node.keywords}
            if name == "torch.load":
                torch_loads += 1
                flag = keywords.get("weights_only")
                if not (isinstance(flag, ast.Constant) and flag.value is True):
                    problems.append(f"{where}: torch.load without weights_only=True")
            elif (module, attr) in _UNPICKLERS:
                problems.append(f"{where}: {name}")
            elif attr == "load" and module in ("np", "numpy"):
                flag = keywords.get("allow_pickle")
                if flag is not None and not (isinstance(flag, ast.Constant) and flag.value is False):
                    problems.append(f"{where}: {name} with allow_pickle")
    assert torch_loads >= 1, "the scan found no torch.load at all: it is not looking at the code"
    assert not problems, "\n".join(problems)
    # the same by text, for calls the AST walk cannot name (aliases, getattr)
    for path in files:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\btorch\.load\(", line):
                assert "weights_only=True" in line, f"{path}:{n}: {line.strip()}"
            assert not re.search(r"\b(pickle|dill|cloudpickle)\.loads?\(", line), f"{path}:{n}: {line.strip()}"


def test_plain_http_endpoint_in_the_aws_config_file_is_refused(monkeypatch, tmp_path):
    """boto3 and s3fs take endpoint_url from the AWS config file when no endpoint variable is set."""
    for name in storage.ENDPOINT_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("SFM_ALLOW_INSECURE_S3", raising=False)
    config = tmp_path / "config"
    config.write_text("[default]\nendpoint_url = https://s3.example.com\n"
                      "[profile lab]\nservices = lab-s3\n[services lab-s3]\ns3 =\n  endpoint_url = http://10.1.2.3:9000\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.delenv("AWS_DEFAULT_PROFILE", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    assert storage.s3_endpoint_url() is None  # https in the default profile: allowed
    monkeypatch.setenv("AWS_PROFILE", "lab")
    with pytest.raises(SFMError) as err:
        storage.s3_endpoint_url()
    assert str(err.value).startswith("S3 endpoint http://10.1.2.3:9000 is plain http on a non-loopback host")
    assert "AWS config file of profile lab" in str(err.value) and "\n" not in str(err.value)
    monkeypatch.setenv("SFM_ALLOW_INSECURE_S3", "1")  # the same opt-in as for the variables
    assert storage.s3_endpoint_url() is None
