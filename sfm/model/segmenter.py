"""Task models: a segmentation head over an MAE's encoder, or a network of its own, and their export.

A :class:`Segmenter` maps imgs [N, 1, D, H, W] to logits [N, C, D, H, W] for crops of ``crop`` voxels:
C = 1 for a binary task (one logit, class 1 against 0), C = N for ``classes:N`` (one logit per class).
Its head is one entry of :data:`HEADS`, chosen by :attr:`Task.head` (the fine-tune flow's ``[finetune] head``):

- ``"linear"``: a linear layer per token that emits the patch's voxels (whatever the head finds must be in
  the final tokens);
- ``"unetr"``: a light decoder in the manner of UNETR (Hatamizadeh et al., 2022): the tokens of several
  encoder blocks (``taps``) projected to ``width`` channels each, deconvolved from the patch grid to
  voxels, joined with a convolution of the input volume at full resolution (UNETR's first skip), and
  fused by a 3 x 3 x 3 convolution before a per-voxel classifier. Fine detail a token cannot hold
  (a fault's exact trace) can come from the input path, the context from the encoder;
- ``"unet"``: a FaultSeg3D-style U-Net (:class:`sfm.model.unet.UNet3D`, levels of ``width``, 2 ``width``,
  4 ``width`` channels) that reads the amplitude alone: a Segmenter without an encoder, the from-scratch
  baseline (the fine-tune flow's ``--encoder unet``).

A new head is one class registered with :func:`register_head`: built from (the encoder's MAEConfig, or None
without an encoder; the Task; the crop), it maps (the encoder or None, imgs) to logits. ``reads_encoder`` says
whether it needs an encoder, ``reads_decoder`` whether the MAE's reconstruction decoder is part of the task
model (fine-tuned and exported with it; otherwise it is left out of both).

Export (``save_segmenter`` / ``load_segmenter``, ``save_pretrained`` / ``from_pretrained``), the registry's
format: ``model.safetensors`` (the encoder and the head) and ``config.json`` holding ``model`` (the MAEConfig;
null without an encoder), ``crop``, ``task`` (:meth:`Task.to_dict`) and whatever ``meta`` the caller adds.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Callable, ClassVar, Sequence

import torch
from torch import nn

from sfm.config import LABEL_IGNORE
from sfm.errors import SFMError

from .hub import CONFIG, WEIGHTS, HubFolder, config_bytes
from .mae import MAEConfig, MaskedAutoencoder3D
from .unet import UNet3D

HEADS: dict[str, type[nn.Module]] = {}  # Task.head -> the head's class (register_head)
KINDS = ("binary", "classes")
DECODER_KEYS = ("mae.decoder_", "mae.mask_token")  # the MAE's reconstruction decoder: not exported by most heads


def register_head(name: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator: the head ``name`` of :data:`HEADS`. The class is built as ``cls(cfg, task, crop)`` (cfg: the
    encoder's MAEConfig, or None when ``reads_encoder`` is False) and called as ``head(mae, imgs)`` -> logits
    [N, task.channels, D, H, W]; class attributes ``reads_encoder`` and ``reads_decoder`` (see the module)."""

    def register(cls: type[nn.Module]) -> type[nn.Module]:
        HEADS[name] = cls
        return cls

    return register


