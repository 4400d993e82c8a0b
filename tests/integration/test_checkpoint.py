"""sfm.train.checkpoint: complete-or-invisible checkpoints, keep-last-K, fallback past unreadable ones;
on local disk and on an S3 server (moto_server over HTTP)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from sfm import storage
from sfm.train import checkpoint


def _write(root: str, step: int, keep: int = 2, value: float | None = None) -> dict:
    """A checkpoint whose tensors all hold ``value`` (default: the step), as the training loop writes it."""
    value = float(step if value is None else value)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    checkpoint.begin(root, step)
    checkpoint.save_rank_rng(root, step, rank=0)
    checkpoint.save(root, step, model.state_dict(), opt.state_dict(), sched.state_dict(),
                    {"data": {"step": step}, "history": [{"step": step, "loss": 1.0}]}, keep=keep)
    return model.state_dict()


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "ckpt")
    s3 = request.getfixturevalue("s3_env")
    bucket = f"ckpt-{random.randrange(1 << 30)}"
    return storage.join(s3.make_bucket(bucket), "run", "ckpt")


def test_round_trip_restores_everything(root):
    written = _write(root, 10)
    torch.manual_seed(123)
    np.random.seed(5)
    random.seed(9)
    checkpoint.save_rank_rng(root, 10, rank=0)  # the RNG state as of now
    expected = (torch.rand(3), np.random.rand(3), random.random())

    ckpt = checkpoint.load_latest(root, rank=0)
    assert ckpt["url"] == checkpoint.step_dir(root, 10)
    assert ckpt["state"]["step"] == 10 and ckpt["state"]["data"] == {"step": 10}
    for k, v in written.items():
        assert torch.equal(ckpt["model"][k], v)
    assert ckpt["optimizer"]["state"][0]["step"] == 1
    assert "base_lrs" in ckpt["scheduler"]
    checkpoint.set_rng_state(ckpt["rng"])
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1]) and got[2] == expected[2]


def test_keeps_the_newest_k(root):
    for step in (10, 20, 30, 40):
        _write(root, step, keep=2)
    assert checkpoint.complete_steps(root) == [30, 40]
    assert checkpoint.all_steps(root) == [30, 40]


def test_incomplete_checkpoint_is_invisible_and_pruned(root):
    _write(root, 10)
    # a save killed before its marker: RNG and weights there, no state.json
    checkpoint.save_rank_rng(root, 20, rank=0)
    storage.write_bytes(storage.join(checkpoint.step_dir(root, 20), "model.safetensors"), b"partial")
    assert checkpoint.complete_steps(root) == [10]
    assert checkpoint.load_latest(root, rank=0)["state"]["step"] == 10
    _write(root, 30)  # the next save clears the leftover
    assert checkpoint.all_steps(root) == [10, 30]


@pytest.mark.parametrize("part", ["model.safetensors", "optimizer.pt", "rng-rank0.pt", "state.json"])
def test_unreadable_latest_falls_back_with_a_warning(root, part):
    _write(root, 10)
    _write(root, 20)
    url = storage.join(checkpoint.step_dir(root, 20), part)
    data = storage.read_bytes(url)
    storage.write_bytes(url, data[: len(data) // 2])  # truncated, as a crashed upload would leave it
    warnings = []
    ckpt = checkpoint.load_latest(root, rank=0, warn=warnings.append)
    assert ckpt["state"]["step"] == 10 and ckpt["url"] == checkpoint.step_dir(root, 10)
    assert torch.all(ckpt["model"]["weight"] == 10.0)
    assert len(warnings) == 1 and "step-000020" in warnings[0] and "falling back" in warnings[0]


def test_nothing_readable_means_a_fresh_start(root):
    assert checkpoint.load_latest(root, rank=0) is None
    _write(root, 10)
    storage.write_bytes(storage.join(checkpoint.step_dir(root, 10), "model.safetensors"), b"junk")
    assert checkpoint.load_latest(root, rank=0, warn=lambda msg: None) is None


def test_rewriting_a_step_never_mixes_attempts(root):
    """A run that fell back past a corrupt step-20 writes step 20 again: begin() clears the old
    folder (marker first), so the old marker never vouches for a mix of old and new files."""
    _write(root, 10)
    _write(root, 20, value=-1.0)
    checkpoint.begin(root, 20)
    assert checkpoint.complete_steps(root) == [10] and checkpoint.all_steps(root) == [10]
    _write(root, 20, value=2.0)
    ckpt = checkpoint.load_latest(root, rank=0)
    assert ckpt["state"]["step"] == 20 and torch.all(ckpt["model"]["weight"] == 2.0)


def test_optimizer_state_loads_without_pickle(tmp_path):
    root = str(tmp_path / "ckpt")
    _write(root, 10)
    raw = (tmp_path / "ckpt" / "step-000010" / "optimizer.pt").read_bytes()
    import io

    torch.load(io.BytesIO(raw), weights_only=True)  # tensors and plain containers only
    state = json.loads((tmp_path / "ckpt" / "step-000010" / "state.json").read_text())
    assert state["step"] == 10
