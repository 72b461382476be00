"""Planner properties: capacity limits, load response, verify-all on a flat table, agreement of
the two planners, and non-anticipation (with a control showing the test catches a planner that
anticipates, the paper's Appendix A counterexample)."""

import numpy as np
import pytest
import torch

from sglang_dspark.scheduling.cost_model import AdditiveCostModel, StepCostTable, uninitialised_cost_model
from sglang_dspark.scheduling.planner import (
    EarlyStopPlanner,
    PlannerError,
    TwoStepCapacityPlanner,
    capacity_from,
    decide_capacity,
    early_stop_lens,
    fill_capacity,
    plan_algorithm1,
    survivals_from_confidences,
)

META = {"hardware": "test", "model": "test"}


def affine(bias: float = 0.05, per_token: float = 0.002, per_request: float = 0.0) -> AdditiveCostModel:
    """T = bias + per_request * bs + per_token * B: a smooth, unimodal-objective cost model."""
    return AdditiveCostModel(
        bias_seconds=bias,
        request_knots=[1, 2],
        alpha_seconds=[0.0, per_request],
        token_knots=[1, 2],
        theta_seconds=[0.0, per_token],
        metadata=META,
    )


def convex() -> AdditiveCostModel:
    """Memory-bound then compute-bound: cheap tokens first, then steeper."""
    return AdditiveCostModel(0.05, [1, 2], [0.0, 0.0], [1, 64, 128, 512], [0.0, 0.02, 0.08, 1.0], metadata=META)


def random_confidences(batch: int, gamma: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, gamma, generator=g) * 2.0 + 1.0


def random_survivals(batch: int, gamma: int, seed: int) -> torch.Tensor:
    return survivals_from_confidences(random_confidences(batch, gamma, seed))


@pytest.mark.parametrize("seed", range(5))
def test_capacity_and_length_limits_are_never_exceeded(seed):
    g = torch.Generator().manual_seed(100 + seed)
    survivals = random_survivals(16, 7, seed)
    low = torch.randint(0, 3, (16,), generator=g)
    high = torch.clamp(low + torch.randint(0, 6, (16,), generator=g), max=7)
    for capacity in (0, 1, 5, 20, 200):
        lens = fill_capacity(survivals, capacity, min_lens=low, max_lens=high)
        assert int(lens.sum()) <= max(capacity, int(low.sum()))
        assert bool((lens >= low).all()) and bool((lens <= high).all())
        if capacity >= int(low.sum()):
            assert int(lens.sum()) == min(capacity, int(high.sum()))
    for cost in (affine(), convex()):
        lens = plan_algorithm1(survivals, cost, min_lens=low, max_lens=high)
        assert bool((lens >= low).all()) and bool((lens <= high).all())
        decision = decide_capacity(survivals, cost, min_lens=low, max_lens=high)
        assert int(low.sum()) <= decision.capacity <= int(high.sum())


@pytest.mark.parametrize("cost", [affine(), affine(per_request=0.001), convex()], ids=["affine", "affine+req", "convex"])
def test_budget_per_request_never_grows_as_load_grows(cost):
    row = random_survivals(1, 7, seed=3)
    previous_a1 = previous_k = float("inf")
    for load in (1, 2, 4, 8, 16, 32, 64, 128):
        survivals = row.expand(load, 7).contiguous()
        per_request_a1 = float(plan_algorithm1(survivals, cost).sum()) / load
        per_request_k = capacity_from(survivals, cost) / load
        assert per_request_a1 <= previous_a1 + 1e-9
        assert per_request_k <= previous_k + 1e-9
        previous_a1, previous_k = per_request_a1, per_request_k
    assert previous_a1 < 7  # load did cut the budget


def test_flat_uninitialised_table_verifies_everything():
    survivals = random_survivals(8, 7, seed=1)
    survivals[0] = 0.0  # even hopeless drafts: an uninitialised planner is plain verify-all
    table = uninitialised_cost_model()
    assert plan_algorithm1(survivals, table).tolist() == [7] * 8
    assert capacity_from(survivals, table) == 56
    assert fill_capacity(survivals, capacity_from(survivals, table)).tolist() == [7] * 8
    assert plan_algorithm1(survivals, table, max_lens=3).tolist() == [3] * 8


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cost", [affine(), affine(0.2, 0.01), convex()], ids=["affine", "steep", "convex"])
def test_algorithm1_and_production_agree_when_confidences_do_not_change(seed, cost):
    survivals = random_survivals(12, 7, seed)
    ids = list(range(12))
    planner = TwoStepCapacityPlanner(cost, gamma=7, lag=2, window=3)
    for _ in range(6):  # steady state: every step sees the same confidences
        decision = planner.decide(ids)
        production = fill_capacity(survivals, decision.capacity, max_lens=decision.draft_width)
        planner.publish(ids, survivals)
    assert production.tolist() == plan_algorithm1(survivals, cost).tolist()


