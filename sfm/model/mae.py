"""3D ViT Masked AutoEncoder for seismic volumes (He et al., 2021, "Masked Autoencoders Are
Scalable Vision Learners"), shaped after facebookresearch/mae ``models_mae.py``.

A volume ``[N, C, D, H, W]`` (inline, crossline, sample) is cut into non-overlapping 3D patches,
75% of them are dropped, the encoder sees the rest plus a cls token, and a light decoder
reconstructs the dropped patches' voxels. The loss is MSE on the masked patches only.

Plain PyTorch: no process groups. Data parallelism, activation checkpointing policy, compile and
context parallelism are applied from outside; ``Attention.attn_fn`` (:mod:`sfm.model.blocks`, the layers) is
the seam a context-parallel wrapper replaces. A model is saved and loaded as a folder (``save_pretrained`` / ``from_pretrained``:
:mod:`sfm.model.hub`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from sfm.errors import SFMError

from .blocks import Block, Int3, PatchEmbed3D
from .hub import CONFIG, WEIGHTS, HubFolder, config_bytes

TUBE_AXES = ("", "inline", "crossline", "sample")  # MAEConfig.mask_tube: "" or the axis a masked column runs along


@dataclass
class MAEConfig:
    """Architecture of a :class:`MaskedAutoencoder3D`. Defaults are the ``base`` preset at 128^3."""

    crop: Int3 = (128, 128, 128)  # D, H, W voxels = inline, crossline, sample
    patch: Int3 = (16, 16, 16)  # voxels per patch along each axis
    in_chans: int = 1
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    decoder_embed_dim: int = 512
    decoder_depth: int = 8
    decoder_num_heads: int = 16
    mlp_ratio: float = 4.0
    mask_ratio: float = 0.75
    norm_pix_loss: bool = True
    mask_tube: str = ""  # "": mask patches independently; "inline" | "crossline" | "sample": whole columns along that axis
    decoder_mask_ratio: float = 0.0  # in training, this fraction of the masked patches is not decoded (dual masking)


    def __post_init__(self):
        self.crop = _int3("crop", self.crop)
        self.patch = _int3("patch", self.patch)
        for c, p, axis in zip(self.crop, self.patch, "DHW"):
            if c % p:
                raise ValueError(
                    f"MAEConfig: crop {self.crop} is not divisible by patch {self.patch} along "
                    f"axis {axis} ({c} % {p} = {c % p}); choose a crop that is a multiple of the patch"
                )
        for name in ("in_chans", "embed_dim", "depth", "num_heads",
                     "decoder_embed_dim", "decoder_depth", "decoder_num_heads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MAEConfig: {name} must be a positive int, got {v!r}")
        for dim, heads in (("embed_dim", "num_heads"), ("decoder_embed_dim", "decoder_num_heads")):
            if getattr(self, dim) % getattr(self, heads):
                raise ValueError(
                    f"MAEConfig: {dim}={getattr(self, dim)} is not divisible by "
                    f"{heads}={getattr(self, heads)}; pick a head count that divides the width"
                )
        if not 0.0 <= self.mask_ratio < 1.0:
            raise ValueError(f"MAEConfig: mask_ratio must be in [0, 1), got {self.mask_ratio}")
        if not 0.0 <= self.decoder_mask_ratio < 1.0:
            raise ValueError(f"MAEConfig: decoder_mask_ratio must be in [0, 1), got {self.decoder_mask_ratio}")
        if self.mlp_ratio <= 0:
            raise ValueError(f"MAEConfig: mlp_ratio must be > 0, got {self.mlp_ratio}")
        if self.mask_tube not in TUBE_AXES:
            raise ValueError(f"MAEConfig: mask_tube must be one of {', '.join(map(repr, TUBE_AXES))}, "
                             f"got {self.mask_tube!r}")

    @property
    def grid(self) -> Int3:
        """Patches per axis for ``crop``."""
        return tuple(c // p for c, p in zip(self.crop, self.patch))

    @property
    def num_patches(self) -> int:
        return math.prod(self.grid)

    def decoded_masked(self, masked: int) -> int:
        """How many of ``masked`` masked patches the decoder sees in training: all of them, or with dual
        masking all less ``decoder_mask_ratio`` of them (at least one while any is masked)."""
        return max(1, masked - int(masked * self.decoder_mask_ratio)) if masked else 0

    def to_dict(self) -> dict:
        """JSON-able dict (tuples become lists)."""
        d = asdict(self)
        d["crop"], d["patch"] = list(self.crop), list(self.patch)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> MAEConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"MAEConfig: unknown keys {sorted(unknown)}; valid keys are {sorted(known)}")
        return cls(**d)  # __post_init__ turns lists back into tuples


def _int3(name: str, v) -> Int3:
    try:
        t = tuple(int(x) for x in v)
    except TypeError:
        raise ValueError(f"MAEConfig: {name} must be 3 ints (D, H, W), got {v!r}") from None
    if len(t) != 3 or any(x < 1 for x in t):
        raise ValueError(f"MAEConfig: {name} must be 3 positive ints (D, H, W), got {v!r}")
    return t


# --------------------------------------------------------------------------------------------
# Fixed 3D sin-cos positional embedding
# --------------------------------------------------------------------------------------------


def _sincos_1d(dim: int, pos: torch.Tensor) -> torch.Tensor:
    """pos: [M] -> [M, dim] (dim even): half sin, half cos, as in MAE's get_1d_sincos."""
    omega = torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0)
    omega = 1.0 / 10000**omega
    out = pos.double()[:, None] * omega[None, :]
    return torch.cat([torch.sin(out), torch.cos(out)], dim=1)


