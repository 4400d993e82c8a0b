"""sfm.distributed.strategies on 2 real processes (gloo, CPU): for ddp, fsdp2-zero2 and fsdp2-full, the loss
curve equals one process training on the same global batch with the same seed, all ranks end with
identical full weights, and a sharded checkpoint saved mid-run (to local disk, and for fsdp2-full to
S3 on a loopback moto_server) loads into a freshly built model and optimiser and continues exactly as
the run that saved it.

Masking is random, so each sample is one micro-batch whose masking noise is seeded by (step, global
sample index): any split of the global batch over ranks then sees the same masks. That also runs
gradient accumulation through :func:`sfm.distributed.strategies.no_sync`.
"""

from __future__ import annotations

import datetime as dt
import gc
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import free_port
from sfm.distributed import gloo_overlap
from sfm.distributed import strategies as parallelize
from sfm.model import build_model, mae_config
from sfm.train.step import build_optimizer

WORLD = 2
GLOBAL_BATCH = 4
STEPS = 3
CROP = (16, 16, 16)


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(mae_config("tiny", crop=CROP))


def global_batch(step: int) -> torch.Tensor:
    """[GLOBAL_BATCH, 1, *CROP], the same on every rank."""
    return torch.randn(GLOBAL_BATCH, 1, *CROP, generator=torch.Generator().manual_seed(100 + step))


def train_step(model, optimizer, step: int, rank: int, world: int) -> float:
    """One optimiser step over this rank's share of the global batch, one sample per micro-batch;
    returns the mean loss over the global batch."""
    per_rank = GLOBAL_BATCH // world
    batch = global_batch(step)[rank * per_rank:(rank + 1) * per_rank]
    total = torch.zeros(())
    for i, sample in enumerate(batch):
        torch.manual_seed(1000 * step + rank * per_rank + i)  # the masking noise of this global sample
        sync = i == per_rank - 1
        with (parallelize.no_sync(model) if not sync else torch.enable_grad()):
            loss, _, _ = model(sample[None])
            (loss / per_rank).backward()
        total += loss.detach()
    parallelize.clip_grad_norm(model, 0.05)  # small enough to clip: the norm must be the global one
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if world > 1:
        dist.all_reduce(total)
    return total.item() / GLOBAL_BATCH


def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([state[k].flatten().float() for k in sorted(state)])


def worker(rank: int, port: int, out_dir: str, s3_root: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=dt.timedelta(seconds=120))
    results = {}
    try:
        for strategy in parallelize.APPLIED:
            model = parallelize.apply_strategy(make_model(), strategy)
            optimizer = build_optimizer(model, lr=1e-2, weight_decay=0.05)
            losses = [train_step(model, optimizer, s, rank, WORLD) for s in range(STEPS)]
            ckpt = f"{s3_root}/ckpt-{strategy}" if strategy == "fsdp2-full" else os.path.join(out_dir, f"ckpt-{strategy}")
            parallelize.save_sharded(ckpt, model, optimizer)
            next_loss = train_step(model, optimizer, STEPS, rank, WORLD)
            weights = flat(parallelize.full_state_dict(model, rank0_only=False))
            gathered = [torch.empty_like(weights) for _ in range(WORLD)]
            dist.all_gather(gathered, weights)

            # a fresh model (other initial weights) and optimiser, loaded from the checkpoint
            fresh = parallelize.apply_strategy(make_model(seed=7), strategy)
            fresh_opt = build_optimizer(fresh, lr=1e-2, weight_decay=0.05)
            parallelize.load_sharded(ckpt, fresh, fresh_opt)
            resumed_loss = train_step(fresh, fresh_opt, STEPS, rank, WORLD)
            resumed = flat(parallelize.full_state_dict(fresh, rank0_only=False))
            results[strategy] = {
                "losses": losses, "next_loss": next_loss, "resumed_loss": resumed_loss,
                "ranks_identical": all(torch.equal(g, gathered[0]) for g in gathered),
                "resumed_max_diff": (resumed - weights).abs().max().item(),
                "sharded": [type(p).__name__ for p in model.parameters()][:1],
                "weights": weights.tolist() if rank == 0 else None,
            }
            del model, optimizer, fresh, fresh_opt
            gc.collect()  # as in worker_without_private_api
        dist.barrier()  # no rank tears gloo down while the other still has work in flight on it
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def reference_run() -> tuple[list[float], torch.Tensor]:
    """One process, no process group, the whole global batch: the curve every strategy must match."""
    model = make_model()
    optimizer = build_optimizer(model, lr=1e-2, weight_decay=0.05)
    losses = [train_step(model, optimizer, s, 0, 1) for s in range(STEPS + 1)]
    return losses, flat(model.state_dict())