def admitted_after_flip(plan, confidences: torch.Tensor, row: int, position: int, seed: int) -> tuple[bool, bool]:
    """Whether draft `position` of `row` is admitted, before and after changing the value of that
    draft token, which (through the Markov feature) changes every later confidence of the row."""
    before = plan(survivals_from_confidences(confidences))
    flipped = confidences.clone()
    g = torch.Generator().manual_seed(seed)
    flipped[row, position + 1 :] = torch.randn(confidences.shape[1] - position - 1, generator=g) * 3.0
    after = plan(survivals_from_confidences(flipped))
    return bool(before[row] > position), bool(after[row] > position)


def planners_under_test():
    cost = convex()
    old = random_survivals(10, 7, seed=99)  # the production capacity comes from earlier steps
    capacity = capacity_from(old, cost)
    return {
        "algorithm1": lambda s: plan_algorithm1(s, cost),
        "algorithm1_min_max": lambda s: plan_algorithm1(s, cost, min_lens=1, max_lens=5),
        "production_fill": lambda s: fill_capacity(s, capacity),
        "production_fill_small_k": lambda s: fill_capacity(s, 7),
        "early_stop": lambda s: early_stop_lens(s, cost, throughput=1000.0),
        "early_stop_width_5": lambda s: early_stop_lens(s, cost, throughput=1000.0, max_lens=5),
    }


@pytest.mark.parametrize("name", list(planners_under_test()))
def test_admission_never_depends_on_the_admitted_token_itself(name):
    plan = planners_under_test()[name]
    checked = 0
    for seed in range(6):
        confidences = random_confidences(10, 7, seed)
        for row in range(10):
            for position in range(6):
                for flip in range(3):
                    before, after = admitted_after_flip(plan, confidences, row, position, 1000 * seed + flip)
                    assert before == after, f"row {row} position {position}: admission changed"
                    checked += before
    assert checked > 50  # the property was exercised on admitted drafts, not only rejected ones


def test_the_non_anticipation_check_catches_a_retrospective_global_search():
    """Paper Appendix A: without early stop, admitting x1 depends on x1 through c2."""
    sps = StepCostTable(batch_tokens=[1, 2, 3], steps_per_second=[1.0, 0.5, 0.45], metadata=META)
    high = torch.tensor([[0.8, 0.8 * 0.9]])
    low = torch.tensor([[0.8, 0.0]])

    def retrospective(s):  # global argmax on the *current* survivals: what production must not do
        return fill_capacity(s, capacity_from(s, sps))

    assert retrospective(high).item() == 2 and retrospective(low).item() == 0  # x1's fate flips
    assert plan_algorithm1(high, sps).item() == plan_algorithm1(low, sps).item() == 0  # early stop
    confidences = torch.logit(torch.tensor([[0.8, 0.9]]))
    found = False
    for seed in range(20):
        before, after = admitted_after_flip(retrospective, confidences, 0, 0, seed)
        found |= before != after
    assert found, "the flip test must be able to fail"


def test_ties_go_to_the_earlier_position_then_the_lower_request():
    survivals = torch.tensor([[0.9, 0.5, 0.5], [0.9, 0.5, 0.5], [0.5, 0.5, 0.5]])
    assert fill_capacity(survivals, 3).tolist() == [1, 1, 1]  # 0.9, 0.9, then (req 2, pos 0)
    assert fill_capacity(survivals, 4).tolist() == [2, 1, 1]  # then position 1 of request 0


def test_expensive_drafting_under_load_turns_speculation_off_cheap_drafting_keeps_it():
    survivals = torch.full((32, 7), 0.9).cumprod(dim=1)
    cost = affine(0.05, 0.004)
    off = decide_capacity(survivals, cost, draft_seconds=1.0)
    assert (off.capacity, off.draft_width) == (0, 0)
    on = decide_capacity(survivals, cost, draft_seconds=0.0001)
    assert on.capacity > 0 and on.draft_width >= 1
    # a drafter whose cost grows with the block width gets a short block
    widths = [0.0] + [0.02 * w for w in range(1, 8)]
    short = decide_capacity(survivals, affine(0.05, 0.0005), draft_seconds=widths)
    assert 1 <= short.draft_width < 7 and short.capacity <= 32 * short.draft_width


