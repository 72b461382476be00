"""Calibration: metrics are right on hand-computed cases, STS halves the held-out ECE of
over-confident scores, never makes calibrated scores worse than identity beyond noise, and the
choice between fits is made on held-out data and reported."""

import math

import pytest
import torch

from sglang_dspark.calibration.metrics import (
    CalibrationDataError,
    brier_score,
    ece_sampling_floor,
    expected_calibration_error,
    position_report,
    prefix_labels,
    reliability_bins,
)
from sglang_dspark.calibration.sts import CalibrationData, StsCalibration, calibrate, evaluate, fit_method


def rounds(n: int, gamma: int, seed: int, scale: float, shift: float):
    """True conditional acceptance logits z; acceptance drawn from sigmoid(z); the head reports
    scale * z + shift (scale > 1: over-confident)."""
    g = torch.Generator().manual_seed(seed)
    true = torch.randn(n, gamma, generator=g, dtype=torch.float64) * 1.2 + 1.2
    accepted_each = torch.rand(n, gamma, generator=g, dtype=torch.float64) < torch.sigmoid(true)
    accepted = torch.cumprod(accepted_each.long(), dim=1).sum(dim=1)
    return true * scale + shift, accepted


def test_ece_and_brier_on_a_hand_computed_case():
    pred = torch.tensor([0.1, 0.1, 0.9, 0.9])
    label = torch.tensor([0.0, 1.0, 1.0, 1.0])
    # bin 2: mean pred 0.1, mean label 0.5 -> 0.4; bin 18: 0.9 vs 1.0 -> 0.1; equal weights
    assert expected_calibration_error(pred, label) == pytest.approx(0.25)
    assert brier_score(pred, label) == pytest.approx((0.01 + 0.81 + 0.01 + 0.01) / 4)
    weighted = expected_calibration_error(pred, label, torch.tensor([1.0, 1.0, 0.0, 0.0]))
    assert weighted == pytest.approx(0.4)
    bins = reliability_bins(pred, label)
    assert bins.weight[2] == 2 and bins.mean_label[2] == pytest.approx(0.5)
    assert math.isnan(bins.mean_prediction[10]) and len(bins.edges) == 21