@dataclass(frozen=True)
class Task:
    """What a task model segments and which head reads the encoder."""

    kind: str = "binary"  # "binary": one logit per voxel (class 1 against 0); "classes": one per class
    classes: int = 2  # label classes 0..classes-1 (2 for binary)
    head: str = "linear"  # a name of HEADS: linear (per token), unetr (light decoder over several blocks), unet
    ignore: int = LABEL_IGNORE  # label value left out of the loss and the scores
    width: int = 16  # channels of the unetr decoder; of the unet's first level
    taps: tuple[int, ...] = ()  # encoder blocks the unetr decoder reads (empty: 4 evenly spaced, the last included)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"task kind must be one of {KINDS}, got {self.kind!r}")
        if self.head not in HEADS:
            raise ValueError(f"task head must be one of {', '.join(HEADS)}, got {self.head!r}")
        if self.classes < 2 or (self.kind == "binary" and self.classes != 2):
            raise ValueError(f"a {self.kind} task needs {'2' if self.kind == 'binary' else 'at least 2'} classes, "
                             f"got {self.classes}")
        if not 0 <= self.ignore <= 255 or self.ignore < self.classes:
            raise ValueError(f"the ignore value must be a uint8 above the classes, got {self.ignore}")
        object.__setattr__(self, "taps", tuple(int(t) for t in self.taps))

    @property
    def channels(self) -> int:
        """Logits per voxel: 1 for a binary task, ``classes`` otherwise."""
        return 1 if self.kind == "binary" else self.classes

    @property
    def name(self) -> str:
        """``binary`` or ``classes:N``, as the fine-tune flow's ``--task`` reads."""
        return self.kind if self.kind == "binary" else f"classes:{self.classes}"

    @classmethod
    def parse(cls, text: str, **settings) -> Task:
        """``"binary"`` or ``"classes:N"`` (plus any other field) -> Task; ValueError otherwise."""
        text = text.strip()
        if text == "binary":
            return cls(kind="binary", classes=2, **settings)
        kind, _, count = text.partition(":")
        if kind != "classes" or not count.isdigit():
            raise ValueError(f"task {text!r} is not a task; use binary or classes:N")
        return cls(kind="classes", classes=int(count), **settings)

    def to_dict(self) -> dict:
        return {**asdict(self), "taps": list(self.taps)}

    @classmethod
    def from_dict(cls, d: dict) -> Task:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def default_taps(depth: int) -> tuple[int, ...]:
    """Four evenly spaced blocks of a ``depth``-block encoder, the last included (UNETR reads 3, 6, 9, 12 of 12)."""
    return tuple(sorted({max(1, round(depth * k / 4)) for k in range(1, 5)}))


def voxels(x: torch.Tensor, grid: tuple[int, int, int], patch: tuple[int, int, int]) -> torch.Tensor:
    """Per-token voxel values x [N, L, pd*ph*pw*C] (channels last, as MAE's patchify) -> [N, C, D, H, W]."""
    (gd, gh, gw), (pd, ph, pw) = grid, patch
    n, channels = x.shape[0], x.shape[-1] // (pd * ph * pw)
    x = x.reshape(n, gd, gh, gw, pd, ph, pw, channels).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return x.reshape(n, channels, gd * pd, gh * ph, gw * pw)


@register_head("linear")
class LinearHead(nn.Linear):
    """The final tokens [N, L, E] -> per-voxel logits [N, C, D, H, W]: each token's patch of voxels."""

    reads_encoder: ClassVar[bool] = True
    reads_decoder: ClassVar[bool] = False

    def __init__(self, cfg: MAEConfig, task: Task, crop: Sequence[int]):
        super().__init__(cfg.embed_dim, math.prod(cfg.patch) * task.channels)
        self.patch = tuple(cfg.patch)
        nn.init.trunc_normal_(self.weight, std=0.02)
        nn.init.zeros_(self.bias)

    def forward(self, mae: MaskedAutoencoder3D, imgs: torch.Tensor) -> torch.Tensor:
        return voxels(super().forward(mae.encode(imgs)), mae.grid_shape(imgs), self.patch)


