"""A serving simulator: decode steps of a batch at fixed concurrency, for each planning policy.

Every slot holds one request; a finished request is replaced at once by a new one (closed loop,
decode only: prefill is not simulated). Per step: the trace source gives each request's
confidence logits and natural accepted length; the policy picks how many drafts each request
verifies; the step lasts target_cost(batch) + drafter_cost(batch) seconds; each request commits
min(verified, natural) + 1 tokens (capped at what it still needs).

Policies: no_spec (no drafter, one token per step), static_1 (verify one draft; the drafter runs
one slot, MTP-1-like), static_7 (verify the whole block), algorithm1 (paper Algorithm 1 on this
step's survivals, drafter cost as fixed per-step time), scheduled (the paper's two-step planner:
capacity K and drafter block width from survivals at least `lag` steps back, top-K fill on
this step's survivals), early_stop (DSPARK_LIVE's production planner, `EarlyStopPlanner`: the
width valued on recent survivals, then verification in survival order up to the first draft
that does not pay). For the last two the drafter is charged for the chosen width, and at width 0
its forward is skipped and no new survivals are published.

Metrics: aggregate tokens/s = tokens committed / simulated time; per-user tokens/s = mean over
finished requests of output tokens / (finish - start); tau = tokens committed per request-step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from sglang_dspark.scheduling.cost_model import CostModel, StepShape
from sglang_dspark.scheduling.planner import (
    EarlyStopPlanner,
    TwoStepCapacityPlanner,
    fill_capacity,
    plan_algorithm1,
    survivals_from_confidences,
)
from sglang_dspark.scheduling.traces import RoundSource

POLICIES = ("no_spec", "static_1", "static_7", "algorithm1", "scheduled", "early_stop")
PLANNED = ("scheduled", "early_stop")  # the policies that choose a draft width each step


class SimulationError(ValueError):
    """Bad simulator settings; names the setting and what was expected."""


@dataclass(frozen=True)
class SimSettings:
    gamma: int = 7
    output_tokens: tuple[int, int] = (128, 384)  # uniform per request, inclusive
    prompt_tokens: tuple[int, int] = (128, 1024)
    requests_per_slot: float = 3.0  # stop once concurrency * this many requests finished,
    min_requests: int = 48  # and at least this many (low concurrency needs them for a stable mean)
    lag: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("output_tokens", "prompt_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise SimulationError(f"{name} must be (low, high) with 1 <= low <= high, got {(low, high)}")
        if self.gamma < 1 or self.lag < 1 or self.requests_per_slot <= 0 or self.min_requests < 1:
            raise SimulationError(
                f"need gamma >= 1, lag >= 1, requests_per_slot > 0; got {self.gamma}, {self.lag}, "
                f"{self.requests_per_slot}"
            )


@dataclass
class SimResult:
    policy: str
    concurrency: int
    aggregate_tps: float
    per_user_tps: float
    tau: float
    mean_verified_drafts: float
    draft_skipped_fraction: float
    steps: int
    finished_requests: int
    simulated_seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(data.pop("extra"))
        return data


class _Requests:
    """Per-slot request state as tensors.

    Every request draws its properties and all its rounds from its own generator, seeded by
    (seed, request id), and requests are numbered in arrival order: request r meets the same
    rounds under every policy, so policies are compared on paired samples.
    """

    def __init__(self, concurrency: int, source: RoundSource, settings: SimSettings) -> None:
        self.source, self.settings = source, settings
        self.next_id = 0
        self.ids = [0] * concurrency
        self.domain = torch.zeros(concurrency, dtype=torch.long)
        self.offset = torch.zeros(concurrency, dtype=torch.float64)
        self.output = torch.zeros(concurrency, dtype=torch.long)
        self.remaining = torch.zeros(concurrency, dtype=torch.long)
        self.context = torch.zeros(concurrency, dtype=torch.long)
        self.start = torch.zeros(concurrency, dtype=torch.float64)
        most = settings.output_tokens[1]
        self.round_logits = torch.zeros(concurrency, most, source.gamma)
        self.round_natural = torch.zeros(concurrency, most, dtype=torch.long)
        self.round_index = torch.zeros(concurrency, dtype=torch.long)
        for slot in range(concurrency):
            self.replace(slot, 0.0)

    def _uniform(self, bounds: tuple[int, int]) -> int:
        return int(torch.randint(bounds[0], bounds[1] + 1, (1,), generator=self.generator))

    def replace(self, slot: int, now: float) -> None:
        request_id = self.next_id
        self.ids[slot] = request_id
        self.next_id += 1
        self.generator = torch.Generator().manual_seed(self.settings.seed * 1_000_003 + request_id)
        domains = len(self.source.domains)
        self.domain[slot] = int(torch.randint(0, domains, (1,), generator=self.generator))
        self.offset[slot] = self.source.new_request_offset(self.generator)
        self.output[slot] = self._uniform(self.settings.output_tokens)
        self.remaining[slot] = self.output[slot]
        self.context[slot] = self._uniform(self.settings.prompt_tokens)
        self.start[slot] = now
        rounds = self.round_natural.shape[1]  # a request never needs more rounds than tokens
        logits, natural = self.source.draw(
            self.domain[slot].expand(rounds), self.offset[slot].expand(rounds), self.generator
        )
        self.round_logits[slot], self.round_natural[slot] = logits, natural
        self.round_index[slot] = 0

    def next_rounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each slot's next round: confidence logits [C, gamma], natural accepted length [C]."""
        slots = torch.arange(self.round_index.numel())
        picked = self.round_logits[slots, self.round_index], self.round_natural[slots, self.round_index]
        self.round_index += 1
        return picked


