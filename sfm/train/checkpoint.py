"""Training checkpoints: save and load everything a resumed run needs, and nothing else.

Layout under a checkpoint root (local or S3)::

    step-000050/model.safetensors    weights (never pickled)
    step-000050/optimizer.pt         optimiser + scheduler state (tensors only; loaded weights_only=True)
    step-000050/rng-rank0.pt         each rank's RNG states
    step-000050/state.json           step, data position, history; written LAST: marks it complete

A sharded checkpoint (FSDP2 strategies) keeps the weights and optimiser state as a
``torch.distributed.checkpoint`` in ``step-000050/shards/`` (each rank writes its own shards, see
:func:`sfm.distributed.strategies.save_sharded`) instead of ``model.safetensors`` and the optimiser part of
``optimizer.pt``; its ``state.json`` says ``"sharded": true``.

A checkpoint without ``state.json`` is incomplete and ignored. Writing one is three moves:
:func:`begin` (rank 0 clears whatever an earlier attempt left at that step, marker first), then
:func:`save_rank_rng` on every rank, then :func:`save` on rank 0, which writes ``state.json`` last and
prunes. Only the newest ``keep`` complete checkpoints are kept; a pruned one loses its marker before
its files, so no reader ever sees a half-deleted checkpoint as complete. If the newest cannot be
read, the one before it is used, with a warning.
"""

from __future__ import annotations

import io
import json
import logging
import random
import re
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from sfm import storage
from sfm.errors import SFMError

log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step-(\d{6,})$")
MARKER = "state.json"  # written last: a checkpoint folder without it is incomplete


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


def rng_state(generators: dict[str, torch.Generator] | None = None) -> dict[str, Any]:
    """The global RNG states (torch, CUDA, numpy, python) and those of the named ``generators``."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
             "generators": {name: g.get_state() for name, g in (generators or {}).items()}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any], generators: dict[str, torch.Generator] | None = None) -> None:
    """Restore what :func:`rng_state` captured; each of ``generators`` from its saved namesake."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    saved = state.get("generators", {})
    for name, gen in (generators or {}).items():
        if name in saved:
            gen.set_state(saved[name])
        else:  # a checkpoint from before that generator existed: it keeps its seeded state
            log.warning("checkpoint has no state for RNG %r; it continues from its seed", name)


