"""Registered models as Hugging Face model folders (issue 56): `sfm registry export NAME:vN --format hf DIR` writes
a folder with a model card, `from_pretrained` opens it offline with the same outputs as the registry's model, the
card holds the version's metrics and lineage, and sfm's own loaders read the folder too; the model references
`sfm registry` takes (registry.resolve_reference)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sfm.errors import SFMError
from sfm.model import build_model, mae_config, registry
from sfm.model.io import save
from sfm.model.segmenter import Segmenter, Task, save_segmenter

pytestmark = pytest.mark.integration

ENCODER, TASK_MODEL = "sfm-mae", "sfm-faults"
ENCODER_METRICS = {"masked_nmse": 0.4375, "baseline_zero_nmse": 1.0, "ft_ap_gain_b1": 0.0625,
                   "ft_ap_gain_b4": 0.125, "ft_all_seeds_gain_b4": True, "downstream": {"recipe": {"budgets": [1, 4]}}}
TASK_METRICS = {"ap": 0.75, "f1": 0.5, "iou": 0.375, "threshold": 0.5, "threshold_chosen_on": "the validation labels"}


def lineage(tag: str, **more) -> dict:
    return {"run_pathspec": f"TestFlow/{tag}", "manifest_version": "m0-0", "code_version": "test",
            "surveys": [f"/data/surveys/{tag}-train.zarr"], "held_out_surveys": [f"/data/surveys/{tag}-held.zarr"],
            **more}


def sfm_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "sfm.cli", *args], capture_output=True, text=True, timeout=300,
                          env=env)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    """A registry with one encoder (sfm-mae v1) and one task model fine-tuned from it (sfm-faults v1)."""
    base = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    mae = build_model(mae_config("tiny", crop=(16, 16, 16), patch=(4, 4, 4)))
    save(mae, str(base / "mae"))
    net = Segmenter(mae, Task(head="unetr", width=4))
    save_segmenter(net, str(base / "net"))
    data = str(base / "data")
    registry.register(data, ENCODER, str(base / "mae"), config={"model": {"preset": "tiny"}},
                      metrics=ENCODER_METRICS, lineage=lineage("pretrain"))
    registry.register(data, TASK_MODEL, str(base / "net"), config={}, metrics=TASK_METRICS,
                      lineage=lineage("finetune", task="binary", encoder=f"{ENCODER}:v1",
                                      labels=[{"label_id": "faults-abc", "survey": "/data/surveys/ft-train.zarr",
                                               "role": "train"}]),
                      champion=registry.Champion("ap"))
    return data


_LOAD = r"""
import sys, torch
from safetensors.torch import save_file
from sfm.model.mae import MaskedAutoencoder3D
from sfm.model.segmenter import Segmenter
from sfm.errors import SFMError

kind, folder, out = sys.argv[1:]
torch.set_num_threads(1)  # as the reference: a convolution's sums depend on how the threads split them
torch.manual_seed(1)
x = torch.randn(2, 1, 16, 16, 16)
model = (Segmenter if kind == "task" else MaskedAutoencoder3D).from_pretrained(folder)
with torch.no_grad():
    if kind == "task":
        outputs = {"logits": model(x)}
    else:
        _, pred, _ = model(x, noise=torch.rand(2, 64, generator=torch.Generator().manual_seed(2)))
        outputs = {"features": model.encode(x), "pred": pred}
save_file({k: v.contiguous() for k, v in outputs.items()}, out)
print("HUB-IMPORTED" if "huggingface_hub" in sys.modules else "TORCH-ONLY")
try:
    MaskedAutoencoder3D.from_pretrained("sfm-test/not-a-cached-repo")
except SFMError as err:
    print("REPO-ERROR " + str(err))
"""


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Equal tensors, over what a folder holds (a task model's MAE reconstruction decoder is not exported)."""
    from sfm.model.segmenter import DECODER_KEYS

    ours, theirs = a.state_dict(), b.state_dict()
    exported = [k for k in ours if not (isinstance(a, Segmenter) and k.startswith(DECODER_KEYS))]
    return ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in exported)


def reference_outputs(model, kind: str) -> dict[str, torch.Tensor]:
    """What _LOAD computes, from the model the registry loads, on one thread as _LOAD does."""
    torch.manual_seed(1)
    x = torch.randn(2, 1, 16, 16, 16)
    model.eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            if kind == "task":
                return {"logits": model(x)}
            _, pred, _ = model(x, noise=torch.rand(2, 64, generator=torch.Generator().manual_seed(2)))
            return {"features": model.encode(x), "pred": pred}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name,kind", [(ENCODER, "encoder"), (TASK_MODEL, "task")])
