"""What speculation actually delivered: measured tokens/s of steps that speculated (ran the
drafter, or verified lookup drafts) against plain one-token steps, per batch size.

The production planner values a draft width with a cost model (the SPS table, rescaled online)
and calibrated survivals. Both can be wrong in the same direction where it matters most: at
concurrency 16 on this project's CPU, undrafted steps took 76 ms where the table said 99, served
acceptance fell below the offline one, and the planner drafted 73-80 % of the steps for 0.84x
the throughput of never drafting. `StepRates` needs no model: it compares what the two kinds of
step measured at (about) this batch size, and the planner runs plain steps where speculating
measurably loses ("speculation must never cost throughput under load").

Lookup drafts count as speculation: they cost no drafter, but each verified one is a target row,
and the step pays their proposals and planning. At concurrency 16 on the Zen 4 EPYC (session 45)
steps that skipped the drafter but verified lookups delivered 386-396 tokens/s where plain steps
delivered 403-417; while the check compared drafted steps only with plain ones and left
lookup-only steps out, its skipped side was never measured there (a skip verified lookups), and
the planner drafted at 0.93x plain serving's throughput.
"""

from __future__ import annotations

import numpy as np

PLAIN, SPECULATED = 0, 1


class StepRates:
    """Exponentially forgotten means of committed tokens and step seconds, per batch size and
    per kind of step (speculated or plain).

    A rate at batch size B pools the sizes within B +- B // `spread` (batch size drifts as
    requests come and go; a rate is comparable only across similar sizes), as the ratio of the
    pooled means, each size weighted by its effective sample count (at most 1 / `decay`).

    A server's first decode steps pay one-off costs (7-10x a warm step on this CPU): the first
    `warmup` steps of each kind are not counted, and once a size has `min_samples` of a kind,
    a step counts at most `outlier_factor` from that mean (a stall must not turn drafting off)."""

    def __init__(self, decay: float = 0.1, min_samples: int = 4, spread: int = 8, warmup: int = 8,
                 outlier_factor: float = 2.0, margin: float = 0.03) -> None:
        if not 0.0 < decay <= 1.0 or min_samples < 1 or spread < 1 or warmup < 0 or outlier_factor < 1.0:
            raise ValueError(f"need 0 < decay <= 1, min_samples >= 1, spread >= 1, warmup >= 0, outlier_factor >= 1; "
                             f"got {decay}, {min_samples}, {spread}, {warmup}, {outlier_factor}")
        self.decay, self.min_samples, self.spread = decay, min_samples, spread
        self.outlier_factor, self.margin = outlier_factor, margin
        self._warmup_left = [warmup, warmup]
        self._stats: dict[int, np.ndarray] = {}  # batch size -> [kind, (tokens, seconds, count)]

    def add(self, batch_size: int, speculated: bool, tokens: float, seconds: float) -> None:
        """One finished decode step: its batch size, whether it speculated, the tokens it committed
        and its seconds (drafting and planning included)."""
        if batch_size < 1 or not (seconds > 0.0 and np.isfinite(seconds)) or tokens < 0:
            return
        kind = SPECULATED if speculated else PLAIN
        if self._warmup_left[kind] > 0:
            self._warmup_left[kind] -= 1
            return
        row = self._stats.setdefault(batch_size, np.zeros((2, 3)))[kind]
        if row[2] >= self.min_samples:
            seconds = min(max(seconds, row[1] / self.outlier_factor), row[1] * self.outlier_factor)
        row[2] += 1
        step = max(self.decay, 1.0 / row[2])  # a plain mean while young
        row[0] += step * (tokens - row[0])
        row[1] += step * (seconds - row[1])

    def rate(self, batch_size: int, speculated: bool) -> tuple[float | None, int]:
        """(tokens/s, samples) of this kind of step around `batch_size`; rate None without samples."""
        kind = SPECULATED if speculated else PLAIN
        reach = batch_size // self.spread
        tokens = seconds = 0.0
        samples = 0
        for size in range(max(1, batch_size - reach), batch_size + reach + 1):
            stats = self._stats.get(size)
            if stats is None or stats[kind, 2] == 0:
                continue
            weight = min(stats[kind, 2], 1.0 / self.decay)
            tokens += weight * stats[kind, 0]
            seconds += weight * stats[kind, 1]
            samples += int(stats[kind, 2])
        return (tokens / seconds if seconds > 0 else None), samples

    def forget(self, batch_size: int, speculated: bool) -> None:
        """Drop what steps of this kind measured around `batch_size` (the sizes `rate` pools)."""
        kind = SPECULATED if speculated else PLAIN
        reach = batch_size // self.spread
        for size in range(max(1, batch_size - reach), batch_size + reach + 1):
            if size in self._stats:
                self._stats[size][kind] = 0.0

    def known(self, batch_size: int, speculated: bool) -> bool:
        """At least `min_samples` steps of this kind were measured around `batch_size`."""
        return self.rate(batch_size, speculated)[1] >= self.min_samples

    def speculation_loses(self, batch_size: int) -> bool:
        """Both kinds are known around `batch_size` and speculated steps delivered more than
        `margin` fewer tokens/s than plain ones. The margin keeps noise from vetoing: at concurrency 1 a ten-step mean
        of committed tokens swings by ~20 %, and a request whose drafts pay little (1.3 tokens
        a step) drafted at 1.01x its skipped rate."""
        plain_rate, plain_samples = self.rate(batch_size, speculated=False)
        speculated_rate, speculated_samples = self.rate(batch_size, speculated=True)
        if plain_rate is None or speculated_rate is None or min(plain_samples, speculated_samples) < self.min_samples:
            return False
        return bool(speculated_rate < (1.0 - self.margin) * plain_rate)  # a Python bool: step records are JSON