def _drafter_seconds(drafter: CostModel | None, width: int, batch: int, context: int) -> float:
    if drafter is None or width == 0:
        return 0.0
    return drafter.predict(StepShape(batch, batch * width, context))


def _policy_lens(
    policy: str,
    survivals: torch.Tensor,
    max_lens: torch.Tensor,
    capacity: Callable[[], int],
    target: CostModel,
    context: int,
    draft_seconds: float,
    planner: TwoStepCapacityPlanner,
) -> torch.Tensor:
    if policy == "no_spec":
        return torch.zeros_like(max_lens)
    if policy == "static_1":
        return max_lens.clamp(max=1)
    if policy == "static_7":
        return max_lens.clamp(max=7)
    if policy == "algorithm1":
        return plan_algorithm1(
            survivals, target, context_tokens=context, fixed_seconds=draft_seconds, max_lens=max_lens
        )
    if policy == "scheduled":
        return fill_capacity(survivals, capacity(), max_lens=max_lens)
    if policy == "early_stop":
        return planner.verify_lens(survivals, max_lens, context_tokens=context)
    raise SimulationError(f"unknown policy {policy!r}; expected one of {POLICIES}")


def simulate(
    policy: str,
    concurrency: int,
    target: CostModel,
    drafter: CostModel | None,
    source: RoundSource,
    settings: SimSettings = SimSettings(),
    temperatures: Sequence[float] | torch.Tensor | None = None,
    biases: Sequence[float] | torch.Tensor | None = None,
) -> SimResult:
    """Run one policy at one concurrency until enough requests finished. The planners see
    sigmoid(logit / temperature + bias) survivals (an STS calibration; identity by default)."""
    if policy not in POLICIES:
        raise SimulationError(f"unknown policy {policy!r}; expected one of {POLICIES}")
    if concurrency < 1:
        raise SimulationError(f"concurrency must be >= 1, got {concurrency}")
    if source.gamma != settings.gamma:
        raise SimulationError(f"trace gamma {source.gamma} != simulator gamma {settings.gamma}")
    gamma = settings.gamma
    requests = _Requests(concurrency, source, settings)
    planner = (EarlyStopPlanner(target, gamma, seed=settings.seed) if policy == "early_stop"
               else TwoStepCapacityPlanner(target, gamma, lag=settings.lag))
    draft_width = {"no_spec": 0, "static_1": 1}.get(policy, gamma)
    target_finished = max(settings.min_requests, round(concurrency * settings.requests_per_slot))
    now = 0.0
    tokens = request_steps = verified = steps = skipped = 0
    per_user: list[float] = []
    while len(per_user) < target_finished:
        context = int(requests.context.sum())
        max_lens = (requests.remaining - 1).clamp(0, gamma)
        capacity = 0
        if policy in PLANNED:
            width_costs = [_drafter_seconds(drafter, w, concurrency, context) for w in range(gamma + 1)]
            decision = planner.decide(
                requests.ids, context_tokens=context, draft_seconds=width_costs, max_lens=max_lens
            )
            capacity, draft_width = decision.capacity, decision.draft_width
            max_lens = max_lens.clamp(max=draft_width)
            skipped += draft_width == 0
        draft_seconds = _drafter_seconds(drafter, draft_width, concurrency, context)
        logits, natural = requests.next_rounds()
        if temperatures is not None:
            logits = logits / torch.as_tensor(temperatures, dtype=logits.dtype)
        if biases is not None:
            logits = logits + torch.as_tensor(biases, dtype=logits.dtype)
        survivals = survivals_from_confidences(logits)
        lens = _policy_lens(
            policy, survivals, max_lens, lambda: capacity, target, context, draft_seconds, planner
        )
        if policy in PLANNED and draft_width > 0:
            planner.publish(requests.ids, survivals, draft_width)
        committed = torch.minimum(torch.minimum(lens, natural) + 1, requests.remaining)
        step_seconds = target.predict(StepShape(concurrency, concurrency + int(lens.sum()), context))
        now += step_seconds + draft_seconds
        steps += 1
        tokens += int(committed.sum())
        request_steps += concurrency
        verified += int(lens.sum())
        requests.remaining -= committed
        requests.context += committed
        for slot in (requests.remaining == 0).nonzero().flatten().tolist():
            per_user.append(int(requests.output[slot]) / (now - float(requests.start[slot])))
            requests.replace(slot, now)
    return SimResult(
        policy=policy,
        concurrency=concurrency,
        aggregate_tps=tokens / now,
        per_user_tps=sum(per_user) / len(per_user),
        tau=tokens / request_steps,
        mean_verified_drafts=verified / request_steps,
        draft_skipped_fraction=skipped / steps,
        steps=steps,
        finished_requests=len(per_user),
        simulated_seconds=now,
    )


