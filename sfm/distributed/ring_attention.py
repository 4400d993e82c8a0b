"""Exact attention over a sequence split across a context-parallel process group (ring attention).

Every rank of ``group`` holds one contiguous shard of the sequence: q, k, v ``[N, heads, L_r, d]``
with ``sum(L_r) = L``; shards may differ in length (an odd ``L`` over two ranks is 19 + 18 tokens).
The result on each rank is its shard of full, non-causal softmax attention over all ``L`` tokens,
forward and backward, to float tolerance (Liu et al., 2023, "Ring Attention with Blockwise
Transformers"; the backward follows zhuzilin/ring-flash-attention and PyTorch's
``torch.distributed.tensor.experimental`` ring attention):

- forward: the K/V shards travel once around the ring (send to ``rank + 1``, receive from
  ``rank - 1``, the next transfer overlapping the current block); each rank attends its queries to
  every block with a kernel that also returns the log-sum-exp of the scores, and merges the block
  results exactly: ``lse = logaddexp(lse_a, lse_b)``, ``out = out_a e^(lse_a - lse) + out_b e^(lse_b - lse)``.
- backward: the K/V shards travel around again together with their dK/dV accumulators; each rank
  runs the kernel's own backward on (its q, the visiting k/v) with the *merged* out and lse, which
  gives that block's exact share of dQ, dK, dV; after a full turn each dK/dV lands on its owner.

Only two K/V shards (plus two dK/dV accumulators in backward) are alive at once, so memory per
rank scales with ``L / cp``. Block kernels: on CPU PyTorch's flash-attention-for-CPU pair
(``_scaled_dot_product_flash_attention_for_cpu`` and its backward: blocked, O(L) memory), the
one exact path tested here with gloo; on CUDA flash attention (fp16/bf16) or memory-efficient
attention (fp32) through the same ATen ops PyTorch's ``context_parallel`` uses. The CUDA path is
not exercised by this project's CPU tests; ``benchmarks/gpu_context.py`` checks it against SDPA.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

aten = torch.ops.aten

_KV_TAGS = (11, 12)  # P2P tags: K/V blocks and dK/dV accumulators travel concurrently
_GRAD_TAGS = (13, 14)


def even_split(total: int, parts: int) -> list[int]:
    """Lengths of ``parts`` contiguous shards of ``total`` items, differing by at most one
    (the longer shards first): ``even_split(37, 2) == [19, 18]``."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def shard_bounds(total: int, parts: int) -> list[int]:
    """Offsets ``[0, b_1, ..., total]`` of :func:`even_split`; shard i is ``[b_i, b_{i+1})``."""
    bounds = [0]
    for n in even_split(total, parts):
        bounds.append(bounds[-1] + n)
    return bounds


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The default-group rank of ``group_rank`` in ``group`` (None: the default group)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


# --------------------------------------------------------------------------------------------
# Block kernels: attention of q to one K/V block, returning the scores' log-sum-exp
# --------------------------------------------------------------------------------------------


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """q [N, h, Lq, d], k/v [N, h, Lk, d] -> (out [N, h, Lq, d], lse [N, h, Lq] float32, extras).

    ``extras`` is what :func:`block_backward` needs from this call besides out and lse.
    """
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
        return out, lse, ()
    if q.dtype in (torch.float16, torch.bfloat16):  # CUDA flash attention
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, False, False, scale=scale)
        return out, lse, ("flash", cum_q, cum_k, max_q, max_k, seed, offset)
    # CUDA fp32: memory-efficient attention; its lse may be padded along the sequence
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False,
                                                                          scale=scale)
    return out, lse[..., : q.shape[2]], ("efficient", seed, offset, lse.shape[-1])


def block_backward(dout, q, k, v, out, lse, scale: float, extras):
    """This block's share of (dq, dk, dv), given the *merged* out and lse over all blocks."""
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, False, scale=scale)
    if extras[0] == "flash":
        _, cum_q, cum_k, max_q, max_k, seed, offset = extras
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, False, seed, offset, scale=scale)
    _, seed, offset, lse_len = extras
    if lse_len > lse.shape[-1]:
        lse = F.pad(lse, (0, lse_len - lse.shape[-1]))
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse.contiguous(), seed, offset, 0.0, [True, True, True, False], False,
        scale=scale)
    return dq, dk, dv


def merge_blocks(acc_out, acc_lse, out, lse):
    """Exact softmax merge of two partial attentions over disjoint key sets (float32).

    acc_out/out [N, h, L, d], acc_lse/lse [N, h, L]; pass acc_out=None for the first block.
    """
    out, lse = out.float(), lse.float()
    if acc_out is None:
        return out, lse
    new_lse = torch.logaddexp(acc_lse, lse)
    return (acc_out * torch.exp(acc_lse - new_lse).unsqueeze(-1)
            + out * torch.exp(lse - new_lse).unsqueeze(-1)), new_lse


# --------------------------------------------------------------------------------------------
# The ring
# --------------------------------------------------------------------------------------------


