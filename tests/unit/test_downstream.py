"""The downstream evaluation (sfm.eval.downstream): its scores on cases with known answers, and that it
tells an encoder that holds fault features from a random one, the same way every time."""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch

from sfm.config import EvalConfig, JobConfig, quick_recipe
from sfm.errors import SFMError
from sfm.eval import downstream, labelled
from sfm.finetune.loop import Schedule
from sfm.model import mae_config
from sfm.model.mae import MaskedAutoencoder3D

pytestmark = pytest.mark.long(1)


def evaluation(finetune: dict | None = None, **settings) -> EvalConfig:
    """An EvalConfig with ``settings``, its recipe the default quick one with ``finetune``'s changes."""
    return EvalConfig(**settings, finetune=replace(quick_recipe(), **(finetune or {})))


def test_fine_tuning_crops_keep_amplitude_and_labels_together_under_every_augmentation():
    """Flips, swaps, polarity inversion and time reversal move the labels with the amplitude: here each
    voxel's amplitude is +-(1 + its label), so |amplitude| - 1 must give the label back; faults lie in the
    shallowest samples, so a time-reversed crop has them at its end."""
    rng = np.random.default_rng(0)
    faults = np.zeros((12, 12, 16), bool)
    faults[:, :, :4] = rng.random((12, 12, 4)) < 0.5
    volume = ((1.0 + faults) * (1 + 0.01 * rng.random(faults.shape))).astype(np.float32)
    imgs, labels = labelled.random_crops([(volume, faults)], (8, 8, 16), 64, np.random.default_rng(1))
    assert torch.equal(labels, (imgs[:, 0].abs() > 1.5).float())
    signs = imgs[:, 0].flatten(1).sign()
    assert bool((signs == 1).all(dim=1).any()) and bool((signs == -1).all(dim=1).any())  # both polarities
    shallow, deep = labels[..., :4].sum(dim=(1, 2, 3)), labels[..., -4:].sum(dim=(1, 2, 3))
    assert bool(((shallow > 0) & (deep == 0)).any()) and bool(((deep > 0) & (shallow == 0)).any())  # reversed too


def test_labelled_volumes_are_normalised_and_seeded():
    a = labelled.labelled_volumes(2, (32, 32, 48), 123)
    b = labelled.labelled_volumes(2, (32, 32, 48), 123)
    assert all(np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]) for x, y in zip(a, b))
    assert not np.array_equal(a[0][0], a[1][0])
    for amplitude, faults in a:
        assert abs(float(amplitude.mean())) < 1e-4 and float(amplitude.std()) == pytest.approx(1.0, abs=1e-4)
        assert 0 < faults.mean() < 0.5
    assert labelled.TEST_SEED - labelled.LABELLED_SEED >= 1_000_000  # pool and test seeds never meet


# ---- the evaluation on the tiny preset ---------------------------------------------------------------

# the tiny preset with thin patches (4 x 4 traces x 8 samples), so a token can outline a fault
TINY = dict(crop=(32, 32, 32), patch=(4, 4, 8))
RECIPE = evaluation({"steps": 40, "batch_size": 4}, budgets=(1,), seeds=2, test_volumes=2, volume=(32, 32, 64),
                    knn=8)


@pytest.fixture(scope="module")
def volumes():
    pool = labelled.labelled_volumes(2, RECIPE.volume, labelled.LABELLED_SEED)
    test = labelled.labelled_volumes(2, RECIPE.volume, labelled.TEST_SEED)
    return pool, test


@pytest.fixture(scope="module")
def fault_trained_encoder():
    """An encoder pretrained by construction: the tiny preset fine-tuned on 6 labelled volumes of seeds
    outside the evaluation's pool and test sets, so its tokens carry fault features."""
    torch.manual_seed(0)
    mae = MaskedAutoencoder3D(mae_config("tiny", **TINY))
    train = labelled.labelled_volumes(6, (32, 32, 64), 3_000_000)
    return downstream.supervised_pretrain(mae, train, quick_recipe(), steps=300, lr=2e-3, seed=5)


def test_encoder_with_fault_features_beats_random_init_on_every_seed(fault_trained_encoder, volumes):
    result = downstream.evaluate_downstream(fault_trained_encoder, RECIPE, pool=volumes[0], test=volumes[1])
    print({k: v for k, v in result.items() if k != "downstream"})
    assert result["ft_all_seeds_gain_b1"] and result["ft_min_gain_b1"] > 0.005
    assert result["linear_all_seeds_gain_b1"] and result["linear_min_gain_b1"] > 0.01
    assert result["knn_ap_gain_b1"] > 0.01
    assert 0 < result["ft_f1_b1"] <= 1 and 0 < result["ft_iou_b1"] <= result["ft_f1_b1"]


