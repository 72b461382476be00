"""Lookup drafts (`engine.lookup`): proposals, their survivals, and how the planner treats them."""

from __future__ import annotations

import random

import pytest
import torch
from test_engine_units import _production_planner

from sglang_dspark.engine.lookup import PRIOR_GREEDY, LookupSurvival, SequenceLookup, SlotLookups


def _brute_force(tokens: list[int], bonus: int, width: int) -> list[int]:
    """The definition: the longest suffix (4, 3, then 2 tokens) of tokens + [bonus] that occurred
    earlier, and what follows if the text goes on repeating with the period between the two
    occurrences (what followed the earlier one, continued past the bonus)."""
    context = tokens + [bonus]
    for n in (4, 3, 2):
        if len(context) <= n:
            continue
        suffix = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == suffix:
                period = len(context) - n - start
                extended = list(context)
                for _ in range(width):
                    extended.append(extended[-period])
                return extended[len(context):]
    return []


@pytest.mark.parametrize("seed", range(6))
def test_the_incremental_index_proposes_what_a_search_of_the_whole_text_finds(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 12])  # small vocabularies repeat often, runs ("a a a") included
    lookup, tokens = SequenceLookup(), []
    while len(tokens) < 300:
        bonus, width = rng.randrange(vocab), rng.randint(1, 7)
        assert lookup.propose(bonus, width) == _brute_force(tokens, bonus, width), (tokens[-8:], bonus, width)
        committed = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
        lookup.extend(committed)
        tokens += committed


def test_a_repeated_phrase_proposes_its_continuation_and_new_text_proposes_nothing():
    lookup = SequenceLookup([10, 11, 12, 13, 14, 15, 90, 91])
    assert lookup.propose(11, 7) == []  # "91 11" never occurred
    lookup.extend([11])  # ... 90 91 11, with "12" next: "91 11 12" never occurred, "11 12" did
    assert lookup.propose(12, 3) == [13, 14, 15]


def test_a_run_of_one_token_or_a_short_cycle_fills_the_block_by_repeating():
    """A run's latest occurrence always ends at the text's end, so without repeating the period a
    request stuck on one token ("\n\n\n...", a biased sampler) never proposed a draft."""
    assert SequenceLookup([5, 7, 7]).propose(7, 4) == [7, 7, 7, 7]
    assert SequenceLookup([1, 8, 9, 8]).propose(9, 5) == [8, 9, 8, 9, 8]


def test_slots_propose_only_when_in_step_with_the_request_and_eligible():
    lookups = SlotLookups()
    lookups.reset(3, [1, 2, 3, 1, 2])
    # "2 3" continued with "1 2", then the bonus; the match is the 3 tokens "1 2 3"
    assert lookups.propose([3], [3], [5], [True], 3) == [([1, 2, 3], 3)]
    assert lookups.propose([3], [3], [5], [True], 5) == [([1, 2, 3, 1, 2], 3)], "a short period repeats"
    none = [([], 0)]
    assert lookups.propose([3], [3], [6], [True], 3) == none, "a slot out of step with its request cannot propose"
    assert lookups.propose([3], [3], [5], [False], 3) == none
    assert lookups.propose([7], [3], [5], [True], 3) == none, "an unknown slot proposes nothing"
    lookups.commit(3, [3, 1])
    assert lookups.synced(3, 7) and lookups.propose([3], [2], [7], [True], 2) == [([3, 1], 4)]  # "2 3 1 2"


