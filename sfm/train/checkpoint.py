"""Training checkpoints: save and load everything a resumed run needs, and nothing else.

Layout under a checkpoint root (local or S3)::

    step-000050/model.safetensors    weights (never pickled)
    step-000050/optimizer.pt         optimiser + scheduler state (tensors only; loaded weights_only=True)
    step-000050/rank0.pt             each rank's own parts (its RNG states), tensors only
    step-000050/state.json           step and the shared parts (train state, data position, history,
                                     health); written LAST: marks it complete

A sharded checkpoint keeps the weights and optimiser state in ``step-000050/shards/``, each rank writing its own
part, instead of ``model.safetensors`` and the optimiser part of ``optimizer.pt``: a ``torch.distributed.checkpoint``
(FSDP2 strategies, :class:`sfm.distributed.strategies.FSDP2Shards`) or DeepSpeed's own files (DeepSpeed strategies,
:class:`sfm.distributed.deepspeed_zero.DeepSpeedShards`). Its ``state.json`` says which and how many ranks wrote
it: ``"sharded": {"kind": "fsdp2" | "deepspeed", "world_size": N}`` (``true`` in older FSDP2 checkpoints).

A checkpoint without ``state.json`` is incomplete and ignored. Writing one is three moves:
:func:`begin` (rank 0 clears whatever an earlier attempt left at that step, marker first), then
:func:`save_rank` on every rank, then :func:`save` on rank 0, which writes ``state.json`` last and
prunes. Only the newest ``keep`` complete checkpoints are kept; a pruned one loses its marker before
its files, so no reader ever sees a half-deleted checkpoint as complete. If the newest cannot be
read, the one before it is used, with a warning.

:class:`Checkpointer` drives those moves for a run: the weights, optimiser and schedule it is built
with, and every other stateful part registered with it (:meth:`Checkpointer.register`), are saved
and restored together, as torchtitan's checkpoint manager does.
"""

from __future__ import annotations

import io
import json
import logging
import random
import re
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from sfm import storage
from sfm.errors import SFMError

log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step-(\d{6,})$")
MARKER = "state.json"  # written last: a checkpoint folder without it is incomplete
RESERVED = ("step", "sharded")  # the marker's own keys: no registered part may take these names


def step_dir(root: str, step: int) -> str:
    return storage.join(root, f"step-{step:06d}")


def all_steps(root: str) -> list[int]:
    """Steps of every checkpoint folder under ``root``, complete or not, oldest first."""
    return sorted(int(m.group(1)) for m in map(_STEP_DIR.match, storage.list_dir(root)) if m)


def complete_steps(root: str) -> list[int]:
    """Steps of the complete checkpoints under ``root``, oldest first."""
    return [step for step in all_steps(root) if storage.exists(storage.join(step_dir(root, step), MARKER))]


def discard(root: str, step: int) -> None:
    """Remove the checkpoint at ``step``: its completion marker first, then the rest."""
    url = step_dir(root, step)
    marker = storage.join(url, MARKER)
    if storage.exists(marker):
        storage.remove(marker)
    storage.remove(url)


def begin(root: str, step: int) -> None:
    """Rank 0, before any rank writes checkpoint ``step``: clear what an earlier attempt left there
    (a complete checkpoint this run fell back past, or a partial one), so old and new files never
    mix under one marker."""
    if step in all_steps(root):
        discard(root, step)


