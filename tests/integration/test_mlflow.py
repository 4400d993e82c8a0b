"""The registry mirrored to a real `mlflow server` (issue 56): the demo flow's register step logs its version (a
run with the metrics, the config and the lineage, the model files, a registered model version, the champion alias);
a better registration and `sfm registry promote` move the alias; an unreachable MLflow costs one line, never the
registration, and `sfm registry sync` catches up; no credential reaches MLflow."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.flowrun import client_view, fast_job_toml, run_flow
from support.mlflow_server import MLflowServer

from conftest import free_port
from sfm.model import build_model, mae_config, registry

pytestmark = [pytest.mark.integration, pytest.mark.long(2)]

MODEL = "sfm-mae"
SECRET = "sfm-mlflow-secret-0001"  # MLflow's password variable: must reach no param, tag, artifact or log line


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server = MLflowServer(tmp_path_factory.mktemp("mlflow"))
    print(f"mlflow server up in {server.started_s:.1f}s")
    yield server
    server.stop()


def sfm_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sfm.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def versions_by_sfm_version(client) -> dict[int, str]:
    """{registry version: MLflow model version} of the registered model."""
    return {int(v.tags["sfm.version"]): v.version for v in client.search_model_versions(f"name = '{MODEL}'")}


def champion_alias(client) -> int:
    """The registry version MLflow's champion alias points at."""
    return int(client.get_model_version_by_alias(MODEL, "champion").tags["sfm.version"])


def everything_logged(client, run) -> str:
    """Every param, tag and artifact byte of a run, as text, for the secret scan."""
    texts = [json.dumps(run.data.params), json.dumps(run.data.tags)]
    for name in ("config.json", "README.md", "version.json"):
        texts.append(Path(client.download_artifacts(run.info.run_id, f"model/{name}")).read_text())
    return "\n".join(texts)


@pytest.mark.timeout(900)
def test_the_flow_registers_into_mlflow_and_the_alias_follows_the_champion(tmp_path, metaflow_env, mlflow_server):
    client = mlflow_server.client()
    config = tmp_path / "job.toml"
    config.write_text(fast_job_toml(train={"max_steps": 2}, registry={"mlflow_uri": mlflow_server.uri}))
    data_root = tmp_path / "data"
    credentials = {"MLFLOW_TRACKING_USERNAME": "sfm", "MLFLOW_TRACKING_PASSWORD": SECRET}  # a server without auth
    result = run_flow({**metaflow_env, **credentials}, top_level={"config": [("config", str(config))]},
                      cwd=str(tmp_path), data_root=str(data_root))
    assert result.status == "successful", result.stderr[-4000:]
    output = result.stdout + result.stderr
    assert f"sfm mlflow: {MODEL} v1 is run " in output and "alias champion -> model version 1 (v1)" in output
    assert SECRET not in output

    # the run: metrics, config as params, lineage as tags, the model files as artifacts
    root = client_view(result.pathspec, metaflow_env, cwd=str(tmp_path))["root"]
    record = registry.get(root, MODEL, 1)
    experiment = client.get_experiment_by_name(MODEL)
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == f"{MODEL}-v1" and run.info.status == "FINISHED"
    assert run.data.metrics["masked_nmse"] == record["metrics"]["masked_nmse"]
    assert run.data.metrics["baseline_zero_nmse"] == record["metrics"]["baseline_zero_nmse"]
    assert run.data.params["train.max_steps"] == "2" and run.data.params["registry.model_name"] == MODEL
    assert "registry.mlflow_uri" not in run.data.params  # a URI is no parameter (it could carry a token)
    tags = run.data.tags
    assert tags["sfm.version"] == "1" and tags["sfm.kind"] == "encoder"
    assert tags["sfm.lineage.run_pathspec"] == result.pathspec
    assert json.loads(tags["sfm.lineage.surveys"]) == record["lineage"]["surveys"]
    artifacts = {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "model")}
    assert artifacts == {"model.safetensors", "config.json", "README.md", "version.json"}
    weights = Path(client.download_artifacts(run.info.run_id, "model/model.safetensors")).read_bytes()
    assert hashlib.sha256(weights).hexdigest() == record["files"]["model.safetensors"]["sha256"]
    assert SECRET not in everything_logged(client, run)

    # the registered model version, and the alias on it
    assert versions_by_sfm_version(client) == {1: "1"} and champion_alias(client) == 1

    # a better version becomes champion: the alias moves; a worse one leaves it
    better = dict(record["metrics"], masked_nmse=record["metrics"]["masked_nmse"] / 2)
    v1_folder = registry.version_url(root, MODEL, 1)
    second = registry.register(root, MODEL, v1_folder, config=record["config"], metrics=better,
                               lineage=dict(record["lineage"], run_pathspec="Manual/2"))
    assert second["version"] == 2 and second["champion"] and second["mlflow"]["champion"] == (2, "2")
    worse = dict(record["metrics"], masked_nmse=record["metrics"]["masked_nmse"] * 2)
    third = registry.register(root, MODEL, v1_folder, config=record["config"], metrics=worse,
                              lineage=dict(record["lineage"], run_pathspec="Manual/3"))
    assert not third["champion"]
    assert versions_by_sfm_version(client) == {1: "1", 2: "2", 3: "3"} and champion_alias(client) == 2

    # a person promotes v1 back: the alias follows
    promoted = sfm_cli("registry", "promote", f"{MODEL}:v1", "--data-root", root)
    assert promoted.returncode == 0, promoted.stderr
    assert champion_alias(client) == 1 and registry.champion_version(root, MODEL) == 1
    assert len(client.search_runs([experiment.experiment_id])) == 3  # nothing logged twice


