"""Task models (sfm.model.segmenter): every head's shapes (the U-Net without an encoder), the linear head as
the evaluation's per-token head, the encoder's multi-depth features, and the export round trip."""

from __future__ import annotations

import json

import pytest
import torch

from sfm.errors import SFMError
from sfm.model import mae_config, save
from sfm.model.mae import MaskedAutoencoder3D
from sfm.model.segmenter import HEADS, Segmenter, Task, default_taps, load_segmenter, save_segmenter, voxels

CFG = dict(crop=(16, 16, 32), patch=(4, 4, 8))


def mae(seed: int = 0) -> MaskedAutoencoder3D:
    torch.manual_seed(seed)
    return MaskedAutoencoder3D(mae_config("tiny", **CFG))


def segmenter(head: str, task: str = "binary", seed: int = 0, **settings) -> Segmenter:
    """A task model with ``head``: over the tiny encoder, or (the unet) on its own at the encoder's crop."""
    t = Task.parse(task, head=head, **settings)
    if HEADS[head].reads_encoder:
        return Segmenter(mae(seed), t)
    torch.manual_seed(seed)
    return Segmenter(None, t, crop=CFG["crop"])


@pytest.mark.parametrize("head", ["linear", "unetr", "unet"])
@pytest.mark.parametrize("task", ["binary", "classes:3"])
def test_every_head_maps_crops_to_per_voxel_logits(head, task):
    net = segmenter(head, task, width=4)
    imgs = torch.randn(2, 1, 16, 16, 32)
    logits = net(imgs)
    assert logits.shape == (2, 1 if task == "binary" else 3, 16, 16, 32)
    assert net.crop == (16, 16, 32)
    probs = net.probabilities(logits)
    if task != "binary":
        torch.testing.assert_close(probs.sum(dim=1), torch.ones(2, 16, 16, 32))
    logits.square().mean().backward()  # the head and every encoder block it reads get gradients
    assert all(p.grad is not None for p in net.head.parameters())
    if head != "unet":
        assert net.mae.blocks[0].attn.qkv.weight.grad.abs().sum() > 0
    assert net(torch.randn(1, 1, 32, 16, 32)).shape[2:] == (32, 16, 32)  # any size divisible by the patch


def test_the_unet_head_is_faultseg3d_sized_and_stands_without_an_encoder():
    net = segmenter("unet")
    assert net.mae is None and net.head.unet.widths == (16, 32, 64)
    assert 350_000 < sum(p.numel() for p in net.parameters()) < 356_000  # two 3x3x3 convolutions per level
    with pytest.raises(ValueError, match="network of its own"):
        Segmenter(mae(), Task(head="unet"))
    with pytest.raises(ValueError, match="reads an encoder"):
        Segmenter(None, Task(head="linear"), crop=(16, 16, 32))
    with pytest.raises(ValueError, match="multiple of 4"):
        Segmenter(None, Task(head="unet"), crop=(16, 18, 32))


def test_the_linear_head_puts_each_tokens_voxels_back_where_patchify_took_them():
    """A head that copies the patch's own voxels (tokens = patchify(imgs)) must give the input back."""
    net = Segmenter(mae())
    imgs = torch.randn(2, 1, 16, 16, 32)
    patches = net.mae.patchify(imgs)
    torch.testing.assert_close(voxels(patches, net.mae.grid_shape(imgs), net.head.patch), imgs, rtol=0, atol=0)


def test_encode_blocks_reads_the_encoder_at_several_depths():
    model = mae()
    model.eval()
    imgs = torch.randn(2, 1, 16, 16, 32)
    feats = model.encode_blocks(imgs, (1, 2))
    assert [f.shape for f in feats] == [(2, 64, 96)] * 2
    torch.testing.assert_close(feats[-1], model.encode(imgs))  # the last block after the final norm
    assert not torch.allclose(feats[0], feats[1])
    with pytest.raises(ValueError, match="taps"):
        model.encode_blocks(imgs, (2, 1))
    assert default_taps(12) == (3, 6, 9, 12) and default_taps(4) == (1, 2, 3, 4) and default_taps(2) == (1, 2)


@pytest.mark.parametrize("head", ["linear", "unetr", "unet"])
def test_an_exported_task_model_loads_back_identical_without_the_reconstruction_decoder(tmp_path, head):
    net = segmenter(head, "classes:4", ignore=200).eval()
    with torch.no_grad():  # a trained look: nothing at its initial value
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    save_segmenter(net, str(tmp_path / "m"), {"lineage": {"encoder": "x"}})
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["task"]["kind"] == "classes" and config["task"]["classes"] == 4 and config["task"]["head"] == head
    assert config["task"]["ignore"] == 200 and config["lineage"] == {"encoder": "x"} and config["crop"] == [16, 16, 32]
    assert (config["model"] is None) == (head == "unet")
    from safetensors.torch import load_file

    assert not any(k.startswith("mae.decoder") for k in load_file(tmp_path / "m" / "model.safetensors"))
    back = load_segmenter(str(tmp_path / "m"))
    assert back.task == net.task and back.crop == net.crop
    imgs = torch.randn(1, 1, 16, 16, 32)
    with torch.no_grad():
        torch.testing.assert_close(back(imgs), net(imgs), rtol=0, atol=0)
        torch.testing.assert_close(Segmenter.from_pretrained(str(tmp_path / "m"))(imgs), net(imgs), rtol=0, atol=0)


def test_an_encoder_export_is_not_a_task_model(tmp_path):
    save(mae(), str(tmp_path / "enc"))
    with pytest.raises(SFMError, match="not a task model"):
        load_segmenter(str(tmp_path / "enc"))


def test_tasks_parse_and_refuse_what_is_not_one():
    assert Task.parse("binary").channels == 1 and Task.parse("classes:5").channels == 5
    assert Task.parse("classes:5").name == "classes:5" and Task.from_dict(Task.parse("binary").to_dict()) == Task()
    for bad in ("binary:2", "classes", "classes:x", "faults"):
        with pytest.raises(ValueError, match="not a task"):
            Task.parse(bad)
    with pytest.raises(ValueError, match="head"):
        Task(head="mlp")
    with pytest.raises(ValueError, match="ignore"):
        Task.parse("classes:4", ignore=3)