def _tensor_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _load_tensors(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def save_rank_rng(root: str, step: int, rank: int, generators: dict[str, torch.Generator] | None = None) -> None:
    """Every rank saves its own RNG states (global ones and ``generators``) before rank 0 marks the
    checkpoint complete."""
    state = rng_state(generators)
    name, keys, pos, has_gauss, cached = state["numpy"]  # ndarray -> tensor: loadable with weights_only
    state["numpy"] = [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached]
    state["python"] = list(state["python"])
    storage.write_bytes(storage.join(step_dir(root, step), f"rng-rank{rank}.pt"), _tensor_bytes(state))


def shards_url(root: str, step: int) -> str:
    """Where a sharded checkpoint's ``torch.distributed.checkpoint`` lives."""
    return storage.join(step_dir(root, step), "shards")


def save(root: str, step: int, model_state: dict[str, torch.Tensor] | None, optimizer_state: dict | None,
         scheduler_state: dict, meta: dict[str, Any], keep: int = 2) -> str:
    """Write a checkpoint (rank 0, after every rank called :func:`save_rank_rng`); returns its URL.

    ``model_state`` and ``optimizer_state`` None: a sharded checkpoint whose ranks have already
    written :func:`shards_url` together; this writes the scheduler and the marker."""
    url = step_dir(root, step)
    sharded = model_state is None
    if not sharded:
        tensors = {k: v.detach().contiguous().cpu() for k, v in model_state.items()}
        storage.write_bytes(storage.join(url, "model.safetensors"), save_safetensors(tensors))
    storage.write_bytes(storage.join(url, "optimizer.pt"),
                        _tensor_bytes({"optimizer": optimizer_state, "scheduler": scheduler_state}))
    storage.write_bytes(storage.join(url, MARKER), json.dumps({"step": step, "sharded": sharded, **meta}).encode())
    complete = complete_steps(root)
    stale = set(complete[:-keep]) if keep > 0 else set()
    stale |= {s for s in all_steps(root) if s < step and s not in complete}  # partial leftovers of killed saves
    for old in sorted(stale):
        discard(root, old)
    return url


def load(url: str, rank: int) -> dict[str, Any]:
    """Read one checkpoint completely (raises if any part is unreadable). For a sharded one,
    ``model`` and ``optimizer`` are None and ``shards`` is the URL to load them from, collectively."""
    state = json.loads(storage.read_bytes(storage.join(url, MARKER)))
    sharded = bool(state.get("sharded"))
    model = None if sharded else load_safetensors(storage.read_bytes(storage.join(url, "model.safetensors")))
    opt = _load_tensors(storage.read_bytes(storage.join(url, "optimizer.pt")))
    rng_url = storage.join(url, f"rng-rank{rank}.pt")
    rng = None
    if storage.exists(rng_url):
        raw = _load_tensors(storage.read_bytes(rng_url))
        name, keys, pos, has_gauss, cached = raw["numpy"]
        raw["numpy"] = (name, keys.numpy().astype(np.uint32), pos, has_gauss, cached)
        raw["python"] = (raw["python"][0], tuple(raw["python"][1]), raw["python"][2])
        rng = raw
    return {"state": state, "model": model, "optimizer": opt["optimizer"], "scheduler": opt["scheduler"], "rng": rng,
            "shards": storage.join(url, "shards") if sharded else None}


def load_latest(root: str, rank: int, warn: Callable[[str], None] = log.warning) -> dict[str, Any] | None:
    """The newest readable complete checkpoint under ``root``; None if there is none."""
    for step in reversed(complete_steps(root)):
        url = step_dir(root, step)
        try:
            ckpt = load(url, rank)
        except Exception as err:  # corrupt or partially deleted: fall back to the one before
            warn(f"checkpoint {url} is unreadable ({type(err).__name__}: {err}); falling back to an earlier one")
            continue
        ckpt["url"] = url
        return ckpt
    return None


class Checkpointer:
    """The one owner of a run's checkpoints: when to save, saving every rank's part, and finding,
    agreeing on and loading the newest checkpoint every rank can read, for plain and sharded
    strategies alike.

    ``model`` is the plain model (its full weights, unsharded strategies), ``step_model`` what the
    step runs (sharded strategies save and load through it); ``accelerator`` gives rank, world and
    barriers. Every method is collective: all ranks call it together.
    """

    def __init__(self, root: str, accelerator, model: torch.nn.Module, step_model: torch.nn.Module, optimizer,
                 scheduler, *, sharded: bool, every: int, keep: int):
        self.root, self.accelerator = root, accelerator
        self.model, self.step_model, self.optimizer, self.scheduler = model, step_model, optimizer, scheduler
        self.sharded, self.every, self.keep = sharded, every, keep
        self.rank, self.world = accelerator.process_index, accelerator.num_processes

    def due(self, step: int, last: bool) -> bool:
        return step % self.every == 0 or last

    def save(self, step: int, meta: dict[str, Any]) -> None:
        """Rank 0 clears the step's folder, every rank writes its RNG state (and, sharded, its shards
        of the weights and optimiser state), then rank 0 writes the rest and marks it complete."""
        acc = self.accelerator
        if acc.is_main_process:
            begin(self.root, step)
        acc.wait_for_everyone()
        save_rank_rng(self.root, step, self.rank)
        if self.sharded:
            from sfm.distributed import strategies

            strategies.save_sharded(shards_url(self.root, step), self.step_model, self.optimizer)
        acc.wait_for_everyone()
        if acc.is_main_process:
            if self.sharded:
                save(self.root, step, None, None, self.scheduler.state_dict(), meta, keep=self.keep)
            else:
                save(self.root, step, self.model.state_dict(), self.optimizer.state_dict(),
                     self.scheduler.state_dict(), meta, keep=self.keep)
        acc.wait_for_everyone()

    def load(self) -> dict[str, Any] | None:
        """The newest checkpoint every rank can read, loaded into the model, optimiser and scheduler;
        None if there is none. Newest first: a checkpoint any rank cannot read or load is passed
        over by all (with a warning naming why), so the ranks never resume out of step."""
        steps = [complete_steps(self.root) if self.accelerator.is_main_process else None]
        if self.world > 1:
            torch.distributed.broadcast_object_list(steps, src=0)
        passed_over = False
        for step in reversed(steps[0]):
            url = step_dir(self.root, step)
            ckpt, why = None, ""
            try:
                ckpt = load(url, self.rank)
                why = self._cannot_restore(url, ckpt)
            except SFMError:
                raise
            except Exception as err:  # corrupt or partially deleted
                why = f"{type(err).__name__}: {err}"
            if why:
                log.warning("checkpoint %s is unreadable (%s); falling back to an earlier one", url, why)
            if self._all_ranks(not why):
                try:
                    self._restore(ckpt)
                except Exception as err:
                    why = f"{type(err).__name__}: {err}"
                    log.warning("checkpoint %s cannot be loaded (%s); falling back to an earlier one", url, why)
                if self._all_ranks(not why):
                    if passed_over and self.world > 1:
                        log.warning("all ranks continue from step %d", step)
                    ckpt["url"] = url
                    return ckpt
            elif not why:
                log.warning("checkpoint %s is unreadable on another rank; falling back to an earlier one", url)
            passed_over = True
        return None

    def _cannot_restore(self, url: str, ckpt: dict[str, Any]) -> str:
        """Why this strategy cannot restore ``ckpt`` ("" if it can)."""
        if self.sharded and ckpt["shards"] is None:
            return "it was written by an unsharded strategy"
        if not self.sharded and ckpt["model"] is None:
            raise SFMError(f"checkpoint {url} is sharded (an fsdp2 run); resume it with the same dist.strategy "
                           "on more than one process")
        return ""

    def _restore(self, ckpt: dict[str, Any]) -> None:
        if self.sharded:
            from sfm.distributed import strategies

            strategies.load_sharded(ckpt["shards"], self.step_model, self.optimizer)
        else:
            self.model.load_state_dict(ckpt["model"])
            self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])

    def _all_ranks(self, ok: bool) -> bool:
        """True when ``ok`` holds on every rank (a collective)."""
        if self.world == 1:
            return ok
        flag = torch.tensor([0.0 if ok else 1.0], device=self.accelerator.device)
        torch.distributed.all_reduce(flag)
        return flag.item() == 0
