"""The model registry: concurrent registrations, the champion margin rule, `sfm registry` round trips."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sfm import storage
from sfm.model import registry
from sfm.errors import SFMError
from sfm.model import build_model, mae_config
from sfm.model.io import load, save

MODEL = "m"


def export_model(url: str, seed: int):
    torch.manual_seed(seed)
    model = build_model(mae_config("tiny", crop=(16, 16, 16), patch=(4, 4, 4)))
    save(model, url)
    return model


def lineage(tag: str) -> dict:
    return {"run_pathspec": f"TestFlow/{tag}", "manifest_version": "m0-0", "code_version": "test",
            "surveys": [], "held_out_surveys": []}


_CHILD = r"""
import json, sys, time
from sfm.model import registry
start_at, root, model, url, nmse, tag = json.loads(sys.argv[1])
time.sleep(max(0.0, start_at - time.time()))  # every child starts registering at the same moment
lineage = {"run_pathspec": f"TestFlow/{tag}", "manifest_version": "m0-0", "code_version": "test",
           "surveys": [], "held_out_surveys": []}
record = registry.register(root, model, url, config={"tag": tag}, metrics={"masked_nmse": nmse}, lineage=lineage)
print("RESULT " + json.dumps({"version": record["version"], "champion": record["champion"], "tag": tag}))
"""


def _race(root: str, sources: list[tuple[str, float, str]]) -> list[dict]:
    """Register every source from its own process, all at once; returns each process's result."""
    start_at = time.time() + 8.0  # time for the interpreters to start (a loaded machine is slow)
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps([start_at, root, MODEL, url, nmse, tag])],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for url, nmse, tag in sources]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        results += [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    return results


def _check_race(root: str, sources: list[tuple[str, float, str]], results: list[dict]) -> None:
    n = len(sources)
    assert sorted(r["version"] for r in results) == list(range(1, n + 1)), results  # distinct, no gaps
    assert registry.versions(root, MODEL) == list(range(1, n + 1))
    by_tag = {tag: (url, nmse) for url, nmse, tag in sources}
    for r in results:  # every version holds exactly the weights its registrant sent: nothing lost or mixed
        record = registry.get(root, MODEL, r["version"])
        url, nmse = by_tag[record["config"]["tag"]]
        assert record["lineage"]["run_pathspec"] == f"TestFlow/{r['tag']}" and record["metrics"]["masked_nmse"] == nmse
        sent = hashlib.sha256(storage.read_bytes(storage.join(url, "model.safetensors"))).hexdigest()
        assert record["files"]["model.safetensors"]["sha256"] == sent
        assert registry.verified_files(root, MODEL, r["version"])  # the stored bytes match the record
    best = min(sources, key=lambda s: s[1])[2]
    champion = registry.get(root, MODEL, "champion")
    assert champion["config"]["tag"] == best  # whatever the interleaving, the best one ends up champion
    values = [e["value"] for e in registry.champion_history(root, MODEL)]
    assert values == sorted(values, reverse=True) and len(set(values)) == len(values)  # only ever improved


def _sources(base: str, n: int) -> list[tuple[str, float, str]]:
    out = []
    for i in range(n):
        url = storage.join(base, "exports", f"model-{i}")
        export_model(url, seed=i)
        out.append((url, 0.9 - 0.1 * ((i * (n - 1) + 1) % n), f"r{i}"))  # distinct metrics, the best is not last
    return out


@pytest.mark.timeout(300)
def test_concurrent_registrations_local(tmp_path):
    root = str(tmp_path / "data")
    sources = _sources(root, 6)
    _check_race(root, sources, _race(root, sources))


@pytest.mark.timeout(300)
def test_concurrent_registrations_on_s3(s3_env):
    root = s3_env.make_bucket("sfm-registry-race") + "/data"
    sources = _sources(root, 4)
    _check_race(root, sources, _race(root, sources))
    keys = s3_env.keys("sfm-registry-race", "data/registry/")
    assert sum(k.endswith("/version.json") for k in keys) == 4


def test_champion_follows_the_margin_rule(tmp_path):
    root = str(tmp_path)
    export = str(tmp_path / "export")
    export_model(export, seed=0)
    margin = 0.125  # values chosen exact in binary: the boundary case is decided by the rule, not rounding

    def reg(nmse):
        return registry.register(root, MODEL, export, config={}, metrics={"masked_nmse": nmse}, lineage=lineage("x"),
                                 champion=registry.Champion(margin=margin))

    assert reg(0.5)["champion"]  # the first version is champion: there is none to beat
    assert not reg(0.4375)["champion"]  # better, but by less than the margin
    assert reg(0.375)["champion"]  # better by exactly the margin
    assert not reg(0.3125)["champion"]  # better by 0.0625 < margin
    assert registry.champion_version(root, MODEL) == 3
    rule = registry.Champion(margin=margin)
    assert not registry.maybe_promote(root, MODEL, 2, champion=rule)  # worse than the champion
    assert registry.maybe_promote(root, MODEL, 2, force=True)  # forced: a person decided
    assert registry.champion_version(root, MODEL) == 2
    history = registry.champion_history(root, MODEL)
    assert [(e["version"], e["forced"], e["previous"]) for e in history] == [
        (1, False, None), (3, False, 1), (2, True, 3)]
    with pytest.raises(SFMError, match="no champion"):
        registry.get(str(tmp_path / "empty"), MODEL, "champion")


def test_a_downstream_gain_as_champion_metric_is_higher_is_better(tmp_path):
    """[registry] champion_metric = ft_ap_gain_b4: the larger gain wins; a champion without the metric (an
    encoder registered before it was chosen) loses to a version that has it."""
    from sfm.config import JobConfig

    root, export = str(tmp_path), str(tmp_path / "export")
    export_model(export, seed=0)
    rule = registry.Champion.of(JobConfig.from_toml(None, ["registry.champion_metric=ft_ap_gain_b4",
                                                           "registry.margin=0.125"]).registry)  # exact in binary
    assert not rule.lower_is_better and registry.Champion().lower_is_better

    def reg(metrics):
        return registry.register(root, MODEL, export, config={}, metrics=metrics, lineage=lineage("x"), champion=rule)

    registry.register(root, MODEL, export, config={}, metrics={"masked_nmse": 0.5}, lineage=lineage("x"))  # before
    assert reg({"masked_nmse": 0.6, "ft_ap_gain_b4": 0.25})["champion"]  # the champion lacks the metric
    assert not reg({"masked_nmse": 0.4, "ft_ap_gain_b4": 0.3125})["champion"]  # larger, by less than the margin
    assert reg({"masked_nmse": 0.7, "ft_ap_gain_b4": 0.375})["champion"]  # larger by the margin: worse NMSE is no matter
    assert [e["metric"] for e in registry.champion_history(root, MODEL)] == ["masked_nmse"] + ["ft_ap_gain_b4"] * 2
    with pytest.raises(SFMError, match="has no ft_ap_gain_b4"):
        reg({"masked_nmse": 0.1})


def sfm_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sfm.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_registry_cli_load_round_trips_the_weights(tmp_path):
    root = str(tmp_path / "data")
    exports = [str(tmp_path / f"export-{i}") for i in range(2)]
    originals = [export_model(url, seed=10 + i) for i, url in enumerate(exports)]
    for i, url in enumerate(exports):
        registry.register(root, MODEL, url, config={"i": i}, metrics={"masked_nmse": 0.5 - 0.1 * i},
                          lineage=lineage(f"r{i}"))

    listed = [json.loads(line) for line in sfm_cli("registry", "list", MODEL, "--data-root", root)
              .stdout.splitlines()]
    assert [(v["version"], v["champion"]) for v in listed] == [(1, False), (2, True)]
    listing = ("import sys; from sfm.cli import main; sys.argv = ['sfm', 'registry', 'list', '--data-root', sys.argv[1]]; "
               "main(); print('torch' in sys.modules)")  # reading records needs no torch: a quick listing
    proc = subprocess.run([sys.executable, "-c", listing, root], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "False", proc.stdout + proc.stderr
    shown = json.loads(sfm_cli("registry", "show", MODEL, "--data-root", root).stdout)
    assert shown["version"] == 2 and shown["champion"] is True

    out = tmp_path / "loaded"
    proc = sfm_cli("registry", "load", f"{MODEL}:v1", "--data-root", root, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["version"] == 1
    loaded = load(str(out)).state_dict()
    expected = originals[0].state_dict()
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    assert (out / "model.safetensors").read_bytes() == (Path(exports[0]) / "model.safetensors").read_bytes()
    assert torch.equal(registry.load(root, MODEL, "latest").state_dict()["cls_token"], originals[1].cls_token.detach())

    proc = sfm_cli("registry", "promote", f"{MODEL}:1", "--data-root", root)
    assert proc.returncode == 0 and registry.champion_version(root, MODEL) == 1

    # damaged weights are refused with one line, not loaded
    weights = Path(registry.version_url(root, MODEL, 2)) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    proc = sfm_cli("registry", "load", f"{MODEL}:v2", "--data-root", root)
    assert proc.returncode == 2 and "does not match its registry record" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    for bad in (f"{MODEL}:v7", "../x", "sfm-nothing"):
        proc = sfm_cli("registry", "show", bad, "--data-root", root)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    with pytest.raises(SFMError, match="not a version"):
        registry.resolve(root, MODEL, "seven")
