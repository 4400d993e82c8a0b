"""Downstream value of an encoder: per-voxel fault segmentation at small label budgets.

The literature's protocol for self-supervised encoders (MAE, VideoMAE, MONAI's self-supervised
UNETR, the Seismic Foundation Model of Sheng et al.): fine-tune the pretrained encoder and the same
architecture from random initialisation on a few labelled volumes, score both on held-out volumes,
and report the gain. Gains are largest with the fewest labels, so the budgets are small (1, 4, 16).

Data: FaultSeg3D-like labelled volumes from :func:`sfm.synth.geology.synthesize_volume`, normalised the way
the training sampler normalises a survey (clipped to the 0.1/99.9 percentiles, standardised). Seeds
come from :data:`sfm.eval.labelled.LABELLED_SEED` on, far from any survey seed generated for pretraining;
the test volumes' seeds are disjoint from the labelled pool's. Any other source of labelled volumes
(a different generator, real interpretations) can be passed to :func:`evaluate_downstream` instead.

The segmentation network is the encoder and the head of the recipe (``[eval.finetune] head``; by default the
linear head per token that emits the patch's voxels: what it finds must be in the tokens). The recipe is the
fine-tune flow's type, :class:`sfm.config.FinetuneConfig` (``EvalConfig.finetune``), run through the same loop
(:func:`sfm.finetune.loop.probe_then_fine_tune`): random crops of the labelled volumes (random flips,
inline/crossline swap, polarity inversion, time reversal), class-balanced binary cross-entropy, AdamW with warmup
and cosine decay and layer-wise learning-rate decay (MAE's fine-tuning recipe), steps scaled with the labelled
volumes unless fixed. Pretrained and random encoders see identical crops, heads and schedules for a seed (paired
seeds); each arm trains at every peak rate of its own grid (``lrs``, ``lrs_random``) and keeps the one its
validation labels prefer, as MAE tunes its from-scratch baselines apart: at the rate that suits a pretrained encoder
a random one is under-trained in a short fine-tuning, and the gain would flatter pretraining.

Frozen probes, with no hand-made features: the same linear head fitted to its optimum on the frozen
encoder's tokens (:func:`train_linear_head`, also the LP-FT start), and k-nearest neighbours (each test
token's voxels get the mean label patch of its most similar training tokens, cosine similarity).

Early stopping, the same for both initialisations: the network keeps the weights of the step (every
``validate_every``) with the best AP on validation labels, so each initialisation stops where it is
best (a pretrained encoder overfits a single labelled volume within tens of steps, while a random one
is still learning). The validation labels are either ``validation_volumes`` whole labelled volumes of
their own (seeds disjoint from the pool's and the test volumes'; the same for every budget, seed and
initialisation; fine-tuning then sees every label of the budget), or, with ``validation_volumes = 0``,
the last ``validation`` fraction of each budget volume's inlines, held out of fine-tuning. The held-out
inlines cut the very fault planes fine-tuning trains on, so they reward memorising those planes; whole
volumes do not, at the price of labels outside the budget (as MONAI's and most segmentation fine-tuning
protocols keep a validation set apart from the training labels).

Scores, over every voxel of the test volumes: average precision of the fault class (threshold free),
and F1 / IoU / F1 at a 2-voxel tolerance at the threshold that maximises F1 on the training volumes. Every
prediction (early stopping's, the test volumes') goes through :mod:`sfm.predict.windows` as ``sfm predict``'s does:
windows overlapping by the recipe's ``overlap``, Gaussian-weighted, mirrored with ``mirror``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from sfm.config import EvalConfig, FinetuneConfig
from sfm.eval.labelled import (Held, Volume, budget_volumes, evaluation_pool, evaluation_test,
                               evaluation_validation, random_crops, split_for_validation, whole)
from sfm.finetune.fault_scores import average_precision, scores
from sfm.finetune.loop import RunHooks, Schedule, balanced_bce, planned_steps, probe_then_fine_tune
from sfm.model.segmenter import Segmenter, Task
from sfm.predict.windows import WindowGrid, add_window, cut_window, predict_volume
from sfm.progress import Progress

PROBE_ITERATIONS = 100  # the frozen linear probe: at most this many L-BFGS iterations (it stops where it converges)
PROBE_RIDGE = 1e-2  # ... and its ridge on the standardised tokens' weights of a voxel, small: it keeps the optimum
# finite where the tokens separate the labels


# ---- fine-tuning and probes -------------------------------------------------------------------------


def device_of(module: nn.Module) -> torch.device:
    """Where a module's parameters live: the evaluation runs its networks there (CPU or a GPU)."""
    return next(module.parameters()).device