def test_prefix_labels_mark_unverified_positions_invalid():
    labels, valid = prefix_labels(torch.tensor([0, 2, 3]), gamma=4, verified_lengths=torch.tensor([4, 2, 4]))
    assert labels.tolist() == [[0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]
    assert valid.tolist() == [[True] * 4, [True, True, False, False], [True] * 4]
    with pytest.raises(CalibrationDataError, match="accepted <= verified"):
        prefix_labels(torch.tensor([3]), gamma=4, verified_lengths=torch.tensor([2]))


def test_sts_cuts_heldout_ece_of_overconfident_scores_at_least_in_half():
    logits, accepted = rounds(6000, 7, seed=0, scale=2.5, shift=0.5)
    train = CalibrationData.from_rounds(logits[:4000], accepted[:4000])
    test = CalibrationData.from_rounds(logits[4000:], accepted[4000:])
    sts = fit_method("sts", train)
    before = evaluate(StsCalibration.identity(7), test)
    after = evaluate(sts, test)
    assert after.mean_ece <= 0.5 * before.mean_ece
    assert all(t > 1.0 for t in sts.temperatures)  # over-confident -> softened
    for k in range(7):
        assert after.ece[k] < before.ece[k]


@pytest.mark.parametrize("method", ["sts", "sts_affine"])
def test_positions_a_round_never_verified_do_not_move_the_fit(method):
    """Served rounds are censored where the planner stopped (at concurrency 16 most verify 1-2
    drafts): the scores at positions a round never verified carry no label, so whatever they are,
    the fitted temperatures and biases are the same."""
    logits, accepted = rounds(3000, 5, seed=3, scale=2.0, shift=0.3)
    verified = torch.randint(1, 6, (3000,), generator=torch.Generator().manual_seed(4))
    accepted = torch.minimum(accepted, verified)
    unverified = torch.arange(5)[None, :] >= verified[:, None]
    fits = []
    for junk in (-40.0, 40.0):
        data = CalibrationData.from_rounds(logits.masked_fill(unverified, junk), accepted, verified)
        fits.append(fit_method(method, data))
    assert unverified[:, 1:].float().mean() > 0.3
    assert fits[0].temperatures == fits[1].temperatures and fits[0].biases == fits[1].biases


def test_sts_keeps_the_ranking():
    logits, accepted = rounds(2000, 5, seed=4, scale=2.0, shift=0.0)
    sts = fit_method("sts", CalibrationData.from_rounds(logits, accepted))
    calibrated = sts.apply(logits)
    for k in range(5):
        conditional = calibrated[:, k] / (calibrated[:, k - 1] if k else 1.0)
        by_raw = conditional[torch.argsort(logits[:, k])]
        assert bool((by_raw[1:] >= by_raw[:-1] - 1e-12).all())


@pytest.mark.parametrize("seed", [1, 2])
def test_calibrate_never_worse_than_identity_beyond_noise_on_calibrated_scores(seed):
    logits, accepted = rounds(3000, 7, seed=seed, scale=1.0, shift=0.0)
    result = calibrate(CalibrationData.from_rounds(logits, accepted), seed=seed)
    identity = result.heldout_mean_ece["identity"]
    assert result.heldout_after.mean_ece <= identity + 0.005
    fresh_logits, fresh_accepted = rounds(3000, 7, seed=seed + 50, scale=1.0, shift=0.0)
    fresh = CalibrationData.from_rounds(fresh_logits, fresh_accepted)
    assert evaluate(result.calibration, fresh).mean_ece <= evaluate(StsCalibration.identity(7), fresh).mean_ece + 0.01


def test_calibrate_reports_its_choice_and_uses_a_better_fit_when_one_exists():
    # a constant offset is something temperature alone cannot fix, a per-position bias can
    logits, accepted = rounds(5000, 7, seed=3, scale=1.0, shift=2.5)
    result = calibrate(CalibrationData.from_rounds(logits, accepted))
    scores = result.heldout_mean_ece
    assert set(scores) == {"identity", "global_temperature", "sts", "sts_affine"}
    assert result.chosen_method == min(scores, key=scores.get) or scores[result.chosen_method] <= min(scores.values()) + 0.002
    assert result.chosen_method in result.note and "held-out" in result.note
    assert result.heldout_after.mean_ece <= 0.5 * result.heldout_before.mean_ece
    assert result.calibration.metadata["heldout_mean_ece"] == scores


def test_calibration_json_round_trip_and_gamma_check(tmp_path):
    calibration = StsCalibration([1.5, 2.0, 0.7], biases=[0.0, -0.5, 0.1], method="sts_affine")
    path = tmp_path / "sts.json"
    calibration.save(path)
    loaded = StsCalibration.load(path)
    logits = torch.randn(4, 3)
    assert torch.allclose(loaded.apply(logits), calibration.apply(logits))
    with pytest.raises(CalibrationDataError, match="gamma=3"):
        loaded.apply(torch.randn(2, 7))
    with pytest.raises(CalibrationDataError, match="finite values > 0"):
        StsCalibration([1.0, 0.0])


def test_position_report_ignores_unverified_positions():
    survivals = torch.tensor([[0.9, 0.8], [0.9, 0.8]])
    labels, valid = prefix_labels(torch.tensor([1, 2]), 2, torch.tensor([1, 2]))
    report = position_report(survivals, labels, valid)
    assert report.samples == [2, 1]
    assert report.mean_label == [1.0, 1.0]


def test_ece_floor_is_the_sampling_noise_of_a_calibrated_predictor():
    generator = torch.Generator().manual_seed(3)
    few, many = torch.rand(200, generator=generator), torch.rand(20000, generator=generator)
    assert ece_sampling_floor(few) > 5 * ece_sampling_floor(many)  # noise ~ 1/sqrt(n)

    calibrated = torch.bernoulli(many, generator=generator)
    overconfident = torch.bernoulli((many - 0.2).clamp(0, 1), generator=generator)
    floor = ece_sampling_floor(many)
    assert expected_calibration_error(many, calibrated) < 3 * floor
    assert expected_calibration_error(many, overconfident) > 10 * floor


def test_ece_floor_needs_a_weighted_sample():
    with pytest.raises(CalibrationDataError, match="positive weight"):
        ece_sampling_floor(torch.rand(4), torch.zeros(4))