def test_export_hf_then_from_pretrained_gives_the_registered_model(root, tmp_path, name, kind):
    folder = tmp_path / "hf"
    proc = sfm_cli("registry", "export", f"{name}:v1", str(folder), "--format", "hf", "--data-root", root)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["files"] == ["README.md", "config.json", "model.safetensors"]
    assert "from_pretrained" in proc.stderr

    out = tmp_path / "outputs.safetensors"
    loaded = subprocess.run([sys.executable, "-c", _LOAD, kind, str(folder), str(out)], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert loaded.returncode == 0, loaded.stderr
    assert "TORCH-ONLY" in loaded.stdout  # a local folder is read without huggingface_hub: offline, torch alone
    assert "REPO-ERROR sfm-test/not-a-cached-repo is neither a model folder here nor a Hub repo" in loaded.stdout
    theirs = load_file(out)
    ours = reference_outputs(registry.load(root, name, 1), kind)
    assert theirs.keys() == ours.keys()
    for key in ours:
        assert torch.equal(theirs[key], ours[key]), key  # identical, not close

    # sfm's own loaders read the folder, and save_pretrained writes the same weights back
    from sfm.model.io import load
    from sfm.model.segmenter import load_segmenter

    model = (load_segmenter if kind == "task" else load)(str(folder))
    assert same_weights(model, registry.load(root, name, 1))
    again = tmp_path / "again"
    model.save_pretrained(again)
    assert (again / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    assert (again / "README.md").read_text().startswith("---\n")  # a card made from the config alone


def test_the_model_card_holds_the_metrics_and_lineage(root, tmp_path):
    from huggingface_hub import ModelCard

    registry.export(root, ENCODER, 1, str(tmp_path / "mae"))
    registry.export(root, TASK_MODEL, 1, str(tmp_path / "net"))
    card = ModelCard.load(tmp_path / "mae" / "README.md")  # the Hub's own parser: valid metadata
    data = card.data.to_dict()
    assert data["library_name"] == "sfm" and data["pipeline_tag"] == "image-feature-extraction"
    results = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert results["masked_nmse"] == 0.4375 and results["ft_ap_gain_b1"] == 0.0625
    assert results["ft_ap_gain_b4"] == 0.125 and results["ft_all_seeds_gain_b4"] == 1.0
    assert data["sfm"]["version"] == 1 and data["sfm"]["lineage"] == lineage("pretrain")
    assert data["sfm"]["architecture"]["depth"] == mae_config("tiny", crop=(16, 16, 16), patch=(4, 4, 4)).depth
    text = card.text
    assert "label efficiency" in text and "pretrain-train.zarr" in text and "pretrain-held.zarr" in text
    assert "TestFlow/pretrain" in text and "Intended use and limits" in text
    assert "MaskedAutoencoder3D.from_pretrained" in text

    task = ModelCard.load(tmp_path / "net" / "README.md")
    assert task.data.pipeline_tag == "image-segmentation"
    assert {r.metric_type: r.metric_value for r in task.data.eval_results}["ap"] == 0.75
    assert task.data.to_dict()["sfm"]["task"]["head"] == "unetr"
    assert "encoder: `sfm-mae:v1`" in task.text and "faults-abc" in task.text
    assert "Segmenter.from_pretrained" in task.text
    assert (tmp_path / "mae" / "README.md").read_bytes() == registry.RegisteredModel(root, ENCODER).folder(1)[
        "README.md"]  # the same card every time


def test_export_files_is_byte_for_byte(root, tmp_path):
    proc = sfm_cli("registry", "export", f"{ENCODER}:latest", str(tmp_path / "files"), "--format", "files",
                   "--data-root", root)
    assert proc.returncode == 0, proc.stderr
    version = Path(registry.version_url(root, ENCODER, 1))
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "files" / name).read_bytes() == (version / name).read_bytes()
    assert not (tmp_path / "files" / "README.md").exists()
    bad = sfm_cli("registry", "export", f"{ENCODER}:v7", str(tmp_path / "x"), "--data-root", root)
    assert bad.returncode == 2 and "no version v7" in bad.stderr and "Traceback" not in bad.stderr


def test_a_registry_version_folder_opens_with_from_pretrained(root):
    """The version folder itself is a Hugging Face folder but for the card."""
    from sfm.model.mae import MaskedAutoencoder3D

    model = MaskedAutoencoder3D.from_pretrained(registry.version_url(root, ENCODER, 1))
    assert same_weights(model, registry.load(root, ENCODER, 1))
    with pytest.raises(SFMError, match="is a task model, not an encoder"):
        MaskedAutoencoder3D.from_pretrained(registry.version_url(root, TASK_MODEL, 1))


def test_model_references(root):
    assert registry.resolve_reference(root, ENCODER) == (ENCODER, 1)  # NAME: its champion
    for ref in (f"{ENCODER}:v1", f"{ENCODER}:1", f"{ENCODER}:latest", f"{ENCODER}:champion"):
        assert registry.resolve_reference(root, ref) == (ENCODER, 1), ref
    assert registry.resolve_reference(root, "v1", default_model=TASK_MODEL) == (TASK_MODEL, 1)
    assert registry.resolve_reference(root, "champion", default_model=ENCODER) == (ENCODER, 1)
    for ref, message in (("sfm-none:v1", "not in the registry"), (f"{ENCODER}:v2", "no version v2"),
                         (f"{ENCODER}:vx", "is not a version"), (f"{ENCODER}:", "not a model reference"),
                         ("./models/mae", "not a model reference"), ("s3://b/registry/sfm-mae/v1", "not a model"),
                         (f"{ENCODER}:v1:v2", "not a model reference"), ("", "not a model reference")):
        with pytest.raises(SFMError, match=message):
            registry.resolve_reference(root, ref)
    assert registry.is_folder_url("s3://b/x") and registry.is_folder_url("./m") and not registry.is_folder_url("m:v1")