def test_a_request_whose_lookups_keep_failing_stops_proposing_them_for_a_growing_quiet_spell():
    """Near-repeating text ("s2s3s4...") matches every step and is refused every time; after three
    refused rounds in a row the slot proposes nothing for 8 committed tokens, then 16, and a round
    that accepts a draft ends the backoff. Another slot, and a new request in the slot, are unaffected."""
    from sglang_dspark.engine.lookup import MISSES_BEFORE_QUIET, QUIET_TOKENS

    lookups = SlotLookups()
    text = [5, 6, 7] * 6
    lookups.reset(0, list(text))
    lookups.reset(1, list(text))

    def committed(slot: int) -> int:
        return len(lookups._slots[slot].tokens)

    def bonus(slot: int) -> int:  # the text goes on repeating
        return text[committed(slot) % 3]

    def proposes(slot: int) -> bool:
        return lookups.propose([slot], [bonus(slot)], [committed(slot)], [True], 2) != [([], 0)]

    def step(slot: int) -> None:
        lookups.commit(slot, [bonus(slot)])  # a step that accepts no draft commits its bonus alone

    def refused_rounds(slot: int, count: int = MISSES_BEFORE_QUIET) -> None:
        for _ in range(count):
            assert proposes(slot)
            lookups.observe(slot, 0)
            step(slot)

    def quiet_steps(slot: int) -> int:
        steps = 0
        while not proposes(slot):
            step(slot)
            steps += 1
        return steps

    refused_rounds(0, MISSES_BEFORE_QUIET - 1)
    lookups.observe(0, 2)  # an accepted round: the count of misses starts again
    refused_rounds(0)
    assert quiet_steps(0) == QUIET_TOKENS[0] - 1, "quiet for the first spell's committed tokens (one came with the last miss)"
    assert proposes(1), "the other slot still proposes"
    refused_rounds(0)
    assert quiet_steps(0) == 2 * QUIET_TOKENS[0] - 1, "the next spell is twice as long"
    refused_rounds(0)
    lookups.reset(0, list(text))
    assert proposes(0), "a new request in the slot starts afresh"


def test_lookup_survivals_start_at_the_prior_and_learn_from_served_rounds():
    survival = LookupSurvival(7, PRIOR_GREEDY[4])
    prior = torch.cumprod(torch.tensor(PRIOR_GREEDY[4], dtype=torch.float64), 0).float()
    assert torch.allclose(survival.survivals(), prior)
    for _ in range(200):  # every round verified 7 and all were rejected at position 1
        survival.add(torch.tensor([7, 7]), torch.tensor([0, 0]))
    assert survival.survivals()[0] < 0.1
    survival = LookupSurvival(7, PRIOR_GREEDY[4])
    for _ in range(200):  # position 3 always rejected: positions 4-7 never tested, so they keep their prior
        survival.add(torch.tensor([7]), torch.tensor([2]))
    conditional = survival.survivals()[1:] / survival.survivals()[:-1]
    assert survival.survivals()[1] > prior[1] and conditional[1] < 0.15  # 32 prior rounds against 200
    assert torch.allclose(conditional[3:], torch.tensor(PRIOR_GREEDY[4][4:]), atol=1e-6)


def test_the_planner_verifies_lookup_rows_on_their_own_survivals_and_never_past_their_drafts(tmp_path, monkeypatch):
    planner = _production_planner(tmp_path, monkeypatch)
    rids, context = ["a", "b", "c"], torch.tensor([100, 100, 100])
    hopeless = torch.full((3, 7), -8.0)  # the drafter's head expects nothing to survive
    plan = planner.plan(rids, hopeless, context, lookup_lens=torch.tensor([7, 2, 0]),
                        lookup_matches=torch.tensor([4, 3, 0]))
    lens = plan.verify_lens.tolist()
    assert lens[0] > 0 and 0 < lens[1] <= 2 and lens[2] == 0, lens
    assert plan.survivals[1, 2:].abs().sum() == 0, "no survival past a row's lookup drafts"


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_a_longer_match_is_trusted_further(tmp_path, monkeypatch, greedy):
    """A 4-token match's drafts survived far more often than a 2-token one's on SmolLM2's answers,
    greedy and sampled: the planner values them by their own match length's survivals, and verifies
    more of them at a batch where a verified row costs."""
    planner = _production_planner(tmp_path, monkeypatch)
    rids, context = [f"r{i}" for i in range(16)], torch.full((16,), 300)
    matches = torch.tensor([4] * 8 + [2] * 8)
    plan = planner.plan(rids, torch.full((16, 7), -8.0), context, greedy=torch.full((16,), greedy),
                        lookup_lens=torch.full((16,), 7), lookup_matches=matches)
    assert bool((plan.survivals[:8, 0] > plan.survivals[8:, 0] + 0.2).all())
    assert plan.verify_lens[:8].sum() > plan.verify_lens[8:].sum(), plan.verify_lens.tolist()
    with pytest.raises(ValueError, match="come together"):
        planner.plan(rids, torch.zeros((16, 7)), context, lookup_lens=torch.full((16,), 7))


