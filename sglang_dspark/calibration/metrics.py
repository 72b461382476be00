"""Calibration metrics for prefix-survival predictions.

The label of position k (0-based) in a round is 1 when drafts 0..k were all accepted. It is only
known when draft k was verified: a planner that verified v drafts tells us nothing about positions
>= v (when all v were accepted). `prefix_labels` returns the labels with that validity mask; every
metric takes per-sample weights (0 = ignore), which also carry recency weighting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_BINS = 20


class CalibrationDataError(ValueError):
    """Calibration input of the wrong shape or range; says what was expected."""


def prefix_labels(
    accepted_lengths: torch.Tensor, gamma: int, verified_lengths: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """labels [N, gamma] (float, 1 = drafts 0..k all accepted) and valid [N, gamma] (bool)."""
    accepted = accepted_lengths.to(torch.long)
    verified = (
        torch.full_like(accepted, gamma) if verified_lengths is None else verified_lengths.long()
    )
    if accepted.dim() != 1 or verified.shape != accepted.shape:
        raise CalibrationDataError(
            f"accepted and verified lengths must be 1-D of equal length, got "
            f"{tuple(accepted.shape)} and {tuple(verified.shape)}"
        )
    if bool((accepted < 0).any()) or bool((accepted > verified).any()) or bool((verified > gamma).any()):
        raise CalibrationDataError(
            f"need 0 <= accepted <= verified <= gamma={gamma} in every round"
        )
    position = torch.arange(gamma)
    labels = (position[None, :] < accepted[:, None]).to(torch.float64)
    valid = position[None, :] < verified[:, None]
    return labels, valid


def _flat_weights(pred: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    if weight is None:
        return torch.ones_like(pred, dtype=torch.float64)
    if weight.shape != pred.shape:
        raise CalibrationDataError(
            f"weights must match predictions' shape {tuple(pred.shape)}, got {tuple(weight.shape)}"
        )
    return weight.to(torch.float64)


@dataclass(frozen=True)
class ReliabilityBins:
    """Per equal-width bin: total weight, mean prediction, mean label (NaN for empty bins)."""

    edges: list[float]
    weight: list[float]
    mean_prediction: list[float]
    mean_label: list[float]


def _binned(
    pred: torch.Tensor, label: torch.Tensor, weight: torch.Tensor, num_bins: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Along the last dim: per bin (weight, weighted prediction sum, weighted label sum)."""
    index = (pred.to(torch.float64) * num_bins).long().clamp(0, num_bins - 1)
    shape = pred.shape[:-1] + (num_bins,)
    sums = []
    for values in (weight, weight * pred.to(torch.float64), weight * label.to(torch.float64)):
        sums.append(torch.zeros(shape, dtype=torch.float64).scatter_add_(-1, index, values))
    return sums[0], sums[1], sums[2]


def expected_calibration_error_batched(
    pred: torch.Tensor, label: torch.Tensor, weight: torch.Tensor, num_bins: int = DEFAULT_BINS
) -> torch.Tensor:
    """ECE along the last dim for every leading index at once (the STS grid search uses this)."""
    bin_weight, pred_sum, label_sum = _binned(pred, label, weight, num_bins)
    total = bin_weight.sum(-1).clamp(min=1e-300)
    return (pred_sum - label_sum).abs().sum(-1) / total


def expected_calibration_error(
    pred: torch.Tensor,
    label: torch.Tensor,
    weight: torch.Tensor | None = None,
    num_bins: int = DEFAULT_BINS,
) -> float:
    """sum_b (W_b / W) |mean pred_b - mean label_b| over `num_bins` equal-width bins."""
    flat_pred = pred.reshape(-1)
    w = _flat_weights(pred, weight).reshape(-1)
    if float(w.sum()) <= 0:
        raise CalibrationDataError("ECE needs at least one sample with positive weight")
    return float(expected_calibration_error_batched(flat_pred, label.reshape(-1), w, num_bins))