def validation_ap(net: Segmenter, held: list[Held], recipe: FinetuneConfig) -> float:
    """AP of the fault class over the held-out inlines of every validation part, predicted with the recipe's
    windows (:func:`sfm.predict.windows.predict_volume`)."""
    probs = [predict_volume(net, h.amplitude, overlap=recipe.overlap, mirror=recipe.mirror)[h.first:].ravel()
             for h in held]
    return average_precision(np.concatenate(probs), np.concatenate([h.faults[h.first:].ravel() for h in held]))


def fine_tune_on_volumes(mae: nn.Module, train: list[Volume], recipe: FinetuneConfig, seed: int, schedule: Schedule,
                         *, head: nn.Linear | None = None, held: list[Held] | None = None,
                         progress: str = "") -> Segmenter:
    """Train ``Segmenter(mae)`` with the recipe's head (in place: ``mae`` is changed) on random crops of ``train``
    on ``schedule`` (its peak rate and steps: :func:`sfm.finetune.loop.probe_then_fine_tune`), the linear head
    starting from ``head`` if given (a linear probe of the frozen tokens: LP-FT), any other head probed on the
    frozen encoder first (``recipe.linear_first``).

    With ``held`` (validation parts of the same budget), the network is scored every
    ``recipe.validate_every`` steps and ends with the weights of the best score (early stopping);
    ``net.chosen_step`` says which step that was (the last without validation) and ``net.validation`` lists every
    (step, validation AP).

    Everything random (the head's initialisation, the crops, their flips) comes from ``seed``, so two
    encoders fine-tuned with one seed see exactly the same data in the same order. ``progress``: the name its
    steps are counted under (with their loss); "" counts nothing.
    """
    torch.manual_seed(seed)
    net = Segmenter(mae, Task(head=recipe.head, width=recipe.head_width))
    if head is not None:
        net.head.load_state_dict(head.state_dict())
    rng = np.random.default_rng(seed)
    positive = float(np.mean([f.mean() for _, f in train]))

    def batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return random_crops(train, mae.cfg.crop, recipe.batch_size, rng)

    def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return balanced_bce(logits[:, 0], labels.to(logits.device, non_blocking=True), positive)

    counted = (lambda total, phase: Progress(total, progress if phase == "fine-tune" else f"{progress}: {phase}")
               ) if progress else None
    probe_then_fine_tune(net, recipe, batches, loss_of, schedule,
                         validate=(lambda n: validation_ap(n, held, recipe)) if held else None,
                         probed=head is not None, hooks=RunHooks(progress=counted))
    return net


def supervised_pretrain(mae: nn.Module, volumes: list[Volume], recipe: FinetuneConfig, *, steps: int, lr: float,
                        seed: int = 0) -> nn.Module:
    """Pretrain ``mae``'s encoder (in place) on the fault labels of ``volumes``: every layer at peak ``lr``
    (no layer decay), ``steps`` steps of ``recipe``'s fine-tuning with its linear head, no probe first, no early
    stopping; returns ``mae``.

    An encoder whose tokens hold fault features by construction: evaluated like a pretrained one, its gain
    over random initialisation is what the evaluation can reward at each budget (a reference scale for
    the self-supervised gain, given labelled volumes outside the pool, test and validation sets)."""
    fine_tune_on_volumes(mae, volumes, replace(recipe, layer_decay=1.0, linear_first=False, head="linear"), seed,
                         Schedule(lr, steps))
    return mae