def test_the_planner_never_verifies_past_a_draft_the_grammar_refuses(tmp_path, monkeypatch):
    planner = _production_planner(tmp_path, monkeypatch)
    rids, context = ["a", "b", "c"], torch.tensor([100, 100, 100])
    certain = torch.full((3, 7), 8.0)  # the head expects every draft to survive
    plan = planner.plan(rids, certain, context, grammar_lens=torch.tensor([7, 2, 0]))
    lens = plan.verify_lens.tolist()
    assert lens[0] > 2 and 0 < lens[1] <= 2 and lens[2] == 0, lens
    refused = planner.plan(rids, certain, context, grammar_lens=torch.zeros(3, dtype=torch.long))
    assert refused.verify_lens.tolist() == [0, 0, 0], "every first draft refused: only the bonus tokens"


def test_lookup_rounds_teach_the_lookup_survivals_and_stay_out_of_the_calibration(tmp_path, monkeypatch):
    planner = _production_planner(tmp_path, monkeypatch)
    rids, context = ["a", "b"], torch.tensor([100, 100])
    plan = planner.plan(rids, torch.zeros((2, 7)), context, greedy=torch.tensor([True, True]),
                        lookup_lens=torch.tensor([7, 0]), lookup_matches=torch.tensor([3, 0]))
    before = {kind: {n: survival.survivals() for n, survival in by_match.items()}
              for kind, by_match in planner.lookup_survival.items()}
    planner.observe_rounds(plan, torch.tensor([0, 3]), greedy=torch.tensor([True, True]))
    assert planner.lookup_survival["greedy"][3].survivals()[0] < before["greedy"][3][0], \
        "the lookup row's rejection at 1 was learnt"
    untouched = [(kind, n) for kind, by_match in planner.lookup_survival.items() for n, survival in by_match.items()
                 if torch.equal(survival.survivals(), before[kind][n])]
    assert len(untouched) == 5, "only the greedy 3-token matches learnt (not sampling, not other match lengths)"
    logits, verify_lens, accepted, greedy = planner._pending_rounds[-1]
    assert logits.shape[0] == 1 and accepted.tolist() == [3], "only the drafter's round waits for the calibration"


def test_a_batch_mixing_lookup_rows_and_sampled_drafter_rows_verifies_each_by_its_own_rule():
    """Request 0 (greedy) verifies its lookup drafts by argmax match; request 1 (T=1) verifies the
    drafter's block by rejection sampling, its draft distribution kept through the merge."""
    from tiny import TINY_VOCAB, make_tiny_drafter, make_tiny_target

    from sglang_dspark.decoding import SamplingParams, sample_block, verify_packed
    from sglang_dspark.engine.worker import DSparkLiveWorker

    worker = DSparkLiveWorker.__new__(DSparkLiveWorker)  # only the drafter is needed to merge blocks
    worker.drafter = make_tiny_drafter(make_tiny_target(), gamma=4, draft_vocab_size=40)
    params = SamplingParams(temperature=torch.tensor([0.0, 1.0]), top_p=torch.ones(2),
                            top_k=torch.zeros(2, dtype=torch.long))
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 4, worker.drafter.config.hidden_size)
    block = sample_block(worker.drafter, hidden, torch.tensor([3]), params.select(torch.tensor([1])), generator)
    lookup = [5, 6, 7, 8]
    merged = worker._with_lookup_drafts(block, torch.tensor([False, True]), [lookup, []], params, width=4)
    assert merged.tokens[0].tolist() == lookup and torch.equal(merged.tokens[1], block.tokens[0])
    assert torch.equal(merged.probs[1], block.probs[0]) and merged.probs_vocab is worker.drafter.d2t
    logits = torch.randn(10, TINY_VOCAB)
    for row, token in enumerate([5, 6, 9]):  # the target agrees with the first two lookup drafts
        logits[row, token] = 100.0
    outcome = verify_packed(merged, logits, torch.tensor([4, 4]), params, generator)
    assert outcome.num_accepted[0] == 2 and outcome.tokens[0, :3].tolist() == [5, 6, 9]