class _Ring:
    """Point-to-point shifts around a process group: send to rank+1, receive from rank-1."""

    def __init__(self, group: dist.ProcessGroup | None, lengths: list[int]):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.lengths = lengths
        self.next = global_rank(group, (self.rank + 1) % self.size)
        self.prev = global_rank(group, (self.rank - 1) % self.size)

    def shift(self, tensors: tuple[torch.Tensor, ...], recv_len: int, tags: tuple[int, ...]):
        """Start sending ``tensors`` [N, h, l, d] onward and receiving ``recv_len``-long ones.

        Returns (received buffers, pending transfer for :func:`_wait`)."""
        recv = tuple(t.new_empty(t.shape[:2] + (recv_len,) + t.shape[3:]) for t in tensors)
        ops = []
        for t, r, tag in zip(tensors, recv, tags):
            ops.append(dist.P2POp(dist.isend, t.contiguous(), self.next, self.group, tag))
            ops.append(dist.P2POp(dist.irecv, r, self.prev, self.group, tag))
        return recv, (dist.batch_isend_irecv(ops), ops)  # ops keep the send buffers alive

    def owner(self, step: int) -> int:
        """Group rank whose K/V block this rank holds at ring step ``step``."""
        return (self.rank - step) % self.size


def _wait(pending) -> None:
    for req in pending[0]:
        req.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale):
        lengths = _shard_lengths(q, k, group)
        ring = _Ring(group, lengths)
        k_blk, v_blk = k.contiguous(), v.contiguous()
        acc_out = acc_lse = None
        extras = []
        for step in range(ring.size):
            if step < ring.size - 1:  # fetch the next block while attending to this one
                nxt, reqs = ring.shift((k_blk, v_blk), lengths[ring.owner(step + 1)], _KV_TAGS)
            out, lse, extra = block_forward(q, k_blk, v_blk, scale)
            acc_out, acc_lse = merge_blocks(acc_out, acc_lse, out, lse)
            extras.append(extra)
            if step < ring.size - 1:
                _wait(reqs)
                k_blk, v_blk = nxt
        out = acc_out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc_lse)
        ctx.group, ctx.scale, ctx.lengths, ctx.extras = group, scale, lengths, extras
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group, ctx.lengths)
        dout = dout.contiguous()
        k_blk, v_blk = k.contiguous(), v.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        grad_in, grad_reqs = None, ((), ())
        for step in range(ring.size):
            if step < ring.size - 1:
                nxt, kv_reqs = ring.shift((k_blk, v_blk), ctx.lengths[ring.owner(step + 1)], _KV_TAGS)
            dq_b, dk_b, dv_b = block_backward(dout, q, k_blk, v_blk, out, lse, ctx.scale, ctx.extras[step])
            dq += dq_b
            if step == 0:
                dk_acc, dv_acc = dk_b.float(), dv_b.float()
            else:  # the accumulators for this block, from the rank that held it one step ago
                _wait(grad_reqs)
                dk_acc, dv_acc = grad_in[0] + dk_b, grad_in[1] + dv_b
            # pass them on; after the last step they arrive at the block's owner
            grad_in, grad_reqs = ring.shift((dk_acc, dv_acc), ctx.lengths[ring.owner(step + 1)], _GRAD_TAGS)
            if step < ring.size - 1:
                _wait(kv_reqs)
                k_blk, v_blk = nxt
        _wait(grad_reqs)
        dk, dv = grad_in
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _shard_lengths(q: torch.Tensor, k: torch.Tensor, group) -> list[int]:
    """Every rank's shard length (one small all_gather; shards may differ)."""
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"ring attention is self-attention: q has {q.shape[2]} tokens, k has {k.shape[2]}")
    mine = torch.tensor([q.shape[2]], dtype=torch.int64, device=q.device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    lengths = [int(t.item()) for t in every]
    if min(lengths) < 1:
        raise ValueError(f"every context-parallel rank needs at least one token; shard lengths are {lengths}")
    return lengths


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: dist.ProcessGroup | None = None, scale: float | None = None) -> torch.Tensor:
    """Non-causal softmax attention of this rank's queries to the keys of every rank in ``group``.

    q, k, v: this rank's contiguous shard [N, heads, L_r, head_dim] (the same N, heads, head_dim
    on every rank; L_r may differ). Returns this rank's shard of the output [N, heads, L_r, head_dim],
    equal to the matching rows of ``F.scaled_dot_product_attention`` on the concatenated sequence.
    With a single rank it is exactly ``F.scaled_dot_product_attention``.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if dist.get_world_size(group) == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    return _RingAttention.apply(q, k, v, group, scale)


class RingAttention:
    """``attn_fn(q, k, v)`` for :class:`sfm.model.blocks.Attention`: :func:`ring_attention` over ``group``."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, self.group)

    def __deepcopy__(self, memo):  # a process group is shared, never copied
        return self

    def __repr__(self) -> str:
        return f"RingAttention(cp={dist.get_world_size(self.group)})"