@torch.no_grad()
def tokens_of(mae: nn.Module, volumes: list[Volume], batch_size: int = 8
              ) -> tuple[torch.Tensor, torch.Tensor, list[list[tuple[int, int, int]]]]:
    """Frozen tokens of every window of ``volumes`` (windows of the crop that abut, :class:`WindowGrid` with no
    overlap): tokens [M, L, E], the windows' label patches [M, L, P] (both on the CPU, whatever the encoder's
    device) and each volume's window origins."""
    crop, device = tuple(mae.cfg.crop), device_of(mae)
    mae.eval()
    toks, labs, origins = [], [], []
    for amplitude, faults in volumes:
        grid = WindowGrid(amplitude.shape, crop, 0.0)
        where = [o for i in grid.axes[0].starts for o in grid.row(i)]
        imgs, labels = np.zeros((len(where), 1, *crop), np.float32), np.zeros((len(where), 1, *crop), np.float32)
        for m, origin in enumerate(where):
            cut_window(amplitude, (0, 0, 0), origin, imgs[m, 0])
            cut_window(faults.astype(np.float32), (0, 0, 0), origin, labels[m, 0])
        imgs = torch.from_numpy(imgs)
        toks += [mae.encode(imgs[i:i + batch_size].to(device)).float().cpu() for i in range(0, len(imgs), batch_size)]
        labs.append(mae.patchify(torch.from_numpy(labels)))
        origins.append(where)
    return torch.cat(toks), torch.cat(labs), origins


def _assemble(mae: nn.Module, probs: torch.Tensor, volumes: list[Volume], origins: list) -> list[np.ndarray]:
    """Per-window voxel probabilities [M, L, P] back into volumes, blended with the windows' weights."""
    crop, out, first = tuple(mae.cfg.crop), [], 0
    for (amplitude, _), where in zip(volumes, origins):
        block = mae.unpatchify(probs[first:first + len(where)], mae.cfg.grid).numpy()  # [M, 1, D, H, W]
        first += len(where)
        grid, total = WindowGrid(amplitude.shape, crop, 0.0), np.zeros((1, *amplitude.shape), np.float32)
        for origin, p in zip(where, block):
            add_window(total, (0, 0, 0), origin, p, grid.weight(origin))
        out.append(total[0])
    return out


def train_linear_head(x_train: torch.Tensor, y_train: torch.Tensor, seed: int) -> nn.Linear:
    """A linear head per token on frozen tokens x_train [M, L, E] for labels y_train [M, L, P]: logistic
    regression solved to its optimum (full-batch L-BFGS with a strong-Wolfe line search, at most
    :data:`PROBE_ITERATIONS` iterations) on standardised tokens, class-balanced BCE plus a small ridge
    (:data:`PROBE_RIDGE` / 2 * |W|^2 / P, the bias free), the standardisation then folded into the weights, so
    the head takes raw tokens like ``Segmenter.head``. A probe at its optimum depends on the tokens alone, not on a step
    count or rate (as linear-probe protocols fit logistic regression); the starting weights are seed ``seed``'s."""
    mean, std = x_train.mean(dim=(0, 1)), x_train.std(dim=(0, 1)) + 1e-6
    torch.manual_seed(seed)
    head = nn.Linear(x_train.shape[-1], y_train.shape[-1])
    optimizer = torch.optim.LBFGS(head.parameters(), lr=1.0, max_iter=PROBE_ITERATIONS, history_size=20,
                                  line_search_fn="strong_wolfe")
    positive = float(y_train.mean())
    xs = (x_train - mean) / std

    def objective() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        ridge = 0.5 * PROBE_RIDGE * head.weight.square().sum() / head.out_features  # per voxel of the patch
        loss = balanced_bce(head(xs), y_train, positive) + ridge
        loss.backward()
        return loss

    optimizer.step(objective)
    with torch.no_grad():  # head((x - mean) / std) == (W / std) x + (b - W (mean / std))
        head.bias -= head.weight @ (mean / std)
        head.weight /= std
    return head


def linear_probe(mae: nn.Module, head: nn.Linear, train_tokens, test_tokens, train: list[Volume],
                 test: list[Volume]) -> dict[str, float]:
    """Scores of a linear head on the frozen tokens of the training and test volumes."""
    (x_train, _, o_train), (x_test, o_test) = train_tokens, test_tokens
    with torch.no_grad():
        p_train, p_test = torch.sigmoid(head(x_train)), torch.sigmoid(head(x_test))
    return scores(_assemble(mae, p_train, train, o_train), train, _assemble(mae, p_test, test, o_test), test)


