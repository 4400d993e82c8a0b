"""Context parallelism for the MAE: one volume's tokens split across the ranks of a cp group.

Applied from outside the model, as torchtitan's ``parallelize.py`` does; ``sfm/model`` stays free
of process groups. A training step on a dp x cp mesh, per rank::

    model = apply_context_parallel(build_model(cfg), cp_group)  # ring attention in every block
    slab = crop_slab(cfg.crop, cfg.patch, cp_rank, cp_size)      # the loader reads only this
    out = cp_forward_loss(model, volumes[..., slab.start:slab.stop, :, :], cfg.crop, cp_group)
    out.loss.backward()                                          # this rank's term of the loss
    all_reduce_grads(model, cp_group)                            # sum over cp: exact gradients
    # out.value is the step's loss, out.mask_ratio the effective mask ratio (log it)

Or, in a loop written for the model (``sfm.train.step.TrainStep`` under Accelerate's DDP/FSDP
over the whole dp x cp world), use ``ContextParallelMAE(model, cp_group, crop)`` in the model's
place and feed it slabs: its forward returns ``(loss, None, CPLoss)`` like the model's
``(loss, pred, mask)``, and the gradient averaging over all ranks comes out exact.

Three layouts of one volume's tokens, computed alike on every rank from the crop, cp and the mask:

- data: rank r holds the inline slab :func:`crop_slab` -> patch tokens ``[t_r, t_r+1)`` in
  patchify order (D-major), so no rank reads the whole crop;
- encoder: ``[cls, K kept tokens in shuffle order]``, split evenly (:func:`shard_bounds`). ``K + 1``
  is made a multiple of cp by :func:`cp_kept_tokens` (the mask ratio moves slightly; it is reported);
- decoder: ``[cls, all L tokens in patch order]``, split evenly (shards differ by at most one token;
  ring attention is exact for unequal shards, so nothing is padded). When the inline patch rows
  divide by cp, rank r's decoder tokens are exactly its data slab's.

Rows move between layouts with one ``all_to_all`` each: raw patches to the encoder and to the loss,
encoder outputs to the decoder (with their gradients in backward). The random mask is drawn as the
single-rank model draws it (``model.random_masking``) and broadcast from cp rank 0, so all cp ranks
agree whatever their RNG state. Loss and gradients equal the single-rank step on the same crop
and mask to float tolerance (tests/test_context_parallel.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from sfm.errors import SFMError
from sfm.distributed.ring_attention import RingAttention, global_rank, ring_attention, shard_bounds

__all__ = [
    "CPLoss",
    "ContextParallelMAE",
    "CropSlab",
    "all_reduce_grads",
    "apply_context_parallel",
    "cp_forward_loss",
    "cp_kept_tokens",
    "crop_slab",
    "mask_ratio_for_kept",
    "remove_context_parallel",
    "ring_attention",
]


# --------------------------------------------------------------------------------------------
# Applying ring attention to a model
# --------------------------------------------------------------------------------------------


def apply_context_parallel(model: nn.Module, group: dist.ProcessGroup | None) -> nn.Module:
    """Swap every attention's ``attn_fn`` (the model's seam) for ring attention over ``group``.

    From then on the model's blocks expect this rank's shard of each sequence; run steps with
    :func:`cp_forward_loss`. Returns the model (changed in place)."""
    hooks = [m for m in model.modules() if hasattr(m, "attn_fn")]
    if not hooks:
        raise ValueError(f"{type(model).__name__} has no attention module with an attn_fn to replace")
    ring = RingAttention(group)
    for m in hooks:
        m.attn_fn = ring
    return model


def remove_context_parallel(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_context_parallel`: back to ``F.scaled_dot_product_attention``."""
    for m in model.modules():
        if isinstance(getattr(m, "attn_fn", None), RingAttention):
            m.attn_fn = torch.nn.functional.scaled_dot_product_attention
    return model


def _check_applied(model: nn.Module, group) -> None:
    for m in model.modules():
        if hasattr(m, "attn_fn") and not (isinstance(m.attn_fn, RingAttention) and m.attn_fn.group is group):
            raise ValueError("the model's attention is not ring attention over this cp group; "
                             "call apply_context_parallel(model, group) first")


