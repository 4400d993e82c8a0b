"""Overlapping FSDP2's collectives with compute on gloo (CPU), through FSDP2's *private* collectives API.

Imported only by :func:`sfm.distributed.strategies.apply_strategy` for FSDP2 over gloo, inside a guard:
if torch moves or changes ``torch.distributed.fsdp._fully_shard._fsdp_collectives``, importing this
module fails and training runs plain FSDP2. Nothing else imports it, so DDP, NCCL and GPU users
never depend on torch internals.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_collectives import AllGather, DefaultAllocMixin, ReduceScatter


class OverlappedAllGather(DefaultAllocMixin, AllGather):
    """FSDP2's parameter all-gather, always issued asynchronously: FSDP waits on the returned work
    right before it copies the parameters out, so a prefetched all-gather overlaps the compute before it."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work:
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=True)


class OverlappedReduceScatter(DefaultAllocMixin, ReduceScatter):
    """FSDP2's gradient reduce-scatter of one unit, left running while backward continues.

    FSDP2 hands the output buffer over as the unit's sharded gradients without reading it when it
    reduces in float32 or bfloat16 (no post-division), so the reduction may finish later:
    the first call of a backward queues an end-of-backward callback that waits for all of them. When
    the unit's parameters already hold gradients (accumulation across backwards without zeroing),
    FSDP2 adds the output to them at once, so that call waits before returning.
    """

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> dist.Work | None:
        work = dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=True)
        reads_output_now = (output_tensor.dtype not in (torch.float32, torch.bfloat16)
                            or any(p.grad is not None for p in self.params))
        if reads_output_now or not _PENDING.defer(work):
            work.wait()
        return None


class _PendingReductions:
    """Reductions in flight in the current backward, waited for by one end-of-backward callback."""

    def __init__(self) -> None:
        self.works: list[dist.Work] = []

    def defer(self, work: dist.Work) -> bool:
        """Keep ``work`` for the end of the running backward; False outside a backward."""
        if not self.works:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self.wait)
            except RuntimeError:  # not inside a backward pass
                return False
        self.works.append(work)
        return True

    def wait(self) -> None:
        works, self.works = self.works, []
        for work in works:
            work.wait()


_PENDING = _PendingReductions()


def overlap_gloo_communication(model: nn.Module, units: list[nn.Module]) -> None:
    """Give an FSDP2 ``model`` (sharded as ``units`` + root, over gloo) the overlapped collectives
    above, and have the root and each unit prefetch the next unit's parameters in forward (the units
    are in forward order, as :func:`sharding_units` lists them)."""
    owned_by_unit = {id(p) for unit in units for p in unit.parameters()}
    for module in [*units, model]:
        own = list(module.parameters()) if module is not model else \
            [p for p in model.parameters() if id(p) not in owned_by_unit]
        module.set_custom_all_gather(OverlappedAllGather())
        module.set_custom_reduce_scatter(OverlappedReduceScatter(own))
    for module, following in zip([model, *units], units):  # the root computes first (patch embedding)
        module.set_modules_to_forward_prefetch([following])