@register_head("unetr")
class UNETRHead(nn.Module):
    """Tokens of the ``taps`` blocks (each [N, L, E]) and the input imgs [N, Ci, D, H, W] -> logits [N, C, D, H, W]."""

    reads_encoder: ClassVar[bool] = True
    reads_decoder: ClassVar[bool] = False

    def __init__(self, cfg: MAEConfig, task: Task, crop: Sequence[int]):
        super().__init__()
        width = task.width
        self.taps = task.taps or default_taps(cfg.depth)
        e = cfg.embed_dim
        self.project = nn.ModuleList(nn.Sequential(nn.LayerNorm(e, eps=1e-6), nn.Linear(e, width)) for _ in self.taps)
        patch = tuple(cfg.patch)
        self.up = nn.ConvTranspose3d(len(self.taps) * width, width, kernel_size=patch, stride=patch)
        self.stem = nn.Sequential(nn.Conv3d(cfg.in_chans, width, 3, padding=1), nn.GELU())
        self.fuse = nn.Sequential(nn.Conv3d(2 * width, width, 3, padding=1), nn.GELU())
        self.classify = nn.Conv3d(width, task.channels, 1)

    def forward(self, mae: MaskedAutoencoder3D, imgs: torch.Tensor) -> torch.Tensor:
        n, grid = imgs.shape[0], mae.grid_shape(imgs)
        features = mae.encode_blocks(imgs, self.taps)
        tokens = torch.cat([p(f) for p, f in zip(self.project, features)], dim=-1)  # [N, L, taps * width]
        coarse = tokens.transpose(1, 2).reshape(n, -1, *grid)  # D-major token order, as patchify
        fine = torch.cat([self.up(coarse), self.stem(imgs)], dim=1)  # [N, 2 * width, D, H, W]
        return self.classify(self.fuse(fine))


@register_head("unet")
class UNetHead(nn.Module):
    """A U-Net of levels ``width``, 2 ``width``, 4 ``width`` over the amplitude alone: imgs [N, 1, D, H, W] ->
    logits [N, C, D, H, W] (every side a multiple of 4)."""

    reads_encoder: ClassVar[bool] = False
    reads_decoder: ClassVar[bool] = False

    def __init__(self, cfg: MAEConfig | None, task: Task, crop: Sequence[int]):
        super().__init__()
        self.unet = UNet3D(tuple(task.width * 2 ** k for k in range(3)), channels=task.channels)
        if any(int(c) % self.unet.divisor for c in crop):
            raise ValueError(f"the unet head pools twice: its crop {list(crop)} must be a multiple of "
                             f"{self.unet.divisor} along every axis")

    def forward(self, mae: None, imgs: torch.Tensor) -> torch.Tensor:
        return self.unet(imgs)