# --------------------------------------------------------------------------------------------
# Geometry: kept tokens and data slabs
# --------------------------------------------------------------------------------------------


def cp_kept_tokens(num_patches: int, mask_ratio: float, cp: int) -> int:
    """Kept (visible) tokens K nearest the model's ``max(1, int(L * (1 - mask_ratio)))`` such that
    the encoder sequence ``K + 1`` (with cls) divides evenly by ``cp``; ties go to fewer tokens.

    The effective mask ratio is ``1 - K / num_patches``."""
    L = int(num_patches)
    want = max(1, int(L * (1 - mask_ratio)))
    down = want - (want + 1) % cp  # largest K <= want with (K + 1) % cp == 0
    candidates = [k for k in (down, down + cp) if 1 <= k <= L]
    if not candidates:
        raise SFMError(f"a crop of {L} patches cannot be split over cp={cp} ranks (needs at least "
                       f"{cp - 1} visible patches); use a larger crop or a smaller cp")
    return min(candidates, key=lambda k: (abs(k - want), k))


def mask_ratio_for_kept(num_patches: int, kept: int) -> float:
    """The mask ratio that ``random_masking`` (``int(L * (1 - r))`` kept) turns into exactly ``kept``."""
    return 1.0 - (kept + 0.5) / num_patches


class CropSlab(NamedTuple):
    """One cp rank's share of a crop: inline voxels ``[start, stop)`` at full crossline and sample
    extent, holding patch tokens ``[tokens[0], tokens[1])`` in patchify (D-major) order."""

    start: int
    stop: int
    tokens: tuple[int, int]

    def of(self, volume):
        """The slab of a crop array ``[..., D, H, W]`` (numpy or torch) -> ``[..., stop-start, H, W]``."""
        return volume[..., self.start:self.stop, :, :]


