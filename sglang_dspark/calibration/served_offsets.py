"""Served acceptance offsets: per-position corrections of a calibration, learnt from served rounds.

A calibration fitted offline can be off for the traffic a server sees, and where it is off
matters most at the verify budget's margin. Served greedy at concurrency 1 (session 22, AVX2
CPU), a draft's acceptance given the drafts before it accepted was predicted well at position 1
(0.16-0.96 predicted, within ~0.05 of observed in every decile) but under-predicted from position
2 on (0.45 predicted against 0.68 observed, 0.64 against 0.79-0.88, ...), so the early stop
refused deep drafts that would have paid. The live STS refit (`engine.live_calibration`) could
not fix it: it fits all positions' temperatures by binned ECE and must beat the file by a
held-out Brier test, which the rarely verified deep positions never carry.

So, per position k, one offset delta_k is added to the calibrated conditional logit
(`StsCalibration.conditional_logits`): acceptance_k = sigmoid(x_k + delta_k). It is the maximum a
posteriori estimate of a logistic regression with that fixed slope, on every served test of
position k (a round that verified draft k after accepting drafts 1..k-1; label: draft k
accepted). Which rounds test position k depends only on confidences, which are inputs here, so
the fit is unbiased although the planner chooses what gets verified. The prior is Gaussian,
centred on delta_{k-1} (0 for position 1) with `PRIOR_SCALE`: few tests leave an offset near its
shallower neighbour's (deep positions are tested rarely and erred alike), many tests decide it.
Offsets only change which drafts are verified, never which are accepted: output is unchanged.
"""

from __future__ import annotations

import numpy as np
import torch

PRIOR_SCALE = 0.5
"""Standard deviation of an offset's prior around its neighbour's, in logits (0.5 moves an
acceptance of 0.5 to 0.38 or 0.62)."""
NEWTON_STEPS = 6
REFIT_SHARE = 16
"""A refit waits for `refit_every` new tests or a 1/16 of the tests held, whichever is more: with
full buffers (~10,000 tests) a refit takes ~1 ms, and at concurrency 16 64 new tests came every
2-3 steps while moving the offsets by little. A young server refits every 16 tests (a refit over
a few hundred tests is cheap): with 64, a drafter whose drafts the target stopped accepting was
drafted ~20 more steps at batch 3 before its offsets learnt it, against ~8 with 16."""


class ServedOffsets:
    """Per-position offsets of one calibration's conditional logits (see the module doc)."""

    def __init__(self, gamma: int, *, capacity: int = 2048, refit_every: int = 16,
                 prior_scale: float = PRIOR_SCALE) -> None:
        if gamma < 1 or capacity < 1 or refit_every < 1 or not prior_scale > 0:
            raise ValueError(f"served offsets: gamma {gamma}, capacity {capacity}, refit_every {refit_every} and "
                             f"prior_scale {prior_scale}: expected positive values")
        self.gamma, self.capacity, self.refit_every, self.prior_scale = gamma, capacity, refit_every, prior_scale
        self.offsets = np.zeros(gamma)
        self._logits = np.zeros((gamma, capacity))  # per position, a ring of tested conditional logits
        self._labels = np.zeros((gamma, capacity))
        self._sizes = np.zeros(gamma, dtype=np.int64)
        self._next = np.zeros(gamma, dtype=np.int64)
        self._new_tests = 0

    def tests(self) -> list[int]:
        """Tests held per position (at most `capacity` each)."""
        return self._sizes.tolist()

    def apply(self, conditional_logits: torch.Tensor) -> torch.Tensor:
        """Calibrated conditional logits [B, gamma] -> prefix survivals [B, gamma] (float32)."""
        offsets = torch.as_tensor(self.offsets, dtype=torch.float64)
        return torch.cumprod(torch.sigmoid(conditional_logits.to(torch.float64) + offsets), dim=-1).to(torch.float32)

    def add(self, conditional_logits: torch.Tensor, verify_lens: torch.Tensor, accepted: torch.Tensor) -> None:
        """One step's rounds: calibrated conditional logits [B, w] (w <= gamma drafted slots; the
        offsets not applied), drafts verified [B] and accepted [B]. Refits after `refit_every`
        new tests, or a `REFIT_SHARE`-th of those held if more."""
        logits = conditional_logits.detach().to(torch.float64).cpu().numpy()
        verified = verify_lens.detach().cpu().numpy().astype(np.int64)
        accepted = np.minimum(accepted.detach().cpu().numpy().astype(np.int64), verified)
        for position in range(min(logits.shape[1], self.gamma)):
            tested = (verified > position) & (accepted >= position)
            if tested.any():
                self._store(position, logits[tested, position], (accepted[tested] > position).astype(np.float64))
        if self._new_tests >= max(self.refit_every, int(self._sizes.sum()) // REFIT_SHARE):
            self.refit()

    def _store(self, position: int, logits: np.ndarray, labels: np.ndarray) -> None:
        count = min(len(logits), self.capacity)
        logits, labels = logits[-count:], labels[-count:]
        slots = (self._next[position] + np.arange(count)) % self.capacity
        self._logits[position, slots], self._labels[position, slots] = logits, labels
        self._next[position] = (self._next[position] + count) % self.capacity
        self._sizes[position] = min(self._sizes[position] + count, self.capacity)
        self._new_tests += count

    def refit(self) -> None:
        """Each offset's MAP estimate, shallow positions first (each is the next one's prior mean)."""
        self._new_tests = 0
        precision = 1.0 / self.prior_scale**2
        prior_mean = 0.0
        for position in range(self.gamma):
            size = self._sizes[position]
            logits, labels = self._logits[position, :size], self._labels[position, :size]
            offset = prior_mean
            for _ in range(NEWTON_STEPS):  # concave: Newton converges in a few steps
                p = 1.0 / (1.0 + np.exp(-(logits + offset)))
                gradient = float((labels - p).sum()) - precision * (offset - prior_mean)
                curvature = float((p * (1.0 - p)).sum()) + precision
                offset += gradient / curvature
            self.offsets[position] = prior_mean = offset

    def reset(self) -> None:
        """Forget every test and offset (the calibration they were measured against changed)."""
        self.offsets[:] = 0.0
        self._sizes[:] = 0
        self._next[:] = 0
        self._new_tests = 0
