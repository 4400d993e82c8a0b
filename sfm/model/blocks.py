"""The transformer's layers, what facebookresearch/mae takes from timm: the 3D patch embedding, multi-head
self-attention on PyTorch's fused SDPA, the MLP and the pre-norm ViT block. :class:`sfm.model.mae.MaskedAutoencoder3D`
is built from them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

Int3 = tuple[int, int, int]


class PatchEmbed3D(nn.Module):
    """Non-overlapping 3D patches -> tokens: imgs [N, C, D, H, W] -> [N, L, E], D-major patch order.

    The same function as ``nn.Conv3d(C, E, kernel_size=patch, stride=patch)`` and the same
    parameters (``weight`` [E, C, pd, ph, pw], ``bias`` [E]), so checkpoints of either load into
    the other; computed as one matmul over the cut-out patches, which on CPU is much faster than
    the convolution's backward.
    """

    def __init__(self, in_chans: int, embed_dim: int, patch: Int3):
        super().__init__()
        self.patch = tuple(patch)
        self.weight = nn.Parameter(torch.empty(embed_dim, in_chans, *self.patch))
        self.bias = nn.Parameter(torch.empty(embed_dim))
        self.reset_parameters()

    def reset_parameters(self):
        # like nn.Linear in MAE: xavier on the flattened [E, C*pd*ph*pw] matrix, zero bias
        nn.init.xavier_uniform_(self.weight.data.view(self.weight.shape[0], -1))
        nn.init.zeros_(self.bias)

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        N, C, D, H, W = imgs.shape
        pd, ph, pw = self.patch
        gd, gh, gw = D // pd, H // ph, W // pw
        x = imgs.reshape(N, C, gd, pd, gh, ph, gw, pw).permute(0, 2, 4, 6, 1, 3, 5, 7)
        x = x.reshape(N, gd * gh * gw, C * pd * ph * pw)  # channels first within a patch, as the weight
        return F.linear(x, self.weight.reshape(self.weight.shape[0], -1), self.bias)


class Attention(nn.Module):
    """Multi-head self-attention. ``attn_fn(q, k, v)`` on [N, heads, L, head_dim] is the one call a
    context-parallel (ring) wrapper replaces from outside; it defaults to PyTorch's fused SDPA."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.attn_fn = F.scaled_dot_product_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        N, L, C = x.shape
        qkv = self.qkv(x).reshape(N, L, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # each [N, heads, L, head_dim]
        x = self.attn_fn(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(N, L, C))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm ViT block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))
