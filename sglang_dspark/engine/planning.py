"""Per-step verify lengths for the DSPARK_LIVE worker (`DSPARK_PLANNER`).

* `all`: every request verifies all gamma drafts (no cost model needed).
* `fixed:N`: every request verifies N drafts (a measurement knob).
* `sweep`: step s verifies s mod (gamma + 1) drafts per request, so the step log covers every
  verify width at whatever batch sizes the traffic brings (`dspark-ctl bench sps-serve` fits the
  engine's cost model from it). Width-0 steps skip the drafter, as production's one-token steps
  do: a verify that follows a drafter run measured 11-25 % slower on this CPU, and a table whose
  one-token steps carry that made drafting look nearly free under load.
* `production`: before the drafter runs, `decide` picks the draft width (0: skip the drafter)
  by valuing each width on virtual batches drawn from recent steps' survivals, against the
  drafter's cost measured live at this batch size (block forward once, Markov walk per slot);
  then `plan` verifies, within that width, the drafts whose survival pays for the target seconds
  they add, stopping at the first that does not (`scheduling.EarlyStopPlanner`; non-anticipating,
  so lossless). When drafts are not worth their cost (a weak drafter, a saturated engine) steps
  skip the drafter and run as plain decoding, with a probe draft every `EXPLORE_EVERY` steps so
  the planner sees when drafts become worth it again. The table's seconds are rescaled to the
  measured steps (`observe`), so that both sides of the trade are in today's seconds, and where
  steps that speculated (drafted, or verified lookup drafts) measurably delivered fewer tokens/s
  than plain one-token steps around this batch size, the step runs plain whatever the model says
  (`scheduling.StepRates`).

Survivals a_k = prod_{i<=k} sigmoid(c_i / T_i) use the STS temperatures from `DSPARK_STS_PATH` or
`<draft>/sts.json` (identity without one); greedy requests use `DSPARK_STS_GREEDY_PATH` or
`<draft>/sts-greedy.json` when there is one (argmax match is not the sampled acceptance event).
With the production planner, both are refitted on the server's own verify rounds every
`DSPARK_RECALIBRATE_EVERY` rounds of their class, and a refit that calibrates better on held-out
rounds takes over (`live_calibration`); and each class's conditional acceptance at each position
is corrected by an offset learnt from its served rounds (`calibration.served_offsets`,
`DSPARK_SERVED_OFFSETS`), which start afresh when a refit takes over.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from sglang_dspark.calibration.served_offsets import ServedOffsets
from sglang_dspark.engine.live_calibration import KINDS, LiveRecalibrator
from sglang_dspark.engine.lookup import MAX_MATCH, MIN_MATCH, PRIOR_GREEDY, PRIOR_SAMPLED, LookupSurvival
from sglang_dspark.engine.settings import LiveSettings

if TYPE_CHECKING:
    from sglang_dspark.scheduling.cost_model import StepShape

EXPLORE_EVERY = 16
"""After this many steps without drafting, the next step drafts anyway (about 1 % extra cost)."""
ROUNDS_PER_FLUSH = 8
"""Drafted steps whose verify rounds are kept before the served offsets and the live
recalibration take them in, as one batch: each intake costs ~0.3-0.8 ms of numpy and torch calls
whatever its size, on the step's critical path (a CPU step is 35-90 ms), and neither fit moves in
8 steps."""


class DraftCostTracker:
    """Seconds one part of the drafter takes per step, learnt from the steps that drafted.

    The median of the recent samples at each batch size, and a least-squares line through those
    medians when there are several sizes (the block grows with the batch); 0 before any sample
    (optimistic: the planner drafts and so measures). Medians, because a server's first drafts
    pay one-off costs (a first walk took 86-115 ms against 8 ms after): a mean over a few samples
    made drafting look ten times dearer and the planner stopped drafting, so stopped measuring.

    Beyond the largest measured batch size the estimate grows in proportion to the batch (every
    row does the same work), not along the line: after a warm-up at batch 1 (10 ms in the server)
    a flat line charged a first batch of 16 the same 10 ms, where it cost 50 ms, and the planner
    drafted ~20 steps at 1.8x a skipped step's time before its measured check stopped it. The
    probes then measure the real cost there and the line takes over."""

    def __init__(self, window: int = 128, refit_every: int = 8) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._counts: Counter[int] = Counter()  # samples per batch size in the window
        self._fit: tuple[float, float, float] | None = None  # (largest size, intercept, slope)
        self._unfitted = 0  # samples added since the fit
        self._refit_every = refit_every

    def add(self, batch_size: int, seconds: float) -> None:
        if len(self._samples) == self._samples.maxlen:
            self._counts[self._samples[0][0]] -= 1
        self._samples.append((batch_size, seconds))
        self._counts[batch_size] += 1
        self._unfitted += 1
        if self._counts[batch_size] <= self._refit_every:  # a size still young: its median moves
            self._fit = None

    def estimate(self, batch_size: int) -> float:
        """Runs every decode step, so the fit (~0.1 ms vectorised for 128 samples, twice a drafted
        step) is redone only when stale: after each of a batch size's first `refit_every` samples
        (a server's first, one-off slow drafts must not linger), otherwise every `refit_every`
        samples (a full window's medians move little in fewer)."""
        if not self._samples:
            return 0.0
        if self._fit is None or self._unfitted >= self._refit_every:
            self._fit = self._line()
            self._unfitted = 0
        largest, intercept, slope = self._fit
        size = min(batch_size, largest)
        return max(0.0, intercept + slope * size) * batch_size / size  # in proportion beyond `largest`

    def _line(self) -> tuple[float, float, float]:
        """(largest measured size, intercept, slope) of the line through the per-size medians."""
        samples = np.asarray(self._samples, dtype=np.float64)
        order = np.lexsort((samples[:, 1], samples[:, 0]))  # by batch size, then seconds
        sizes, seconds = samples[order, 0], samples[order, 1]
        unique_sizes, starts, counts = np.unique(sizes, return_index=True, return_counts=True)
        medians = (seconds[starts + (counts - 1) // 2] + seconds[starts + counts // 2]) / 2
        # more rows never cost less: a size's median is capped by every larger size's. A server's
        # first draft (275 ms, one-off) was batch 1's only sample under concurrency 4, and the line
        # through it and batch 4's 12 ms charged batch 1 245 ms: a wave's last request never drafted
        medians = np.minimum.accumulate(medians[::-1])[::-1]
        if len(unique_sizes) == 1:
            return float(unique_sizes[0]), float(medians[0]), 0.0
        # least squares through the medians, each weighted by its sample count
        mean_size = np.average(unique_sizes, weights=counts)
        mean_median = np.average(medians, weights=counts)
        slope = (np.sum(counts * (unique_sizes - mean_size) * (medians - mean_median))
                 / np.sum(counts * (unique_sizes - mean_size) ** 2))
        return float(unique_sizes[-1]), float(mean_median - slope * mean_size), float(slope)


class DraftCosts:
    """Seconds to draft w = 0..gamma slots at a batch size: the block forward (paid once per
    drafting step) plus the Markov walk (paid per drafted slot: lm_head over the draft
    vocabulary, the Markov bias, a softmax and a sample). At batch 16 on this CPU a 7-slot walk
    cost 15 ms against 7.6 for 2 slots, so a step that needs 2 drafts drafts 2. The block's last
    layer computes only the drafted slots' rows (`DSparkDrafter.forward_block`), so it too costs
    less at narrow widths; its estimate is the median over the widths drafted lately at that
    batch size (a microbenchmark at batch 1 on the AVX2 CPU: 1.5 ms for one slot, 2.5 for three,
    4.4 for seven: widths far from the recent ones are valued within ~2 ms)."""

    def __init__(self, window: int = 128, catch_up_decay: float = 0.05) -> None:
        self.block = DraftCostTracker(window)
        self.per_slot = DraftCostTracker(window)
        self._catch_up_decay = catch_up_decay
        self._catch_up = np.zeros(2)  # exponentially forgotten (rows, seconds) of context catch-ups

    def add(self, batch_size: int, width: int, block_seconds: float, walk_seconds: float) -> None:
        self.block.add(batch_size, block_seconds)
        self.per_slot.add(batch_size, walk_seconds / max(width, 1))

    def add_catch_up(self, rows: int, seconds: float) -> None:
        """A drafting step first projected `rows` committed taps into the drafter context."""
        if rows > 0:
            self._catch_up += self._catch_up_decay * (np.array([rows, seconds]) - self._catch_up)

    def catch_up_seconds(self, rows: float) -> float:
        """What keeping the context current costs for `rows` new tokens when every step drafts.

        The worker projects taps only when a step drafts, so a step after a run of skips pays for
        all of them at once; charged as measured, a rare drafting step would look far dearer
        than drafting every step is."""
        return float(rows * self._catch_up[1] / self._catch_up[0]) if self._catch_up[0] > 0 else 0.0

    def per_width(self, batch_size: int, gamma: int) -> list[float]:
        block = self.block.estimate(batch_size) + self.catch_up_seconds(batch_size)
        slot = self.per_slot.estimate(batch_size)
        return [0.0] + [block + width * slot for width in range(1, gamma + 1)]


@dataclass(frozen=True)
class StepDecision:
    """Made before drafting: how many block slots to draft (0: skip the drafter), the
    capacity K (None: not budgeted) and whether lookup drafts may be verified."""

    draft_width: int
    capacity: int | None
    vetoed: bool = False  # runs plain because speculated steps measurably lost (`StepRates`)
    lookups: bool = True  # False: a plain step (a veto, or a sample of plain steps' rate)

    @property
    def draft(self) -> bool:
        return self.draft_width > 0


@dataclass(frozen=True)
class Plan:
    """verify_lens [B]: drafts verified per request (the bonus position comes on top)."""

    verify_lens: torch.Tensor
    capacity: int | None
    predicted_seconds: float | None
    confidence_logits: torch.Tensor | None
    survivals: torch.Tensor | None
    step_shape: StepShape | None = None  # what was predicted (production planner only)
    lookup_lens: torch.Tensor | None = None  # [B] lookup drafts in place of the drafter's (0: none)
    lookup_matches: torch.Tensor | None = None  # [B] length of the match that proposed them (0: none)
    # ((temperature class, match length), rows) of the lookup rows: grouped once, read by plan and observe_rounds
    lookup_groups: list[tuple[tuple[str, int], torch.Tensor]] | None = None


class VerifyPlanner:
    """Holds the planner state across decode steps of one worker."""

    def __init__(self, settings: LiveSettings) -> None:
        self.settings = settings
        self.gamma = settings.gamma
        self.calibration = self._load_calibration(settings.sts_path)
        self.greedy_calibration = self._load_calibration(settings.sts_greedy_path)
        self.capacity_planner = None
        self.draft_costs = DraftCosts()
        self._sweep_step = 0
        self.recalibrator = None
        self.served_offsets: dict[str, ServedOffsets] | None = None  # per temperature class
        self._pending_rounds: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.lookup_survival = {  # per temperature class and match length
            "greedy": {n: LookupSurvival(self.gamma, PRIOR_GREEDY[n]) for n in range(MIN_MATCH, MAX_MATCH + 1)},
            "sampled": {n: LookupSurvival(self.gamma, PRIOR_SAMPLED[n]) for n in range(MIN_MATCH, MAX_MATCH + 1)}}
        if settings.planner == "production":
            from sglang_dspark.scheduling.cost_model import load_cost_model
            from sglang_dspark.scheduling.planner import EarlyStopPlanner

            self.capacity_planner = EarlyStopPlanner(load_cost_model(settings.sps_path), gamma=self.gamma,
                                                     explore_every=EXPLORE_EVERY, seed=settings.seed)
            if settings.recalibrate_every:  # only this planner's decisions read survivals
                self.recalibrator = LiveRecalibrator(self.gamma, settings.recalibrate_every, seed=settings.seed)
            if settings.served_offsets:
                self.served_offsets = {kind: ServedOffsets(self.gamma) for kind in KINDS}

    def _load_calibration(self, path):
        """STS temperatures (and biases) from `path` cut to gamma, or None (no file)."""
        if path is None:
            return None
        from sglang_dspark.calibration.sts import StsCalibration

        calibration = StsCalibration.load(path)
        if calibration.gamma < self.gamma:
            raise ValueError(
                f"STS file {path} has {calibration.gamma} temperatures; expected at least gamma={self.gamma}"
            )
        biases = None if calibration.biases is None else calibration.biases[: self.gamma]
        return StsCalibration(temperatures=calibration.temperatures[: self.gamma], biases=biases)

    def survivals(self, confidence_logits: torch.Tensor, greedy: torch.Tensor | None = None) -> torch.Tensor:
        """Prefix survivals a_k from raw confidence logits [B, gamma]; rows where `greedy` [B] is
        True use the greedy calibration (and offsets) when there is one."""
        if greedy is None or not bool(greedy.any()):
            return self._survivals_of("sampled", confidence_logits)
        if bool(greedy.all()):  # (the usual batch: no row masks)
            return self._survivals_of("greedy", confidence_logits)
        survivals = torch.empty(confidence_logits.shape, dtype=torch.float32)
        survivals[greedy] = self._survivals_of("greedy", confidence_logits[greedy])
        survivals[~greedy] = self._survivals_of("sampled", confidence_logits[~greedy])
        return survivals

    def _calibration_of(self, kind: str):
        """The calibration in force for a temperature class (greedy rows fall back to the sampled
        one until they have their own; None: raw confidences)."""
        return (self.greedy_calibration or self.calibration) if kind == "greedy" else self.calibration

    def _conditional_logits(self, kind: str, confidence_logits: torch.Tensor) -> torch.Tensor:
        calibration = self._calibration_of(kind)
        if calibration is None:
            return confidence_logits.to(torch.float64)
        return calibration.conditional_logits(confidence_logits)

    def _survivals_of(self, kind: str, confidence_logits: torch.Tensor) -> torch.Tensor:
        conditional = self._conditional_logits(kind, confidence_logits)
        if self.served_offsets is not None:
            return self.served_offsets[kind].apply(conditional)
        return torch.cumprod(torch.sigmoid(conditional), dim=-1).to(torch.float32)

    def decide(self, request_ids: list, context_lens: torch.Tensor) -> StepDecision:
        """How many block slots this step drafts (0: none), decided before the drafter runs."""
        if self.settings.planner == "fixed":  # draft what is verified (0: skip the drafter)
            return StepDecision(draft_width=min(self.settings.fixed_drafts, self.gamma), capacity=None)
        if self.settings.planner == "sweep" and self._sweep_step % (self.gamma + 1) == 0:
            return StepDecision(draft_width=0, capacity=None)  # skipped() advances the sweep
        if self.settings.planner != "production":
            return StepDecision(draft_width=self.gamma, capacity=None)
        decision = self.capacity_planner.decide(
            request_ids, context_tokens=float(context_lens.sum()),
            draft_seconds=self.draft_costs.per_width(len(request_ids), self.gamma))
        return StepDecision(draft_width=decision.draft_width, capacity=decision.capacity,
                            vetoed=self.capacity_planner.vetoed, lookups=not self.capacity_planner.plain_step)

    def plan(self, request_ids: list, confidence_logits: torch.Tensor | None, context_lens: torch.Tensor,
             decision: StepDecision | None = None, greedy: torch.Tensor | None = None,
             lookup_lens: torch.Tensor | None = None, grammar_lens: torch.Tensor | None = None,
             lookup_matches: torch.Tensor | None = None) -> Plan:
        """Verify lengths for this step, given the drafts' confidence logits [B, w] (w <= gamma:
        the drafter ran only the decision's draft width; lookup rows may hold up to gamma drafts,
        and a production step that skipped the drafter may still verify its lookup rows').

        `confidence_logits` is None for a drafter without a confidence head (a DFlash drafter): only
        `all` and `fixed` can plan without survivals, and `load_settings` refuses `production` for
        such a drafter at launch. `decision` is this step's `decide` (made here when not given);
        `greedy` [B] marks the greedy requests (their own calibration); `lookup_lens` [B] counts the
        lookup drafts (`engine.lookup`) that replaced a request's block (0: none), `lookup_matches` [B]
        the length of the match that proposed them: those rows take their temperature class's lookup
        survivals for that match length, and never verify past their lookup drafts, as
        the drafter's rows never verify past the decision's width. `grammar_lens` [B] caps the drafts
        of constrained requests where their grammar refuses one (`engine.grammar.guide_drafts`)."""
        batch = len(request_ids)
        if (lookup_lens is None) != (lookup_matches is None):
            raise ValueError("lookup_lens and lookup_matches come together: the drafts and the match that "
                             "proposed them")
        decision = decision or self.decide(request_ids, context_lens)
        groups = None if lookup_lens is None else self._lookup_groups(lookup_lens, lookup_matches, greedy)
        if confidence_logits is None:
            if self.settings.planner == "production":
                raise ValueError("the production planner needs a drafter with a confidence head")
            verify_lens = torch.minimum(torch.full((batch,), self._next_static_drafts(), dtype=torch.long),
                                        _draft_limits(batch, decision.draft_width, lookup_lens, grammar_lens))
            return Plan(verify_lens=verify_lens, capacity=None, predicted_seconds=None, confidence_logits=None,
                        survivals=None, lookup_lens=lookup_lens, lookup_matches=lookup_matches,
                        lookup_groups=groups)
        confidence_logits = confidence_logits[:, : self.gamma].float().cpu()
        width = confidence_logits.shape[1]
        drafted_width = min(width, decision.draft_width)  # the drafter's rows hold this many drafts
        limits = _draft_limits(batch, drafted_width, lookup_lens, grammar_lens)
        # survivals are prefix products: slots past the drafted width (padding here) change none
        # of the first `width`, and neither the verify lengths (limits) nor publish read them
        padded = torch.nn.functional.pad(confidence_logits, (0, self.gamma - width))
        survivals = self.survivals(padded, greedy)
        if lookup_lens is not None:
            survivals = self._with_lookup_survivals(survivals, lookup_lens, groups)
        survivals = survivals * (torch.arange(1, self.gamma + 1)[None, :] <= limits[:, None])  # no draft, no survival
        if self.settings.planner != "production":
            verify_lens = torch.minimum(torch.full((batch,), self._next_static_drafts(), dtype=torch.long), limits)
            return Plan(verify_lens=verify_lens, capacity=None, predicted_seconds=None,
                        confidence_logits=confidence_logits, survivals=survivals[:, :width], lookup_lens=lookup_lens,
                        lookup_matches=lookup_matches, lookup_groups=groups)
        if bool((limits > 0).any()):
            verify_lens = self.capacity_planner.verify_lens(survivals, limits, float(context_lens.sum()))
        elif grammar_lens is not None:  # every request's grammar refused its first draft
            verify_lens = torch.zeros(batch, dtype=torch.long)
        else:
            raise ValueError("plan() needs drafts: a step decided not to draft, without lookup drafts, takes skipped()")
        if decision.draft:
            self._publish_drafter_rows(request_ids, survivals, drafted_width, lookup_lens)
        shape = self._shape(batch, int(verify_lens.sum()), context_lens)
        return Plan(verify_lens=verify_lens, capacity=decision.capacity, predicted_seconds=self._predict(shape),
                    confidence_logits=confidence_logits[:, :width] if decision.draft else None,
                    survivals=survivals[:, :width], step_shape=shape, lookup_lens=lookup_lens,
                    lookup_matches=lookup_matches, lookup_groups=groups)

    def _publish_drafter_rows(self, request_ids: list, survivals: torch.Tensor, drafted_width: int,
                              lookup_lens: torch.Tensor | None) -> None:
        """Give the width decision the survivals of the rows the drafter walked, and only those.

        The pool `decide` values each draft width on stands for drafter rows. Lookup rows hold
        lookup survivals over the whole block (served at batch 16: 0.29-0.36 at positions 5-7,
        where the drafter's were 0.00-0.03), so pooled beside them they made the last slots look
        worth walking: the planner walked all 7 slots on every drafted step at batch 12-16 (2.5 ms
        of walk a step) while no drafter row was ever verified past position 5."""
        if lookup_lens is None:
            self.capacity_planner.publish(request_ids, survivals, drafted_width)
            return
        walked = (lookup_lens == 0).nonzero().squeeze(-1)
        if len(walked) > 0:
            self.capacity_planner.publish([request_ids[row] for row in walked.tolist()], survivals[walked],
                                          drafted_width)

    @property
    def verifies_lookups_on_skipped_steps(self) -> bool:
        """Whether a step that skips the drafter still verifies lookup drafts: with the production
        planner, whose skip is a judgement of the drafter's cost (`all`/`fixed`/`sweep` skip
        because they were told to: `fixed:0` is the one-token baseline)."""
        return self.settings.planner == "production"

    def _with_lookup_survivals(self, survivals: torch.Tensor, lookup_lens: torch.Tensor,
                               groups: list[tuple[tuple[str, int], torch.Tensor]]) -> torch.Tensor:
        """Rows with lookup drafts (`groups`, `_lookup_groups`) take their class's served lookup
        survivals for their match length, zero past their drafts."""
        if not groups:
            return survivals
        survivals = survivals.clone()
        positions = torch.arange(1, self.gamma + 1)
        for (kind, n), rows in groups:
            within = positions[None, :] <= lookup_lens[rows, None]
            survivals[rows] = (self.lookup_survival[kind][n].survivals()[None, :] * within).to(survivals.dtype)
        return survivals

    @staticmethod
    def _lookup_groups(lookup_lens: torch.Tensor, lookup_matches: torch.Tensor,
                       greedy: torch.Tensor | None) -> list[tuple[tuple[str, int], torch.Tensor]]:
        """((temperature class, match length), row indices) of each group of lookup rows present
        (`greedy` None: every row sampled): one pass over host lists (a masked tensor comparison
        per group took ~50 us a call at batch 16, 18 us this way), once a step: the plan keeps it
        for `observe_rounds`."""
        greedy_rows = [False] * len(lookup_lens) if greedy is None else greedy.bool().tolist()
        groups: dict[tuple[str, int], list[int]] = {}
        for row, (drafts, match, is_greedy) in enumerate(zip(lookup_lens.tolist(), lookup_matches.tolist(),
                                                            greedy_rows)):
            if drafts > 0:
                groups.setdefault(("greedy" if is_greedy else "sampled", match), []).append(row)
        return [(key, torch.tensor(rows, dtype=torch.long)) for key, rows in groups.items()]

    def skipped(self, request_ids: list, context_lens: torch.Tensor) -> Plan:
        """The plan of a step that did not draft: every request verifies only its bonus token."""
        if self.settings.planner == "sweep":
            self._next_static_drafts()
        batch = len(request_ids)
        shape = self._shape(batch, 0, context_lens)
        return Plan(verify_lens=torch.zeros(batch, dtype=torch.long), capacity=0,
                    predicted_seconds=self._predict(shape), confidence_logits=None, survivals=None,
                    step_shape=shape)

    def _next_static_drafts(self) -> int:
        """Drafts per request for all/fixed/sweep; advances the sweep, so call it once per step."""
        if self.settings.planner == "sweep":
            self._sweep_step += 1
            return (self._sweep_step - 1) % (self.gamma + 1)
        return self.gamma if self.settings.planner == "all" else self.settings.fixed_drafts

    def observe(self, plan: Plan, request_ids: list, target_seconds: float, step_seconds: float,
                committed_tokens: int, drafted: bool) -> None:
        """A finished step: its seconds after drafting (verify forward, acceptance, bookkeeping:
        what the table was fitted on), to which the production planner rescales its table, and
        the whole step's seconds (with the scheduler's between steps) and committed tokens, which
        it checks speculating against (unless `request_ids`, the step's batch, changed since the
        previous step). A step speculated when it drafted or had lookup drafts to plan, verified
        or not: it paid for them."""
        if self.capacity_planner is not None:
            self.capacity_planner.observe(plan.step_shape, target_seconds)
            looked_up = plan.lookup_lens is not None and bool((plan.lookup_lens > 0).any())
            self.capacity_planner.record_step(request_ids, drafted or looked_up, committed_tokens, step_seconds)

    def observe_rounds(self, plan: Plan, num_accepted: torch.Tensor, greedy: torch.Tensor) -> None:
        """A drafted step's verify outcomes (accepted drafts [B], greedy [B]) for the served
        offsets of each temperature class and live recalibration, taken in every
        `ROUNDS_PER_FLUSH` drafted steps (`flush_rounds`); lookup rounds go to the lookup
        survivals at once (their drafts are not the drafter's, so they say nothing of its head),
        each to the temperature class and match length the plan valued it by (`Plan.lookup_groups`)."""
        verify_lens, num_accepted, greedy = plan.verify_lens, num_accepted.cpu(), greedy.bool().cpu()
        if plan.lookup_lens is not None:  # lookup rounds teach the lookup survivals, not the calibration
            lookup = plan.lookup_lens > 0
            for (kind, n), rows in plan.lookup_groups:  # the classes the plan valued them by
                self.lookup_survival[kind][n].add(verify_lens[rows], num_accepted[rows])
        if plan.confidence_logits is None:  # no drafter rows (or no head to calibrate)
            return
        logits = plan.confidence_logits
        if plan.lookup_lens is not None:
            logits, verify_lens, num_accepted, greedy = logits[~lookup], verify_lens[~lookup], num_accepted[~lookup], greedy[~lookup]
        if self.served_offsets is None and self.recalibrator is None:
            return
        logits = torch.nn.functional.pad(logits, (0, self.gamma - logits.shape[1]))
        self._pending_rounds.append((logits, verify_lens, num_accepted, greedy))
        if len(self._pending_rounds) >= ROUNDS_PER_FLUSH:
            self.flush_rounds()

    def flush_rounds(self) -> None:
        """Take in the kept rounds: a refit that calibrates better on held-out rounds replaces
        the calibration in force for its class (`live_calibration`), and that class's offsets
        start afresh (they corrected the calibration it replaced). Slots past a step's drafted
        width are zeros, never verified, so neither fit reads them."""
        if not self._pending_rounds:
            return
        logits, verify_lens, accepted, greedy = (torch.cat(parts) for parts in zip(*self._pending_rounds))
        self._pending_rounds.clear()
        if self.served_offsets is not None:
            self._add_served_tests(logits, verify_lens, accepted, greedy)
        if self.recalibrator is None:
            return
        self.recalibrator.add(logits, verify_lens, accepted, greedy)
        for kind in self.recalibrator.due():
            refitted = self.recalibrator.refit(kind, self._calibration_of(kind))
            if refitted is None:
                continue
            if kind == "greedy":
                self.greedy_calibration = refitted
            else:
                self.calibration = refitted
            if self.served_offsets is not None:
                self.served_offsets[kind].reset()

    def _add_served_tests(self, logits: torch.Tensor, verify_lens: torch.Tensor, accepted: torch.Tensor,
                          greedy: torch.Tensor) -> None:
        for kind, rows in (("greedy", greedy), ("sampled", ~greedy)):
            if bool(rows.any()):
                conditional = self._conditional_logits(kind, logits[rows])
                self.served_offsets[kind].add(conditional, verify_lens[rows], accepted[rows])

    def _shape(self, batch: int, drafts: int, context_lens: torch.Tensor) -> StepShape | None:
        if self.capacity_planner is None:
            return None
        from sglang_dspark.scheduling.cost_model import StepShape

        return StepShape(num_requests=batch, batch_tokens=batch + drafts, context_tokens=int(context_lens.sum()))

    def _predict(self, shape: StepShape | None) -> float | None:
        return None if shape is None else self.capacity_planner.cost_model.predict(shape)


def _draft_limits(batch: int, drafted_width: int, lookup_lens: torch.Tensor | None,
                  grammar_lens: torch.Tensor | None = None) -> torch.Tensor:
    """Drafts each request holds this step [B]: its lookup drafts, else the drafter's width, cut
    where its grammar refuses a draft."""
    limits = torch.full((batch,), drafted_width, dtype=torch.long)
    if lookup_lens is not None:
        limits = torch.where(lookup_lens > 0, lookup_lens, limits)
    return limits if grammar_lens is None else torch.minimum(limits, grammar_lens)