def test_two_step_planner_uses_old_survivals_and_a_prior_for_new_requests():
    cost = affine()
    confident = torch.full((4, 7), 0.99).cumprod(dim=1)
    doubtful = torch.full((4, 7), 0.2).cumprod(dim=1)
    planner = TwoStepCapacityPlanner(cost, gamma=7, lag=2, window=1, long_run=False)
    ids = ["a", "b", "c", "d"]
    assert planner.decide(ids).capacity == 28  # nothing known yet: optimistic prior
    planner.publish(ids, confident)
    planner.publish(ids, doubtful)
    # the decision for the next step sees the step two back (confident), not the newest
    assert planner.decide(ids).capacity == capacity_from(confident, cost)
    planner.publish(ids, doubtful)
    assert planner.decide(ids).capacity == capacity_from(doubtful, cost)
    mixed = planner.lagged_survivals(["a", "new"])
    assert torch.allclose(mixed[0, 0], doubtful[0])
    assert torch.allclose(mixed[0, 1], planner.prior_survival())


def test_skipped_drafting_is_explored_again_after_a_while():
    cost = affine(0.05, 0.004)
    planner = TwoStepCapacityPlanner(cost, gamma=7, explore_every=5)
    ids = list(range(32))
    planner.publish(ids, torch.full((32, 7), 0.3).cumprod(dim=1))
    widths = [planner.decide(ids, draft_seconds=1.0).draft_width for _ in range(10)]
    assert widths.count(0) == 8 and widths[4] > 0 and widths[9] > 0


@pytest.mark.parametrize(
    "survivals, kwargs, message",
    [
        (torch.tensor([[0.5, 0.9]]), {}, "non-increasing"),
        (torch.tensor([[1.5, 0.9]]), {}, r"\[0, 1\]"),
        (torch.tensor([0.5, 0.4]), {}, "batch"),
        (torch.tensor([[0.5, 0.4]]), {"min_lens": 2, "max_lens": 1}, "min_lens <= max_lens"),
        (torch.tensor([[0.5, 0.4]]), {"max_lens": torch.tensor([1, 1])}, "shape"),
    ],
)
def test_bad_planner_input_is_a_clear_error(survivals, kwargs, message):
    with pytest.raises(PlannerError, match=message):
        plan_algorithm1(survivals, affine(), **kwargs)


@pytest.mark.parametrize("kind", ["step", "additive", "context"])
def test_budget_shrinks_with_load_on_the_measured_cpu_profiles(kind):
    from pathlib import Path

    from sglang_dspark.scheduling.cost_model import load_cost_model

    cost = load_cost_model(Path(__file__).resolve().parents[1] / "profiles" / f"cpu-smollm2-135m-target-{kind}.json")
    for seed in range(3):
        row = random_survivals(1, 7, seed)
        budgets, greedy = [], []
        for load in (1, 2, 4, 8, 16, 32, 64):
            survivals = row.expand(load, 7).contiguous()
            budgets.append(capacity_from(survivals, cost, context_tokens=512.0 * load) / load)
            greedy.append(float(plan_algorithm1(survivals, cost, context_tokens=512.0 * load).sum()) / load)
        for curve in (budgets, greedy):
            assert all(b <= a + 1e-9 for a, b in zip(curve, curve[1:])), curve


def test_early_stop_verifies_while_a_draft_pays_for_its_seconds():
    survivals = torch.tensor([[0.9, 0.6, 0.4, 0.1], [0.7, 0.3, 0.2, 0.1]])
    cost = affine(0.05, 0.001)  # one more verify token: 1 ms
    # at 500 tokens/s a draft pays from survival 0.5: 0.9, 0.7, 0.6 are verified, then 0.4 stops it
    assert early_stop_lens(survivals, cost, throughput=500.0).tolist() == [2, 1]
    assert early_stop_lens(survivals, cost, throughput=500.0, max_lens=1).tolist() == [1, 1]
    assert early_stop_lens(survivals, cost, throughput=50.0).tolist() == [4, 4]