def sincos_pos_embed_3d(embed_dim: int, grid: tuple[int, int, int]) -> torch.Tensor:
    """Fixed sin-cos embedding of a 3D patch grid -> [gd*gh*gw, embed_dim] float32.

    Each axis gets the same even share of the channels (D first, then H, then W); channels left
    over when embed_dim isn't divisible by 6 are zero. Rows are in patchify order (D-major, W
    fastest). The embedding is a function of the absolute integer grid position only, so a
    sub-grid's rows equal the matching rows of any larger grid: models run on any crop size.
    """
    gd, gh, gw = grid
    share = (embed_dim // 6) * 2
    d, h, w = torch.meshgrid(torch.arange(gd), torch.arange(gh), torch.arange(gw), indexing="ij")
    parts = [_sincos_1d(share, a.reshape(-1)) for a in (d, h, w)]
    pad = embed_dim - 3 * share
    if pad:
        parts.append(torch.zeros(gd * gh * gw, pad, dtype=torch.float64))
    return torch.cat(parts, dim=1).float()


def tube_noise(noise: torch.Tensor, grid: Int3, axis: str) -> torch.Tensor:
    """Masking noise [N, L] made constant along ``axis`` of the patch grid (gd, gh, gw) -> [N, L].

    Each column takes the noise of its first patch plus a tie-break far below the spacing of the
    values, so argsort orders whole columns and, within the column at the cut, its patches.
    """
    N = noise.shape[0]
    g = noise.reshape(N, *grid)
    dim = {"inline": 1, "crossline": 2, "sample": 3}[axis]
    first = g.narrow(dim, 0, 1).expand_as(g)
    return (first + g * 1e-6).reshape(N, -1)


# --------------------------------------------------------------------------------------------
# MAE
# --------------------------------------------------------------------------------------------


class MaskedAutoencoder3D(nn.Module, HubFolder):
    """Masked Autoencoder with a 3D ViT backbone.

    Shapes: N batch, C channels, L patches (gd*gh*gw), K kept patches, E encoder width,
    P = pd*ph*pw*C voxels per patch.
    """

    def __init__(self, cfg: MAEConfig):
        super().__init__()
        self.cfg = cfg
        self.grad_checkpointing = False  # set True to recompute block activations in backward
        patch_dim = math.prod(cfg.patch) * cfg.in_chans

        # encoder
        self.patch_embed = PatchEmbed3D(cfg.in_chans, cfg.embed_dim, cfg.patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.embed_dim))
        self.blocks = nn.ModuleList(
            Block(cfg.embed_dim, cfg.num_heads, cfg.mlp_ratio) for _ in range(cfg.depth)
        )
        self.norm = nn.LayerNorm(cfg.embed_dim, eps=1e-6)

        # decoder
        self.decoder_embed = nn.Linear(cfg.embed_dim, cfg.decoder_embed_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, cfg.decoder_embed_dim))
        self.decoder_blocks = nn.ModuleList(
            Block(cfg.decoder_embed_dim, cfg.decoder_num_heads, cfg.mlp_ratio)
            for _ in range(cfg.decoder_depth)
        )
        self.decoder_norm = nn.LayerNorm(cfg.decoder_embed_dim, eps=1e-6)
        self.decoder_pred = nn.Linear(cfg.decoder_embed_dim, patch_dim)

        # Fixed sin-cos tables per (grid, dim, device, dtype). A plain dict, not a buffer: they are
        # analytic, so checkpoints stay independent of crop size.
        self._pos_cache: dict[tuple, torch.Tensor] = {}
        self.initialize_weights()

    def initialize_weights(self):
        self.patch_embed.reset_parameters()
        nn.init.normal_(self.cls_token, std=0.02)
        nn.init.normal_(self.mask_token, std=0.02)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module):
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.constant_(m.bias, 0)
        elif isinstance(m, nn.LayerNorm):
            nn.init.constant_(m.bias, 0)
            nn.init.constant_(m.weight, 1.0)

    # ---- geometry ---------------------------------------------------------------------------

    def grid_shape(self, imgs: torch.Tensor) -> Int3:
        """Patch grid (gd, gh, gw) of imgs [N, C, D, H, W]; any size divisible by the patch works."""
        if imgs.ndim != 5 or imgs.shape[1] != self.cfg.in_chans:
            raise ValueError(
                f"expected volumes [N, {self.cfg.in_chans}, D, H, W], got shape {tuple(imgs.shape)}"
            )
        spatial, patch = tuple(imgs.shape[2:]), self.cfg.patch
        if any(s % p for s, p in zip(spatial, patch)):
            raise ValueError(f"volume size {spatial} is not divisible by patch {patch}; crop or pad it")
        return tuple(s // p for s, p in zip(spatial, patch))

    def _grid_for(self, L: int, grid: Int3 | None) -> Int3:
        if grid is not None:
            if math.prod(grid) != L:
                raise ValueError(f"grid {tuple(grid)} has {math.prod(grid)} patches, tokens have {L}")
            return tuple(grid)
        if L == self.cfg.num_patches:
            return self.cfg.grid
        raise ValueError(f"{L} patches do not match cfg.crop {self.cfg.crop}; pass grid=(gd, gh, gw)")

    def pos_embed(self, grid: Int3, dim: int, like: torch.Tensor) -> torch.Tensor:
        """[1, L, dim] fixed sin-cos table for grid, on like's device and dtype (cached)."""
        key = (tuple(grid), dim, like.device, like.dtype)
        pe = self._pos_cache.get(key)
        if pe is None:
            # not an inference tensor, even if first asked for under torch.inference_mode()
            with torch.inference_mode(False):
                pe = sincos_pos_embed_3d(dim, grid).to(device=like.device, dtype=like.dtype)[None]
            self._pos_cache[key] = pe
        return pe

    def patchify(self, imgs: torch.Tensor) -> torch.Tensor:
        """imgs: [N, C, D, H, W] -> [N, L, pd*ph*pw*C], patches in D-major order, channels last."""
        gd, gh, gw = self.grid_shape(imgs)
        pd, ph, pw = self.cfg.patch
        N, C = imgs.shape[:2]
        x = imgs.reshape(N, C, gd, pd, gh, ph, gw, pw)
        x = x.permute(0, 2, 4, 6, 3, 5, 7, 1)  # N, gd, gh, gw, pd, ph, pw, C
        return x.reshape(N, gd * gh * gw, pd * ph * pw * C)

    def unpatchify(self, x: torch.Tensor, grid: Int3 | None = None) -> torch.Tensor:
        """x: [N, L, pd*ph*pw*C] -> [N, C, D, H, W]. grid defaults to cfg.crop's grid."""
        gd, gh, gw = self._grid_for(x.shape[1], grid)
        pd, ph, pw = self.cfg.patch
        N, C = x.shape[0], self.cfg.in_chans
        x = x.reshape(N, gd, gh, gw, pd, ph, pw, C)
        x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)  # N, C, gd, pd, gh, ph, gw, pw
        return x.reshape(N, C, gd * pd, gh * ph, gw * pw)

    # ---- the algorithm ----------------------------------------------------------------------

    def random_masking(self, x: torch.Tensor, mask_ratio: float, generator: torch.Generator | None = None,
                       noise: torch.Tensor | None = None, grid: Int3 | None = None):
        """Per-sample random masking by argsort of uniform noise.

        x: [N, L, E] -> x_kept [N, K, E] with K = max(1, int(L * (1 - mask_ratio))),
        mask [N, L] (0 keep, 1 remove), ids_restore [N, L] (undoes the shuffle).
        The noise [N, L] is ``noise`` if given (a training loop that derives it from the data's
        position makes masks independent of how samples are spread over ranks), else drawn from
        ``generator`` (default: torch's global RNG). With ``cfg.mask_tube`` and the patch ``grid``, every
        column of patches along that axis shares one noise value (:func:`tube_noise`), so whole columns
        are kept or masked together (VideoMAE's tubes); only the column cut by K may be split.
        """
        N, L, E = x.shape
        len_keep = max(1, int(L * (1 - mask_ratio)))
        if noise is None:
            noise = torch.rand(N, L, device=x.device, generator=generator)
        elif tuple(noise.shape) != (N, L):
            raise ValueError(f"mask noise must be [N, L] = {[N, L]}, got {list(noise.shape)}")
        if self.cfg.mask_tube and grid is not None:
            noise = tube_noise(noise, grid, self.cfg.mask_tube)
        ids_shuffle = torch.argsort(noise, dim=1)  # ascending: small noise is kept
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        ids_keep = ids_shuffle[:, :len_keep]
        x_kept = torch.gather(x, 1, ids_keep.unsqueeze(-1).expand(-1, -1, E))
        mask = torch.ones(N, L, device=x.device, dtype=x.dtype)
        mask[:, :len_keep] = 0
        mask = torch.gather(mask, 1, ids_restore)
        return x_kept, mask, ids_restore

    def _run(self, blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
        for blk in blocks:
            if self.grad_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        return x

    def _embed(self, imgs: torch.Tensor):
        """imgs -> patch tokens with position [N, L, E], grid."""
        grid = self.grid_shape(imgs)
        x = self.patch_embed(imgs)  # [N, L, E]
        return x + self.pos_embed(grid, x.shape[-1], x), grid

    def _with_cls(self, x: torch.Tensor) -> torch.Tensor:
        # the cls token carries no position (MAE's zero row of pos_embed)
        return torch.cat([self.cls_token.to(x.dtype).expand(x.shape[0], -1, -1), x], dim=1)

    def forward_encoder(self, imgs: torch.Tensor, mask_ratio: float, generator: torch.Generator | None = None,
                        noise: torch.Tensor | None = None):
        """imgs [N, C, D, H, W] -> latent [N, 1+K, E], mask [N, L], ids_restore [N, L]."""
        x, grid = self._embed(imgs)
        x, mask, ids_restore = self.random_masking(x, mask_ratio, generator, noise, grid)
        x = self._run(self.blocks, self._with_cls(x))
        return self.norm(x), mask, ids_restore

    def forward_decoder(self, latent: torch.Tensor, ids_restore: torch.Tensor,
                        grid: Int3 | None = None, decode: torch.Tensor | None = None) -> torch.Tensor:
        """latent [N, 1+K, E], ids_restore [N, L] -> pred [N, L, P] (voxels of every patch), or with
        ``decode`` [N, M] (patch indices) pred [N, M, P] of those patches only: the decoder sees just them.

        grid defaults to cfg.crop's grid; pass it when the input was another size.
        """
        N, L = ids_restore.shape
        grid = self._grid_for(L, grid)
        x = self.decoder_embed(latent)
        Ed = x.shape[-1]
        mask_tokens = self.mask_token.to(x.dtype).expand(N, L + 1 - x.shape[1], -1)
        x_ = torch.cat([x[:, 1:], mask_tokens], dim=1)  # kept first, then masked: shuffled order
        x_ = torch.gather(x_, 1, ids_restore.unsqueeze(-1).expand(-1, -1, Ed))  # unshuffle
        x_ = x_ + self.pos_embed(grid, Ed, x_)
        if decode is not None:
            x_ = torch.gather(x_, 1, decode.unsqueeze(-1).expand(-1, -1, Ed))
        x = self._run(self.decoder_blocks, torch.cat([x[:, :1], x_], dim=1))
        x = self.decoder_norm(x)[:, 1:]  # drop cls before the head
        return self.decoder_pred(x)

    def decoded_patches(self, ids_restore: torch.Tensor, kept: int) -> torch.Tensor:
        """Dual masking (VideoMAE V2): the patches the decoder sees in training, [N, K + M] indices: the
        ``kept`` visible ones and the ``M`` masked ones with the lowest masking noise, M the masked
        patches less ``cfg.decoder_mask_ratio`` of them (at least one). The masking noise is uniform, so
        they are a random subset, drawn from the same noise as the mask (exact resume needs no new draw)."""
        decoded = self.cfg.decoded_masked(ids_restore.shape[1] - kept)
        ids_shuffle = torch.argsort(ids_restore, dim=1)  # patches by rising noise: kept first
        return ids_shuffle[:, :kept + decoded]

    def patch_targets(self, imgs: torch.Tensor) -> torch.Tensor:
        """Reconstruction targets [N, L, P] in the loss's space: the raw patches, or with
        norm_pix_loss each patch normalised by its own mean and variance (as in MAE)."""
        target = self.patchify(imgs).float()
        if self.cfg.norm_pix_loss:
            var, mean = torch.var_mean(target, dim=-1, keepdim=True)  # one pass; unbiased var, as MAE
            scale = torch.rsqrt(var + 1.0e-6)
            target = torch.addcmul(-mean * scale, target, scale)  # (target - mean) * scale, one pass
        return target

    def forward_loss(self, imgs: torch.Tensor, pred: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Mean squared error over the voxels of masked patches only (mask: 0 keep, 1 remove)."""
        target = self.patch_targets(imgs)
        loss = F.mse_loss(pred.float(), target, reduction="none").mean(dim=-1)  # [N, L] per patch; fused backward
        mask = mask.float()
        return (loss * mask).sum() / mask.sum().clamp(min=1.0)

    def forward(self, imgs: torch.Tensor, mask_ratio: float | None = None, generator: torch.Generator | None = None,
                noise: torch.Tensor | None = None):
        """imgs [N, C, D, H, W] -> (loss, pred [N, L, P], mask [N, L]); ``noise`` [N, L]: see random_masking.

        In training with ``cfg.decoder_mask_ratio`` > 0 the decoder sees only :meth:`decoded_patches`:
        the loss is over the masked patches among them, ``pred`` is 0 at every other patch and ``mask``
        marks just the masked patches that were decoded (the ones the loss is over)."""
        mask_ratio = self.cfg.mask_ratio if mask_ratio is None else mask_ratio
        grid = self.grid_shape(imgs)
        latent, mask, ids_restore = self.forward_encoder(imgs, mask_ratio, generator, noise)
        if self.training and self.cfg.decoder_mask_ratio > 0:
            decode = self.decoded_patches(ids_restore, latent.shape[1] - 1)
            part = self.forward_decoder(latent, ids_restore, grid, decode)
            pred = part.new_zeros(*mask.shape, part.shape[-1]).scatter(
                1, decode.unsqueeze(-1).expand(-1, -1, part.shape[-1]), part)
            mask = mask * torch.zeros_like(mask).scatter(1, decode, 1.0)
        else:
            pred = self.forward_decoder(latent, ids_restore, grid)
        loss = self.forward_loss(imgs, pred, mask)
        return loss, pred, mask

    # ---- a model folder (sfm.model.hub): the weights, and the config that rebuilds the model --------------

    def folder_files(self, meta: dict | None = None) -> dict[str, bytes]:
        """{model.safetensors: every tensor of the state dict, config.json: {"model": the MAEConfig, **meta}}."""
        from safetensors.torch import save

        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        config = {"model": self.cfg.to_dict(), **(meta or {})}
        return {WEIGHTS: save(tensors), CONFIG: config_bytes(config)}

    @classmethod
    def from_folder_files(cls, config: bytes, weights: bytes, where: str) -> MaskedAutoencoder3D:
        """The encoder a config.json and model.safetensors describe; a task model's are refused."""
        from safetensors.torch import load

        meta = json.loads(config)
        if "task" in meta:
            raise SFMError(f"{where} is a task model, not an encoder; load it with "
                           "sfm.model.segmenter.Segmenter.from_pretrained")
        model = cls(MAEConfig.from_dict(meta["model"]))
        model.load_state_dict(load(weights))
        return model

    def encode(self, imgs: torch.Tensor) -> torch.Tensor:
        """Features for downstream probes: all patches, no masking -> [N, L, E] after the final
        norm (cls dropped). Reshape to [N, gd, gh, gw, E] with grid_shape(imgs)."""
        x, _ = self._embed(imgs)
        x = self._run(self.blocks, self._with_cls(x))
        return self.norm(x)[:, 1:]

    def encode_blocks(self, imgs: torch.Tensor, taps: tuple[int, ...]) -> list[torch.Tensor]:
        """Features of several depths for a decoder that reads them (UNETR's skip connections): all
        patches, no masking -> one [N, L, E] per entry of ``taps`` (block numbers 1..depth, ascending), the
        tokens after that block with the cls token dropped; block ``depth`` after the final norm, as
        :meth:`encode` gives it."""
        if list(taps) != sorted(set(taps)) or not taps or taps[0] < 1 or taps[-1] > len(self.blocks):
            raise ValueError(f"taps must be ascending block numbers in 1..{len(self.blocks)}, got {taps}")
        x, _ = self._embed(imgs)
        x = self._with_cls(x)
        out, done = [], 0
        for tap in taps:
            x = self._run(self.blocks[done:tap], x)
            done = tap
            out.append((self.norm(x) if tap == len(self.blocks) else x)[:, 1:])
        return out