def test_a_random_encoder_does_not_beat_random_init(volumes):
    torch.manual_seed(99)  # another random initialisation than the baseline's
    random_encoder = MaskedAutoencoder3D(mae_config("tiny", **TINY))
    result = downstream.evaluate_downstream(random_encoder, RECIPE, pool=volumes[0], test=volumes[1])
    print({k: v for k, v in result.items() if k != "downstream"})
    assert result["ft_ap_gain_b1"] < 0.005
    assert abs(result["linear_ap_gain_b1"]) < 0.005 and abs(result["knn_ap_gain_b1"]) < 0.01


def test_same_seeds_give_the_same_scores(fault_trained_encoder, volumes):
    recipe = evaluation({"steps": 10}, budgets=(1,), seeds=1, test_volumes=1, volume=(32, 32, 64), knn=4)
    state = {k: v.clone() for k, v in fault_trained_encoder.state_dict().items()}
    first = downstream.evaluate_downstream(fault_trained_encoder, recipe, pool=volumes[0], test=volumes[1][:1])
    second = downstream.evaluate_downstream(fault_trained_encoder, recipe, pool=volumes[0], test=volumes[1][:1])
    assert first["downstream"]["budgets"] == second["downstream"]["budgets"]
    # the evaluation fine-tunes copies: the encoder it was given is untouched
    assert all(torch.equal(v, fault_trained_encoder.state_dict()[k]) for k, v in state.items())


def test_validation_holds_out_labels_fine_tuning_never_sees():
    amplitude = np.arange(64 * 8 * 16, dtype=np.float32).reshape(64, 8, 16)
    faults = (np.arange(64)[:, None, None] % 3 == 0).repeat(8, 1).repeat(16, 2).astype(np.uint8)
    fit, held = labelled.split_for_validation([(amplitude, faults)], 0.25, (32, 8, 16))
    (fit_a, fit_f), = fit
    assert fit_a.shape[0] == 48 and np.array_equal(fit_a, amplitude[:48]) and np.array_equal(fit_f, faults[:48])
    (h,) = held  # a whole crop of amplitude, of which only the 16 held-out inlines are scored
    assert h.amplitude.shape[0] == 32 and np.array_equal(h.amplitude, amplitude[32:]) and h.first == 16
    assert np.array_equal(h.faults[h.first:], faults[48:])
    # a volume too small to leave a crop for fine-tuning is not split; nor is anything at fraction 0
    assert labelled.split_for_validation([(amplitude[:40], faults[:40])], 0.25, (32, 8, 16))[1] == []
    assert labelled.split_for_validation([(amplitude, faults)], 0.0, (32, 8, 16))[1] == []


def test_fine_tuning_keeps_the_step_with_the_best_validation_score(volumes):
    pool, _ = volumes
    train = [(np.concatenate([a, a[::-1]]), np.concatenate([f, f[::-1]])) for a, f in pool[:1]]  # 64 inlines
    torch.manual_seed(0)
    mae = MaskedAutoencoder3D(mae_config("tiny", **TINY))
    recipe = replace(quick_recipe(), batch_size=2, validate_every=4, linear_first=False)
    fit, held = labelled.split_for_validation(train, recipe.validation, mae.cfg.crop)
    net = downstream.fine_tune_on_volumes(mae, fit, recipe, 0, Schedule(1e-3, 12), held=held)
    steps, aps = zip(*net.validation)
    assert steps == (4, 8, 12)
    assert net.chosen_step == steps[int(np.argmax(aps))]
    assert downstream.validation_ap(net, held, recipe) == pytest.approx(max(aps), abs=1e-6)