def ece_sampling_floor(
    pred: torch.Tensor,
    weight: torch.Tensor | None = None,
    num_bins: int = DEFAULT_BINS,
    draws: int = 256,
    seed: int = 0,
) -> float:
    """The ECE a perfectly calibrated predictor shows on this many samples: the mean ECE over
    `draws` label sets drawn as Bernoulli(pred).

    ECE is biased upwards by sampling noise (a bin of n rounds misses its mean by ~sqrt(p(1-p)/n)),
    so a measured ECE means little without this floor: one near it is all the calibration the
    sample can show; the excess over it is real miscalibration.
    """
    flat_pred = pred.reshape(-1).to(torch.float64)
    w = _flat_weights(pred, weight).reshape(-1)
    if float(w.sum()) <= 0:
        raise CalibrationDataError("the ECE floor needs at least one sample with positive weight")
    generator = torch.Generator().manual_seed(seed)
    expanded = flat_pred.clamp(0.0, 1.0).expand(draws, -1)
    labels = torch.bernoulli(expanded, generator=generator)
    floors = expected_calibration_error_batched(expanded, labels, w.expand(draws, -1), num_bins)
    return float(floors.mean())


def brier_score(pred: torch.Tensor, label: torch.Tensor, weight: torch.Tensor | None = None) -> float:
    """Weighted mean squared error between predicted probability and outcome."""
    w = _flat_weights(pred, weight)
    if float(w.sum()) <= 0:
        raise CalibrationDataError("Brier score needs at least one sample with positive weight")
    error = (pred.to(torch.float64) - label.to(torch.float64)) ** 2
    return float((w * error).sum() / w.sum())


def reliability_bins(
    pred: torch.Tensor,
    label: torch.Tensor,
    weight: torch.Tensor | None = None,
    num_bins: int = DEFAULT_BINS,
) -> ReliabilityBins:
    """The reliability diagram's data."""
    w = _flat_weights(pred, weight).reshape(-1)
    bin_weight, pred_sum, label_sum = _binned(pred.reshape(-1), label.reshape(-1), w, num_bins)
    safe = bin_weight.clamp(min=1e-300)
    empty = bin_weight <= 0
    nan = torch.full_like(bin_weight, float("nan"))
    return ReliabilityBins(
        edges=[i / num_bins for i in range(num_bins + 1)],
        weight=bin_weight.tolist(),
        mean_prediction=torch.where(empty, nan, pred_sum / safe).tolist(),
        mean_label=torch.where(empty, nan, label_sum / safe).tolist(),
    )


@dataclass(frozen=True)
class PositionReport:
    """Calibration of the cumulative survival at each position."""

    ece: list[float]
    brier: list[float]
    mean_prediction: list[float]
    mean_label: list[float]
    samples: list[int]

    @property
    def mean_ece(self) -> float:
        """Mean over positions that have samples."""
        values = [e for e, n in zip(self.ece, self.samples) if n > 0]
        return sum(values) / len(values) if values else float("nan")


def position_report(
    survivals: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    weights: torch.Tensor | None = None,
    num_bins: int = DEFAULT_BINS,
) -> PositionReport:
    """Per position: ECE (20 bins), Brier, mean prediction and label, sample count."""
    row_weight = torch.ones(survivals.shape[0], dtype=torch.float64) if weights is None else weights
    w = valid.to(torch.float64) * row_weight.to(torch.float64)[:, None]
    pred = survivals.to(torch.float64)
    ece, brier, mean_pred, mean_label, samples = [], [], [], [], []
    for k in range(survivals.shape[1]):
        wk, count = w[:, k], int(valid[:, k].sum())
        samples.append(count)
        if float(wk.sum()) <= 0:
            ece.append(float("nan")), brier.append(float("nan"))
            mean_pred.append(float("nan")), mean_label.append(float("nan"))
            continue
        ece.append(float(expected_calibration_error_batched(pred[:, k], labels[:, k], wk, num_bins)))
        brier.append(brier_score(pred[:, k], labels[:, k], wk))
        mean_pred.append(float((wk * pred[:, k]).sum() / wk.sum()))
        mean_label.append(float((wk * labels[:, k]).sum() / wk.sum()))
    return PositionReport(ece, brier, mean_pred, mean_label, samples)
