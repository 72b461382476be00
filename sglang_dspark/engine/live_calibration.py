"""Live recalibration: the planner's STS calibrations refitted on the server's own verify rounds.

The shipped `sts.json` / `sts-greedy.json` were fitted offline, on the calibration split decoded
by the reference decoder. Served traffic differs (other prompts, stop at EOS, the server's dtype),
and so does how often deep drafts survive: served greedy at concurrency 1 on an AVX2 CPU (session
20), drafts at positions 3-6 survived 0.31 / 0.27 / 0.18 / 0.09 of the time against 0.22 / 0.20 /
0.10 / 0.05 predicted, and the planner verified fewer drafts than paid (`fixed:3` served 7 % more
tokens/s than it). Refits on 4,096 of those served rounds lowered the held-out binned ECE (0.10-0.13
-> 0.06-0.12) but not, beyond noise, the Brier score (gains of -0.003 to +0.004 per round, standard
errors 0.001-0.003; one refit in four passed the test below): the deep positions are too rarely
verified to weigh, so on that traffic the shipped file mostly stays in force. Where the file is
missing, or was fitted on other traffic, a refit takes over.

Every verified round (a request's confidence logits, how many of its drafts were verified and how
many accepted) goes into a bounded buffer per temperature class (greedy rounds survive by argmax
match, sampled ones by rejection sampling: separate calibrations). Every `every` new rounds of a
class, a calibration is refitted on 70 % of the buffer (`calibration.sts.calibrate`: identity, one
temperature, STS or STS with a bias per position, by held-out ECE) and compared with the one in
force on the other 30 %: it replaces it only where its Brier score there is lower by more than
`SIGNIFICANCE` standard errors (a paired comparison on the same rounds; the difference of two
binned ECEs on ~1,000 rounds is mostly noise). A refit of a full buffer takes the scheduler
process ~0.1 s where most rounds verified 1-2 drafts (concurrency 16) and ~0.2 s where they
verified 3-7 (concurrency 1; the steps wait; each position's grid reads only the rounds that
verified it), so each refit that changes nothing doubles the wait for the next, up to
`MAX_BACKOFF` times `every`; one that takes over resets it. Rounds are censored where
the planner stopped early (positions past the verified ones carry no label), which the metrics
already handle. Survivals only steer how many drafts are verified, so output is unchanged:
verification stays lossless.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass

import torch

from sglang_dspark.calibration.buffer import CalibrationSampleBuffer
from sglang_dspark.calibration.sts import CalibrationData, StsCalibration, calibrate, evaluate

logger = logging.getLogger(__name__)

KINDS = ("greedy", "sampled")
HOLDOUT_FRACTION = 0.3
MIN_ROUNDS = 64
MAX_BACKOFF = 16
SIGNIFICANCE = 3.0


@dataclass(frozen=True)
class RefitReport:
    """One refit: the class, rounds used, held-out mean ECE of the calibration in force and of
    the refitted one, the held-out Brier gain (and its standard error), and whether the refit
    took over."""

    kind: str
    rounds: int
    ece_before: float
    ece_after: float
    brier_gain: float
    brier_gain_error: float
    adopted: bool
    method: str


class LiveRecalibrator:
    """Buffers verify rounds per temperature class and refits their STS calibration."""

    def __init__(self, gamma: int, every: int, *, capacity: int = 4096, seed: int = 0) -> None:
        if every < MIN_ROUNDS:
            raise ValueError(f"recalibration every {every} rounds: expected at least {MIN_ROUNDS} (a refit "
                             "holds some out to compare with the calibration in force)")
        self.gamma, self.every = gamma, every
        self._buffers = {kind: CalibrationSampleBuffer(max(capacity, every), gamma) for kind in KINDS}
        self._new_rounds = dict.fromkeys(KINDS, 0)
        self._interval = dict.fromkeys(KINDS, every)
        self._generator = torch.Generator().manual_seed(seed)
        self.reports: deque[RefitReport] = deque(maxlen=64)

    def add(self, confidence_logits: torch.Tensor, verify_lens: torch.Tensor, accepted: torch.Tensor,
            greedy: torch.Tensor) -> None:
        """One step's rounds: raw confidence logits [B, w] (w <= gamma drafted slots), drafts
        verified [B] and accepted [B], greedy [B] (bool). Rounds that verified nothing are dropped."""
        verified = verify_lens.long().cpu()
        keep = verified > 0
        if not bool(keep.any()):
            return
        logits = torch.nn.functional.pad(confidence_logits.float().cpu(), (0, self.gamma - confidence_logits.shape[1]))
        accepted = accepted.long().cpu().minimum(verified)
        greedy = greedy.bool().cpu()
        for kind, rows in (("greedy", keep & greedy), ("sampled", keep & ~greedy)):
            if bool(rows.any()):
                self._buffers[kind].add(logits[rows], accepted[rows], verified[rows])
                self._new_rounds[kind] += int(rows.sum())

    def due(self) -> list[str]:
        """The classes with enough new rounds since their last refit (`every`, more after refits
        that changed nothing)."""
        return [kind for kind in KINDS if self._new_rounds[kind] >= self._interval[kind]]

    def refit(self, kind: str, current: StsCalibration | None) -> StsCalibration | None:
        """A calibration for `kind` fitted on its buffer when it beats `current` (None: raw
        confidences) on held-out rounds (Brier score, by `SIGNIFICANCE` standard errors); else
        None (keep `current`)."""
        self._new_rounds[kind] = 0
        data = self._buffers[kind].snapshot().calibration_data()
        rounds = data.logits.shape[0]
        order = torch.randperm(rounds, generator=self._generator)
        holdout = int(rounds * HOLDOUT_FRACTION)
        train, heldout = data.subset(order[holdout:]), data.subset(order[:holdout])
        fitted = calibrate(train, seed=int(torch.randint(0, 2**31, (1,), generator=self._generator)))
        in_force = current if current is not None else StsCalibration.identity(self.gamma)
        gain, error = brier_gain(in_force, fitted.calibration, heldout)
        adopted = gain > SIGNIFICANCE * error
        report = RefitReport(kind, rounds, evaluate(in_force, heldout).mean_ece,
                             evaluate(fitted.calibration, heldout).mean_ece, gain, error, adopted, fitted.chosen_method)
        self.reports.append(report)
        self._interval[kind] = self.every if adopted else min(2 * self._interval[kind], MAX_BACKOFF * self.every)
        logger.info("sglang-dspark: live recalibration (%s, %d rounds): held-out Brier gain %.5f +- %.5f, mean ECE "
                    "%.4f in force, %.4f refitted (%s): %s", kind, rounds, gain, error, report.ece_before,
                    report.ece_after, fitted.chosen_method, "adopted" if adopted else "kept the one in force")
        return fitted.calibration if adopted else None


def brier_gain(current: StsCalibration, candidate: StsCalibration, data: CalibrationData) -> tuple[float, float]:
    """How much lower `candidate`'s Brier score is than `current`'s on `data`, per round (summed
    over its labelled positions), and that mean's standard error: a paired comparison on the same
    rounds, far steadier than the difference of two binned ECEs."""
    valid = data.valid.to(torch.float64)
    per_round = (((current.apply(data.logits) - data.labels) ** 2 - (candidate.apply(data.logits) - data.labels) ** 2)
                 * valid).sum(dim=1)
    rounds = per_round.numel()
    return float(per_round.mean()), float(per_round.std() / math.sqrt(rounds)) if rounds > 1 else float("inf")