def knn_probe(mae: nn.Module, train_tokens, test_tokens, train: list[Volume], test: list[Volume], k: int
              ) -> dict[str, float]:
    """k nearest training tokens by cosine similarity; a token's voxels get their mean label patch.
    The training volumes' own scores (for the threshold) leave each token out of its neighbours."""
    (x_train, y_train, o_train), (x_test, o_test) = train_tokens, test_tokens
    bank = F.normalize(x_train.reshape(-1, x_train.shape[-1]), dim=-1)
    labels = y_train.reshape(-1, y_train.shape[-1])

    def vote(queries: torch.Tensor, leave_out: bool) -> torch.Tensor:
        q = F.normalize(queries.reshape(-1, queries.shape[-1]), dim=-1)
        out = torch.empty(len(q), labels.shape[-1])
        for first in range(0, len(q), 2048):
            sim = q[first:first + 2048] @ bank.T
            if leave_out:
                rows = torch.arange(len(sim))
                sim[rows, rows + first] = -2.0
            idx = sim.topk(min(k, len(bank) - int(leave_out)), dim=-1).indices
            out[first:first + 2048] = labels[idx].mean(dim=1)
        return out.reshape(queries.shape[0], queries.shape[1], -1)

    return scores(_assemble(mae, vote(x_train, True), train, o_train), train,
                  _assemble(mae, vote(x_test, False), test, o_test), test)


# ---- the evaluation -----------------------------------------------------------------------------


def evaluate_downstream(model: nn.Module, ev: EvalConfig | None = None, *, pool: list[Volume] | None = None,
                        test: list[Volume] | None = None, validation: list[Volume] | None = None,
                        example: dict | None = None, log=print,
                        random_arm: dict[str, Any] | None = None) -> dict[str, Any]:
    """Fine-tune ``model``'s encoder and a randomly initialised copy of its architecture at every label
    budget and seed of ``ev`` (an :class:`sfm.config.EvalConfig`; its ``finetune`` is the recipe); frozen probes
    besides. ``pool``/``test``/``validation``: labelled volumes (default: generated, ``max(budgets)`` for the
    pool, ``test_volumes`` held out and ``validation_volumes`` for early stopping, with disjoint seeds; no
    ``validation`` volumes: early stopping on held-out inlines of each budget volume, ``finetune.validation``).

    ``random_arm``: an earlier result with the same fine-tuning recipe, pool and test volumes whose
    random-init fine-tuning scores are reused when ``ev.probes`` is off (they do not depend on the
    evaluated model, e.g. for its snapshots); a different fine-tuning recipe is refused.

    Returns ``downstream``: per budget {"ft_pretrained": [per-seed scores], "ft_random": [...], ...},
    plus flat headline keys ``ft_ap_gain_b<N>``, ``ft_ap_b<N>``, ``ft_ap_random_b<N>``,
    ``ft_all_seeds_gain_b<N>`` and, with probes, ``linear_ap_*`` / ``knn_ap_*``. ``example``, if given,
    receives the first test volume (``amplitude``, ``faults``) and the fault probability both fine-tuned
    networks give it (``pretrained``, ``random``: [IL, XL, NS]) at the smallest budget, seed 0.

    Every network runs on ``model``'s device (move the model to a GPU to evaluate there); ``model`` itself
    is not changed.
    """
    ev = ev if ev is not None else EvalConfig()
    t0 = time.perf_counter()
    pool = pool if pool is not None else evaluation_pool(ev)
    test = test if test is not None else evaluation_test(ev)
    validation = validation if validation is not None else evaluation_validation(ev)
    recipe = recipe_record(ev)
    if random_arm is not None:
        earlier = random_arm["downstream"]["recipe"]
        differs = [k for k in recipe if k not in ("budgets", "probes", "knn") and earlier.get(k) != recipe[k]]
        if differs:
            raise ValueError(f"random_arm was fine-tuned with another recipe ({', '.join(differs)} differ)")
    pretrained_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rng_state = torch.get_rng_state()
    results: dict[str, Any] = {"budgets": {}, "recipe": recipe, "test_volumes": len(test), "pool_volumes": len(pool),
                               "validation_volumes": len(validation),
                               "test_fault_fraction": float(np.mean([f.mean() for _, f in test]))}
    flat: dict[str, Any] = {}
    try:
        for budget in ev.budgets:
            if budget > len(pool):
                raise ValueError(f"label budget {budget} is larger than the labelled pool of {len(pool)} volumes")
            runs: dict[str, list[dict[str, float]]] = {}
            for seed in range(ev.seeds):
                train = budget_volumes(pool, budget, seed)
                shown = example if budget == min(ev.budgets) and seed == 0 else None
                for init in ("pretrained", "random"):
                    if init == "random" and random_arm is not None and not ev.probes:
                        score = random_arm["downstream"]["budgets"][str(budget)]["ft_random"][seed]
                        runs.setdefault("ft_random", []).append(score)
                        continue
                    state = pretrained_state if init == "pretrained" else None
                    for kind, score in one_run(model.cfg, state, RunVolumes(train, test, validation), ev, seed,
                                               example=shown, device=device_of(model)).items():
                        runs.setdefault(f"{kind}_{init}", []).append(score)
                    score = runs[f"ft_{init}"][-1]
                    log(f"sfm downstream: budget {budget} seed {seed} {init}: AP {score['ap']:.4f} "
                        f"F1 {score['f1']:.4f}, lr {score['lr']:g}, step {score['steps']} "
                        f"({time.perf_counter() - t0:.0f}s)")
            flat.update(gains(runs, budget))
            results["budgets"][str(budget)] = runs
    finally:
        torch.set_rng_state(rng_state)
    results["seconds"] = time.perf_counter() - t0
    return {"downstream": results, **flat}


