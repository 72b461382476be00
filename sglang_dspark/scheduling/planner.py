"""The verification planner: how many drafts each request verifies this step.

Objective (paper Section 3.2.2): maximise expected tokens per second
    Theta = tau / (T(bs, B, C) + fixed_seconds),
    B = sum_r (1 + l_r) batch tokens, tau = sum_r (1 + sum_{j<=l_r} a_{r,j}) expected tokens,
where a_{r,j} is the prefix survival of request r's draft j and T comes from a cost model.
`fixed_seconds` is per-step time that does not depend on the verify width (the drafter's
forward, sampling, scheduling); the paper's SPS table leaves it out, which biases the planner
towards too-short verification when drafting is not free.

Two planners, both non-anticipating (whether draft k is admitted never depends on the value of
draft k or anything after it; such values only enter through a_{r,k+1}, a_{r,k+2}, ...):

* `plan_algorithm1`: the paper's Algorithm 1. Candidates (r, j) sorted by a_{r,j} descending,
  admitted while Theta strictly rises, stop at the first non-improvement. A candidate's fate is
  decided by the candidates ranked at or above it, and a_{r,k+1} <= a_{r,k} ranks below (r, k).
* the production pair `capacity_from` + `fill_capacity`: the capacity K (total draft slots) is a
  global argmax of Theta over survivals from earlier steps, so it is known before the target
  forward is launched and cannot see this step's tokens; the K slots then go to a global top-K of
  this step's survivals. `TwoStepCapacityPlanner` holds the earlier survivals for the worker.

Ties are broken by position, then request (stable sort over a position-major flattening), so a
row's admitted drafts are always a prefix. `verify_lens[r]` counts admitted drafts (0..gamma);
the anchor/bonus position is always verified on top of them.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np
import torch

from sglang_dspark.scheduling.cost_model import CostModel, CostModelSlot, ScaledCostModel, StepCostTable, StepShape
from sglang_dspark.scheduling.step_rates import StepRates

DEFAULT_SURVIVAL_EPS = 1e-6
MAX_PROBE_BACKOFF = 8
"""Probes and skip samples come at most every `explore_every` x this many steps."""
SKIP_SAMPLE_SPEEDUP = 4
"""Until plain steps are measured around a batch size, every `explore_every / 4`-th speculated
step runs plain: at concurrency 16 one in 16 took ~190 drafted steps per batch size (8 warm-up
and 4 measured skipped steps) before the check could act, and drafted steps there delivered
0.6-0.8x the tokens/s of skipped ones."""
FORGET_MAX_BATCH = 4
"""A veto is forgotten with the requests it was measured on only up to this batch size: there
one text's acceptance decides what drafting delivers; in larger batches it averages out, and
re-measuring costs more (at concurrency 16, forgetting after every turnover drafted 17 % of the
steps for 0.88x the tokens/s of never drafting)."""


class PlannerError(ValueError):
    """Planner input of the wrong shape or range; the message says what was expected."""


def survivals_from_confidences(
    confidence_logits: torch.Tensor, temperatures: torch.Tensor | None = None
) -> torch.Tensor:
    """a_{r,k} = prod_{i<=k} sigmoid(c_{r,i} / T_i): prefix survival from raw confidence logits."""
    logits = confidence_logits.to(torch.float32)
    if temperatures is not None:
        logits = logits / temperatures.to(torch.float32)
    return torch.cumprod(torch.sigmoid(logits), dim=-1)


def _lengths(value: torch.Tensor | int | None, batch: int, default: int, name: str) -> np.ndarray:
    if value is None:
        return np.full(batch, default, dtype=np.int64)
    if isinstance(value, int):
        return np.full(batch, value, dtype=np.int64)
    if tuple(value.shape) != (batch,):
        raise PlannerError(f"{name} must have shape ({batch},), got {tuple(value.shape)}")
    return value.detach().cpu().numpy().astype(np.int64)


def _as_array(survivals: torch.Tensor | np.ndarray) -> np.ndarray:
    """float64 numpy view/copy of planner input (the planner's arrays are tiny: numpy's per-op
    cost is a fraction of torch's)."""
    if isinstance(survivals, np.ndarray):
        return survivals.astype(np.float64, copy=False)
    return survivals.detach().cpu().numpy().astype(np.float64, copy=False)


def _check_inputs(
    survivals: np.ndarray, min_lens: torch.Tensor | int | None, max_lens: torch.Tensor | int | None
) -> tuple[np.ndarray, np.ndarray]:
    if survivals.ndim != 2 or survivals.shape[0] < 1 or survivals.shape[1] < 1:
        raise PlannerError(
            f"survivals must be [batch >= 1, gamma >= 1], got shape {tuple(survivals.shape)}"
        )
    batch, gamma = survivals.shape
    if not (survivals.min() >= 0.0 and survivals.max() <= 1.0):
        raise PlannerError("survivals must lie in [0, 1] (prefix survival probabilities)")
    if gamma > 1 and not (survivals[:, 1:] <= survivals[:, :-1]).all():
        raise PlannerError(
            "survivals must be non-increasing along positions (a cumulative product of "
            "confidences); pass survivals_from_confidences(...), not raw confidences"
        )
    low = _lengths(min_lens, batch, 0, "min_lens")
    high = _lengths(max_lens, batch, gamma, "max_lens")
    if (low < 0).any() or (high > gamma).any() or (low > high).any():
        raise PlannerError(
            f"need 0 <= min_lens <= max_lens <= gamma={gamma}, got min_lens={low.tolist()}, "
            f"max_lens={high.tolist()}"
        )
    return low, high


@dataclass(frozen=True)
class _Path:
    """The greedy admission path: forced drafts first, then candidates by survival."""

    rows: np.ndarray  # [n] request of each candidate, in admission order
    order: np.ndarray  # [n] its index in the position-major flattening (position * B + row)
    values: np.ndarray  # [n] its survival
    forced: np.ndarray  # [B] drafts admitted regardless (min_lens)
    forced_survival: float


def _admission_path(survivals: np.ndarray, low: np.ndarray, high: np.ndarray, eps: float) -> _Path:
    batch, gamma = survivals.shape
    position = np.arange(gamma)
    forced_mask = position[None, :] < low[:, None]
    allowed = (position[None, :] < high[:, None]) & ~forced_mask & (survivals > eps)
    masked = np.where(allowed, survivals, -1.0).T.ravel()
    count = int(allowed.sum())
    order = np.argsort(-masked, kind="stable")[:count]  # stable: ties by position, then row
    return _Path(
        rows=order % batch,
        order=order,
        values=masked[order],
        forced=low,
        forced_survival=float(survivals[forced_mask].sum()),
    )


def _target_seconds(
    cost_model: CostModel, batch: int, tokens: np.ndarray, context_tokens: float
) -> np.ndarray:
    return cost_model.seconds_curve(batch, tokens, float(context_tokens))


def _lens_from_admitted(path: _Path, admitted: int) -> torch.Tensor:
    batch = path.forced.size
    lens = path.forced + np.bincount(path.rows[:admitted], minlength=batch)
    return torch.from_numpy(lens.astype(np.int64))


def _is_flat(cost_model: CostModel) -> bool:
    if isinstance(cost_model, ScaledCostModel):
        return _is_flat(cost_model.base)
    return isinstance(cost_model, StepCostTable) and cost_model.is_flat


def plan_algorithm1(
    survivals: torch.Tensor,
    cost_model: CostModel,
    *,
    context_tokens: float = 0.0,
    fixed_seconds: float = 0.0,
    min_lens: torch.Tensor | int | None = None,
    max_lens: torch.Tensor | int | None = None,
    survival_eps: float = DEFAULT_SURVIVAL_EPS,
) -> torch.Tensor:
    """Paper Algorithm 1 with early stop: verify_lens [B] (drafts per request, anchor excluded).

    A flat (uninitialised) table verifies every draft up to max_lens.
    """
    values = _as_array(survivals)
    low, high = _check_inputs(values, min_lens, max_lens)
    if _is_flat(cost_model):
        return torch.from_numpy(high.copy())
    path = _admission_path(values, low, high, survival_eps)
    batch = values.shape[0]
    tau = np.concatenate(([0.0], np.cumsum(path.values))) + batch + path.forced_survival
    tokens = batch + int(low.sum()) + np.arange(path.values.size + 1, dtype=np.float64)
    theta = tau / (_target_seconds(cost_model, batch, tokens, context_tokens) + fixed_seconds)
    falls = np.flatnonzero(theta[1:] <= theta[:-1])
    admitted = int(falls[0]) if falls.size else path.values.size
    return _lens_from_admitted(path, admitted)


@dataclass(frozen=True)
class CapacityDecision:
    """The production planner's per-step decision, made before the step's drafts exist.

    capacity: K, total draft slots to verify (forced ones included); draft_width: how many block
    slots the drafter must produce (0: skip the drafter's forward this step); expected_tokens and
    step_seconds: the objective at the chosen point (Theta = expected_tokens / step_seconds).
    """

    capacity: int
    draft_width: int
    expected_tokens: float
    step_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.expected_tokens / self.step_seconds


def _draft_costs(draft_seconds: float | Sequence[float], gamma: int) -> np.ndarray:
    """Seconds to draft w = 0..gamma slots; a scalar means 'the whole block or nothing'."""
    if isinstance(draft_seconds, (int, float)):
        costs = np.full(gamma + 1, float(draft_seconds))
        costs[0] = 0.0
        return costs
    costs = np.asarray(list(draft_seconds), dtype=np.float64)
    if costs.shape != (gamma + 1,) or (costs < 0).any() or costs[0] != 0.0:
        raise PlannerError(
            f"draft_seconds per width must have {gamma + 1} entries (w = 0..gamma), be >= 0 and "
            f"start with 0.0, got {list(draft_seconds)}"
        )
    return costs


def decide_capacity(
    survivals: torch.Tensor,
    cost_model: CostModel,
    *,
    context_tokens: float = 0.0,
    fixed_seconds: float = 0.0,
    draft_seconds: float | Sequence[float] = 0.0,
    min_lens: torch.Tensor | int | None = None,
    max_lens: torch.Tensor | int | None = None,
    survival_eps: float = DEFAULT_SURVIVAL_EPS,
    require_draft: bool = False,
    throughput: float | None = None,
) -> CapacityDecision:
    """Choose (K, draft width) maximising expected tokens/s, global argmax (no early stop: jagged
    tables have local maxima).

    survivals: [B, gamma] or [m, B, gamma], earlier steps' survivals aligned to the current
    requests; m snapshots are averaged per request (a steadier estimate of this step's survivals
    than any single old step). Only old information enters, so whatever this step's tokens are,
    K and the width are already fixed: the pair with `fill_capacity` is non-anticipating.
    draft_seconds: per-step drafter time, charged only when drafting (a scalar), or per width
    w = 0..gamma (a drafter that can run a shorter block). require_draft: exclude width 0 (the
    planner's periodic exploration). throughput: the long-run tokens/s lambda; when given,
    maximise expected tokens - lambda * seconds instead of this step's ratio (Dinkelbach: the
    step that maximises the long-run ratio sum(tokens) / sum(seconds); the per-step ratio
    over-verifies doubtful steps and under-verifies confident ones when steps differ a lot)."""
    values = _as_array(survivals)
    if values.ndim == 3 and values.shape[0] >= 1:
        values = values.mean(axis=0)  # each request's mean survival curve over the steps
    low, high = _check_inputs(values, min_lens, max_lens)
    batch, gamma = values.shape
    if _is_flat(cost_model):
        return CapacityDecision(int(high.sum()), gamma, float("nan"), float("nan"))
    costs = _draft_costs(draft_seconds, gamma)
    path = _admission_path(values, low, high, survival_eps)
    # one admission path; a width w keeps the candidates at positions < w, in the same order
    widths = np.arange(gamma + 1)
    kept = (path.order // batch)[None, :] < widths[:, None]  # [w, n]
    count = np.cumsum(kept, axis=1)
    gain = np.cumsum(kept * path.values[None, :], axis=1)
    forced_count = int(low.sum())
    base_tau = batch + path.forced_survival
    tokens = batch + forced_count + np.arange(path.values.size + 1, dtype=np.float64)
    target = _target_seconds(cost_model, batch, tokens, context_tokens) + fixed_seconds
    seconds = target[count] + costs[:, None]
    start_seconds = target[0] + costs  # [w]: admit nothing beyond the forced drafts
    if throughput is None:
        theta, start_theta = (base_tau + gain) / seconds, base_tau / start_seconds
    else:
        theta = (base_tau + gain) - throughput * seconds
        start_theta = base_tau - throughput * start_seconds
    usable = widths >= max(int(low.max()), 1 if require_draft else 0)
    full = np.concatenate((start_theta[:, None], theta), axis=1)  # [w, 1 + n]
    full[:, 1:][~kept] = -np.inf
    full[~usable] = -np.inf
    # ties go to the wider block: same objective, fresher survivals for later decisions
    best = int(np.argmax(full[::-1].ravel()))
    flipped_width, index = divmod(best, full.shape[1])
    width = gamma - flipped_width
    admitted = 0 if index == 0 else int(count[width, index - 1])
    step_seconds = float(start_seconds[width]) if index == 0 else float(seconds[width, index - 1])
    expected = base_tau + (0.0 if index == 0 else float(gain[width, index - 1]))
    return CapacityDecision(
        capacity=forced_count + admitted,
        draft_width=width,
        expected_tokens=expected,
        step_seconds=step_seconds,
    )


def capacity_from(
    survivals: torch.Tensor,
    cost_model: CostModel,
    *,
    context_tokens: float = 0.0,
    fixed_seconds: float = 0.0,
    draft_seconds: float = 0.0,
    min_lens: torch.Tensor | int | None = None,
    max_lens: torch.Tensor | int | None = None,
    survival_eps: float = DEFAULT_SURVIVAL_EPS,
) -> int:
    """K alone (see `decide_capacity`), for a worker whose drafter always drafts the full block."""
    return decide_capacity(
        survivals,
        cost_model,
        context_tokens=context_tokens,
        fixed_seconds=fixed_seconds,
        draft_seconds=draft_seconds,
        min_lens=min_lens,
        max_lens=max_lens,
        survival_eps=survival_eps,
    ).capacity


def fill_capacity(
    survivals: torch.Tensor,
    capacity: int,
    min_lens: torch.Tensor | int | None = None,
    max_lens: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Spend `capacity` draft slots on this step's survivals: min_lens first, then a global top-K
    (ties: earlier position, then lower request index). Never exceeds max_lens; exceeds
    `capacity` only when sum(min_lens) alone does. A drafter that ran a shorter block: pass
    max_lens clamped to the draft width."""
    if capacity < 0:
        raise PlannerError(f"capacity must be >= 0, got {capacity}")
    values = _as_array(survivals)
    low, high = _check_inputs(values, min_lens, max_lens)
    path = _admission_path(values, low, high, eps=-1.0)
    return _lens_from_admitted(path, max(capacity - int(low.sum()), 0))


@dataclass
class _Snapshot:
    ids: tuple[Hashable, ...]
    index: dict[Hashable, int]
    survivals: np.ndarray


MAX_SCALE = 4.0  # the one-token step: the machine's drift (57-93 ms here) stays well inside
WARMUP_STEPS = 8  # a server's first decode steps pay one-off costs (allocations, kernel set-up):
# 0.55-0.88 s against 0.09 s once warm; the fit ignores them
OUTLIER_FACTOR = 2.0  # one step counts at most this far from what the fit predicts for it (a stall,
# a new shape's first run), so no single step can swing the fit
MAX_TOKEN_SCALE = 16.0  # verify tokens: the table can miss their slope by more (a layout change made
# 1-2 drafts at batch 1 nearly free; 4 one-draft requests in a batch of 16 cost ~10x the table)


def _clamp(scale: float, limit: float) -> float:
    return min(max(scale, 1 / limit), limit)


class TwoStepCapacityPlanner:
    """The production planner's state, held by the worker across decode steps.

    Per decode step t: `decide(ids, ...)` before launching the forward that needs K (it uses the
    survivals published at least `lag` steps earlier, averaged over `window` such steps), then
    `fill_capacity(current survivals, decision.capacity, max_lens=min(max_lens, width))`, then
    `publish(ids, survivals, decision.draft_width)`. Unknown requests (new since those steps) and
    slots beyond a short draft width are filled in from a running mean of each position's
    conditional confidence (1.0 until anything is known: optimistic, so the planner explores).
    After `explore_every` consecutive skipped drafts the next step drafts anyway, so a planner
    that turned speculation off notices when drafts become worth verifying again.
    With `long_run` (default) each decision maximises expected tokens - lambda * seconds, lambda
    the running tokens/s of its recent decisions (see `decide_capacity`): the long-run rate, not
    one step's, is what aggregate and per-user speed are made of.
    The table's seconds are scaled by what the finished steps measured (`observe`), since the
    drafter's cost, against which they are weighed, is measured live too.
    """

    def __init__(
        self,
        cost_model: CostModel | CostModelSlot,
        gamma: int,
        lag: int = 2,
        window: int = 4,
        fixed_seconds: float = 0.0,
        survival_eps: float = DEFAULT_SURVIVAL_EPS,
        explore_every: int = 64,
        prior_decay: float = 0.05,
        long_run: bool = True,
        throughput_decay: float = 0.05,
        scale_decay: float = 0.05,
        warmup_steps: int = WARMUP_STEPS,
    ) -> None:
        if lag < 1 or gamma < 1 or window < 1 or explore_every < 1:
            raise PlannerError(
                f"need lag, gamma, window, explore_every >= 1; got {lag}, {gamma}, {window}, "
                f"{explore_every}"
            )
        self._slot = cost_model if isinstance(cost_model, CostModelSlot) else CostModelSlot(cost_model)
        self.gamma, self.lag, self.window = gamma, lag, window
        self.fixed_seconds, self.survival_eps = fixed_seconds, survival_eps
        self.explore_every, self.prior_decay = explore_every, prior_decay
        self._history: deque[_Snapshot] = deque(maxlen=lag + window - 1)
        self._prior_conditional = np.ones(gamma)
        self._skips = 0
        self.long_run, self.throughput_decay = long_run, throughput_decay
        self._mean_tokens: float | None = None  # running means of the chosen steps
        self._mean_seconds: float | None = None
        self._decisions = 0
        self.scale_decay = scale_decay
        self._warmup_left = warmup_steps
        self.step_scale, self.token_scale = 1.0, 1.0
        # exponentially forgotten sums for measured ~ a * step + b * extra (least squares)
        self._scale_sums = np.zeros(5)  # step^2, step*extra, extra^2, step*measured, extra*measured

    @property
    def cost_slot(self) -> CostModelSlot:
        """Swap the table at a step boundary with `cost_slot.replace(...)`."""
        return self._slot

    @property
    def cost_model(self) -> CostModel:
        """The table in force, its one-token step and its extra tokens each rescaled to what the
        live steps measured (`observe`)."""
        model = self._slot.model
        if self.step_scale == 1.0 and self.token_scale == 1.0:
            return model
        return ScaledCostModel(model, self.step_scale, self.token_scale)

    def observe(self, step: StepShape | None, measured_seconds: float) -> None:
        """A finished step's shape and measured target seconds: refits measured ~ a * T(B) +
        b * (T(B + n) - T(B)) on the table in force, over recent steps (least squares with
        exponential forgetting), a within [1/4, 4] so that no burst of stalled steps turns
        speculation off, b within [1/16, 16]. While too few steps verified drafts, b follows a.

        A server's first decode steps (one-off allocations and kernel set-up) took 7-10x a warm
        step; as the only steps with drafts so far, least squares blamed them on the drafts
        (b = 16), the planner stopped verifying drafts, and with no verified drafts to correct it
        drafting stayed off for hundreds of steps. So the first `warmup_steps` are not fitted,
        and every later measurement is clipped to within `OUTLIER_FACTOR` of what the current
        fit predicts for its shape: a stall moves the fit at most 2x, a real change still gets
        there over a few steps."""
        if step is None or not (measured_seconds > 0 and math.isfinite(measured_seconds)):
            return
        if self._warmup_left > 0:
            self._warmup_left -= 1
            return
        model = self._slot.model
        tokens = np.array([float(step.num_requests), float(step.batch_tokens)])
        one, full = model.seconds_curve(step.num_requests, tokens, float(step.context_tokens))
        if not (one > 0 and full >= one):
            return
        extra = full - one
        expected = self.step_scale * one + self.token_scale * extra
        measured_seconds = min(max(measured_seconds, expected / OUTLIER_FACTOR), expected * OUTLIER_FACTOR)
        features = np.array([one * one, one * extra, extra * extra, one * measured_seconds, extra * measured_seconds])
        self._scale_sums += self.scale_decay * (features - self._scale_sums)
        a2, ab, b2, am, bm = self._scale_sums
        determinant = a2 * b2 - ab * ab
        if b2 > 0 and determinant > 1e-3 * a2 * b2:  # the two directions are told apart
            self.step_scale = _clamp((b2 * am - ab * bm) / determinant, MAX_SCALE)
            self.token_scale = _clamp((a2 * bm - ab * am) / determinant, MAX_TOKEN_SCALE)
        else:
            self.step_scale = self.token_scale = _clamp(am / a2, MAX_SCALE)

    def prior_survival(self) -> torch.Tensor:
        """The survival curve assumed for a request nothing is known about."""
        return torch.from_numpy(np.cumprod(self._prior_conditional)).to(torch.float32)

    def publish(
        self, request_ids: Sequence[Hashable], survivals: torch.Tensor, draft_width: int | None = None
    ) -> None:
        """Record this step's survivals [len(request_ids), gamma]; only the first `draft_width`
        positions are read (the rest are extended with the prior)."""
        width = self.gamma if draft_width is None else draft_width
        if tuple(survivals.shape) != (len(request_ids), self.gamma) or not 1 <= width <= self.gamma:
            raise PlannerError(
                f"publish needs survivals of shape ({len(request_ids)}, {self.gamma}) and "
                f"1 <= draft_width <= {self.gamma}, got {tuple(survivals.shape)}, {draft_width}"
            )
        known = _as_array(survivals)[:, :width]
        previous = np.concatenate((np.ones((known.shape[0], 1)), known[:, :-1]), axis=1)
        conditional = (known / np.maximum(previous, 1e-12)).mean(axis=0)
        prior = self._prior_conditional
        prior[:width] += self.prior_decay * (conditional - prior[:width])
        tail = known[:, -1:] * np.cumprod(prior[width:])[None, :]
        ids = tuple(request_ids)
        index = {rid: i for i, rid in enumerate(ids)}
        self._history.append(_Snapshot(ids, index, np.concatenate((known, tail), axis=1)))

    def _lagged(self, request_ids: Sequence[Hashable]) -> np.ndarray | None:
        if not self._history:
            return None
        usable = max(1, len(self._history) - self.lag + 1)
        prior = np.cumprod(self._prior_conditional)
        aligned = []
        ids = tuple(request_ids)
        for snapshot in list(self._history)[:usable]:
            if snapshot.ids == ids:  # the common case: same batch as then
                aligned.append(snapshot.survivals)
                continue
            rows = [snapshot.index.get(rid, -1) for rid in ids]
            gathered = snapshot.survivals[rows]
            unknown = np.asarray(rows) < 0
            gathered[unknown] = prior
            aligned.append(gathered)
        return np.stack(aligned)

    def lagged_survivals(self, request_ids: Sequence[Hashable]) -> torch.Tensor | None:
        """[m, B, gamma]: the snapshots at least `lag` steps old (the newest ones while fewer
        exist), aligned to `request_ids`; None before any publish."""
        lagged = self._lagged(request_ids)
        return None if lagged is None else torch.from_numpy(lagged).to(torch.float32)

    def decide(
        self,
        request_ids: Sequence[Hashable],
        *,
        context_tokens: float = 0.0,
        draft_seconds: float | Sequence[float] = 0.0,
        fixed_seconds: float | None = None,
        min_lens: torch.Tensor | int | None = None,
        max_lens: torch.Tensor | int | None = None,
    ) -> CapacityDecision:
        """K and draft width for the coming step, from information at least `lag` steps old."""
        lagged = self._lagged(request_ids)
        informed = lagged is not None
        if lagged is None:
            prior = np.cumprod(self._prior_conditional)
            lagged = np.broadcast_to(prior, (1, len(request_ids), self.gamma))
        explore = self._skips + 1 >= self.explore_every
        decision = decide_capacity(
            lagged,
            self.cost_model,
            context_tokens=context_tokens,
            fixed_seconds=self.fixed_seconds if fixed_seconds is None else fixed_seconds,
            draft_seconds=draft_seconds,
            min_lens=min_lens,
            max_lens=max_lens,
            survival_eps=self.survival_eps,
            require_draft=explore,
            throughput=self.long_run_throughput() if self.long_run else None,
        )
        self._skips = 0 if decision.draft_width > 0 else self._skips + 1
        if informed:  # a guess from the prior alone would bias lambda
            self._track_throughput(decision)
        return decision

    def long_run_throughput(self) -> float | None:
        """Expected tokens/s of the recent decisions (ratio of running means), or None."""
        if self._mean_tokens is None or self._mean_seconds is None:
            return None
        return self._mean_tokens / self._mean_seconds

    def _track_throughput(self, decision: CapacityDecision) -> None:
        if not (math.isfinite(decision.expected_tokens) and math.isfinite(decision.step_seconds)):
            return
        if self._mean_tokens is None or self._mean_seconds is None:
            self._mean_tokens, self._mean_seconds = decision.expected_tokens, decision.step_seconds
            self._decisions = 1
            return
        self._decisions += 1
        decay = max(self.throughput_decay, 1.0 / self._decisions)  # a plain mean while young
        self._mean_tokens += decay * (decision.expected_tokens - self._mean_tokens)
        self._mean_seconds += decay * (decision.step_seconds - self._mean_seconds)

    def capacity(self, request_ids: Sequence[Hashable], **kwargs) -> int:
        """`decide(...).capacity`."""
        return self.decide(request_ids, **kwargs).capacity


def early_stop_lens(
    survivals: torch.Tensor,
    cost_model: CostModel,
    throughput: float,
    *,
    context_tokens: float = 0.0,
    max_lens: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Verify lengths from this step's survivals [B, gamma]: candidates in the global order of
    survival (ties: earlier position, then lower request) are admitted while each pays for the
    target seconds it adds, a_i >= throughput * (T(B + i) - T(B + i - 1)), up to the first that
    does not.

    Lossless: survival a_{b,k} reads the drafts before slot k only, and every candidate ahead of
    it in the order has a survival at least as high (its own earlier slots, or other requests),
    so whether draft k is verified never depends on draft k itself (non-anticipating)."""
    values = _as_array(survivals)
    low, high = _check_inputs(values, None, max_lens)
    batch = values.shape[0]
    path = _admission_path(values, low, high, eps=-1.0)
    tokens = batch + np.arange(path.values.size + 1, dtype=np.float64)
    marginal = np.diff(_target_seconds(cost_model, batch, tokens, context_tokens))
    pays = path.values >= throughput * marginal
    return _lens_from_admitted(path, int(np.cumprod(pays).sum()))


def _probe_one_draft(survivals: torch.Tensor, lens: torch.Tensor, max_lens: torch.Tensor | int) -> torch.Tensor:
    """`lens` with the first draft of the request most likely to keep it verified.

    A probe that verifies nothing teaches the online cost fit nothing about verify tokens, so a
    cost it over-estimated (one noisy step can do it) would keep drafting off for good. Lossless:
    the choice reads only first-slot survivals, which no draft token feeds."""
    limits = torch.as_tensor(max_lens, dtype=torch.long).expand(lens.shape[0])
    candidates = torch.where(limits > 0, torch.as_tensor(survivals[:, 0], dtype=torch.float64),
                             torch.tensor(float("-inf"), dtype=torch.float64))
    if not bool(torch.isfinite(candidates).any()):
        return lens
    lens = lens.clone()
    lens[int(torch.argmax(candidates))] = 1
    return lens


class EarlyStopPlanner(TwoStepCapacityPlanner):
    """The production planner of DSPARK_LIVE: draft width from recent steps, verify lengths by
    early stop (`early_stop_lens`) on this step's survivals.

    Why not the paper's lagged per-request capacity: on this project's eval traces a request's
    acceptance two rounds back says next to nothing about its acceptance now (P(first draft
    accepted) 0.37 after an accepted round, 0.38 after a rejected one, greedy), and a capacity
    fixed before drafting verifies the same number of drafts whatever their confidence. Replayed
    on those traces at concurrency 1 (greedy, SPS table, 7.5 ms drafter), the lagged planner
    drafted on 20 % of steps for 1.03x over plain decoding; drafting every step and stopping
    verification early gave 1.19x.

    So `decide` values each draft width by applying the early-stop rule to virtual batches drawn
    from the recent steps' survival rows (any request: a pool, not a per-request lag), charges
    the drafter's measured cost for that width, and keeps the best (width 0: skip the drafter,
    with a probe after `explore_every` skipped steps, which refreshes the survivals; each probe
    that leaves the planner skipping doubles the wait for the next, up to `explore_every *
    MAX_PROBE_BACKOFF`, until a step wants to draft again: at concurrency 16 a probe, with the
    context catch-up of every step skipped before it, cost ~50-100 ms more than a skipped step
    of ~75 ms, and probes every 16 steps took ~4 % of the throughput). Then `verify_lens`
    applies the rule for real.
    `capacity` in its decisions is the most the width allows (the early stop admits fewer).

    What the model values is checked against what the steps measured (`record_step`,
    `StepRates`): where steps that speculated (ran the drafter or verified lookup drafts) around
    this batch size delivered fewer tokens/s than plain one-token steps (by more than
    `StepRates.margin`), the step runs plain whatever the model says (`vetoed`, `plain_step`:
    no drafter, no lookup drafts); the same backed-off probes keep the speculated side measured.
    A veto that began in a batch of at most `FORGET_MAX_BATCH` is forgotten, with what
    speculated steps measured at that batch size, once none of its requests is left: acceptance is a property of the text, and at
    concurrency 1 one request whose drafts paid little (1.3 tokens a step) had otherwise kept
    the next six requests from drafting, 26 % of all steps vetoed; at concurrency 4 one wave's
    last request, vetoed at batch 1, vetoed every later wave's last request (47 % of steps).
    Where plain steps have not been measured lately, one speculated step in `explore_every *
    MAX_PROBE_BACKOFF` runs plain instead (every `explore_every / SKIP_SAMPLE_SPEEDUP` until
    `StepRates.min_samples` are known), so the comparison exists wherever the server speculates."""

    def __init__(self, cost_model: CostModel | CostModelSlot, gamma: int, *, pool_steps: int = 16,
                 virtual_rows: int = 256, explore_every: int = 16, seed: int = 0,
                 rates: StepRates | None = None, **kwargs) -> None:
        super().__init__(cost_model, gamma, lag=1, window=pool_steps, explore_every=explore_every, **kwargs)
        self.virtual_rows = virtual_rows
        self._probing = False  # this step drafts only because drafting was skipped for too long
        self._rng = np.random.default_rng(seed)
        self.rates = rates or StepRates()
        self._probe_every = explore_every
        self._speculated_in_a_row = 0  # recorded steps since the last plain one
        self.vetoed = False  # the last decision runs plain because speculating measurably lost
        self.plain_step = False  # the last decision verifies no drafts at all (a veto, or a plain sample)
        self._veto_requests: frozenset | None = None  # the batch when drafting began to lose
        self._veto_batch = 0  # and its size
        self._drafting_lost = False
        self._step_throughput: float | None = None  # lambda of the last `decide`, for `verify_lens`
        self._recorded_requests: frozenset = frozenset()  # the last `record_step`'s batch

    def _throughput(self, batch: int, context_tokens: float) -> float:
        """lambda: the recent decisions' tokens/s, and never less than a skipped step delivers at
        this batch size. The recent decisions may come from another batch size: after a warm-up
        at batch 1 (~25 tokens/s) the first steps of a batch of 16 (~200 tokens/s when skipping)
        valued a second at 1/8 of its worth there, and drafted 20 steps at 1.8x a skipped step's
        time for 1.4x its tokens."""
        one_token = _target_seconds(self.cost_model, batch, np.array([float(batch)]), context_tokens)[0]
        skipping = batch / (one_token + self.fixed_seconds)
        recent = self.long_run_throughput()
        return skipping if recent is None else max(recent, skipping)

    def record_step(self, request_ids: Sequence[Hashable], speculated: bool, committed_tokens: float,
                    seconds: float) -> None:
        """A finished step as measured (drafting included), for the speculate-or-plain check:
        `speculated` when it ran the drafter or proposed lookup drafts.

        A step whose requests differ from the previous recorded step's (one finished, one joined)
        is left out: it pays for the change (at concurrency 16 on the AVX2 CPU a skipped step
        right after one took 103-113 ms against 60-64 ms otherwise), and which kind of step
        happens to land there would decide the comparison instead of drafting itself."""
        requests = frozenset(request_ids)
        changed = requests != self._recorded_requests
        self._recorded_requests = requests
        self._speculated_in_a_row = self._speculated_in_a_row + 1 if speculated else 0
        if not changed:
            self.rates.add(len(requests), speculated, committed_tokens, seconds)

    def decide(self, request_ids: Sequence[Hashable], *, context_tokens: float = 0.0,
               draft_seconds: float | Sequence[float] = 0.0, **unused) -> CapacityDecision:
        batch = len(request_ids)
        self.vetoed = self.plain_step = False
        if not self._history:  # nothing known: draft the whole block and learn
            return CapacityDecision(batch * self.gamma, self.gamma, float("nan"), float("nan"))
        requests = frozenset(request_ids)
        if self._veto_requests is not None and not requests & self._veto_requests:
            # the veto was measured on requests now gone: forget what drafting measured at the
            # veto's batch size (a wave's last request at 1, say, when the next wave runs at 4)
            self.rates.forget(self._veto_batch, speculated=True)
            self._veto_requests = None
        speculation_loses = self._drafting_lost = self.rates.speculation_loses(batch)
        if speculation_loses and self._skips + 1 < self._probe_every:
            # a vetoed step (no probe due) runs plain without valuing every width (~0.6 ms of
            # numpy at batch 16 on every step of a saturated server)
            self.vetoed = self.plain_step = True
            self._probing = False
            self._skips += 1
            one_token = _target_seconds(self.cost_model, batch, np.array([float(batch)]), context_tokens)[0]
            decision = CapacityDecision(0, 0, float(batch), float(one_token + self.fixed_seconds))
        else:
            throughput = self._throughput(batch, context_tokens)
            expected, seconds = self._width_values(batch, context_tokens, draft_seconds, throughput)
            # lambda from larger batches can exceed what any width delivers here (a wave's last
            # requests): then every value is negative and the cheapest width, skipping, wins
            # whatever drafting would deliver, so cap lambda at this step's best tokens/s
            self._step_throughput = min(throughput, float((expected / seconds).max()))
            width = self._choose_width(batch, expected - self._step_throughput * seconds, speculation_loses)
            decision = CapacityDecision(batch * width, width, float(expected[width]), float(seconds[width]))
        if not self._drafting_lost:
            self._veto_requests = None
        elif self._veto_requests is None and batch <= FORGET_MAX_BATCH:
            self._veto_requests, self._veto_batch = requests, batch
        self._track_throughput(decision)
        return decision

    def _width_values(self, batch: int, context_tokens: float, draft_seconds: float | Sequence[float],
                      throughput: float) -> tuple[np.ndarray, np.ndarray]:
        """Expected committed tokens and seconds of drafting each width 0..gamma this step, each
        draft admitted while it pays for its seconds at `throughput` (lambda)."""
        pool = np.concatenate([snapshot.survivals for snapshot in self._history])
        if batch == 1:  # each pool row is a virtual batch: the exact mean, over ~16 rows, not 256 draws
            virtual = pool[:, None, :]
        else:
            virtual = pool[self._rng.integers(0, len(pool), size=(max(1, self.virtual_rows // batch), batch))]
        costs = _draft_costs(draft_seconds, self.gamma)
        tokens = batch + np.arange(batch * self.gamma + 1, dtype=np.float64)
        target = _target_seconds(self.cost_model, batch, tokens, context_tokens) + self.fixed_seconds
        marginal = np.diff(target)
        # every width at once (this runs on every decode step): width w's candidates are each
        # virtual batch's survivals at slots < w, best first; the slots beyond w sort last as -1
        # and never pay
        widths = np.arange(1, self.gamma + 1)
        in_width = np.arange(self.gamma) < widths[:, None]  # [W, gamma]
        candidates = np.where(in_width[:, None, None, :], virtual[None], -1.0).reshape(self.gamma, len(virtual), -1)
        candidates = -np.sort(-candidates, axis=2)
        real = np.arange(candidates.shape[2]) < batch * widths[:, None, None]
        admitted = np.cumprod((candidates >= throughput * marginal) & real, axis=2)
        expected = np.concatenate(([batch], batch + (candidates * admitted).sum(axis=2).mean(axis=1)))
        seconds = np.concatenate(([target[0]], target[admitted.sum(axis=2)].mean(axis=1) + costs[1:]))
        return expected, seconds

    def _choose_width(self, batch: int, value: np.ndarray, speculation_loses: bool) -> int:
        """The best width by value (ties to the wider block), then the probes and plain samples
        around it. Where speculation loses, `decide` has already run every step but the probes."""
        best = self.gamma - int(np.argmax(value[::-1]))
        wants_draft = best > 0 and not speculation_loses
        self._probing = not wants_draft and self._skips + 1 >= self._probe_every
        if self._probing:  # draft anyway, at the best width the model sees
            width = self.gamma - int(np.argmax(value[:0:-1]))
            # the next probe waits twice as long, unless a step wants to draft before it
            self._probe_every = min(2 * self._probe_every, self.explore_every * MAX_PROBE_BACKOFF)
        elif self._plain_sample_due(batch):  # (also where the model skips: lookups speculate too)
            width, self.plain_step = 0, True
        else:
            width = best if wants_draft else 0
        if wants_draft:
            self._probe_every = self.explore_every
        self._skips = 0 if width > 0 else self._skips + 1
        return width

    def _plain_sample_due(self, batch: int) -> bool:
        """Whether this step should run plain to measure plain steps (see the class doc); never
        before speculated steps are measured here (nothing to compare with yet)."""
        if not self.rates.known(batch, speculated=True):
            return False
        if not self.rates.known(batch, speculated=False):
            every = max(2, self.explore_every // SKIP_SAMPLE_SPEEDUP)
        else:
            every = self.explore_every * MAX_PROBE_BACKOFF
        return self._speculated_in_a_row + 1 >= every

    def verify_lens(self, survivals: torch.Tensor, max_lens: torch.Tensor | int,
                    context_tokens: float = 0.0) -> torch.Tensor:
        """This step's verify lengths (`early_stop_lens` within the drafted width, `max_lens`)."""
        throughput = self._step_throughput or self._throughput(survivals.shape[0], context_tokens)
        self._step_throughput = None
        lens = early_stop_lens(survivals, self.cost_model, throughput, context_tokens=context_tokens,
                               max_lens=max_lens)
        if self._probing and int(lens.sum()) == 0:
            lens = _probe_one_draft(survivals, lens, max_lens)
        self._probing = False
        return lens
