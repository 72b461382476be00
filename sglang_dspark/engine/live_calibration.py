"""Live recalibration: the planner's STS calibrations refitted on the server's own verify rounds.

The shipped `sts.json` / `sts-greedy.json` were fitted offline, on the calibration split decoded
by the reference decoder. Served traffic differs (other prompts, stop at EOS, the server's dtype),
and so does how often deep drafts survive: served greedy at concurrency 1 on an AVX2 CPU (session
20), drafts at positions 3-6 survived 0.32 / 0.33 / 0.24 / 0.11 of the time against 0.23 / 0.20 /
0.10 / 0.06 predicted, and the planner verified fewer drafts than paid (`fixed:3` served 7 % more
tokens/s than it). A refit on those 4,075 served rounds did not take over, though: held-out mean
ECE 0.107 against 0.110 for the shipped file (the served confidences separate survivors less
sharply than on the calibration split, which no temperature mends), so there the file stays in
force. Where it is missing or fitted on other traffic, the refit takes over.

Every verified round (a request's confidence logits, how many of its drafts were verified and how
many accepted) goes into a bounded buffer per temperature class (greedy rounds survive by argmax
match, sampled ones by rejection sampling: separate calibrations). Every `every` new rounds of a
class, STS is refitted (`calibration.sts.calibrate`, identity or STS by held-out ECE) on 70 % of
the buffer and compared with the calibration in force on the other 30 %: it replaces it only where
its held-out mean ECE is lower by `margin`. A refit of a full buffer takes ~0.3 s of the scheduler
process (the steps wait), so each refit that changes nothing doubles the wait for the next, up to
`MAX_BACKOFF` times `every`; one that takes over resets it. Rounds are censored where the planner stopped early
(positions past the verified ones carry no label), which the metrics already handle. Survivals only
steer how many drafts are verified, so output is unchanged: verification stays lossless.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import torch

from sglang_dspark.calibration.buffer import CalibrationSampleBuffer
from sglang_dspark.calibration.sts import StsCalibration, calibrate, evaluate

logger = logging.getLogger(__name__)

KINDS = ("greedy", "sampled")
HOLDOUT_FRACTION = 0.3
MIN_ROUNDS = 64
MAX_BACKOFF = 16


@dataclass(frozen=True)
class RefitReport:
    """One refit: the class, rounds used, held-out mean ECE of the calibration in force and of
    the refitted one, and whether the refit took over."""

    kind: str
    rounds: int
    ece_before: float
    ece_after: float
    adopted: bool
    method: str


class LiveRecalibrator:
    """Buffers verify rounds per temperature class and refits their STS calibration."""

    def __init__(self, gamma: int, every: int, *, capacity: int = 4096, margin: float = 0.005, seed: int = 0) -> None:
        if every < MIN_ROUNDS:
            raise ValueError(f"recalibration every {every} rounds: expected at least {MIN_ROUNDS} (a refit "
                             "holds some out to compare with the calibration in force)")
        self.gamma, self.every, self.margin = gamma, every, margin
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
        confidences) on held-out rounds by `margin`; else None (keep `current`)."""
        self._new_rounds[kind] = 0
        data = self._buffers[kind].snapshot().calibration_data()
        rounds = data.logits.shape[0]
        order = torch.randperm(rounds, generator=self._generator)
        holdout = int(rounds * HOLDOUT_FRACTION)
        train, heldout = data.subset(order[holdout:]), data.subset(order[:holdout])
        fitted = calibrate(train, methods=("identity", "sts"), seed=int(torch.randint(0, 2**31, (1,),
                                                                                      generator=self._generator)))
        in_force = current if current is not None else StsCalibration.identity(self.gamma)
        before = evaluate(in_force, heldout).mean_ece
        after = evaluate(fitted.calibration, heldout).mean_ece
        adopted = after < before - self.margin
        self.reports.append(RefitReport(kind, rounds, before, after, adopted, fitted.chosen_method))
        self._interval[kind] = self.every if adopted else min(2 * self._interval[kind], MAX_BACKOFF * self.every)
        logger.info("sglang-dspark: live recalibration (%s, %d rounds): held-out mean ECE %.4f in force, %.4f "
                    "refitted (%s): %s", kind, rounds, before, after, fitted.chosen_method,
                    "adopted" if adopted else "kept the one in force")
        return fitted.calibration if adopted else None
