"""The fine-tuning loop, shared by the downstream evaluation (sfm.eval.downstream) and the fine-tune flow
(sfm.finetune.job): MAE's fine-tuning recipe for a :class:`sfm.model.segmenter.Segmenter`.

- AdamW with layer-wise learning-rate decay (:func:`optimizer_for`): encoder layer ``k`` of a depth-``d``
  encoder learns at lr * decay^(d + 1 - k), the head at lr; no weight decay on biases, norms, tokens; a
  network without an encoder (the U-Net) learns at lr throughout;
- warm-up then cosine decay to 0 (the pretraining schedule's shape), gradients clipped to norm 1;
- LP-FT (:func:`probe_then_fine_tune`): the head alone on the frozen encoder first, then the whole network;
- early stopping (:func:`train_steps` with ``validate``): the weights of the step with the best
  validation score are kept, scored every ``validate_every`` steps (and at step 0 for LP-FT, where the
  head starts as a linear probe of the frozen encoder);
- a time budget (``deadline``): at each validation point the run's pace is measured, and steps that would end
  past the deadline are cut (the schedule's decay follows the new end);
- losses that weight the classes equally overall (FaultSeg3D's balanced cross-entropy), and leave out
  the voxels nobody labelled (:func:`masked_loss`);
- progress a person can follow (:func:`reporting`): each step counted, with its loss, on a
  :class:`sfm.progress.Progress` (plain lines every few seconds when the output is not a terminal).

A ``recipe`` is a :class:`sfm.config.FinetuneConfig` (the fine-tune flow's ``[finetune]``, the evaluation's
``[eval.finetune]``); a run's peak rate, steps and time budget are its :class:`Schedule` (:func:`planned_steps`, the
grids of rates).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sfm.config import LABELLED_VOLUME
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
    """Let the encoder learn (or not, ``freeze_encoder``); the MAE's reconstruction decoder learns only when the
    head reads it (otherwise it is not part of the segmenter: under DDP every parameter that requires a gradient
    must get one). A network without an encoder learns whole."""
    if net.mae is None:
        return
    net.mae.requires_grad_(False)
    if freeze_encoder:
        return
    if net.reads_decoder:
        net.mae.requires_grad_(True)
    for _, params in encoder_parameters(net.mae):
        for _, p in params:
            p.requires_grad_(True)


def optimizer_for(net: Segmenter, recipe, lr: float, *, freeze_encoder: bool = False) -> torch.optim.AdamW:
    """AdamW with layer-wise decay: layer ``k`` of a depth-``d`` encoder learns at lr * decay^(d + 1 - k), the head
    (and a decoder it reads) at lr; biases, norms and the cls token have no weight decay
    (:func:`sfm.train.step.weight_decay_groups`)."""
    layers = [] if freeze_encoder or net.mae is None else encoder_parameters(net.mae)
    depth = len(net.mae.blocks) if net.mae is not None else 0
    in_layers = {id(p) for _, params in layers for _, p in params}
    rest = list(net.head.named_parameters())
    if net.mae is not None and net.reads_decoder and not freeze_encoder:
        rest += [(n, p) for n, p in net.mae.named_parameters() if id(p) not in in_layers]
    groups = []
    for layer, params in layers + [(depth + 1, rest)]:
        groups += weight_decay_groups(params, recipe.weight_decay, lr_scale=recipe.layer_decay ** (depth + 1 - layer))
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.999))


def planned_steps(recipe, labelled_voxels: int) -> int:
    """A run's steps: ``recipe.steps``, or (0) ``base_steps`` x sqrt(labelled volumes), a labelled volume being
    :data:`sfm.config.LABELLED_VOLUME` voxels of training labels (at least one), rounded to the validation interval:
    more labels, more steps to learn from them; early stopping keeps the best step of those."""
    if recipe.steps > 0:
        return int(recipe.steps)
    volumes = max(1.0, labelled_voxels / LABELLED_VOLUME)
    every = recipe.validate_every
    return max(every, round(recipe.base_steps * math.sqrt(volumes) / every) * every)


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


@dataclass(frozen=True)
class Schedule:
    """One phase of a fine-tuning run: its peak rate ``lr`` and ``steps`` (warm-up then cosine over them), whether
    only the head learns (``freeze_encoder``: the linear probe), and the time budget it keeps: ``deadline`` (a
    ``time.perf_counter()`` value; None: none), with ``agree(steps)`` the steps every rank runs where each measured
    its own pace (the job's: the fewest any rank would; None: one process)."""

    lr: float
    steps: int
    freeze_encoder: bool = False
    deadline: float | None = None
    agree: Callable[[int], int] | None = None


@dataclass(frozen=True)
class RunHooks:
    """What a run reports to and runs through: ``wrap(net, freeze_encoder)`` the module that runs the batches (DDP;
    None: ``net``), ``progress(total, phase)`` a Progress counting a phase's steps (phases ``linear probe`` and
    ``fine-tune``; None: no count, no loss shown), ``track(phase)`` where that phase's losses go (:func:`reporting`)."""

    wrap: Callable[[Segmenter, bool], nn.Module] | None = None
    progress: Callable[[int, str], Progress] | None = None
    track: Callable[[str], Callable[[dict[str, float], int], None] | None] | None = None


def train_steps(net: Segmenter, recipe, batches: Batches, loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                schedule: Schedule, *, forward: nn.Module | None = None,
                validate: Callable[[Segmenter], float] | None = None, score_start: bool = False) -> Segmenter:
    """Fine-tune ``net`` (in place) for ``schedule.steps`` steps at peak rate ``schedule.lr`` on ``batches(step)``,
    minimising ``loss_of(logits, labels)``; ``forward`` runs the batches (a DistributedDataParallel wrapper of ``net``;
    default ``net`` itself). With ``schedule.freeze_encoder`` only the head learns.

    With ``validate`` (``net`` -> score, higher is better), ``net`` is scored every ``recipe.validate_every``
    steps, at the last step, and with ``score_start`` before the first (LP-FT: the linear probe itself is a
    candidate), and ends with the weights of the best score (early stopping); ``net.chosen_step`` says which
    step that was (the last step without validation) and ``net.validation`` lists every (step, score).

    With ``schedule.deadline``: at every ``validate_every`` steps the pace so far (validation included) is measured,
    and when the remaining steps would end past the deadline they are cut to what fits (at least the steps done;
    every rank as many, ``schedule.agree``); ``net.steps_run`` says how many ran.
    """
    forward = forward if forward is not None else net
    steps, lr = schedule.steps, schedule.lr
    set_trainable(net, schedule.freeze_encoder)
    optimizer = optimizer_for(net, recipe, lr, freeze_encoder=schedule.freeze_encoder)
    best: tuple[float, int, dict | None] = (-math.inf, steps, None)
    history: list[tuple[int, float]] = []
    started = time.perf_counter()

    def score_step(done: int) -> tuple[float, int, dict | None]:
        score = validate(net)
        history.append((done, score))
        return (score, done, {k: v.detach().clone() for k, v in net.state_dict().items()}) if score > best[0] else best

    if validate is not None and score_start:
        best = score_step(0)
    step = 0
    while step < steps:
        net.train()
        factor = lr_at(step, lr=1.0, min_lr=0.0, warmup_steps=max(1, round(recipe.warmup_fraction * steps)),
                       max_steps=steps)  # the pretraining schedule's shape, from 1 down to 0
        for group in optimizer.param_groups:
            group["lr"] = lr * group["lr_scale"] * factor
        imgs, labels = batches(step)
        loss = loss_of(forward(imgs), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in net.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        step += 1
        checkpoint = step % recipe.validate_every == 0
        if schedule.deadline is not None and checkpoint and step < steps:
            pace = (time.perf_counter() - started) / step
            fits = max(step, min(steps, int((schedule.deadline - started) / pace)))
            steps = schedule.agree(fits) if schedule.agree is not None else fits
        if validate is not None and (checkpoint or step == steps):
            best = score_step(step)
    if best[2] is not None:
        net.load_state_dict(best[2])
    net.chosen_step, net.validation, net.steps_run = (best[1] if validate is not None else steps), history, steps
    net.eval()
    return net


def probe_then_fine_tune(net: Segmenter, recipe, batches: Batches, loss_of, schedule: Schedule, *,
                         validate: Callable[[Segmenter], float] | None = None, probed: bool = False,
                         hooks: RunHooks = RunHooks()) -> int:
    """LP-FT on ``net`` (in place): ``recipe.probe_steps`` steps of the head alone on the frozen encoder at
    ``recipe.probe_lr`` (when ``recipe.linear_first``, the network has an encoder, and the head is not
    ``probed`` already), then the whole network on ``schedule`` with early stopping on ``validate`` (the probed head
    a candidate too), both within ``schedule.deadline`` (:func:`train_steps`). The probe reads batches 0, 1, ...;
    fine-tuning the ones after them, so no crop is drawn twice. ``hooks``: what runs the batches, counts the steps
    and takes the losses. Returns the probe steps run."""
    wrap = hooks.wrap or (lambda n, frozen: n)
    probe = recipe.probe_steps if recipe.linear_first and net.mae is not None and not probed else 0

    def phase(name: str, plan: Schedule, first: int, **kw) -> None:
        bar = hooks.progress(plan.steps, name) if hooks.progress is not None else None
        track = hooks.track(name) if hooks.track is not None else None
        counted = reporting(loss_of, bar, track) if bar is not None else loss_of
        train_steps(net, recipe, lambda step: batches(first + step), counted, plan,
                    forward=wrap(net, plan.freeze_encoder), **kw)
        if bar is not None:
            bar.close()

    if probe:
        phase("linear probe", dataclasses.replace(schedule, lr=recipe.probe_lr, steps=probe, freeze_encoder=True), 0)
    phase("fine-tune", schedule, probe, validate=validate, score_start=(probe > 0 or probed))
    return probe
