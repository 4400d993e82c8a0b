"""sfm.train.checkpoint: the Checkpointer saves and restores the weights, optimiser, scheduler and every
registered part (shared ones, each rank's own, the RNG states), a rollback leaves the parts kept on
rollback alone; checkpoints are complete-or-invisible, the newest K are kept, unreadable ones are passed
over; on local disk and on an S3 server (moto_server over HTTP). One process, with Accelerate's real
process state."""

from __future__ import annotations

import io
import json
import logging
import random
import uuid

import numpy as np
import pytest
import torch
from accelerate import PartialState

from sfm import storage
from sfm.config import TrainConfig
from sfm.errors import SFMError
from sfm.train import checkpoint


class Counter:
    """A stateful part whose state is one number."""

    def __init__(self, value: int = 0):
        self.value = value

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


class WholeShards:
    """A one-process sharded strategy's shards (``checkpoint.Shards``) of kind ``kind``: its one rank's part is
    the whole model and optimiser, in the checkpoint's shards folder; another world size cannot load it."""

    reshards = False

    def __init__(self, kind: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.kind, self.model, self.optimizer = kind, model, optimizer

    def save(self, url: str) -> None:
        buf = io.BytesIO()
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, buf)
        storage.write_bytes(storage.join(url, "rank0-part.pt"), buf.getvalue())

    def load(self, url: str) -> None:
        state = torch.load(io.BytesIO(storage.read_bytes(storage.join(url, "rank0-part.pt"))), weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


class Run:
    """A tiny model, its optimiser and schedule, and a Checkpointer with a shared counter, a per-rank
    counter kept on rollback, and the RNG states registered; ``shards``: a sharded strategy of that kind."""

    def __init__(self, root: str, keep: int = 2, shards: str = ""):
        self.model = torch.nn.Linear(3, 2)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0 / (1 + s))
        self.shared, self.own = Counter(), Counter()
        sharded = WholeShards(shards, self.model, self.optimizer) if shards else None
        state = checkpoint.StepState(self.model, self.model, self.optimizer, self.scheduler, sharded=sharded)
        self.ckpt = checkpoint.Checkpointer(root, PartialState(cpu=True), state,
                                            TrainConfig(checkpoint_every=10, keep_checkpoints=keep))
        self.ckpt.register("shared", self.shared)
        self.ckpt.register("own", self.own, per_rank=True, keep_on_rollback=True)
        self.ckpt.register("rng", checkpoint.RNGState(), per_rank=True, keep_on_rollback=True)

    def step(self, value: float | None = None) -> None:
        """One optimiser step; with ``value``, every weight is then set to it."""
        self.model(torch.ones(1, 3)).sum().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()
        if value is not None:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.fill_(value)

    def save(self, step: int, value: float | None = None) -> None:
        self.step(float(step) if value is None else value)
        self.shared.value, self.own.value = step, -step
        self.ckpt.save(step)


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "ckpt")
    s3 = request.getfixturevalue("s3_env")
    bucket = f"ckpt-{uuid.uuid4().hex[:16]}"  # not random: the tests seed it
    return storage.join(s3.make_bucket(bucket), "run", "ckpt")


def test_load_restores_weights_optimiser_schedule_and_every_part(root):
    saved = Run(root)
    saved.save(10)
    torch.manual_seed(123)
    np.random.seed(5)
    random.seed(9)
    saved.ckpt.save(20)  # the RNG states as of now
    expected = (torch.rand(3), np.random.rand(3), random.random())
    weights = {k: v.clone() for k, v in saved.model.state_dict().items()}

    fresh = Run(root)
    assert fresh.ckpt.load() == checkpoint.step_dir(root, 20)
    for k, v in weights.items():
        assert torch.equal(fresh.model.state_dict()[k], v)
    assert fresh.optimizer.state_dict()["state"][0]["step"] == saved.optimizer.state_dict()["state"][0]["step"]
    assert fresh.scheduler.state_dict() == saved.scheduler.state_dict() and fresh.scheduler.last_epoch == 1
    assert (fresh.shared.value, fresh.own.value) == (10, -10)
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1]) and got[2] == expected[2]
    state = json.loads(storage.read_bytes(storage.join(checkpoint.step_dir(root, 20), checkpoint.MARKER)))
    assert state == {"step": 20, "sharded": False, "shared": {"value": 10}}  # the per-rank parts are not in it


def test_sharded_checkpoints_load_only_into_their_kind_and_onto_their_world_size(root):
    """The marker names the shards' kind and world size: a strategy of another kind, an unsharded one, and
    (shards that cannot reshard, as DeepSpeed's) another world size are refused in one line each."""
    saved = Run(root, shards="deepspeed")
    saved.save(10)
    url = checkpoint.step_dir(root, 10)
    assert storage.exists(storage.join(checkpoint.shards_url(root, 10), "rank0-part.pt"))
    assert not storage.exists(storage.join(url, "model.safetensors"))
    marker = storage.join(url, checkpoint.MARKER)
    state = json.loads(storage.read_bytes(marker))
    assert state["sharded"] == {"kind": "deepspeed", "world_size": 1}
    fresh = Run(root, shards="deepspeed")
    assert fresh.ckpt.load() == url and torch.all(fresh.model.weight == 10.0) and fresh.shared.value == 10
    with pytest.raises(SFMError, match=r"holds deepspeed shards, which this fsdp2 run cannot read; resume it with"):
        Run(root, shards="fsdp2").ckpt.load()
    with pytest.raises(SFMError, match=r"is sharded \(a deepspeed run\); resume it with the same dist.strategy"):
        Run(root).ckpt.load()
    state["sharded"]["world_size"] = 2
    storage.write_bytes(marker, json.dumps(state).encode())
    with pytest.raises(SFMError, match=r"was written by 2 ranks and deepspeed cannot reshard its optimiser state "
                                       r"onto 1; resume it on 2 ranks"):
        Run(root, shards="deepspeed").ckpt.load()