def recipe_record(ev: EvalConfig) -> dict[str, Any]:
    """What an evaluation records of how it was run (JSON as it reads back): ``ev``'s settings, the fine-tuning
    recipe under ``finetune``."""
    import json

    return json.loads(json.dumps(asdict(ev)))


class RunVolumes(NamedTuple):
    """The labelled volumes of one paired run: fine-tuned on ``train``, scored on ``test``; early
    stopping scores the whole ``validation`` volumes, or without them the held-out inlines of ``train``
    (``finetune.validation``)."""

    train: list[Volume]
    test: list[Volume]
    validation: list[Volume] | None = None


def one_run(cfg, state: dict | None, volumes: RunVolumes, ev: EvalConfig, seed: int, *, example: dict | None = None,
            device: torch.device | str = "cpu") -> dict[str, dict[str, float]]:
    """One paired run's arm: the encoder of architecture ``cfg`` (weights ``state``: the pretrained arm;
    None: the random arm, seed ``seed``'s random init) probed frozen and fine-tuned on ``volumes.train`` at each
    peak rate of its grid (``ev.finetune.lrs`` or ``lrs_random``; the one with the best validation AP kept),
    scored on ``volumes.test``: {"ft": scores, "linear": ..., "knn": ...} (the probes as ``ev`` asks).
    The networks run on ``device``; the random init is drawn on the CPU, so it is the same on any device."""
    from sfm.model.mae import MaskedAutoencoder3D

    recipe = ev.finetune

    def encoder() -> MaskedAutoencoder3D:
        torch.manual_seed(10_000 + seed)  # the random init of seed s, the same for every budget
        mae = MaskedAutoencoder3D(cfg)
        if state is not None:
            mae.load_state_dict(state)
        return mae.to(device)

    mae = encoder()
    train, test, validation = volumes
    init = "pretrained" if state is not None else "random"
    out: dict[str, dict[str, float]] = {}
    if validation:
        fit, held = train, whole(validation)
    else:
        fit, held = split_for_validation(train, recipe.validation, cfg.crop)
    linear = recipe.head == "linear"
    head = None  # the linear probe of the whole budget's frozen tokens
    if ev.probes or (linear and recipe.linear_first and fit is train):
        tokens = tokens_of(mae, train)
        head = train_linear_head(tokens[0], tokens[1], seed)
    if ev.probes:
        x_test, _, o_test = tokens_of(mae, test)
        out["linear"] = linear_probe(mae, head, tokens, (x_test, o_test), train, test)
        if ev.knn > 0 and seed == 0:  # kNN has no seed of its own: once per budget
            out["knn"] = knn_probe(mae, tokens, (x_test, o_test), train, test, ev.knn)
    start = None
    if linear and recipe.linear_first:  # the LP-FT head sees only the labels fine-tuning may see
        start = head if fit is train else train_linear_head(*tokens_of(mae, fit)[:2], seed)
    rates = (recipe.lrs if init == "pretrained" else recipe.lrs_random)[:None if held else 1]
    steps = planned_steps(recipe, sum(a.size for a, _ in fit))
    best = None
    for k, lr in enumerate(rates):
        name = f"downstream budget {len(train)} seed {seed} {init}{f' lr {lr:g}' if len(rates) > 1 else ''}: fine-tune"
        net = fine_tune_on_volumes(mae if k == 0 else encoder(), fit, recipe, seed, Schedule(lr, steps), head=start,
                                   held=held, progress=name)
        score = max((s for _, s in net.validation), default=None)  # None: no validation labels, one rate
        if best is None or score > best[0]:
            best = (score, lr, net)
    score, lr, net = best
    test_probs = [predict_volume(net, a, overlap=recipe.overlap, mirror=recipe.mirror) for a, _ in test]
    train_probs = [predict_volume(net, a, overlap=recipe.overlap, mirror=recipe.mirror) for a, _ in train]
    out["ft"] = {**scores(train_probs, train, test_probs, test), "steps": net.chosen_step, "lr": lr,
                 "validation_score": score, "planned_steps": steps}
    if example is not None:
        example.update(amplitude=test[0][0], faults=test[0][1], budget=len(train))
        example[init] = test_probs[0]
    return out


