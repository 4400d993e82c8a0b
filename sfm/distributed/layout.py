"""Where a rank sits in the dp x cp mesh, the groups that follow from it, and a check that replicas agree."""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import torch


class Layout(NamedTuple):
    """Where this rank sits in the dp x cp mesh: ranks ``d * cp .. d * cp + cp - 1`` share dp index
    ``d`` (the same crops; each holds 1/cp of every crop's tokens), so a cp group sits on one node."""

    world: int
    dp: int
    cp: int
    dp_rank: int
    cp_rank: int

    @classmethod
    def of(cls, rank: int, world: int, cp: int) -> "Layout":
        """cp must divide world (JobConfig.check_parallelism)."""
        return cls(world, world // cp, cp, rank // cp, rank % cp)


def cp_group(layout: Layout):
    """This rank's context-parallel group (every rank creates every group, in the same order)."""
    import torch.distributed as dist

    mine = None
    for d in range(layout.dp):
        group = dist.new_group(list(range(d * layout.cp, (d + 1) * layout.cp)))
        if d == layout.dp_rank:
            mine = group
    return mine


def replica_digests(model: torch.nn.Module) -> list[str]:
    """sha256 of each rank's full weights, gathered from every rank (a collective): replicas that
    drifted apart would show different digests."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    out: list[str | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, h.hexdigest())
    return out