def test_a_rollback_leaves_the_parts_kept_on_rollback_alone(root):
    run = Run(root)
    run.save(10)
    run.step(value=99.0)
    run.shared.value, run.own.value = 55, 66
    torch.manual_seed(7)
    torch.rand(3)
    assert run.ckpt.load(rollback=True) == checkpoint.step_dir(root, 10)
    assert torch.all(run.model.weight == 10.0) and run.scheduler.last_epoch == 1
    assert (run.shared.value, run.own.value) == (10, 66)
    after = torch.rand(3)  # the RNG went on too, from where it was, not from the checkpoint's states
    torch.manual_seed(7)
    torch.rand(3)
    assert torch.equal(after, torch.rand(3))


def test_a_rank_the_checkpoint_has_no_file_for_keeps_its_own_parts(root):
    """A checkpoint written by fewer ranks (a sharded run resumed on more): a rank without a file of
    its own keeps its parts as they are, and still restores the shared ones."""
    run = Run(root)
    run.save(10)
    storage.remove(storage.join(checkpoint.step_dir(root, 10), checkpoint.rank_file(0)))
    fresh = Run(root)
    fresh.own.value = 4
    assert fresh.ckpt.load() is not None
    assert (fresh.shared.value, fresh.own.value) == (10, 4)


def test_part_names_are_unique_and_not_the_markers_own():
    run = Run("/unused")
    for name in ("shared", "step", "sharded"):
        with pytest.raises(ValueError, match="is taken"):
            run.ckpt.register(name, Counter())


def test_keeps_the_newest_k(root):
    run = Run(root, keep=2)
    for step in (10, 20, 30, 40):
        run.save(step)
    assert checkpoint.complete_steps(root) == [30, 40]
    assert checkpoint.all_steps(root) == [30, 40]


def test_incomplete_checkpoint_is_invisible_and_pruned(root):
    run = Run(root)
    run.save(10)
    # a save killed before its marker: a rank's parts and the weights there, no state.json
    checkpoint.save_rank(root, 20, 0, {"own": {"value": -20}})
    storage.write_bytes(storage.join(checkpoint.step_dir(root, 20), "model.safetensors"), b"partial")
    assert checkpoint.complete_steps(root) == [10]
    assert Run(root).ckpt.load() == checkpoint.step_dir(root, 10)
    run.save(30)  # the next save clears the leftover
    assert checkpoint.all_steps(root) == [10, 30]


@pytest.mark.parametrize("part", ["model.safetensors", "optimizer.pt", "rank0.pt", "state.json"])
def test_unreadable_latest_falls_back_with_a_warning(root, part, caplog):
    run = Run(root)
    run.save(10)
    run.save(20)
    url = storage.join(checkpoint.step_dir(root, 20), part)
    data = storage.read_bytes(url)
    storage.write_bytes(url, data[: len(data) // 2])  # truncated, as a crashed upload would leave it
    fresh = Run(root)
    with caplog.at_level(logging.WARNING, logger="sfm.train.checkpoint"):
        assert fresh.ckpt.load() == checkpoint.step_dir(root, 10)
    assert torch.all(fresh.model.weight == 10.0) and (fresh.shared.value, fresh.own.value) == (10, -10)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "step-000020" in warnings[0] and "falling back" in warnings[0]


def test_nothing_readable_means_a_fresh_start(root):
    assert Run(root).ckpt.load() is None
    run = Run(root)
    run.save(10)
    storage.write_bytes(storage.join(checkpoint.step_dir(root, 10), "model.safetensors"), b"junk")
    fresh = Run(root)
    assert fresh.ckpt.load() is None and fresh.shared.value == 0


def test_rewriting_a_step_never_mixes_attempts(root):
    """A run that fell back past a corrupt step-20 writes step 20 again: begin() clears the old
    folder (marker first), so the old marker never vouches for a mix of old and new files."""
    run = Run(root)
    run.save(10)
    run.save(20, value=-1.0)
    checkpoint.begin(root, 20)
    assert checkpoint.complete_steps(root) == [10] and checkpoint.all_steps(root) == [10]
    run.save(20, value=2.0)
    fresh = Run(root)
    assert fresh.ckpt.load() == checkpoint.step_dir(root, 20) and torch.all(fresh.model.weight == 2.0)


def test_optimizer_and_rank_parts_load_without_pickle(tmp_path):
    root = str(tmp_path / "ckpt")
    Run(root).save(10)
    for name in ("optimizer.pt", "rank0.pt"):
        torch.load(io.BytesIO((tmp_path / "ckpt" / "step-000010" / name).read_bytes()), weights_only=True)
    state = json.loads((tmp_path / "ckpt" / "step-000010" / "state.json").read_text())
    assert state["step"] == 10