class Segmenter(nn.Module, HubFolder):
    """A segmentation head over an MAE's encoder (or, for a head that reads no encoder, on its own): imgs
    [N, 1, D, H, W] -> logits [N, C, D, H, W] (C: :attr:`Task.channels`), on the head's device (inputs are moved
    there). ``crop``: the crop it was fine-tuned on (D, H, W), the window a whole-volume prediction slides (the
    encoder's; given for a model without one); any size divisible by the patch (or the U-Net's pooling) runs.
    Saved and loaded as a folder: ``save_pretrained`` / ``from_pretrained`` (:mod:`sfm.model.hub`)."""

    def __init__(self, mae: MaskedAutoencoder3D | None = None, task: Task | None = None,
                 crop: Sequence[int] | None = None):
        super().__init__()
        self.task = task or Task()
        kind = HEADS[self.task.head]
        if kind.reads_encoder != (mae is not None):
            need = "reads an encoder: give one" if kind.reads_encoder else "is a network of its own: give no encoder"
            raise ValueError(f"the {self.task.head} head {need}")
        if mae is not None and crop is not None and tuple(crop) != tuple(mae.cfg.crop):
            raise ValueError(f"crop {list(crop)} is not the encoder's {list(mae.cfg.crop)}")
        if mae is None and crop is None:
            raise ValueError("a task model without an encoder needs its crop")
        self.mae = mae
        self.crop = tuple(int(c) for c in (mae.cfg.crop if mae is not None else crop))
        self.head = kind(mae.cfg if mae is not None else None, self.task, self.crop)
        if mae is not None:
            self.head.to(next(mae.parameters()).device)

    @property
    def reads_decoder(self) -> bool:
        """Whether the MAE's reconstruction decoder is part of this task model (its head reads it)."""
        return bool(self.head.reads_decoder)

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        imgs = imgs.to(next(self.head.parameters()).device, non_blocking=True)
        return self.head(self.mae, imgs)

    def folder_files(self, meta: dict | None = None) -> dict[str, bytes]:
        """{model.safetensors: the encoder and the head (the MAE's reconstruction decoder only if the head reads
        it), config.json: {**meta, "model": the MAEConfig or None, "crop", "task": the Task}}."""
        from safetensors.torch import save

        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()
                   if self.reads_decoder or not k.startswith(DECODER_KEYS)}
        config = {**(meta or {}), "model": self.mae.cfg.to_dict() if self.mae is not None else None,
                  "crop": list(self.crop), "task": self.task.to_dict()}
        return {WEIGHTS: save(tensors), CONFIG: config_bytes(config)}

    @classmethod
    def from_folder_files(cls, config: bytes, weights: bytes, where: str) -> Segmenter:
        return segmenter_from_files(config, weights, where)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [N, C, ...] -> probabilities [N, C, ...]: the sigmoid of a binary task's one logit (of
        class 1), the softmax over the classes otherwise."""
        return torch.sigmoid(logits) if self.task.kind == "binary" else torch.softmax(logits, dim=1)


# ---- export --------------------------------------------------------------------------------------


def save_segmenter(net: Segmenter, url: str, meta: dict | None = None) -> None:
    """Write ``url``/model.safetensors (encoder and head) and ``url``/config.json (``model``, ``task`` and
    ``meta``'s keys), the config last: the export is complete once it exists."""
    from sfm import storage  # lazy: the model package imports with torch alone

    files = net.folder_files(meta)
    for name in (WEIGHTS, CONFIG):
        storage.write_bytes(storage.join(url, name), files[name])


def record_predict_settings(url: str, **settings) -> None:
    """Add ``settings`` to the ``predict`` section of the config.json exported at ``url`` (how the task model's
    held-out scores were measured, which ``sfm predict`` follows unless told otherwise: e.g. the threshold chosen on
    the validation labels once they have been scored)."""
    from sfm import storage

    meta = json.loads(storage.read_bytes(storage.join(url, CONFIG)))
    meta["predict"] = {**meta.get("predict", {}), **settings}
    storage.write_bytes(storage.join(url, CONFIG), config_bytes(meta))


def segmenter_from_files(config: bytes, weights: bytes, where: str) -> Segmenter:
    """The Segmenter a config.json and model.safetensors describe (``where`` names them in errors)."""
    from safetensors.torch import load as load_safetensors

    meta = json.loads(config)
    if "task" not in meta:
        raise SFMError(f"{where} is not a task model (its config.json has no task section); "
                       "fine-tune one with `sfm flow finetune`")
    mae = MaskedAutoencoder3D(MAEConfig.from_dict(meta["model"])) if meta.get("model") else None
    net = Segmenter(mae, Task.from_dict(meta["task"]), meta.get("crop"))
    missing, unexpected = net.load_state_dict(load_safetensors(weights), strict=False)
    if unexpected or any(net.reads_decoder or not k.startswith(DECODER_KEYS) for k in missing):
        raise SFMError(f"{where}: the weights do not match the config ({len(unexpected)} unexpected, "
                       f"{len(missing)} missing tensors); re-export the task model")
    net.meta = meta
    return net.eval()


def load_segmenter(url: str, map_location: str | torch.device = "cpu") -> Segmenter:
    """The task model exported at ``url`` (a folder, local or s3://, holding model.safetensors and config.json)."""
    from sfm import storage

    config, weights = (storage.read_bytes(storage.join(url, name)) for name in (CONFIG, WEIGHTS))
    return segmenter_from_files(config, weights, url).to(map_location)