def test_sampled_lookup_rounds_teach_the_sampled_survivals_which_then_value_sampled_rows(tmp_path, monkeypatch):
    planner = _production_planner(tmp_path, monkeypatch)
    rids, context, greedy = ["a", "b"], torch.tensor([100, 100]), torch.tensor([True, False])
    for _ in range(200):  # sampled lookup drafts are rejected at once; greedy ones are not served
        plan = planner.plan(rids, torch.zeros((2, 7)), context, greedy=greedy, lookup_lens=torch.tensor([0, 7]),
                            lookup_matches=torch.tensor([0, 4]))
        planner.observe_rounds(plan, torch.tensor([0, 0]), greedy=greedy)
    assert planner.lookup_survival["sampled"][4].survivals()[0] < 0.2
    assert planner.lookup_survival["greedy"][4].survivals()[0] == pytest.approx(PRIOR_GREEDY[4][0])
    plan = planner.plan(["a", "b"], torch.zeros((2, 7)), context, greedy=torch.tensor([True, False]),
                        lookup_lens=torch.tensor([7, 7]), lookup_matches=torch.tensor([4, 4]))
    assert plan.survivals[0, 0] > plan.survivals[1, 0], "each lookup row takes its own class's survivals"


def _lookup_worker(mode: str, draft_vocab_size: int):
    from tiny import make_tiny_drafter, make_tiny_target

    from sglang_dspark.engine.worker import DSparkLiveWorker

    worker = DSparkLiveWorker.__new__(DSparkLiveWorker)  # only the drafter, settings and lookups are read
    worker.drafter = make_tiny_drafter(make_tiny_target(), gamma=4, draft_vocab_size=draft_vocab_size)
    worker.settings = type("Settings", (), {"lookup": mode})()
    worker.lookups = SlotLookups()
    return worker


@pytest.mark.parametrize("mode", ["on", "greedy"])
def test_sampled_requests_draft_from_their_text_only_inside_the_draft_vocabulary_and_only_when_on(mode):
    from sglang_dspark.decoding import SamplingParams

    worker = _lookup_worker(mode, draft_vocab_size=40)
    inside, outside = worker.drafter.d2t[:4].tolist(), int(torch.isin(torch.arange(50), worker.drafter.d2t).logical_not().nonzero()[0])
    texts = [inside * 3, inside * 3, inside[:2] + [outside] + inside[2:] + inside[:2] + [outside] + inside[2:]]
    for slot, text in enumerate(texts):
        worker.lookups.reset(slot, text[:-1])
    params = SamplingParams(temperature=torch.tensor([0.0, 1.0, 1.0]), top_p=torch.ones(3),
                            top_k=torch.zeros(3, dtype=torch.long))
    bonus = torch.tensor([text[-1] for text in texts])
    committed = torch.tensor([len(text) - 1 for text in texts])
    proposals, lookup_lens, lookup_matches = worker._lookup_proposals(torch.arange(3), bonus, committed, params,
                                                                      width=4)
    assert lookup_lens[0] == 4, "a greedy request drafts from its text in both modes"
    assert lookup_lens[1] == (4 if mode == "on" else 0)
    assert lookup_lens[2] == 0, "a point mass outside the draft vocabulary cannot be a draft distribution"
    assert lookup_matches.tolist() == [4, 4 if mode == "on" else 0, 0], "a match length wherever drafts were kept"


