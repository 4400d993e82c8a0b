"""Batches of stored int8 values, normalised where the model runs: :class:`Int8Batch`.

With ``data.batch_dtype = "int8"`` (int8 stores only) the loader does not normalise: it cuts the
stored values, marks dead traces with :data:`DEAD` (a value int8 stores never hold: they use
-127..127) and sends each sample's normalisation along as four numbers. The device turns the batch
into what a float32 batch would have held, with the same float32 operations as
:meth:`sfm.data.survey.SurveyInfo.normalise_into`::

    x = (clamp(stored, lo, hi) * a + b), and 0 where stored == DEAD

so the CPU neither converts nor normalises, and every copy (region pool, batch, host to device) moves
one byte per voxel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEAD = -128  # dead traces in an int8 batch; normalised, they are exactly 0


@dataclass
class Int8Batch:
    """``values`` [B, 1, D, H, W] int8 (stored units); ``affine`` [B, 4] float32: per sample
    ``(lo, hi, a, b)``, the clip range in stored units and the multiply-add that normalises."""

    values: torch.Tensor
    affine: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def to(self, device, non_blocking: bool = False) -> "Int8Batch":
        return Int8Batch(self.values.to(device, non_blocking=non_blocking),
                         self.affine.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "Int8Batch":  # called by the DataLoader's pinning thread
        return Int8Batch(self.values.pin_memory(), self.affine.pin_memory())

    def float(self) -> torch.Tensor:
        """The normalised batch [B, 1, D, H, W] float32, on the batch's device."""
        lo, hi, a, b = (col.view(-1, *([1] * (self.values.dim() - 1))) for col in self.affine.unbind(1))
        x = torch.minimum(torch.maximum(self.values.float(), lo), hi).mul_(a).add_(b)
        return x.masked_fill_(self.values == DEAD, 0.0)