def crop_slab(crop, patch, cp_rank: int, cp_size: int) -> CropSlab:
    """The patch-aligned inline slab of ``crop`` (D, H, W voxels) that cp rank ``cp_rank`` reads.

    The crop's ``D / patch[0]`` inline patch rows are split as evenly as rows allow (counts differ
    by at most one), so each rank reads about ``1 / cp_size`` of the crop and the slabs tile it."""
    crop, patch = tuple(int(c) for c in crop), tuple(int(p) for p in patch)
    if len(crop) != 3 or len(patch) != 3 or any(c % p for c, p in zip(crop, patch)):
        raise SFMError(f"crop {crop} is not a multiple of patch {patch}; choose a crop that is")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside [0, {cp_size})")
    gd, gh, gw = (c // p for c, p in zip(crop, patch))
    if gd < cp_size:
        raise SFMError(f"crop {crop} has {gd} inline patch rows, fewer than cp={cp_size} ranks; use an "
                       f"inline crop of at least {cp_size * patch[0]} voxels or a smaller cp")
    rows = shard_bounds(gd, cp_size)
    r0, r1 = rows[cp_rank], rows[cp_rank + 1]
    return CropSlab(r0 * patch[0], r1 * patch[0], (r0 * gh * gw, r1 * gh * gw))


# --------------------------------------------------------------------------------------------
# Moving rows between layouts
# --------------------------------------------------------------------------------------------


def _locate(bounds: list[int], where: torch.Tensor):
    """Positions ``where`` [N, M] of a sequence split at ``bounds`` -> (owner rank, row in the
    owner's flattened [N, shard_len] table), both flat [N*M]."""
    b = torch.tensor(bounds, device=where.device)
    where = where.contiguous()
    rank = torch.searchsorted(b, where, right=True) - 1
    lens = b[1:] - b[:-1]
    n = torch.arange(where.shape[0], device=where.device)[:, None]
    return rank.flatten(), (n * lens[rank] + where - b[rank]).flatten()


class _RowExchange:
    """A fixed exchange of rows among the ranks of a group, planned alike on every rank.

    Transfer i moves row ``src[1][i]`` of rank ``src[0][i]``'s source table to row ``dst[1][i]``
    of rank ``dst[0][i]``'s destination table (``rows_out`` rows here; rows nobody sends stay zero).
    """

    def __init__(self, src, dst, rows_out: int, group):
        me, world = dist.get_rank(group), dist.get_world_size(group)
        (src_rank, src_row), (dst_rank, dst_row) = src, dst
        out = src_rank == me  # what I send, grouped by destination, in transfer order
        order = torch.argsort(dst_rank[out], stable=True)
        self.send_rows = src_row[out][order]
        self.send_counts = torch.bincount(dst_rank[out], minlength=world).tolist()
        inc = dst_rank == me  # what I receive, grouped by source, in the same transfer order
        order = torch.argsort(src_rank[inc], stable=True)
        self.recv_rows = dst_row[inc][order]
        self.recv_counts = torch.bincount(src_rank[inc], minlength=world).tolist()
        self.rows_out, self.group = rows_out, group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows_in, F] -> [rows_out, F]; differentiable (the gradient goes back the same way)."""
        return _Exchange.apply(x, self)


def _all_to_all_rows(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv_counts),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group)
    return out


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ex: _RowExchange):
        ctx.ex, ctx.rows_in = ex, x.shape[0]
        got = _all_to_all_rows(x[ex.send_rows], ex.send_counts, ex.recv_counts, ex.group)
        out = x.new_zeros((ex.rows_out,) + tuple(x.shape[1:]))
        out[ex.recv_rows] = got
        return out

    @staticmethod
    def backward(ctx, grad):
        ex = ctx.ex
        back = _all_to_all_rows(grad[ex.recv_rows], ex.recv_counts, ex.send_counts, ex.group)
        grad_x = grad.new_zeros((ctx.rows_in,) + tuple(grad.shape[1:]))
        return grad_x.index_add_(0, ex.send_rows, back), None


# --------------------------------------------------------------------------------------------
# The MAE step on a sequence-sharded volume
# --------------------------------------------------------------------------------------------


class CPLoss(NamedTuple):
    """What :func:`cp_forward_loss` returns on each cp rank.

    loss: this rank's term (requires grad); the terms of the cp ranks sum to the step's loss.
    value: the step's loss, detached, the same on every cp rank.
    kept: visible tokens K per volume; mask_ratio: the effective ratio ``1 - K / L``.
    """

    loss: torch.Tensor
    value: torch.Tensor
    kept: int
    mask_ratio: float


def embed_patches(model: nn.Module, patches: torch.Tensor) -> torch.Tensor:
    """The model's patch embedding of patch vectors [N, M, P] (patchify layout) -> tokens [N, M, E].

    The patches are laid out as a [N, C, pd, ph, pw * M] volume (``unpatchify`` on a 1 x 1 x M
    grid) and embedded by ``model.patch_embed`` itself, whether it returns tokens [N, M, E] or,
    as a Conv3d does, a feature volume [N, E, 1, 1, M]."""
    x = model.patch_embed(model.unpatchify(patches, grid=(1, 1, patches.shape[1])))
    return x if x.ndim == 3 else x.flatten(2).transpose(1, 2)


def _run_blocks(model: nn.Module, blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    """The blocks in order, honouring the model's activation-checkpointing switch."""
    recompute = getattr(model, "grad_checkpointing", False) and model.training and torch.is_grad_enabled()
    for blk in blocks:
        x = checkpoint(blk, x, use_reentrant=False) if recompute else blk(x)
    return x


def _shared_mask(model: nn.Module, slab: torch.Tensor, grid: tuple[int, int, int], K: int, group, generator,
                 noise=None):
    """The random mask of the ``slab``'s N crops (L = prod(grid) tokens each) as ``model.random_masking``
    draws it, taken from cp rank 0.

    -> ids_keep [N, K] (kept token ids in shuffle order), mask [N, L] bool (True: removed)."""
    N, L = slab.shape[0], math.prod(grid)
    index = torch.arange(L, device=slab.device).expand(N, L).unsqueeze(-1)  # tokens stand in for themselves
    kept, _, ids_restore = model.random_masking(index, mask_ratio_for_kept(L, K), generator, noise, grid)
    if kept.shape[1] != K:
        raise RuntimeError(f"random_masking kept {kept.shape[1]} tokens, expected {K}")
    ids_restore = ids_restore.contiguous()
    dist.broadcast(ids_restore, src=global_rank(group, 0), group=group)
    ids_keep = torch.argsort(ids_restore, dim=1)[:, :K]
    return ids_keep, ids_restore >= K


