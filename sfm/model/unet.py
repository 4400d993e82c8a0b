"""A FaultSeg3D-style 3D U-Net (Wu et al., 2019, "FaultSeg3D"): the network a user would otherwise train on
their own fault labels, and the yardstick a fine-tuned encoder has to beat (DESIGN.md "Using the model").

Three levels of 16, 32 and 64 channels, two 3 x 3 x 3 convolutions with ReLU per level, 2 x 2 x 2 max
pooling down, nearest-neighbour upsampling and concatenation with the skip up, a 1 x 1 x 1 convolution to
the logits: about 350k parameters, trained from scratch with class-balanced cross-entropy.

As a task model it is the ``unet`` head of :class:`sfm.model.segmenter.Segmenter`, with no encoder (the fine-tune
flow's ``--encoder unet``), so it is fine-tuned, scored, registered, exported and predicted like any other.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def double_conv(cin: int, cout: int) -> nn.Sequential:
    """Two 3 x 3 x 3 convolutions with ReLU: [N, cin, D, H, W] -> [N, cout, D, H, W]."""
    return nn.Sequential(nn.Conv3d(cin, cout, 3, padding=1), nn.ReLU(inplace=True),
                         nn.Conv3d(cout, cout, 3, padding=1), nn.ReLU(inplace=True))


class UNet3D(nn.Module):
    """imgs [N, in_chans, D, H, W] -> logits [N, channels, D, H, W] (D, H, W divisible by 2 ** (levels - 1)).

    ``widths``: channels per level, full resolution first (FaultSeg3D's are 16, 32, 64 with a 128 bottom
    level for 128^3 volumes; at 32 x 32 x 64 crops three levels reach 8 x 8 x 16 voxels at the bottom).
    """

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64), in_chans: int = 1, channels: int = 1):
        super().__init__()
        self.widths = tuple(widths)
        self.down = nn.ModuleList()
        cin = in_chans
        for w in widths:
            self.down.append(double_conv(cin, w))
            cin = w
        self.up = nn.ModuleList(double_conv(widths[k + 1] + widths[k], widths[k]) for k in range(len(widths) - 1))
        self.classify = nn.Conv3d(widths[0], channels, 1)

    @property
    def divisor(self) -> int:
        """What every side of an input must be a multiple of: the pooling's 2 ** (levels - 1)."""
        return 2 ** (len(self.widths) - 1)

    def features(self, imgs: torch.Tensor) -> list[torch.Tensor]:
        """The encoder path: one [N, widths[k], D / 2^k, H / 2^k, W / 2^k] per level, full resolution first."""
        skips, x = [], imgs
        for k, block in enumerate(self.down):
            x = block(x if k == 0 else F.max_pool3d(x, 2))
            skips.append(x)
        return skips

    def decode(self, skips: list[torch.Tensor]) -> torch.Tensor:
        """The decoder path over ``features``' levels -> [N, widths[0], D, H, W] (before the classifier)."""
        x = skips[-1]
        for k in range(len(skips) - 2, -1, -1):
            x = F.interpolate(x, scale_factor=2, mode="nearest")
            x = self.up[k](torch.cat([x, skips[k]], dim=1))
        return x

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.classify(self.decode(self.features(imgs)))