def gains(runs: dict[str, list[dict[str, float]]], budget: int) -> dict[str, Any]:
    """The headline figures of one budget: mean AP of both inits, the paired gains, F1 and IoU."""
    flat: dict[str, Any] = {}
    for kind in ("ft", "linear", "knn"):
        if f"{kind}_pretrained" not in runs:
            continue
        pre = np.array([r["ap"] for r in runs[f"{kind}_pretrained"]])
        rnd = np.array([r["ap"] for r in runs[f"{kind}_random"]])
        n = min(len(pre), len(rnd))
        paired = pre[:n] - rnd[:n]
        flat[f"{kind}_ap_b{budget}"] = float(pre.mean())
        flat[f"{kind}_ap_random_b{budget}"] = float(rnd.mean())
        flat[f"{kind}_ap_gain_b{budget}"] = float(paired.mean())
        flat[f"{kind}_all_seeds_gain_b{budget}"] = bool((paired > 0).all())
        flat[f"{kind}_min_gain_b{budget}"] = float(paired.min())
        for metric in ("f1", "f1_tol2", "iou"):
            flat[f"{kind}_{metric}_b{budget}"] = float(np.mean([r[metric] for r in runs[f"{kind}_pretrained"]]))
            flat[f"{kind}_{metric}_random_b{budget}"] = float(np.mean([r[metric] for r in runs[f"{kind}_random"]]))
    return flat


def summarize(metrics: dict[str, Any]) -> str:
    """One line: the fine-tuned AP of both inits and the gain at every budget, and the frozen probes'."""
    budgets = metrics["downstream"]["recipe"]["budgets"]
    parts = []
    for b in budgets:
        line = (f"{b} vol: AP {metrics[f'ft_ap_b{b}']:.3f} vs {metrics[f'ft_ap_random_b{b}']:.3f} random "
                f"({metrics[f'ft_ap_gain_b{b}']:+.3f}{', every seed' if metrics[f'ft_all_seeds_gain_b{b}'] else ''})")
        for kind in ("linear", "knn"):
            if f"{kind}_ap_gain_b{b}" in metrics:
                line += f", {kind} {metrics[f'{kind}_ap_gain_b{b}']:+.3f}"
        parts.append(line)
    return "fault segmentation fine-tuned, pretrained vs random init: " + "; ".join(parts)