@pytest.mark.timeout(400)
def test_strategies_on_two_processes_match_one_process(tmp_path, s3_env):
    s3_root = s3_env.make_bucket("sfm-parallelize") + "/run"
    mp.spawn(worker, args=(free_port(), str(tmp_path), s3_root), nprocs=WORLD, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    ref_losses, ref_weights = reference_run()
    assert ref_losses[-1] < ref_losses[0]  # it learns, so matching curves mean something

    for strategy in parallelize.APPLIED:
        r0, r1 = ranks[0][strategy], ranks[1][strategy]
        curve = r0["losses"] + [r0["next_loss"]]
        assert curve == r1["losses"] + [r1["next_loss"]]  # the loss is all-reduced: identical on both ranks
        assert curve == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), strategy
        assert r0["ranks_identical"] and r1["ranks_identical"], strategy
        # weights to Adam's noise floor: parameters whose true gradient is 0 (the key bias, through the
        # softmax) move by lr * sign(rounding noise), which differs with the summation order
        assert torch.allclose(torch.tensor(r0["weights"]), ref_weights, rtol=1e-3, atol=1e-3), strategy
        # sharded checkpoint round trip: the same next step, the same weights after it
        assert r0["resumed_loss"] == pytest.approx(r0["next_loss"], rel=1e-6)
        assert r0["resumed_max_diff"] < 1e-6 and r1["resumed_max_diff"] < 1e-6, strategy
        assert r0["sharded"] == (["DTensor"] if strategy.startswith("fsdp2") else ["Parameter"]), strategy
    assert (tmp_path / "ckpt-fsdp2-zero2" / ".metadata").is_file()
    assert len(list((tmp_path / "ckpt-fsdp2-zero2").glob("*.distcp"))) == WORLD  # one shard file per rank
    keys = s3_env.keys("sfm-parallelize", "run/ckpt-fsdp2-full/")
    assert "run/ckpt-fsdp2-full/.metadata" in keys and sum(k.endswith(".distcp") for k in keys) == WORLD


def test_unknown_strategy():
    with pytest.raises(ValueError, match="unknown strategy 'zero3'"):
        parallelize.apply_strategy(make_model(), "zero3")
    with pytest.raises(ValueError, match="'deepspeed-zero2' is not applied here.*deepspeed_zero.initialize"):
        parallelize.apply_strategy(make_model(), "deepspeed-zero2")  # DeepSpeed's engine wraps its own


def overlap_worker(rank: int, port: int, out_dir: str) -> None:
    """fsdp2-zero2 on gloo: how far the deferred reduce-scatters have got when backward reaches the
    patch embedding (the last module it visits), and the gradients of two synced backwards without
    zeroing in between (FSDP2 adds each reduced shard to the held gradient at once)."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=dt.timedelta(seconds=120))
    try:
        model = parallelize.apply_strategy(make_model(), "fsdp2-zero2")
        in_flight = []
        model.patch_embed.register_full_backward_pre_hook(
            lambda *_: in_flight.append(len(gloo_overlap._PENDING.works)))
        per_rank = GLOBAL_BATCH // WORLD
        for step in range(2):
            torch.manual_seed(step)
            loss, _, _ = model(global_batch(step)[rank * per_rank:(rank + 1) * per_rank])
            loss.backward()
            in_flight.append(len(gloo_overlap._PENDING.works))
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        del model
        gc.collect()  # as in worker_without_private_api
    finally:
        dist.destroy_process_group()
    torch.save({"in_flight": in_flight, "grads": grads}, Path(out_dir, f"overlap{rank}.pt"))


@pytest.mark.timeout(200)
def test_fsdp2_on_gloo_overlaps_reductions_with_backward_and_accumulates_exactly(tmp_path):
    mp.spawn(overlap_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    got = torch.load(tmp_path / "overlap0.pt")
    # first backward: block reductions still in flight when backward reaches the patch embedding,
    # none left once backward returns; the second (gradients held) reduces each unit at once
    assert got["in_flight"][0] >= len(parallelize.sharding_units(make_model())) - 2 and got["in_flight"][1] == 0
    assert got["in_flight"][2:] == [0, 0]
    model = make_model()
    per_rank = GLOBAL_BATCH // WORLD
    for step in range(2):  # one process, each rank's half as its own micro-batch, averaged as DP does
        for rank in range(WORLD):
            torch.manual_seed(step)
            loss, _, _ = model(global_batch(step)[rank * per_rank:(rank + 1) * per_rank])
            (loss / WORLD).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got["grads"][name], p.grad, rtol=1e-5, atol=1e-7, msg=name)


PRIVATE = "torch.distributed.fsdp._fully_shard._fsdp_collectives"


def worker_without_private_api(rank: int, port: int, out_dir: str) -> None:
    """As if torch had moved FSDP2's private collectives module: importing it fails in this process."""
    import logging
    import sys

    sys.modules[PRIVATE] = None  # `import` of it now raises ImportError
    sys.modules.pop("sfm.distributed.gloo_overlap", None)
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("sfm.distributed.strategies").addHandler(handler)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=dt.timedelta(seconds=120))
    results = {}
    try:
        for strategy in ("ddp", "fsdp2-full"):
            model = parallelize.apply_strategy(make_model(), strategy)
            optimizer = build_optimizer(model, lr=1e-2, weight_decay=0.05)
            results[strategy] = [train_step(model, optimizer, s, rank, WORLD) for s in range(STEPS + 1)]
            del model, optimizer
            gc.collect()  # FSDP2's hooks and state form cycles: free them (and the works and group handles
            # they hold) while the group is up, not in the interpreter's teardown after it is destroyed
        dist.barrier()  # no rank tears gloo down while the other still has work in flight on it
    finally:
        dist.destroy_process_group()
    results["messages"] = messages
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.mark.timeout(300)
def test_strategies_train_when_the_private_fsdp_api_is_missing(tmp_path):
    mp.spawn(worker_without_private_api, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    ref_losses, _ = reference_run()
    for strategy in ("ddp", "fsdp2-full"):
        assert ranks[0][strategy] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), strategy
    fallback = [m for m in ranks[0]["messages"] if "not overlapped" in m]
    assert len(fallback) == 1 and "plain FSDP2" in fallback[0]  # once, for the FSDP2 run only