def test_early_stop_planner_drafts_for_confident_traffic_and_skips_hopeless_traffic():
    ids = list(range(8))
    confident = EarlyStopPlanner(affine(0.05, 0.001), gamma=7)
    assert confident.decide(ids).draft_width == 7, "nothing known yet: draft the whole block"
    confident.publish(ids, torch.full((8, 7), 0.95).cumprod(dim=1))
    decision = confident.decide(ids, draft_seconds=0.005)
    assert decision.draft_width == 7 and decision.expected_tokens > 8 + 8 * 3

    hopeless = EarlyStopPlanner(affine(0.05, 0.001), gamma=7, explore_every=5)
    hopeless.publish(ids, torch.full((8, 7), 0.05).cumprod(dim=1))
    widths = [hopeless.decide(ids, draft_seconds=0.01).draft_width for _ in range(200)]
    probes = [step for step, width in enumerate(widths) if width]
    # skips, with a probe now and then: after 5 skipped steps, then each wait twice the last, up to 8x
    assert probes == [4, 14, 34, 74, 114, 154, 194], probes


def test_a_step_that_wants_to_draft_brings_the_probes_back_to_their_first_pace():
    ids = list(range(8))
    planner = EarlyStopPlanner(affine(0.05, 0.001), gamma=7, explore_every=5)
    planner.publish(ids, torch.full((8, 7), 0.05).cumprod(dim=1))
    for _ in range(75):  # three probes: the next one 40 skipped steps away
        planner.decide(ids, draft_seconds=0.01)
    planner.publish(ids, torch.full((8, 7), 0.95).cumprod(dim=1))
    assert planner.decide(ids, draft_seconds=0.01).draft_width > 0, "confident traffic drafts"
    for _ in range(16):  # the survival pool forgets the confident step
        planner.publish(ids, torch.full((8, 7), 0.05).cumprod(dim=1))
    widths = [planner.decide(ids, draft_seconds=0.01).draft_width for _ in range(6)]
    assert [w > 0 for w in widths] == [False] * 4 + [True, False], widths


def _settle(planner: EarlyStopPlanner, ids: list, draft_seconds: float, steps: int = 40) -> None:
    """Steps at one batch size with confident drafts (each 0.7 likely to survive the last)."""
    for _ in range(steps):
        planner.publish(ids, torch.full((len(ids), 7), 0.7).cumprod(dim=1))
        planner.decide(ids, draft_seconds=draft_seconds)


def test_a_batch_that_grows_drafts_only_where_it_beats_skipping_at_its_own_size():
    """After a warm-up at batch 1 (drafting ~45 tokens/s there), the first steps of a batch of 16
    valued a second at batch 1's rate, a 1/5 of what skipping delivers at 16, and drafted at
    1.8x a skipped step's time for 1.4x its tokens."""
    planner = EarlyStopPlanner(affine(0.05, 0.001), gamma=7)
    _settle(planner, ["solo"], draft_seconds=0.01)
    assert planner.decide(["solo"], draft_seconds=0.01).draft_width > 0, "drafting pays at batch 1"
    batch = list(range(16))
    skipped_rate = 16 / (0.05 + 0.016)
    decision = planner.decide(batch, draft_seconds=0.06)
    assert decision.draft_width == 0 or decision.expected_tokens / decision.step_seconds > skipped_rate
    assert decision.draft_width == 0, "a 60 ms drafter does not pay at batch 16 with these drafts"


def test_a_batch_that_shrinks_drafts_at_once_where_drafting_pays():
    """A wave's last request: the recent rate of batch 16 (~240 tokens/s) exceeds anything one
    request can deliver, so every width looked a loss and the cheapest, skipping, won."""
    planner = EarlyStopPlanner(affine(0.05, 0.001), gamma=7)
    _settle(planner, list(range(16)), draft_seconds=0.06)
    assert planner.decide(list(range(16)), draft_seconds=0.06).draft_width == 0
    assert planner.decide(["last"], draft_seconds=0.01).draft_width > 0