def cp_forward_loss(model: nn.Module, slab: torch.Tensor, crop, group: dist.ProcessGroup | None = None,
                    mask_ratio: float | None = None, generator: torch.Generator | None = None,
                    noise: torch.Tensor | None = None) -> CPLoss:
    """One MAE forward and loss on a volume batch split across the cp ``group``.

    model: a :class:`~sfm.model.MaskedAutoencoder3D` after :func:`apply_context_parallel`.
    slab: this rank's inline slab of the crops, ``[N, C, stop-start, H, W]`` for
        ``crop_slab(crop, model.cfg.patch, cp_rank, cp_size)`` (the same N crops on every cp rank).
    crop: the whole crop (D, H, W) in voxels.
    mask_ratio: defaults to ``model.cfg.mask_ratio``; adjusted by :func:`cp_kept_tokens`.
    generator: the RNG the mask noise is drawn from, as in ``model(imgs, generator=...)``; every
        cp rank draws, cp rank 0's mask is used.
    noise: [N, L] mask noise instead of drawing it (``model(imgs, noise=...)``); cp rank 0's is used.

    Backward of ``loss`` on every cp rank, then summing parameter gradients over the group
    (:func:`all_reduce_grads`), gives the single-rank gradients of the same crop and mask.
    """
    _check_applied(model, group)
    cfg = model.cfg
    me, cp = dist.get_rank(group), dist.get_world_size(group)
    crop = tuple(int(c) for c in crop)
    mine = crop_slab(crop, cfg.patch, me, cp)
    N = slab.shape[0]
    want = (N, cfg.in_chans, mine.stop - mine.start, crop[1], crop[2])
    if tuple(slab.shape) != want:
        raise ValueError(f"cp rank {me} of {cp} expects its slab {want} of crop {crop}, got {tuple(slab.shape)}")
    grid = tuple(c // p for c, p in zip(crop, cfg.patch))
    L = math.prod(grid)
    K = cp_kept_tokens(L, cfg.mask_ratio if mask_ratio is None else mask_ratio, cp)
    ids_keep, mask = _shared_mask(model, slab, grid, K, group, generator, noise)

    data_b = [crop_slab(crop, cfg.patch, r, cp).tokens[0] for r in range(cp)] + [L]
    enc_b, dec_b = shard_bounds(K + 1, cp), shard_bounds(L + 1, cp)
    dec_tok_b = [max(b - 1, 0) for b in dec_b]  # the decoder's tokens, cls left out
    e0, e1, d0, d1 = enc_b[me], enc_b[me + 1], dec_b[me], dec_b[me + 1]
    t0, t1 = dec_tok_b[me], dec_tok_b[me + 1]
    dev = slab.device
    positions = torch.arange(K + 1, device=dev).expand(N, K + 1)  # encoder sequence positions
    all_tokens = torch.arange(L, device=dev).expand(N, L)
    patches = model.patchify(slab)  # [N, L_me, P]
    P = patches.shape[-1]

    # encoder: this rank's share of [cls, kept patches], cls on the rank holding position 0
    to_encoder = _RowExchange(_locate(data_b, ids_keep), _locate(enc_b, positions[:, 1:]), N * (e1 - e0), group)
    enc_patches = to_encoder(patches.reshape(-1, P)).view(N, e1 - e0, P)
    enc_tokens = torch.cat([ids_keep.new_zeros(N, 1), ids_keep], dim=1)[:, e0:e1]  # 0 stands for cls
    first = 1 if e0 == 0 else 0
    x = embed_patches(model, enc_patches[:, first:])
    x = x + model.pos_embed(grid, x.shape[-1], x)[0][enc_tokens[:, first:]]
    if first:  # the cls token carries no position
        x = torch.cat([model.cls_token.to(x.dtype).expand(N, -1, -1), x], dim=1)
    x = model.norm(_run_blocks(model, model.blocks, x))

    # decoder: [cls, all tokens] with mask tokens where patches were removed
    dec_positions = torch.cat([ids_keep.new_zeros(N, 1), ids_keep + 1], dim=1)  # where encoder rows go
    to_decoder = _RowExchange(_locate(enc_b, positions), _locate(dec_b, dec_positions), N * (d1 - d0), group)
    y = model.decoder_embed(x)
    Ed = y.shape[-1]
    y = to_decoder(y.reshape(-1, Ed)).view(N, d1 - d0, Ed)
    visible = torch.cat([torch.zeros_like(mask[:, :1]), mask], dim=1)[:, d0:d1].logical_not()  # cls or kept
    y = torch.where(visible.unsqueeze(-1), y, model.mask_token.to(y.dtype))
    first = 1 if d0 == 0 else 0
    y = torch.cat([y[:, :first], y[:, first:] + model.pos_embed(grid, Ed, y)[0][t0:t1]], dim=1)
    y = model.decoder_norm(_run_blocks(model, model.decoder_blocks, y))[:, first:]
    pred = model.decoder_pred(y)  # [N, t1 - t0, P]

    # loss on this rank's tokens, weighted so that the ranks' terms sum to the single-rank loss
    to_loss = _RowExchange(_locate(data_b, all_tokens), _locate(dec_tok_b, all_tokens), N * (t1 - t0), group)
    target = to_loss(patches.reshape(-1, P)).view(N, t1 - t0, P)
    # the model's own loss (targets, norm_pix) on these patches laid out as a [N, C, pd, ph, pw * M] volume
    mine_mask = mask[:, t0:t1].float()
    part = model.forward_loss(model.unpatchify(target, grid=(1, 1, t1 - t0)), pred, mine_mask)
    loss = part * (mine_mask.sum() / mask.sum().clamp(min=1))
    if not first:  # every parameter in every rank's graph, for DDP/FSDP's gradient reduction
        loss = loss + 0.0 * model.cls_token.sum()
    value = loss.detach().clone()
    dist.all_reduce(value, group=group)
    return CPLoss(loss, value, K, 1.0 - K / L)


def all_reduce_grads(model: nn.Module, group: dist.ProcessGroup | None, bucket_elems: int = 1 << 25) -> None:
    """Sum parameter gradients over the cp ``group`` (missing gradients count as zero), in buckets."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    bucket: list[nn.Parameter] = []

    def flush():
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        dist.all_reduce(flat, group=group)
        offset = 0
        for p in bucket:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
        bucket.clear()

    size = 0
    for p in params:
        bucket.append(p)
        size += p.numel()
        if size >= bucket_elems:
            flush()
            size = 0
    if bucket:
        flush()


class ContextParallelMAE(nn.Module):
    """A model, its cp group and the crop as one module whose forward is the cp step, shaped like
    ``MaskedAutoencoder3D.forward`` so that a loop written for the model (``sfm.train.step``'s
    ``TrainStep``, DDP or FSDP2 from ``sfm.distributed.strategies``) runs it unchanged, fed slabs instead of crops::

        step_model = ContextParallelMAE(model, cp_group, crop)    # then strategies.apply_strategy(...)
        loss, _, cp = step_model(slab, generator=g)               # loss.backward(); log loss

    ``loss`` has the step's loss as its value (the same on every cp rank: log it) and cp times this
    rank's term as its gradient: DDP or FSDP averaging over all dp x cp ranks then yields the exact
    gradient (the cp terms are summed, the dp replicas averaged). Reducing gradients by hand
    instead? Use :func:`cp_forward_loss` and :func:`all_reduce_grads`. Give DDP/FSDP a process
    group other than ``group`` (e.g. the world, with cp a ``new_group``), so that their gradient
    reduction never interleaves with cp's collectives on one communicator. The third element is
    the :class:`CPLoss` (kept tokens, effective mask ratio) where the model returns its mask; the
    prediction is not gathered (None). Weights live at ``.mae``.
    """

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None, crop):
        super().__init__()
        self.mae = apply_context_parallel(model, group)
        self.group, self.crop = group, tuple(int(c) for c in crop)

    def forward(self, slab: torch.Tensor, mask_ratio: float | None = None,
                generator: torch.Generator | None = None, noise: torch.Tensor | None = None):
        out = cp_forward_loss(self.mae, slab, self.crop, self.group, mask_ratio, generator, noise)
        term = out.loss * dist.get_world_size(self.group)
        return term + (out.value - term).detach(), None, out