def export_model(url: str) -> None:
    from sfm.model.io import save

    torch.manual_seed(0)
    save(build_model(mae_config("tiny", crop=(16, 16, 16), patch=(4, 4, 4))), url)


def lineage(tag: str) -> dict:
    return {"run_pathspec": f"TestFlow/{tag}", "manifest_version": "m0-0", "code_version": "test",
            "surveys": [], "held_out_surveys": []}


def test_an_unreachable_mlflow_costs_one_line_and_sync_catches_up(tmp_path, capsys, mlflow_server):
    root, export = str(tmp_path / "data"), str(tmp_path / "export")
    export_model(export)
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    config = {"registry": {"mlflow_uri": down}}
    record = registry.register(root, "sfm-offline", export, config=config, metrics={"masked_nmse": 0.5},
                               lineage=lineage("down"))
    assert record["version"] == 1 and record["champion"]  # registered, champion: MLflow changed nothing
    assert registry.versions(root, "sfm-offline") == [1] and registry.champion_version(root, "sfm-offline") == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("sfm mlflow: sfm-offline v1 is registered, but MLflow at " + down + " was not updated")
    assert lines[0].endswith("once it is reachable: sfm registry sync sfm-offline:v1")

    # once MLflow is there, `sfm registry sync` logs the version and the alias
    synced = sfm_cli("registry", "sync", "sfm-offline:v1", "--data-root", root, "--mlflow-uri", mlflow_server.uri)
    assert synced.returncode == 0, synced.stderr
    assert "sfm mlflow: sfm-offline v1 is run" in synced.stdout
    client = mlflow_server.client()
    assert client.get_model_version_by_alias("sfm-offline", "champion").tags["sfm.version"] == "1"
    again = sfm_cli("registry", "sync", "sfm-offline:v1", "--data-root", root, "--mlflow-uri", mlflow_server.uri)
    assert again.returncode == 0 and len(client.search_model_versions("name = 'sfm-offline'")) == 1  # idempotent
    with_password = down.replace("http://", f"http://sfm:{SECRET}@")
    refused = sfm_cli("registry", "sync", "sfm-offline:v1", "--data-root", root, "--mlflow-uri", with_password)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert f"MLflow at http://***@127.0.0.1:{down.rpartition(':')[2]} was not updated" in refused.stderr
    assert SECRET not in refused.stderr + refused.stdout


def test_a_tracking_uri_with_credentials_is_refused():
    """The job config travels (flow artifacts, the model's config.json, the registry's records): no credential in it."""
    from sfm.config import JobConfig
    from sfm.errors import SFMError

    for uri in (f"https://sfm:{SECRET}@mlflow.example:5000", f"https://mlflow.example/?token={SECRET}"):
        with pytest.raises(SFMError, match="carries credentials") as err:
            JobConfig.from_dict({"registry": {"mlflow_uri": uri}}).validate()
        assert SECRET not in str(err.value)
    JobConfig.from_dict({"registry": {"mlflow_uri": "https://mlflow.example:5000"}}).validate()


_WITHOUT_MLFLOW = r"""
import sys
sys.modules["mlflow"] = None  # as where the mlflow extra is not installed
from sfm.model import registry
root, export = sys.argv[1:]
record = registry.register(root, "sfm-noclient", export, config={}, metrics={"masked_nmse": 0.5},
                           lineage={"run_pathspec": "T/1", "manifest_version": "m", "code_version": "t", "surveys": []})
print("REGISTERED", record["version"])
"""


def test_without_the_mlflow_client_the_registration_stands(tmp_path):
    export = str(tmp_path / "export")
    export_model(export)
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_MLFLOW, str(tmp_path / "data"), export], text=True,
                          capture_output=True, timeout=300, env={**os.environ, "MLFLOW_TRACKING_URI": "http://x"})
    assert proc.returncode == 0, proc.stderr
    assert "REGISTERED 1" in proc.stdout
    assert proc.stderr.strip() == ("sfm mlflow: sfm-noclient v1 is registered, but MLflow at http://x was not updated: "
                                   "the MLflow client is not installed; pip install 'sfm[mlflow]', then: sfm registry "
                                   "sync sfm-noclient:v1")