def test_with_a_linear_probe_to_start_from_the_probe_itself_is_a_candidate(fault_trained_encoder, volumes):
    """LP-FT: step 0 (the frozen encoder with the probe's head) is scored too, and kept where it validates best."""
    pool, _ = volumes
    recipe = replace(quick_recipe(), batch_size=2, validate_every=4)
    train = [(np.concatenate([a, a[::-1]]), np.concatenate([f, f[::-1]])) for a, f in pool[:1]]  # 64 inlines
    fit, held = labelled.split_for_validation(train, 0.25, TINY["crop"])
    mae = copy.deepcopy(fault_trained_encoder)
    head = downstream.train_linear_head(*downstream.tokens_of(mae, fit)[:2], seed=0)
    net = downstream.fine_tune_on_volumes(mae, fit, recipe, 0, Schedule(5e-2, 8), head=head, held=held)
    steps, aps = zip(*net.validation)
    assert steps == (0, 4, 8)
    assert net.chosen_step == steps[int(np.argmax(aps))]
    if net.chosen_step == 0:  # the weights are the starting ones again
        assert torch.equal(net.head.weight, head.weight)
        assert all(torch.equal(v, fault_trained_encoder.state_dict()[k]) for k, v in net.mae.state_dict().items())
    assert downstream.validation_ap(net, held, recipe) == pytest.approx(max(aps), abs=1e-6)


def test_separate_validation_volumes_stop_early_and_leave_the_whole_budget_to_fine_tuning(
        fault_trained_encoder, volumes, monkeypatch, capsys):
    recipe = evaluation({"steps": 8, "batch_size": 2, "validate_every": 4}, budgets=(1,), seeds=1, test_volumes=1,
                        volume=(64, 32, 64), probes=False, validation_volumes=2)
    pool = [(np.concatenate([a, a[::-1]]), np.concatenate([f, f[::-1]])) for a, f in volumes[0]]  # 64 inlines
    validation = labelled.evaluation_validation(recipe)
    assert len(validation) == 2 and all(v[0].shape == (64, 32, 64) for v in validation)
    for other in (labelled.evaluation_pool(recipe), labelled.evaluation_test(recipe)):  # disjoint seeds
        assert not any(np.array_equal(v[0], o[0]) for v in validation for o in other)
    seen = []
    real = downstream.fine_tune_on_volumes

    def spy(mae, train, recipe, seed, schedule, **kw):
        net = real(mae, train, recipe, seed, schedule, **kw)
        seen.append((train, kw["held"], net))
        return net

    monkeypatch.setattr(downstream, "fine_tune_on_volumes", spy)
    result = downstream.evaluate_downstream(fault_trained_encoder, recipe, pool=pool, test=volumes[1][:1],
                                            validation=validation)
    assert result["downstream"]["validation_volumes"] == 2 and len(seen) == 2  # pretrained and random
    err = capsys.readouterr().err  # each arm's fine-tuning reports plain progress lines (no terminal here)
    for arm in ("pretrained", "random"):
        assert f"downstream budget 1 seed 0 {arm}: fine-tune: step 1/8 (12.5%), loss " in err, err
    for train, held, net in seen:
        assert [t[0].shape[0] for t in train] == [64]  # no inline of the budget is held out
        assert [h.first for h in held] == [0, 0]  # every inline of the validation volumes is scored
        assert all(np.array_equal(h.faults, v[1]) for h, v in zip(held, validation))
        steps, aps = zip(*net.validation)
        assert steps == (0, 4, 8) and net.chosen_step == steps[int(np.argmax(aps))]
        assert downstream.validation_ap(net, held, recipe.finetune) == pytest.approx(max(aps), abs=1e-6)
    without = evaluation(budgets=(1,), seeds=1, volume=(64, 32, 64), validation_volumes=0)
    assert labelled.evaluation_validation(without) == []


def test_the_random_arm_does_not_depend_on_the_evaluated_encoder(fault_trained_encoder, volumes):
    """Which is why the snapshots of a run may reuse its random-init scores (``random_arm``)."""
    recipe = evaluation({"steps": 10}, budgets=(1,), seeds=2, test_volumes=1, volume=(32, 32, 64), probes=False)
    pool, test = volumes[0], volumes[1][:1]
    first = downstream.evaluate_downstream(fault_trained_encoder, recipe, pool=pool, test=test)
    torch.manual_seed(7)
    other = MaskedAutoencoder3D(mae_config("tiny", **TINY))
    full = downstream.evaluate_downstream(other, recipe, pool=pool, test=test)
    reused = downstream.evaluate_downstream(other, recipe, pool=pool, test=test, random_arm=first)
    runs = [r["downstream"]["budgets"]["1"] for r in (first, full, reused)]
    assert runs[0]["ft_random"] == runs[1]["ft_random"] == runs[2]["ft_random"]
    assert runs[1]["ft_pretrained"] == runs[2]["ft_pretrained"] != runs[0]["ft_pretrained"]
    longer = replace(recipe, finetune=replace(recipe.finetune, steps=20))  # scores of another recipe are not reused
    with pytest.raises(ValueError, match="finetune"):
        downstream.evaluate_downstream(other, longer, pool=pool, test=test, random_arm=first)


