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

import itertools
import math
import statistics
from collections import deque
from collections.abc import Iterator


PLAIN, SPECULATED = 0, 1


class StepRates:
    """The recent steps' committed tokens and seconds, per batch size and per kind of step
    (speculated or plain), and the rate each kind delivers around a batch size.

    A rate at batch size B pools the last `window` steps of each size within B +- B // `spread`
    (batch size drifts as requests come and go; a rate is comparable only across similar sizes)
    and is their mean committed tokens over their median seconds. The median, because steps on a
    2-core machine stall when the tokenizer, the detokenizer or the clients take a core: at
    concurrency 16 (session 45) single steps of either kind took 60-120 ms among steps of 36-45
    ms, and plain steps, sampled one in 128 while speculation wins, are few; with a mean (even
    one clipped at 2x) one stalled plain sample made speculating at 0.9x plain look like a win.
    The mean of tokens, because a stall changes no step's tokens, and a speculated step's tokens
    are skewed (many 1-token steps, a few of 5-8): the middle half of the steps by per-step rate
    put drafting at batch 1 below plain steps, and 35 % of its steps were vetoed.

    A server's first decode steps pay one-off costs (7-10x a warm step on this CPU): the first
    `warmup` steps of each kind are not counted.

    Only the last `horizon` recorded steps count, for both kinds: a step's seconds grow with its
    requests' contexts, and the kind the planner runs rarely (plain steps while speculation wins,
    the probes while vetoed) kept samples from long before. At concurrency 16 (session 50) plain
    samples from a wave's start, at short contexts, vetoed drafting mid-wave, and the veto then
    stood for ~900 steps on drafted samples from the previous wave's end, while over the run
    drafted steps delivered 7-9 % more tokens/s than plain ones (0.96x plain serving; a run
    without a veto 1.08x). A kind left with fewer than `min_samples` recent steps is measured
    again: a few plain steps, or drafted ones, every `horizon` steps."""

    def __init__(self, window: int = 32, min_samples: int = 4, spread: int = 8, warmup: int = 8,
                 margin: float = 0.03, horizon: int = 256) -> None:
        if (window < 1 or min_samples < 1 or spread < 1 or warmup < 0 or not 0.0 <= margin < 1.0
                or horizon < min_samples):
            raise ValueError(f"need window >= 1, min_samples >= 1, spread >= 1, warmup >= 0, 0 <= margin < 1, "
                             f"horizon >= min_samples; got {window}, {min_samples}, {spread}, {warmup}, {margin}, "
                             f"{horizon}")
        self.window, self.min_samples, self.spread, self.margin = window, min_samples, spread, margin
        self.horizon = horizon
        self._warmup_left = [warmup, warmup]
        self._recorded = 0  # steps counted so far, of either kind and any size
        # batch size -> per kind, (number, tokens, seconds) of recent steps, oldest first
        self._steps: dict[int, tuple[deque, deque]] = {}

    def add(self, batch_size: int, speculated: bool, tokens: float, seconds: float) -> None:
        """One finished decode step: its batch size, whether it speculated, the tokens it committed
        and its seconds (drafting and planning included)."""
        if batch_size < 1 or not (seconds > 0.0 and math.isfinite(seconds)) or tokens < 0:
            return
        kind = SPECULATED if speculated else PLAIN
        if self._warmup_left[kind] > 0:
            self._warmup_left[kind] -= 1
            return
        if batch_size not in self._steps:
            self._steps[batch_size] = (deque(maxlen=self.window), deque(maxlen=self.window))
        self._recorded += 1
        self._steps[batch_size][kind].append((self._recorded, tokens, seconds))

    def _pooled_windows(self, batch_size: int, kind: int) -> list[deque]:
        reach = batch_size // self.spread
        return [self._steps[size][kind] for size in range(max(1, batch_size - reach), batch_size + reach + 1)
                if size in self._steps]

    def _recent(self, window: deque) -> Iterator[tuple[int, float, float]]:
        """The window's steps within the horizon, newest first (the scan stops at the first stale
        one, and `known` counts them without a copy: it is asked on every decode step)."""
        oldest = self._recorded - self.horizon
        return itertools.takewhile(lambda step: step[0] > oldest, reversed(window))

    def _pooled(self, batch_size: int, kind: int) -> list[tuple[float, float]]:
        return [(tokens, seconds) for window in self._pooled_windows(batch_size, kind)
                for _, tokens, seconds in self._recent(window)]

    def rate(self, batch_size: int, speculated: bool) -> tuple[float | None, int]:
        """(tokens/s, samples) of this kind of step around `batch_size`; rate None without samples."""
        steps = self._pooled(batch_size, SPECULATED if speculated else PLAIN)
        if not steps:
            return None, 0
        # plain Python: two calls every decode step on <= 32-step lists, where building a numpy
        # array from the tuples took ~4x as long as the arithmetic
        mean_tokens = sum(tokens for tokens, _ in steps) / len(steps)
        return mean_tokens / statistics.median(seconds for _, seconds in steps), len(steps)

    def forget(self, batch_size: int, speculated: bool) -> None:
        """Drop what steps of this kind measured around `batch_size` (the sizes `rate` pools)."""
        for window in self._pooled_windows(batch_size, SPECULATED if speculated else PLAIN):
            window.clear()

    def known(self, batch_size: int, speculated: bool) -> bool:
        """At least `min_samples` steps of this kind were measured around `batch_size` lately (`horizon`)."""
        kind = SPECULATED if speculated else PLAIN
        recent = itertools.chain.from_iterable(self._recent(window) for window in self._pooled_windows(batch_size, kind))
        return sum(1 for _ in itertools.islice(recent, self.min_samples)) == self.min_samples  # stops at enough

    def speculation_loses(self, batch_size: int) -> bool:
        """Both kinds are known around `batch_size` and speculated steps delivered more than
        `margin` fewer tokens/s than plain ones. The margin keeps noise from vetoing: at
        concurrency 1 a ten-step mean of committed tokens swings by ~20 %, and a request whose
        drafts pay little (1.3 tokens a step) drafted at 1.01x its skipped rate."""
        plain_rate, plain_samples = self.rate(batch_size, speculated=False)
        speculated_rate, speculated_samples = self.rate(batch_size, speculated=True)
        if plain_rate is None or speculated_rate is None or min(plain_samples, speculated_samples) < self.min_samples:
            return False
        return bool(speculated_rate < (1.0 - self.margin) * plain_rate)  # a Python bool: step records are JSON
