"""Muon for the transformer blocks' weight matrices, AdamW for every other parameter, as one optimiser.

Muon (Jordan et al. 2024) keeps a Nesterov momentum of each weight matrix's gradient and steps along
its orthogonalisation (five Newton-Schulz iterations, in bf16), so every direction of the matrix moves
at the same rate. Its step is scaled by ``0.2 * sqrt(max(rows, cols))`` (Liu et al. 2025, "Muon is
scalable for LLM training"), so that its size matches an AdamW step's and AdamW's weight decay carries
over. Embeddings, the output projection, norms, biases and tokens stay with AdamW, as the authors
advise. One :class:`torch.optim.Optimizer`, so ``LambdaLR``, ``state_dict`` and the checkpoints treat it
like AdamW: each group's ``lr`` is its own peak rate times the schedule's factor.

Each matrix is orthogonalised whole, so Muon needs the whole gradient on every rank: DDP and context
parallelism give it that, FSDP's shards do not (``sfm.config`` refuses the pair).
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Jordan et al.'s quintic iteration
NS_STEPS = 5


def muon_parameters(model: torch.nn.Module) -> list[str]:
    """Names of the parameters Muon updates: the 2-D weights inside ``blocks`` and ``decoder_blocks``
    (attention qkv and projection, MLP layers); every other parameter is AdamW's."""
    return [name for name, p in model.named_parameters()
            if p.requires_grad and p.ndim == 2 and ("blocks." in name)]


def orthogonalise(g: torch.Tensor, steps: int = NS_STEPS, eps: float = 1e-7) -> torch.Tensor:
    """The matrices nearest ``g`` [rows, cols] or [B, rows, cols] with every singular value near 1
    (Newton-Schulz in bf16): ``U S' V^T`` with ``S'`` roughly between 0.5 and 1.5 where ``g = U S V^T``.
    Returns ``g``'s shape and dtype. A batch of same-shape matrices runs as one batched product."""
    a, b, c = NS_COEFFICIENTS
    x = g.bfloat16()
    if x.ndim == 2:
        x = x[None]
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)  # a x + (b G + c G^2) x
    x = x.mT if tall else x
    return x.reshape(g.shape).to(g.dtype)


_pool: tuple[int, ThreadPoolExecutor] | None = None  # (pid, threads) of this process


def orthogonalise_all(stacks: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`orthogonalise` of each stack [B, rows, cols], the same values as one after another. On a
    CPU with several intra-op threads the stacks run concurrently on that many threads, largest first:
    a bf16 batched product of these sizes runs on one core, so in turn they would leave the others idle."""
    threads = torch.get_num_threads()
    if len(stacks) < 2 or threads < 2 or stacks[0].device.type != "cpu":
        return [orthogonalise(s) for s in stacks]
    global _pool
    if _pool is None or _pool[0] != os.getpid():
        _pool = (os.getpid(), ThreadPoolExecutor(max_workers=threads, thread_name_prefix="sfm-muon"))
    order = sorted(range(len(stacks)), key=lambda i: -stacks[i].numel())
    done = dict(zip(order, _pool[1].map(orthogonalise, [stacks[i] for i in order])))
    return [done[i] for i in range(len(stacks))]


class MuonAdamW(torch.optim.Optimizer):
    """Groups with ``muon=True`` step by Muon (``momentum``, Nesterov), the others by AdamW (``betas``,
    ``eps``); every group decays its weights by ``lr * weight_decay`` (decoupled) before the step."""

    def __init__(self, groups: list[dict], *, lr: float, betas: tuple[float, float] = (0.9, 0.95),
                 momentum: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.0):
        defaults = dict(lr=lr, betas=tuple(betas), momentum=momentum, eps=eps, weight_decay=weight_decay, muon=False)
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            params = [p for p in group["params"] if p.grad is not None]
            if wd:
                for p in params:
                    p.mul_(1 - lr * wd)
            if group["muon"]:
                self._muon_step(params, group["momentum"], lr)
            else:
                for p in params:
                    self._adamw_step(p, group, lr)
        return loss

    def _muon_step(self, params: list[torch.Tensor], mu: float, lr: float) -> None:
        """Nesterov momentum, orthogonalised: same-shape matrices together (one batched product)."""
        by_shape: dict[torch.Size, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for p in params:
            buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
            buf.lerp_(p.grad, 1 - mu)  # an average of the gradients (a sum's direction: the scale drops out)
            by_shape.setdefault(p.shape, []).append((p, p.grad.lerp(buf, mu)))  # Nesterov
        stacks = [torch.stack([u for _, u in pairs]) for pairs in by_shape.values()]
        for (shape, pairs), updates in zip(by_shape.items(), orthogonalise_all(stacks)):
            for (p, _), update in zip(pairs, updates):
                p.add_(update, alpha=-lr * 0.2 * math.sqrt(max(shape)))

    def _adamw_step(self, p: torch.Tensor, group: dict, lr: float) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        t = float(state["step"])
        state["exp_avg"].lerp_(p.grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        denom = (state["exp_avg_sq"] / (1 - beta2 ** t)).sqrt_().add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1 ** t))