@pytest.mark.parametrize("kernel", [False, True], ids=["torch-rows", "kernel-rows"])
def test_a_sampled_lookup_draft_leaves_the_output_distribution_exactly_the_targets(kernel):
    """Rejection sampling with a point-mass proposal: accept the draft with the target's
    probability of it, else sample the target's distribution without it; the committed token is
    distributed as the target's, whether the draft is likely or not (both target samplers)."""
    from sglang_dspark.decoding import SamplingParams, verify_packed
    from sglang_dspark.kernels_cpu.target_sampling import kernel_sampler

    worker = _lookup_worker("on", draft_vocab_size=40)
    rows, width = 20000, 1
    vocab = int(worker.drafter.d2t.max()) + 1
    logits_row = torch.full((vocab,), -30.0)
    likely, unlikely, other = worker.drafter.d2t[[3, 5, 9]].tolist()
    logits_row[[likely, unlikely, other]] = torch.log(torch.tensor([0.6, 0.1, 0.3]))
    for draft_token, expected in ((likely, 0.6), (unlikely, 0.1)):
        params = SamplingParams(temperature=torch.ones(rows), top_p=torch.ones(rows),
                                top_k=torch.zeros(rows, dtype=torch.long))
        merged = worker._with_lookup_drafts(None, torch.zeros(rows, dtype=torch.bool), [[draft_token]] * rows,
                                            params, width=width)
        logits = logits_row.repeat(rows * (width + 1), 1)
        outcome = verify_packed(merged, logits, torch.full((rows,), width), params, torch.Generator().manual_seed(1),
                                sampler=kernel_sampler if kernel else None)
        first = outcome.tokens[:, 0]
        assert outcome.num_accepted.float().mean().item() == pytest.approx(expected, abs=0.015)
        for token, p in ((likely, 0.6), (unlikely, 0.1), (other, 0.3)):
            assert (first == token).float().mean().item() == pytest.approx(p, abs=0.015), (draft_token, token)


def test_a_step_that_skips_the_drafter_still_verifies_its_lookup_rows_and_teaches_only_their_survivals(
        tmp_path, monkeypatch):
    from sglang_dspark.engine.planning import StepDecision

    planner = _production_planner(tmp_path, monkeypatch)
    assert planner.verifies_lookups_on_skipped_steps
    rids, context, greedy = ["a", "b", "c"], torch.tensor([100, 100, 100]), torch.tensor([True, True, True])
    planner.plan(rids, torch.zeros((3, 7)), context, StepDecision(draft_width=7, capacity=21), greedy=greedy)
    published = len(planner.capacity_planner._history)
    recorded = []
    monkeypatch.setattr(planner.capacity_planner, "record_step", lambda *args: recorded.append(args))
    skip = StepDecision(draft_width=0, capacity=0)
    plan = planner.plan(rids, torch.zeros((3, 7)), context, skip, greedy=greedy, lookup_lens=torch.tensor([0, 7, 0]),
                        lookup_matches=torch.tensor([0, 2, 0]))
    lens = plan.verify_lens.tolist()
    assert lens[0] == 0 and lens[2] == 0 and lens[1] > 0, "only the lookup row verifies: no drafter ran"
    assert plan.confidence_logits is None and plan.survivals[[0, 2]].abs().sum() == 0
    assert len(planner.capacity_planner._history) == published, "no drafter survivals to publish"
    before = planner.lookup_survival["greedy"][2].survivals()
    planner.observe(plan, rids, target_seconds=0.05, step_seconds=0.05, committed_tokens=5, drafted=False)
    planner.observe_rounds(plan, torch.tensor([0, 0, 0]), greedy=greedy)
    assert recorded == [(rids, True, 5, 0.05)], "a lookup-only step speculated: the check weighs it against plain steps"
    assert planner.lookup_survival["greedy"][2].survivals()[0] < before[0]
    assert planner._pending_rounds == [], "no drafter round waits for the calibration"


def test_lookup_rows_verify_past_a_narrow_drafter_width_and_the_drafters_rows_never_do(tmp_path, monkeypatch):
    from sglang_dspark.engine.planning import StepDecision

    from test_engine_units import _draft_folder

    from sglang_dspark.engine.planning import VerifyPlanner
    from sglang_dspark.engine.settings import load_settings

    monkeypatch.setenv("DSPARK_PLANNER", "all")
    planner = VerifyPlanner(load_settings(_draft_folder(tmp_path, block_size=7)))
    assert not planner.verifies_lookups_on_skipped_steps, "fixed:0 and friends skip because they were told to"
    rids, context = ["a", "b"], torch.tensor([100, 100])
    plan = planner.plan(rids, torch.zeros((2, 7)), context, StepDecision(draft_width=3, capacity=None),
                        lookup_lens=torch.tensor([0, 7]), lookup_matches=torch.tensor([0, 4]))
    assert plan.verify_lens.tolist() == [3, 7]