def _tensor_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _load_tensors(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def rank_file(rank: int) -> str:
    """The file of a checkpoint folder that holds rank ``rank``'s own parts."""
    return f"rank{rank}.pt"


def save_rank(root: str, step: int, rank: int, parts: dict[str, Any]) -> None:
    """Every rank writes its own parts' states (tensors and plain containers) before rank 0 marks the
    checkpoint complete."""
    storage.write_bytes(storage.join(step_dir(root, step), rank_file(rank)), _tensor_bytes(parts))


def shards_url(root: str, step: int) -> str:
    """Where a sharded checkpoint's ``torch.distributed.checkpoint`` lives."""
    return storage.join(step_dir(root, step), "shards")


def save(root: str, step: int, model_state: dict[str, torch.Tensor] | None, optimizer_state: dict | None,
         scheduler_state: dict, parts: dict[str, Any], keep: int = 2, shards: dict[str, Any] | None = None) -> str:
    """Write a checkpoint (rank 0, after every rank called :func:`save_rank`); returns its URL.

    ``parts``: the shared parts' states, JSON-able, written into the marker. ``shards`` ({"kind", "world_size"}),
    with ``model_state`` and ``optimizer_state`` None: a sharded checkpoint whose ranks have already written
    :func:`shards_url` together; this writes the scheduler and the marker."""
    url = step_dir(root, step)
    sharded = shards or (model_state is None)
    if model_state is not None:
        tensors = {k: v.detach().contiguous().cpu() for k, v in model_state.items()}
        storage.write_bytes(storage.join(url, "model.safetensors"), save_safetensors(tensors))
    storage.write_bytes(storage.join(url, "optimizer.pt"),
                        _tensor_bytes({"optimizer": optimizer_state, "scheduler": scheduler_state}))
    storage.write_bytes(storage.join(url, MARKER), json.dumps({"step": step, "sharded": sharded, **parts}).encode())
    complete = complete_steps(root)
    stale = set(complete[:-keep]) if keep > 0 else set()
    stale |= {s for s in all_steps(root) if s < step and s not in complete}  # partial leftovers of killed saves
    for old in sorted(stale):
        discard(root, old)
    return url


def load(url: str, rank: int) -> dict[str, Any]:
    """Read one checkpoint completely (raises if any part is unreadable). For a sharded one,
    ``model`` and ``optimizer`` are None, ``shards`` is the URL to load them from, collectively, and
    ``written`` says who wrote them ({"kind", "world_size"}; None when not sharded).
    ``rank`` holds this rank's own parts; None when the checkpoint has none for it (it was written
    by fewer ranks)."""
    state = json.loads(storage.read_bytes(storage.join(url, MARKER)))
    sharded = state["sharded"]
    model = None if sharded else load_safetensors(storage.read_bytes(storage.join(url, "model.safetensors")))
    opt = _load_tensors(storage.read_bytes(storage.join(url, "optimizer.pt")))
    mine = storage.join(url, rank_file(rank))
    own = _load_tensors(storage.read_bytes(mine)) if storage.exists(mine) else None
    written = ({"kind": "fsdp2"} if sharded is True else sharded) if sharded else None  # true: an older FSDP2 one
    return {"state": state, "model": model, "optimizer": opt["optimizer"], "scheduler": opt["scheduler"],
            "rank": own, "shards": storage.join(url, "shards") if sharded else None, "written": written}


class Stateful(Protocol):
    """What a registered part offers: its state, and restoring it."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class RNGState:
    """The process's global RNG states (torch, CUDA, numpy, python) as a checkpoint part: a rank's
    own (register it ``per_rank``); its state is tensors and plain containers, loadable with
    ``weights_only``."""

    def state_dict(self) -> dict[str, Any]:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state = {"torch": torch.get_rng_state(), "python": list(random.getstate()),
                 "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached]}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        if "cuda" in state and torch.cuda.is_available():  # a CPU run's checkpoint has none
            torch.cuda.set_rng_state_all(state["cuda"])


class Shards(Protocol):
    """A sharded strategy's weights and optimiser state, which its ranks save and load together, each its own
    part (:class:`sfm.distributed.strategies.FSDP2Shards`, :class:`sfm.distributed.deepspeed_zero.DeepSpeedShards`).
    ``kind`` names the format in the marker; ``reshards``: another world size can load them."""

    kind: str
    reshards: bool

    def save(self, url: str) -> None: ...

    def load(self, url: str) -> None: ...


class StepState(NamedTuple):
    """What every optimiser step changes: the plain ``model`` (its full weights, unsharded strategies),
    ``step_model`` (what the step runs), the optimiser and the scheduler. ``sharded``: the strategy's
    :class:`Shards`, saved instead of full weights; None (or False) for full weights."""

    model: torch.nn.Module
    step_model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    sharded: Shards | None


class _Part(NamedTuple):
    part: Stateful
    per_rank: bool
    keep_on_rollback: bool


class Checkpointer:
    """The one owner of a run's checkpoints and of everything restored from them: when to save, saving
    every rank's part, and finding, agreeing on and loading the newest checkpoint every rank can read,
    for plain and sharded strategies alike.

    It saves and restores ``state`` (weights, optimiser, scheduler) and every part registered with
    :meth:`register`; nothing else in a run restores state. ``accelerator`` gives rank, world and
    barriers; ``train`` is the job's ``[train]`` section (``checkpoint_every``, ``keep_checkpoints``).
    Every method but :meth:`register` and :meth:`due` is collective: all ranks call it together.
    """

    def __init__(self, root: str, accelerator, state: StepState, train):
        self.root, self.accelerator, self.step_state = root, accelerator, state
        self.every, self.keep = train.checkpoint_every, train.keep_checkpoints
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        self.parts: dict[str, _Part] = {}

    def register(self, name: str, part: Stateful, *, per_rank: bool = False, keep_on_rollback: bool = False) -> None:
        """Save ``part.state_dict()`` with every checkpoint and give it back to ``part.load_state_dict``
        on every load, parts in the order they were registered.

        ``per_rank``: each rank saves its own (tensors and plain containers; a rank the checkpoint has
        none for, one of more ranks than wrote it, keeps its own); otherwise the state is the same on
        every rank and rank 0's is saved (JSON-able). ``keep_on_rollback``: a rollback
        (``load(rollback=True)``) leaves the part as it is."""
        if name in RESERVED or name in self.parts:
            raise ValueError(f"checkpoint part name {name!r} is taken")
        self.parts[name] = _Part(part, per_rank, keep_on_rollback)

    def due(self, step: int, last: bool) -> bool:
        return step % self.every == 0 or last

    def save(self, step: int) -> None:
        """Rank 0 clears the step's folder, every rank writes its own parts (and, sharded, its shards
        of the weights and optimiser state), then rank 0 writes the rest and marks it complete."""
        acc, s = self.accelerator, self.step_state
        if acc.is_main_process:
            begin(self.root, step)
        acc.wait_for_everyone()
        save_rank(self.root, step, self.rank, self._states(per_rank=True))
        if s.sharded:
            s.sharded.save(shards_url(self.root, step))
        acc.wait_for_everyone()
        if acc.is_main_process:
            model, optimizer = (None, None) if s.sharded else (s.model.state_dict(), s.optimizer.state_dict())
            shards = {"kind": s.sharded.kind, "world_size": self.world} if s.sharded else None
            save(self.root, step, model, optimizer, s.scheduler.state_dict(), self._states(per_rank=False),
                 keep=self.keep, shards=shards)
        acc.wait_for_everyone()

    def load(self, *, rollback: bool = False) -> str | None:
        """Restore the newest checkpoint every rank can read: the weights, optimiser and scheduler, then
        every registered part (with ``rollback``, those not kept on rollback). Returns its URL; None
        if there is none. Newest first: a checkpoint any rank cannot read or load is passed over by
        all (with a warning naming why), so the ranks never resume out of step."""
        steps = [complete_steps(self.root) if self.accelerator.is_main_process else None]
        if self.world > 1:
            torch.distributed.broadcast_object_list(steps, src=0)
        passed_over = False
        for step in reversed(steps[0]):
            url = step_dir(self.root, step)
            ckpt, why = self._read(url)
            if why:
                log.warning("checkpoint %s is unreadable (%s); falling back to an earlier one", url, why)
            if self._all_ranks(not why):
                try:
                    self._restore_weights(ckpt)
                except Exception as err:
                    why = f"{type(err).__name__}: {err}"
                    log.warning("checkpoint %s cannot be loaded (%s); falling back to an earlier one", url, why)
                if self._all_ranks(not why):
                    self._restore_parts(ckpt, rollback)
                    if passed_over and self.world > 1:
                        log.warning("all ranks continue from step %d", step)
                    return url
            elif not why:
                log.warning("checkpoint %s is unreadable on another rank; falling back to an earlier one", url)
            passed_over = True
        return None

    def _states(self, per_rank: bool) -> dict[str, Any]:
        return {name: p.part.state_dict() for name, p in self.parts.items() if p.per_rank == per_rank}

    def _read(self, url: str) -> tuple[dict[str, Any] | None, str]:
        """This rank's reading of the checkpoint at ``url``, and why this strategy cannot restore it
        ("" if it can)."""
        try:
            ckpt = load(url, self.rank)
        except SFMError:
            raise
        except Exception as err:  # corrupt or partially deleted
            return None, f"{type(err).__name__}: {err}"
        mine, written = self.step_state.sharded, ckpt["written"]
        if mine and written is None:
            return ckpt, "it was written by an unsharded strategy"
        if not mine and written is not None:
            raise SFMError(f"checkpoint {url} is sharded (a {written['kind']} run); resume it with the same "
                           "dist.strategy on more than one process")
        if mine and written["kind"] != mine.kind:
            raise SFMError(f"checkpoint {url} holds {written['kind']} shards, which this {mine.kind} run cannot "
                           "read; resume it with the dist.strategy that wrote it")
        if mine and not mine.reshards and written["world_size"] != self.world:
            raise SFMError(f"checkpoint {url} was written by {written['world_size']} ranks and {mine.kind} cannot "
                           f"reshard its optimiser state onto {self.world}; resume it on {written['world_size']} "
                           "ranks (nodes x procs_per_node)")
        return ckpt, ""

    def _restore_weights(self, ckpt: dict[str, Any]) -> None:
        s = self.step_state
        if s.sharded:
            s.sharded.load(ckpt["shards"])
        else:
            s.model.load_state_dict(ckpt["model"])
            s.optimizer.load_state_dict(ckpt["optimizer"])
        s.scheduler.load_state_dict(ckpt["scheduler"])

    def _restore_parts(self, ckpt: dict[str, Any], rollback: bool) -> None:
        for name, p in self.parts.items():
            if rollback and p.keep_on_rollback:
                continue
            if not p.per_rank:
                p.part.load_state_dict(ckpt["state"][name])
            elif ckpt["rank"] is not None:
                p.part.load_state_dict(ckpt["rank"][name])

    def _all_ranks(self, ok: bool) -> bool:
        """True when ``ok`` holds on every rank (a collective)."""
        if self.world == 1:
            return ok
        flag = torch.tensor([0.0 if ok else 1.0], device=self.accelerator.device)
        torch.distributed.all_reduce(flag)
        return flag.item() == 0
