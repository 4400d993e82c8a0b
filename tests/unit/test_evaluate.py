"""Reconstruction metrics and baselines on constructed cases with known answers."""

from __future__ import annotations

import math

import pytest
import torch

from sfm.eval.reconstruction import MaskedError, interpolate_masked, metrics_table, predictions, visible_voxels
from sfm.model import build_model, mae_config


def tiny_model(**overrides):
    torch.manual_seed(0)
    return build_model(mae_config("tiny", crop=(16, 16, 16), patch=(4, 4, 4), **overrides))


def trilinear(shape, dtype=torch.float64) -> torch.Tensor:
    i, j, k = torch.meshgrid(*(torch.arange(n, dtype=dtype) for n in shape), indexing="ij")
    return 1 + 2 * i - 3 * j + 0.5 * k + 0.1 * i * j - 0.2 * j * k + 0.05 * i * k + 0.01 * i * j * k


# ---- the metric --------------------------------------------------------------------------------


def test_masked_error_known_values():
    target = torch.tensor([[[1.0, -1.0, 2.0, -2.0], [5.0, 5.0, 5.0, 5.0]]])  # [N=1, L=2, P=4]
    mask = torch.tensor([[1.0, 0.0]])  # only patch 0 is scored
    zero = MaskedError()
    zero.add(torch.zeros_like(target), target, mask)
    r = zero.result()
    assert r["mse"] == pytest.approx(2.5)
    assert r["nmse"] == pytest.approx(1.0)  # sum t^2 = 10 = sum (t - mean t)^2
    assert r["psnr"] == pytest.approx(10 * math.log10(4 / 2.5))  # peak |t| = 2

    close = MaskedError()
    wrong_unmasked = target.clone()
    wrong_unmasked[0, 1] += 100.0  # errors on visible patches never count
    close.add(wrong_unmasked + torch.tensor([[[0.1], [0.0]]]), target, mask)
    r = close.result()
    assert r["mse"] == pytest.approx(0.01)
    assert r["nmse"] == pytest.approx(0.04 / 10)
    assert r["psnr"] == pytest.approx(10 * math.log10(4 / 0.01))

    perfect = MaskedError()
    perfect.add(target, target, mask)
    assert perfect.result()["nmse"] == 0.0 and perfect.result()["psnr"] == math.inf


# ---- the interpolation baseline ------------------------------------------------------------------


def test_interpolation_is_exact_on_trilinear_fields_inside_the_volume():
    field = trilinear((16, 16, 16))[None]
    visible = torch.ones_like(field, dtype=torch.bool)
    visible[:, 4:8, 8:12, 4:12] = False  # hidden blocks with visible neighbours on every side
    visible[:, 8:12, 4:8, 8:12] = False
    filled = interpolate_masked(field, visible).double()
    assert torch.allclose(filled, field, atol=1e-4 * float(field.abs().max()))
    assert torch.equal(filled[visible], field[visible].float().double())  # visible voxels are kept


def test_interpolation_at_the_border_takes_the_nearest_visible_voxel():
    volume = torch.zeros(1, 8, 8, 8)
    volume[:, :, :, :4] = 3.0  # constant along the first two axes
    visible = torch.ones_like(volume, dtype=torch.bool)
    visible[:, :, :, 4:] = False  # the last half of the time axis is hidden, open to the border
    filled = interpolate_masked(volume, visible)
    assert torch.allclose(filled, torch.full_like(filled, 3.0))  # one-sided: nearest visible value


def test_interpolation_with_nothing_visible_is_the_survey_mean():
    volume = torch.randn(1, 4, 4, 4)
    assert torch.equal(interpolate_masked(volume, torch.zeros_like(volume, dtype=torch.bool)), torch.zeros_like(volume))


# ---- predictors in target space -----------------------------------------------------------------


def _score(model, imgs, pred, mask, means):
    target = model.patch_targets(imgs)
    out = {}
    for name, p in predictions(model, imgs, pred, mask, means).items():
        acc = MaskedError()
        acc.add(p, target, mask)
        out[f"target_{name}"] = acc.result()["nmse"]
    return out


def test_zero_and_mean_baselines_have_their_closed_form_nmse():
    """Patches = offset m_p + zero-mean pattern. In target space zero scores 1; a constant survey mean 0 lands
    at -m_p/sd_p, so its NMSE is (sum_p (P-1) + P (m_p/sd_p)^2) / sum_p (P-1)."""
    model = tiny_model()
    torch.manual_seed(1)
    imgs = torch.randn(2, 1, 16, 16, 16)
    offsets = torch.randn(2, 1, 4, 4, 4).repeat_interleave(4, 2).repeat_interleave(4, 3).repeat_interleave(4, 4)
    imgs = imgs + 2 * offsets
    mask = (torch.rand(2, 64) < 0.75).float()
    scores = _score(model, imgs, torch.zeros(2, 64, 64), mask, torch.zeros(2))
    assert scores["target_zero"] == pytest.approx(1.0, abs=1e-5)

    patches = model.patchify(imgs).double()
    mu, sd = patches.mean(-1), (patches.var(-1) + 1e-6).sqrt()
    p = patches.shape[-1]
    m = mask.bool()
    energy = (p - 1) * patches.var(-1) / sd**2  # sum of t^2 over a patch
    expected = (energy + p * (mu / sd) ** 2)[m].sum() / energy[m].sum()
    assert scores["target_mean"] == pytest.approx(float(expected), rel=1e-4)
    assert scores["target_mean"] > scores["target_zero"]


def test_a_perfect_prediction_and_an_exact_interpolation_score_zero():
    model = tiny_model()
    imgs = trilinear((16, 16, 16)).float()[None, None]
    mask = torch.zeros(1, 64)
    mask[0, [21, 22, 25, 26, 37, 38, 41, 42]] = 1.0  # interior patches only: two-sided anchors on every axis
    target = model.patch_targets(imgs)
    scores = _score(model, imgs, target, mask, torch.zeros(1))
    assert scores["target_model"] == 0.0
    assert scores["target_interp"] < 1e-6
    visible = visible_voxels(model, imgs, mask)
    assert int((~visible).sum()) == 8 * 64


def test_metrics_table_rows():
    metrics = {"masked_nmse": 0.5, "masked_psnr": 20.0, "baseline_zero_nmse": 1.0, "baseline_zero_psnr": 18.0,
               "baseline_mean_nmse": 1.2, "baseline_mean_psnr": 17.0, "baseline_interp_nmse": 1.5,
               "baseline_interp_psnr": 16.0}
    rows = metrics_table(metrics)
    assert rows[0] == ["model", "0.5000", "20.00"]
    assert rows[1] == ["zero (true patch mean)", "1.0000", "18.00"] and rows[3][1] == "1.5000"
