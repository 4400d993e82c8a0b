"""The fine-tuning loop, shared by the downstream evaluation (sfm.eval.downstream) and the fine-tune flow
(sfm.finetune.job): MAE's fine-tuning recipe for a :class:`sfm.model.segmenter.Segmenter`.

- AdamW with layer-wise learning-rate decay (:func:`optimizer_for`): encoder layer ``k`` of a depth-``d``
  encoder learns at lr * decay^(d + 1 - k), the head at lr; no weight decay on biases, norms, tokens;
- warm-up then cosine decay to 0 (the pretraining schedule's shape), gradients clipped to norm 1;
- early stopping (:func:`train_steps` with ``validate``): the weights of the step with the best
  validation score are kept, scored every ``validate_every`` steps (and at step 0 for LP-FT, where the
  head starts as a linear probe of the frozen encoder);
- losses that weight the classes equally overall (FaultSeg3D's balanced cross-entropy), and leave out
  the voxels nobody labelled (:func:`masked_loss`);
- progress a person can follow (:func:`reporting`): each step counted, with its loss, on a
  :class:`sfm.progress.Progress` (plain lines every few seconds when the output is not a terminal).

A ``recipe`` is anything with ``steps``, ``batch_size``, ``lr``, ``layer_decay``, ``weight_decay``,
``warmup_fraction`` and ``validate_every`` (the evaluation's ``Recipe``, the flow's ``FinetuneConfig``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sfm.model.segmenter import Segmenter
from sfm.progress import Progress
from sfm.train.step import lr_at, weight_decay_groups

Batches = Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # step -> (imgs [N, 1, D, H, W], labels [N, D, H, W])


def encoder_parameters(mae: nn.Module) -> list[tuple[int, list[tuple[str, nn.Parameter]]]]:
    """The encoder's named parameters by layer: 0 the patch embedding and cls token, 1..depth the blocks,
    depth + 1 the final norm (the decoder is not part of the encoder)."""
    depth = len(mae.blocks)
    layers = [(0, [("patch_embed.weight", mae.patch_embed.weight), ("patch_embed.bias", mae.patch_embed.bias),
                   ("cls_token", mae.cls_token)])]
    layers += [(b + 1, list(block.named_parameters())) for b, block in enumerate(mae.blocks)]
    layers.append((depth + 1, list(mae.norm.named_parameters())))
    return layers


def set_trainable(net: Segmenter, freeze_encoder: bool) -> None:
    """Let the encoder learn (or not, ``freeze_encoder``); the MAE's reconstruction decoder never does (it is
    not part of the segmenter: under DDP every parameter that requires a gradient must get one)."""
    net.mae.requires_grad_(False)
    for _, params in [] if freeze_encoder else encoder_parameters(net.mae):
        for _, p in params:
            p.requires_grad_(True)


def optimizer_for(net: Segmenter, recipe, *, freeze_encoder: bool = False) -> torch.optim.AdamW:
    """AdamW with layer-wise decay: layer ``k`` of a depth-``d`` encoder learns at lr * decay^(d + 1 - k);
    biases, norms and the cls token have no weight decay (:func:`sfm.train.step.weight_decay_groups`)."""
    depth = len(net.mae.blocks)
    groups = []
    layers = [] if freeze_encoder else encoder_parameters(net.mae)
    for layer, params in layers + [(depth + 1, list(net.head.named_parameters()))]:
        groups += weight_decay_groups(params, recipe.weight_decay, lr_scale=recipe.layer_decay ** (depth + 1 - layer))
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=recipe.lr, betas=(0.9, 0.999))


def balanced_bce(logits: torch.Tensor, labels: torch.Tensor, positive_fraction: float) -> torch.Tensor:
    """Binary cross-entropy with the two classes weighted equally overall (FaultSeg3D's balanced loss)."""
    p = min(max(positive_fraction, 1e-4), 1 - 1e-4)
    weight = torch.where(labels > 0.5, 0.5 / p, 0.5 / (1 - p))
    return F.binary_cross_entropy_with_logits(logits, labels, weight=weight)


def class_weights(fractions: list[float]) -> torch.Tensor:
    """Per-class loss weights [C] that weight every class equally overall: 1 / (C * fraction), each
    fraction clamped away from 0 (a class absent from a batch's labels costs nothing)."""
    f = torch.tensor(fractions, dtype=torch.float32).clamp(min=1e-4)
    return 1.0 / (len(fractions) * f)


def masked_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, ignore: int) -> torch.Tensor:
    """The balanced loss over labelled voxels only: logits [N, C, D, H, W], labels [N, D, H, W] integer
    classes (``ignore``: not interpreted, no loss), ``weights`` [C] from :func:`class_weights` (the label
    fractions). C = 1: binary cross-entropy of class 1 against 0; C > 1: cross-entropy over the classes.
    The mean is over the labelled voxels (0 when a batch holds none)."""
    labels = labels.to(logits.device, non_blocking=True).long()
    labelled = labels != ignore
    target = torch.where(labelled, labels, torch.zeros_like(labels))
    weights = weights.to(logits.device)
    if logits.shape[1] == 1:
        per_voxel = F.binary_cross_entropy_with_logits(logits[:, 0], target.float(), reduction="none")
        per_voxel = per_voxel * torch.where(target > 0, weights[1], weights[0])
    else:
        per_voxel = F.cross_entropy(logits, target, weight=weights, reduction="none")
    return (per_voxel * labelled).sum() / labelled.sum().clamp(min=1)