def test_the_pool_does_not_depend_on_which_budgets_a_run_evaluates():
    """The flow may evaluate budgets 1 and 4 and the benchmark 1, 4 and 16: with one ``pool_volumes``
    both draw the same volumes for a budget and seed, so their scores can be compared."""
    few = EvalConfig(budgets=(1, 4), pool_volumes=16)
    many = EvalConfig(budgets=(1, 4, 16), pool_volumes=16)
    assert labelled.pool_size(few.pool_volumes, few.budgets) == 16
    assert labelled.pool_size(many.pool_volumes, many.budgets) == 16
    assert labelled.pool_size(0, (1, 4)) == 4  # 0: the largest budget
    small = [EvalConfig(budgets=b, pool_volumes=3, volume=(32, 32, 64)) for b in ((1,), (1, 2))]
    pools = [labelled.evaluation_pool(r) for r in small]
    assert len(pools[0]) == len(pools[1]) == 3
    assert all(np.array_equal(a, b) and np.array_equal(f, g) for (a, f), (b, g) in zip(*pools))
    draw, indices = labelled.budget_volumes, list(range(16))  # a budget's draw depends on its seed alone
    assert draw(indices, 4, 2) == draw(indices, 4, 2) != draw(indices, 4, 1)


def test_each_arm_keeps_the_rate_of_its_grid_its_validation_labels_prefer(fault_trained_encoder, volumes):
    """A grid of peak rates (``lrs`` for the pretrained arm, ``lrs_random`` for the random one) trains each arm at
    every rate and keeps the one with the best validation score: its scores are those of a run at that rate
    alone, and each arm's grid changes that arm and nothing else."""
    base = dict(budgets=(1,), seeds=1, test_volumes=1, volume=(32, 32, 64), probes=False, validation_volumes=1)
    pool, test = volumes[0], volumes[1][:1]
    runs = {}
    for name, rates in (("slow", ((1e-4,), (1e-4,))), ("fast", ((3e-2,), (3e-2,))),
                        ("grids", ((1e-4, 3e-2), (3e-2,)))):
        recipe = evaluation({"steps": 10, "lrs": rates[0], "lrs_random": rates[1]}, **base)
        runs[name] = downstream.evaluate_downstream(fault_trained_encoder, recipe, pool=pool,
                                                    test=test)["downstream"]["budgets"]["1"]
    assert runs["grids"]["ft_random"] == runs["fast"]["ft_random"] != runs["slow"]["ft_random"]
    (kept,) = runs["grids"]["ft_pretrained"]
    alone = runs["slow" if kept["lr"] == 1e-4 else "fast"]["ft_pretrained"][0]
    assert kept == alone and alone["validation_score"] == max(
        r["ft_pretrained"][0]["validation_score"] for r in (runs["slow"], runs["fast"]))
    with pytest.raises(SFMError, match="eval.finetune.lrs_random"):
        JobConfig.from_toml(None, ["eval.finetune.lrs_random=[-1]"]).validate()


def test_the_linear_probe_is_the_optimum_of_its_objective_whatever_its_seed():
    """The frozen linear probe is logistic regression at its optimum: the class-balanced BCE plus its ridge has no
    gradient left there, and any starting weights end at the same probabilities."""
    from sfm.finetune.loop import balanced_bce

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 20, 12, generator=gen) * 3 + 1  # tokens [M, L, E], not standardised
    truth = torch.randn(12, 8, generator=gen)
    y = ((x - 1) @ truth + torch.randn(6, 20, 8, generator=gen) * 2 > 3).float()  # label patches [M, L, P]
    heads = [downstream.train_linear_head(x, y, seed) for seed in (0, 1)]
    mean, std = x.mean(dim=(0, 1)), x.std(dim=(0, 1)) + 1e-6
    xs, positive = (x - mean) / std, float(y.mean())
    for head in heads:  # unfold the standardisation: the weights the solver saw
        w = (head.weight * std).detach().requires_grad_()
        b = (head.bias + head.weight @ mean).detach().requires_grad_()
        loss = balanced_bce(xs @ w.T + b, y, positive) + 0.5 * downstream.PROBE_RIDGE * w.square().sum() / w.shape[0]
        loss.backward()
        assert max(w.grad.abs().max(), b.grad.abs().max()) < 1e-4
    with torch.no_grad():  # the same probabilities from either start
        assert torch.allclose(torch.sigmoid(heads[0](x)), torch.sigmoid(heads[1](x)), atol=1e-3)