@pytest.mark.parametrize("batch", [1, 3, 16])
def test_the_width_values_equal_a_per_width_evaluation(batch):
    """The planner values every width in one pass (it runs on every decode step); each width's
    expected tokens and seconds equal evaluating that width alone: the virtual batches' survivals
    at slots < w, best first, admitted while each pays for its marginal seconds. At batch 1 the
    virtual batches are the pool's rows, each once (an exact mean, not 256 draws)."""
    planner = EarlyStopPlanner(convex(), gamma=7, seed=3)
    ids = list(range(batch))
    for step in range(5):
        planner.publish(ids, random_survivals(batch, 7, seed=batch + 100 * step))
    per_slot = [0.0] + [0.002 * w for w in range(1, 8)]
    state = planner._rng.bit_generator.state
    throughput = planner._throughput(batch, 120.0)
    expected, seconds = planner._width_values(batch, 120.0, per_slot, throughput)

    planner._rng.bit_generator.state = state  # the same virtual batches
    pool = np.concatenate([snapshot.survivals for snapshot in planner._history])
    if batch == 1:
        virtual = pool[:, None, :]
    else:
        virtual = pool[planner._rng.integers(0, len(pool), size=(max(1, planner.virtual_rows // batch), batch))]
    target = convex().seconds_curve(batch, batch + np.arange(batch * 7 + 1, dtype=np.float64), 120.0)
    for width in range(1, 8):
        candidates = -np.sort(-virtual[:, :, :width].reshape(len(virtual), -1), axis=1)
        admitted = np.cumprod(candidates >= throughput * np.diff(target)[: candidates.shape[1]], axis=1)
        assert expected[width] == pytest.approx(batch + (candidates * admitted).sum(axis=1).mean(), rel=1e-12)
        assert seconds[width] == pytest.approx(target[admitted.sum(axis=1)].mean() + per_slot[width], rel=1e-12)
    assert (expected[0], seconds[0]) == (batch, pytest.approx(target[0]))


def test_early_stop_planner_drafts_short_blocks_when_the_walk_costs_per_slot():
    ids = list(range(4))
    planner = EarlyStopPlanner(affine(0.05, 0.001), gamma=7)
    planner.publish(ids, torch.tensor([0.9, 0.8, 0.5, 0.4, 0.3, 0.2, 0.1]).expand(4, 7))
    per_slot = [0.0] + [0.004 * w for w in range(1, 8)]
    assert 1 <= planner.decide(ids, draft_seconds=per_slot).draft_width < 7


def test_a_probe_step_verifies_the_most_confident_first_draft_and_normal_steps_do_not():
    """A probe that verified nothing could never show the online cost fit that verify tokens got
    cheaper again, and drafting would stay off for good."""
    ids = list(range(4))
    hopeless = EarlyStopPlanner(affine(0.05, 0.01), gamma=7, explore_every=3)
    hopeless.publish(ids, torch.full((4, 7), 0.05).cumprod(dim=1))
    survivals = torch.tensor([0.02, 0.04, 0.03, 0.01])[:, None].expand(4, 7).cumprod(dim=1)
    lens = []
    for _ in range(9):
        width = hopeless.decide(ids, draft_seconds=0.01).draft_width
        lens.append(hopeless.verify_lens(survivals, width).tolist() if width else None)
    assert lens == [None, None, [0, 1, 0, 0]] + [None] * 5 + [[0, 1, 0, 0]]
    # a chosen draft width is no probe: early stop alone decides
    confident = EarlyStopPlanner(affine(0.05, 0.01), gamma=7, explore_every=3)
    assert confident.decide(ids).draft_width == 7
    assert confident.verify_lens(survivals, 7).tolist() == [0, 0, 0, 0]


def _replay(planner: EarlyStopPlanner, steps: int, drafted_step: tuple[float, float],
            skipped_step: tuple[float, float], ids: list | None = None) -> list[int]:
    """Drive the planner with confident survivals; each step 'measures' (tokens, seconds) of its kind."""
    ids = list(range(8)) if ids is None else ids
    survivals = torch.full((len(ids), 7), 0.95).cumprod(dim=1)
    widths = []
    for _ in range(steps):
        width = planner.decide(ids, draft_seconds=0.005).draft_width
        if width:
            planner.publish(ids, survivals, width)
        tokens, seconds = drafted_step if width else skipped_step
        planner.record_step(ids, width > 0, tokens, seconds)
        widths.append(width)
    return widths


def _most_speculated_steps_while_vetoed(steps: int, explore_every: int = 16) -> int:
    """The backed-off probes, and each time the speculated side leaves the horizon its
    re-measure (`StepRates.min_samples` steps) and the probes' backoff starting over."""
    from sglang_dspark.scheduling.planner import MAX_PROBE_BACKOFF
    from sglang_dspark.scheduling.step_rates import StepRates

    rates = StepRates()
    probes = steps // (explore_every * MAX_PROBE_BACKOFF) + 1
    return probes + (steps // rates.horizon + 1) * (rates.min_samples + MAX_PROBE_BACKOFF.bit_length())


def _most_plain_steps_while_speculation_wins(steps: int, explore_every: int = 16) -> int:
    """One plain sample in `explore_every * MAX_PROBE_BACKOFF` steps, and each time the plain
    side leaves the horizon its re-measure (`StepRates.min_samples` steps)."""
    from sglang_dspark.scheduling.planner import MAX_PROBE_BACKOFF
    from sglang_dspark.scheduling.step_rates import StepRates

    rates = StepRates()
    return steps // (explore_every * MAX_PROBE_BACKOFF) + 1 + (steps // rates.horizon + 1) * rates.min_samples


def test_where_drafted_steps_measurably_lose_the_planner_skips_whatever_its_model_says():
    """At concurrency 16 the table and the survivals both made drafting look worth it while
    drafted steps delivered 0.84x the tokens/s of skipped ones: measurement overrules the model,
    and the probes that keep measuring drafted steps back off; a review now and then measures
    drafting afresh and vetoes it again."""
    planner = EarlyStopPlanner(affine(0.05, 0.001), gamma=7, explore_every=16)
    widths = _replay(planner, 800, drafted_step=(10.0, 0.2), skipped_step=(8.0, 0.05))
    late = widths[-400:]
    assert planner.vetoed or late[-1] > 0
    assert 1 <= sum(w > 0 for w in late) <= _most_speculated_steps_while_vetoed(400), late


def test_a_veto_rests_on_recent_steps_only():
    """While vetoed, only the rare probes measure drafting, so the speculated side kept what it
    measured when the veto began (at concurrency 16: steps at the long contexts of a wave's end,
    against plain steps at the next wave's short ones; vetoed for ~900 steps while drafted steps
    delivered 1.1x). Steps past the horizon do not count: drafting is measured afresh."""
    from sglang_dspark.scheduling.step_rates import StepRates

    horizon = StepRates().horizon
    planner = EarlyStopPlanner(affine(0.05, 0.001), gamma=7, explore_every=16)
    _replay(planner, 300, drafted_step=(10.0, 0.2), skipped_step=(8.0, 0.05))  # drafting loses
    assert planner.vetoed
    widths = _replay(planner, horizon + 40, drafted_step=(20.0, 0.06), skipped_step=(8.0, 0.05))
    assert not planner.vetoed and all(w > 0 for w in widths[-20:]), "drafting wins again: measured afresh"
    still_losing = EarlyStopPlanner(affine(0.05, 0.001), gamma=7, explore_every=16)
    _replay(still_losing, 300, drafted_step=(10.0, 0.2), skipped_step=(8.0, 0.05))
    widths = _replay(still_losing, horizon + 40, drafted_step=(10.0, 0.2), skipped_step=(8.0, 0.05))
    assert still_losing.vetoed and sum(w > 0 for w in widths) <= _most_speculated_steps_while_vetoed(len(widths))


def test_a_veto_measured_on_requests_that_have_all_left_is_forgotten():
    """Acceptance belongs to the text being written: drafted steps that lost on some requests
    say little about the next ones. Once none of them is left, drafting is measured afresh
    (and vetoed again if it still loses); while any of them stays, the veto holds."""
    from sglang_dspark.scheduling.planner import FORGET_MAX_BATCH

    losing = {"drafted_step": (3.0, 0.2), "skipped_step": (2.0, 0.05)}
    planner = EarlyStopPlanner(affine(0.05, 0.001), gamma=7, explore_every=16)
    _replay(planner, 200, ids=[0, 1], **losing)
    assert planner.vetoed
    assert _replay(planner, 1, ids=[1, 2], **losing) == [0], "request 1 stayed: still vetoed"
    fresh = _replay(planner, 40, ids=[100, 101], **losing)
    assert fresh[0] > 0, "new requests: drafting is measured again"
    assert planner.vetoed and sum(w > 0 for w in fresh) <= 8, fresh

    # a wave's last request vetoed at batch 1; the next wave (4 new requests) forgets it, so its
    # own last request is measured afresh instead of inheriting the veto
    planner = EarlyStopPlanner(affine(0.05, 0.001), gamma=7, explore_every=16)
    _replay(planner, 200, ids=[7], **{"drafted_step": (1.3, 0.2), "skipped_step": (1.0, 0.05)})
    assert planner.vetoed
    _replay(planner, 5, ids=[10, 11, 12, 13], **{"drafted_step": (7.0, 0.06), "skipped_step": (4.0, 0.05)})
    assert _replay(planner, 1, ids=[13], **losing)[0] > 0, "the next wave's last request drafts again"

    # in a large batch what drafting delivers is a property of the load: the veto holds
    large = list(range(FORGET_MAX_BATCH + 12))
    losing = {"drafted_step": (20.0, 0.2), "skipped_step": (16.0, 0.05)}
    planner = EarlyStopPlanner(affine(0.05, 0.001), gamma=7, explore_every=16)
    _replay(planner, 200, ids=large, **losing)
    assert planner.vetoed
    assert _replay(planner, 5, ids=[i + 1000 for i in large], **losing) == [0] * 5


def test_steps_right_after_a_request_joins_or_leaves_do_not_decide_whether_speculation_loses():
    """A step whose batch changed pays for the change whatever its kind; if those steps happen
    to be skipped ones, counting them made skipping look as slow as drafting at concurrency 16."""
    planner = EarlyStopPlanner(affine(0.05, 0.001), gamma=7)
    batch, next_id = list(range(16)), 16
    for step in range(120):
        if step % 4 == 0:  # one request finished, another joined; a slow skipped step (80 tokens/s)
            batch, next_id = batch[1:] + [next_id], next_id + 1
            planner.record_step(batch, False, 16.0, 0.2)
        elif step % 2:
            planner.record_step(batch, True, 20.0, 0.1)  # drafted: 200 tokens/s
        else:
            planner.record_step(batch, False, 16.0, 0.065)  # skipped: 246 tokens/s
    skip_rate, skip_samples = planner.rates.rate(16, speculated=False)
    assert skip_rate == pytest.approx(16.0 / 0.065) and skip_samples == 30 - 8  # less the warm-up
    assert planner.rates.speculation_loses(16)


def test_where_the_model_drafts_from_the_start_a_losing_draft_is_found_within_a_few_dozen_steps():
    """The check needs skipped steps to compare with; where the model drafts every step they come
    only from skip samples, so those come often until the skipped side is known."""
    planner = EarlyStopPlanner(affine(0.05, 0.001), gamma=7, explore_every=16)
    widths = _replay(planner, 60, drafted_step=(10.0, 0.2), skipped_step=(8.0, 0.05))
    assert planner.vetoed, widths
    assert widths.count(0) >= 12, "8 warm-up and 4 measured skipped steps"


def test_where_drafting_measurably_wins_only_a_rare_step_skips_to_keep_the_comparison_fresh():
    planner = EarlyStopPlanner(affine(0.05, 0.001), gamma=7, explore_every=16)
    widths = _replay(planner, 800, drafted_step=(20.0, 0.06), skipped_step=(8.0, 0.05))
    late = widths[-400:]
    assert 1 <= late.count(0) <= _most_plain_steps_while_speculation_wins(400), late
    assert not planner.vetoed


def test_step_rates_pool_similar_batch_sizes_and_ignore_warmup_and_stalls():
    from sglang_dspark.scheduling.step_rates import StepRates

    rates = StepRates(window=8, min_samples=4, spread=8, warmup=2)
    for _ in range(2):
        rates.add(16, True, 20.0, 5.0)  # a server's first steps: not counted
    assert rates.rate(16, speculated=True) == (None, 0)
    for size in (15, 16, 17):
        for _ in range(4):
            rates.add(size, True, 18.0, 0.1)
            rates.add(size, False, 16.0, 0.08)
    rates.add(16, True, 18.0, 10.0)  # a stall (the tokenizer took a core) moves nothing
    assert rates.rate(16, speculated=True) == (pytest.approx(180.0), 13)
    for tokens in (1.0, 1.0, 1.0, 8.0):  # skewed tokens (batch 1): their mean counts, not a typical step's
        rates.add(1, True, tokens, 0.025)
    assert rates.rate(1, speculated=True)[0] == pytest.approx(110.0)
    assert rates.rate(16, speculated=False) == (pytest.approx(200.0), 10)  # warm-up counts per kind
    assert rates.speculation_loses(16) is True and rates.speculation_loses(18) is True  # 18 +- 2 reaches 16 and 17
    assert not rates.speculation_loses(4), "nothing measured near batch 4"
    for size in (15, 16, 17):  # each size's window keeps its recent steps: speculation got faster
        for _ in range(8):
            rates.add(size, True, 24.0, 0.1)
    assert rates.rate(16, speculated=True)[0] == pytest.approx(240.0)
    assert not rates.speculation_loses(16)
    with pytest.raises(ValueError, match="window"):
        StepRates(window=0)


def test_step_rates_count_only_the_steps_within_their_horizon():
    """A rate compares the two kinds of step at today's contexts: steps recorded more than
    `horizon` steps ago, of any size, no longer count, and a kind left with too few is unknown."""
    from sglang_dspark.scheduling.step_rates import StepRates

    rates = StepRates(window=8, min_samples=2, warmup=0, horizon=10)
    for _ in range(3):
        rates.add(16, False, 16.0, 0.04)  # plain steps at a wave's short contexts: 400 tokens/s
    for _ in range(6):
        rates.add(16, True, 40.0, 0.1)  # drafted, longer contexts: 400 tokens/s
    assert rates.rate(16, speculated=False) == (pytest.approx(400.0), 3)
    for _ in range(3):
        rates.add(4, True, 12.0, 0.05)  # another batch size's steps age the others too
    assert rates.rate(16, speculated=False) == (pytest.approx(400.0), 1)
    assert not rates.known(16, speculated=False) and not rates.speculation_loses(16)
    for _ in range(2):
        rates.add(16, False, 16.0, 0.032)  # plain measured again at the contexts of now: 500 tokens/s
    assert rates.rate(16, speculated=False) == (pytest.approx(500.0), 2)
    assert rates.rate(16, speculated=True) == (pytest.approx(400.0), 5) and rates.speculation_loses(16)
    with pytest.raises(ValueError, match="horizon"):
        StepRates(min_samples=4, horizon=3)


def test_one_stalled_plain_sample_among_few_does_not_make_losing_speculation_look_like_a_win():
    """Plain steps come one in 128 while speculation wins; at concurrency 16 one of them took
    68 ms among 36-45 ms ones, and a mean of the few made speculation at 0.9x plain look ahead."""
    from sglang_dspark.scheduling.step_rates import StepRates

    rates = StepRates(min_samples=4, warmup=0)
    for seconds in (0.040, 0.041, 0.068, 0.039, 0.040):
        rates.add(16, False, 16.0, seconds)
    for _ in range(32):
        rates.add(16, True, 25.0, 0.069)  # 362 tokens/s against plain's ~400
    assert rates.speculation_loses(16)


def _replay_lookups(planner: EarlyStopPlanner, steps: int, speculated_step: tuple[float, float],
                    plain_step: tuple[float, float]) -> list[bool]:
    """A batch of 16 whose drafter never pays (the model skips it) but whose requests always have
    lookup drafts: a step speculates (verifies lookups) unless the planner asks for a plain step.
    Returns, per step, whether it ran plain."""
    ids = list(range(16))
    survivals = torch.full((16, 7), 0.9).cumprod(dim=1)
    plain = []
    for _ in range(steps):
        width = planner.decide(ids, draft_seconds=10.0).draft_width
        if width:
            planner.publish(ids, survivals, width)
        ran_plain = planner.plain_step and not width
        tokens, seconds = plain_step if ran_plain else speculated_step
        planner.record_step(ids, not ran_plain, tokens, seconds)
        plain.append(ran_plain)
    return plain


def test_where_lookup_drafts_measurably_lose_the_planner_runs_plain_steps():
    """At concurrency 16 steps that skipped the drafter but verified lookup drafts delivered
    386-396 tokens/s against plain steps' 403-417: speculation of any source is checked against
    plain steps, which the planner samples even where its model never drafts."""
    planner = EarlyStopPlanner(affine(0.05, 0.001), gamma=7, explore_every=16)
    plain = _replay_lookups(planner, 400, speculated_step=(20.0, 0.06), plain_step=(16.0, 0.04))
    assert planner.vetoed and planner.plain_step
    late = plain[-200:]
    assert late.count(False) <= _most_speculated_steps_while_vetoed(200), "only probes and re-measures speculate"
    assert plain[:60].count(True) >= 12, "plain steps are sampled until their rate is known"


def test_where_lookup_drafts_measurably_win_only_a_rare_step_runs_plain():
    planner = EarlyStopPlanner(affine(0.05, 0.001), gamma=7, explore_every=16)
    plain = _replay_lookups(planner, 800, speculated_step=(24.0, 0.045), plain_step=(16.0, 0.04))
    late = plain[-400:]
    assert 1 <= late.count(True) <= _most_plain_steps_while_speculation_wins(400), late
    assert not planner.vetoed