def reporting(loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], progress: Progress,
              track: Callable[[dict[str, float], int], None] | None = None
              ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss_of`` that also counts each step on ``progress`` and shows that step's loss beside the count
    (``train_steps`` computes the loss once per step), and hands it to ``track`` ({"loss": value}, step): rank 0's
    experiment trackers (:meth:`sfm.train.trackers.Trackers.under`)."""

    def counted(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = loss_of(logits, labels)
        value = loss.item() if progress.enabled or track is not None else None
        if progress.enabled:
            progress.set(loss=f"{value:.4f}")
        progress.update()
        if track is not None:
            track({"loss": value}, progress.n)
        return loss

    return counted


def train_steps(net: Segmenter, recipe, batches: Batches, loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                *, forward: nn.Module | None = None, freeze_encoder: bool = False,
                validate: Callable[[Segmenter], float] | None = None, score_start: bool = False) -> Segmenter:
    """Fine-tune ``net`` (in place) for ``recipe.steps`` steps on ``batches(step)``, minimising
    ``loss_of(logits, labels)``; ``forward`` runs the batches (a DistributedDataParallel wrapper of
    ``net``; default ``net`` itself). With ``freeze_encoder`` only the head learns.

    With ``validate`` (``net`` -> score, higher is better), ``net`` is scored every
    ``recipe.validate_every`` steps, at the last step, and with ``score_start`` before the first (LP-FT:
    the linear probe itself is a candidate), and ends with the weights of the best score (early
    stopping); ``net.chosen_step`` says which step that was (``recipe.steps`` without validation) and
    ``net.validation`` lists every (step, score).
    """
    forward = forward if forward is not None else net
    set_trainable(net, freeze_encoder)
    optimizer = optimizer_for(net, recipe, freeze_encoder=freeze_encoder)
    best: tuple[float, int, dict | None] = (-1.0, recipe.steps, None)
    history: list[tuple[int, float]] = []

    def score_step(done: int) -> tuple[float, int, dict | None]:
        score = validate(net)
        history.append((done, score))
        return (score, done, {k: v.detach().clone() for k, v in net.state_dict().items()}) if score > best[0] else best

    if validate is not None and score_start:
        best = score_step(0)
    for step in range(recipe.steps):
        net.train()
        factor = lr_at(step, lr=1.0, min_lr=0.0, warmup_steps=max(1, round(recipe.warmup_fraction * recipe.steps)),
                       max_steps=recipe.steps)  # the pretraining schedule's shape, from 1 down to 0
        for group in optimizer.param_groups:
            group["lr"] = recipe.lr * group["lr_scale"] * factor
        imgs, labels = batches(step)
        loss = loss_of(forward(imgs), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        done = step + 1
        if validate is not None and (done % recipe.validate_every == 0 or done == recipe.steps):
            best = score_step(done)
    if best[2] is not None:
        net.load_state_dict(best[2])
    net.chosen_step, net.validation = best[1], history
    net.eval()
    return net
