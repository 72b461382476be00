"""Calibration drift detection on a rolling ECE.

Traffic changes (a new domain, a new prompt style) silently bend the confidence head's calibration
and with it every planner decision. The detector keeps the last `window` rounds' predicted
survivals and realised prefix labels, computes the mean per-position ECE of that window, and
reports drift once it exceeds the reference (the held-out ECE at fit time) by `tolerance` on
`patience` consecutive updates, so one unlucky batch does not trigger a refit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_dspark.calibration.metrics import (
    DEFAULT_BINS,
    CalibrationDataError,
    expected_calibration_error_batched,
    prefix_labels,
)


@dataclass(frozen=True)
class DriftStatus:
    rolling_ece: float | None  # None until min_samples rounds were seen
    reference_ece: float | None
    samples: int
    drifted: bool


class EceDriftDetector:
    def __init__(
        self,
        gamma: int,
        window: int = 2048,
        reference_ece: float | None = None,
        tolerance: float = 0.03,
        min_samples: int = 256,
        patience: int = 3,
        num_bins: int = DEFAULT_BINS,
    ) -> None:
        if window < min_samples or min_samples < 1 or patience < 1:
            raise CalibrationDataError(
                f"need window >= min_samples >= 1 and patience >= 1, got window={window}, "
                f"min_samples={min_samples}, patience={patience}"
            )
        self.gamma, self.window, self.tolerance = gamma, window, tolerance
        self.min_samples, self.patience, self.num_bins = min_samples, patience, num_bins
        self.reference_ece = reference_ece
        self._survivals = torch.zeros(window, gamma, dtype=torch.float64)
        self._labels = torch.zeros(window, gamma, dtype=torch.float64)
        self._valid = torch.zeros(window, gamma, dtype=torch.float64)
        self._next = self._size = self._strikes = 0

    def set_reference(self, ece: float) -> None:
        """After a (re)fit: the new held-out ECE becomes the baseline; the window restarts."""
        self.reference_ece = ece
        self._next = self._size = self._strikes = 0

    def rolling_ece(self) -> float | None:
        if self._size < self.min_samples:
            return None
        pred = self._survivals[: self._size].t()
        label = self._labels[: self._size].t()
        weight = self._valid[: self._size].t()
        ece = expected_calibration_error_batched(pred, label, weight, self.num_bins)
        has_data = weight.sum(-1) > 0
        return float(ece[has_data].mean()) if bool(has_data.any()) else None

    def update(
        self,
        survivals: torch.Tensor,
        accepted_lengths: torch.Tensor,
        verified_lengths: torch.Tensor | None = None,
    ) -> DriftStatus:
        """Add rounds (predicted survivals [n, gamma] as the planner used them) and re-check."""
        if survivals.dim() != 2 or survivals.shape[1] != self.gamma:
            raise CalibrationDataError(
                f"survivals must be [n, {self.gamma}], got {tuple(survivals.shape)}"
            )
        labels, valid = prefix_labels(accepted_lengths, self.gamma, verified_lengths)
        survivals, labels, valid = survivals[-self.window :], labels[-self.window :], valid[-self.window :]
        n = survivals.shape[0]
        slots = (self._next + torch.arange(n)) % self.window
        self._survivals[slots] = survivals.to(torch.float64)
        self._labels[slots] = labels
        self._valid[slots] = valid.to(torch.float64)
        self._next = (self._next + n) % self.window
        self._size = min(self._size + n, self.window)
        ece = self.rolling_ece()
        if ece is not None and self.reference_ece is None:
            self.reference_ece = ece
        too_high = ece is not None and ece > (self.reference_ece or 0.0) + self.tolerance
        self._strikes = self._strikes + 1 if too_high else 0
        return DriftStatus(ece, self.reference_ece, self._size, self._strikes >= self.patience)