def _interpolate_per_user(curve: list[SimResult], aggregate: float) -> float | None:
    """Per-user speed where a policy's curve (ordered by concurrency) reaches `aggregate`."""
    for low, high in zip(curve, curve[1:]):
        lo, hi = sorted((low.aggregate_tps, high.aggregate_tps))
        if lo <= aggregate <= hi and hi > lo:
            share = (aggregate - low.aggregate_tps) / (high.aggregate_tps - low.aggregate_tps)
            return low.per_user_tps + share * (high.per_user_tps - low.per_user_tps)
        if lo == hi == aggregate:
            return max(low.per_user_tps, high.per_user_tps)
    return None


def matched_throughput(
    results: list[SimResult], policy: str = "scheduled", baseline: str = "static_1"
) -> list[dict[str, float]]:
    """At each of the baseline's points: the policy's per-user speed at the same aggregate
    throughput (interpolated along the policy's concurrency curve) and the ratio."""
    curve = sorted((r for r in results if r.policy == policy), key=lambda r: r.concurrency)
    rows = []
    for point in sorted((r for r in results if r.policy == baseline), key=lambda r: r.concurrency):
        speed = _interpolate_per_user(curve, point.aggregate_tps)
        if speed is not None:
            rows.append(
                {
                    "baseline_concurrency": point.concurrency,
                    "aggregate_tps": point.aggregate_tps,
                    "baseline_per_user_tps": point.per_user_tps,
                    "policy_per_user_tps": speed,
                    "ratio": speed / point.per_user_tps,
                }
            )
    return rows


def same_concurrency_crossings(
    results: list[SimResult], policy: str = "scheduled", baseline: str = "static_1"
) -> list[dict[str, float]]:
    """Where the two policies' aggregate throughput (as functions of concurrency) cross: the
    per-user speeds of both there (linear interpolation in concurrency)."""
    mine = {r.concurrency: r for r in results if r.policy == policy}
    theirs = {r.concurrency: r for r in results if r.policy == baseline}
    levels = sorted(set(mine) & set(theirs))
    rows = []
    for a, b in zip(levels, levels[1:]):
        gap_a = mine[a].aggregate_tps - theirs[a].aggregate_tps
        gap_b = mine[b].aggregate_tps - theirs[b].aggregate_tps
        if gap_a == 0 or gap_a * gap_b < 0:
            share = 0.0 if gap_a == 0 else gap_a / (gap_a - gap_b)

            def lerp(x: float, y: float) -> float:
                return x + share * (y - x)

            rows.append(
                {
                    "concurrency": lerp(a, b),
                    "aggregate_tps": lerp(mine[a].aggregate_tps, mine[b].aggregate_tps),
                    "policy_per_user_tps": lerp(mine[a].per_user_tps, mine[b].per_user_tps),
                    "baseline_per_user_tps": lerp(theirs[a].per_user_tps, theirs[b].per_user_tps),
                    "ratio": lerp(mine[a].per_user_tps, mine[b].per_user_tps)
                    / lerp(theirs[a].per_user_tps, theirs[b].per_user_tps),
                }
            )
    return rows