def test_a_narrow_drafter_block_merges_with_full_width_lookup_rows():
    from sglang_dspark.decoding import SamplingParams, sample_block

    worker = _lookup_worker("on", draft_vocab_size=40)
    params = SamplingParams(temperature=torch.tensor([1.0, 1.0]), top_p=torch.ones(2),
                            top_k=torch.zeros(2, dtype=torch.long))
    hidden = torch.randn(1, 2, worker.drafter.config.hidden_size)  # a block of width 2
    block = sample_block(worker.drafter, hidden, torch.tensor([3]), params.select(torch.tensor([0])),
                         torch.Generator().manual_seed(0))
    lookup = worker.drafter.d2t[:4].tolist()
    merged = worker._with_lookup_drafts(block, torch.tensor([True, False]), [[], lookup], params, width=4)
    assert merged.tokens.shape == (2, 4) and merged.tokens[1].tolist() == lookup
    assert torch.equal(merged.tokens[0, :2], block.tokens[0]) and torch.equal(merged.probs[0, :2], block.probs[0])
    assert merged.probs[0, 2:].abs().sum() == 0 and merged.probs[1].sum(-1).tolist() == [1.0] * 4


def test_a_step_that_skipped_the_drafter_merges_sampled_lookup_rows_beside_rows_without_drafts():
    """The drafter walked no row: a sampled request without a lookup holds no draft at all (its
    verify length is 0), the sampled lookup row its point masses. (Served at T=1 this crashed.)"""
    from sglang_dspark.decoding import SamplingParams

    worker = _lookup_worker("on", draft_vocab_size=40)
    params = SamplingParams(temperature=torch.tensor([1.0, 1.0, 0.0]), top_p=torch.ones(3),
                            top_k=torch.zeros(3, dtype=torch.long))
    lookup = worker.drafter.d2t[:4].tolist()
    merged = worker._with_lookup_drafts(None, torch.zeros(3, dtype=torch.bool), [[], lookup, []], params, width=4)
    assert merged.tokens[1].tolist() == lookup
    assert merged.probs[0].abs().sum() == 0 and merged.probs[1].sum(-1).tolist() == [1.0] * 4


def test_lookup_rows_do_not_make_the_drafter_walk_slots_its_own_rows_never_verify(tmp_path, monkeypatch):
    """Served at batch 12-16, a third of the rows carried lookup drafts whose survivals stay
    around 0.3 to the end of the block, while the drafter's own fell to 0.03 by position 5.
    The width the planner walks is valued on the drafter's rows alone: pooled with the lookup
    rows, it walked all 7 slots on every step although none past the 5th was ever verified."""
    from sglang_dspark.engine.planning import StepDecision

    planner = _production_planner(tmp_path, monkeypatch)
    batch = 16
    rids, context = [f"r{i}" for i in range(batch)], torch.full((batch,), 400)
    greedy = torch.ones(batch, dtype=torch.bool)
    drafter_rows = torch.tensor([3.0, -2.0, -4.0, -6.0, -6.0, -6.0, -6.0]).repeat(batch, 1)  # sure of one draft
    lookup_lens = torch.tensor([7] * 6 + [0] * (batch - 6))
    for _ in range(8):
        planner.plan(rids, drafter_rows, context, StepDecision(draft_width=7, capacity=7 * batch), greedy=greedy,
                     lookup_lens=lookup_lens, lookup_matches=torch.where(lookup_lens > 0, 4, 0))
    pool = [row for snapshot in planner.capacity_planner._history for row in snapshot.ids]
    assert pool and all(rid not in pool for rid in rids[:6]), "lookup rows are not drafter rows"
    planner.draft_costs.add(batch, 7, 0.003, 0.007)  # a walk of 1 ms a slot
    decision = planner.decide(rids, context)
    assert decision.draft and decision.draft_width <= 2, decision
