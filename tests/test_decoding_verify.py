"""verify and sample_block: exact greedy behaviour, ragged lengths, and statistical losslessness.

The losslessness test simulates many independent speculative decodes of a bigram (Markov)
target with a bigram drafter, through the real ``sample_block`` walk and ``verify``, over
several rounds with random verify lengths, and compares the joint distribution of the first
three committed tokens with the target's exact one. The same test must reject two deliberately
broken rules, which shows it has the power to catch a real bug.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from decoding_stats import FALSE_ALARM_RATE, chi_square_p_value, total_variation  # noqa: E402

from sglang_dspark.decoding import DraftBlock, SamplingParams, logits_to_probs, sample_block, verify, verify_greedy
from sglang_dspark.decoding import verification
from sglang_dspark.decoding.verification import LIST_WALK_MAX_ROWS, NO_TOKEN


def greedy_block(tokens: list[list[int]]) -> DraftBlock:
    drafts = torch.tensor(tokens)
    return DraftBlock(tokens=drafts, probs=None, confidence_logits=torch.zeros(drafts.shape))


def logits_with_argmax(argmax: list[list[int]], vocab: int) -> torch.Tensor:
    logits = torch.zeros(len(argmax), len(argmax[0]), vocab)
    for row, tokens in enumerate(argmax):
        for slot, token in enumerate(tokens):
            logits[row, slot, token] = 5.0
    return logits


def test_greedy_accepts_the_matching_prefix_then_emits_the_target_argmax() -> None:
    block = greedy_block([[3, 4, 5], [3, 4, 5], [3, 4, 5], [1, 1, 1]])
    logits = logits_with_argmax([[3, 4, 6, 7], [3, 4, 5, 7], [3, 4, 5, 7], [2, 1, 1, 1]], vocab=8)
    result = verify(block, logits, torch.tensor([3, 3, 1, 3]), SamplingParams.uniform(4, 0.0))
    assert result.num_accepted.tolist() == [2, 3, 1, 0]
    assert result.tokens.tolist() == [
        [3, 4, 6, NO_TOKEN],  # mismatch at slot 2 -> target's argmax there
        [3, 4, 5, 7],  # all accepted -> bonus from slot 3
        [3, 4, NO_TOKEN, NO_TOKEN],  # capped at 1 draft -> bonus from slot 1
        [2, NO_TOKEN, NO_TOKEN, NO_TOKEN],
    ]


@pytest.mark.parametrize("batch", [32, 2 * LIST_WALK_MAX_ROWS], ids=["list-walk", "tensor-ops"])
def test_greedy_verification_from_argmax_ids_alone_equals_verification_from_logits(batch: int) -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(batch, 5, 6, generator=generator)
    drafts = torch.randint(0, 6, (batch, 7), generator=generator)
    drafts[: batch // 2, :4] = logits[: batch // 2, :4].argmax(-1)  # half the rows accept some drafts
    verify_lens = torch.randint(0, 5, (batch,), generator=generator)
    want = verify(greedy_block(drafts.tolist()), logits, verify_lens, SamplingParams.uniform(batch, 0.0))
    got = verify_greedy(drafts, logits.argmax(-1), verify_lens)
    assert torch.equal(got.num_accepted, want.num_accepted) and torch.equal(got.tokens, want.tokens)
    assert int(want.num_accepted.max()) >= 2, "the comparison must cover accepted runs, not just rejections"
    given = verify(greedy_block(drafts.tolist()), logits, verify_lens, SamplingParams.uniform(batch, 0.0),
                   target_argmax=logits.argmax(-1))
    assert torch.equal(given.tokens, want.tokens)
    with pytest.raises(ValueError, match="verify_lens must be in 0..4"):
        verify_greedy(drafts, logits.argmax(-1), torch.full((batch,), 5))
    # a one-token step (every row verifies its bonus position only) takes the target's choices
    one = verify(greedy_block(drafts[:, :1].tolist()), logits[:, :1], torch.zeros(batch, dtype=torch.long),
                 SamplingParams.uniform(batch, 0.0))
    got = verify_greedy(drafts[:, :0], logits[:, :1].argmax(-1), torch.zeros(batch, dtype=torch.long))
    assert torch.equal(got.num_accepted, one.num_accepted) and torch.equal(got.tokens, one.tokens)
    with pytest.raises(ValueError, match="verify_lens must be in 0..0"):
        verify_greedy(drafts[:, :0], logits[:, :1].argmax(-1), torch.ones(batch, dtype=torch.long))


def test_zero_drafts_just_samples_the_bonus_at_slot_zero() -> None:
    block = greedy_block([[3, 4]])
    logits = logits_with_argmax([[6]], vocab=8)  # only the anchor's slot was computed
    result = verify(block, logits, torch.tensor([0]), SamplingParams.uniform(1, 0.0))
    assert result.num_accepted.tolist() == [0] and result.tokens.tolist() == [[6]]


def test_sampled_row_with_identical_distributions_accepts_everything() -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 4, 10, generator=generator)
    params = SamplingParams.uniform(5, 1.0)
    draft_probs = logits_to_probs(logits[:, :3], params)
    drafts = torch.multinomial(draft_probs.reshape(-1, 10), 1, generator=generator).reshape(5, 3)
    block = DraftBlock(drafts, draft_probs, torch.zeros(5, 3))
    result = verify(block, logits, torch.tensor([3, 3, 2, 1, 0]), params, generator)
    assert result.num_accepted.tolist() == [3, 3, 2, 1, 0]
    for row, length in enumerate([3, 3, 2, 1, 0]):
        assert result.tokens[row, :length].tolist() == drafts[row, :length].tolist()
        assert int(result.tokens[row, length]) >= 0  # the bonus


def test_mixed_greedy_and_sampled_rows_in_one_batch() -> None:
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 4, 12, generator=generator)
    greedy_drafts = logits[0, :3].argmax(-1)  # the greedy row's drafts all match
    params = SamplingParams(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0]), torch.tensor([0, 0]))
    probs = logits_to_probs(logits[:, :3], params)
    sampled_drafts = torch.multinomial(probs[1], 1, generator=generator).squeeze(-1)
    block = DraftBlock(torch.stack([greedy_drafts, sampled_drafts]), probs, torch.zeros(2, 3))
    result = verify(block, logits, torch.tensor([3, 3]), params, generator)
    assert result.num_accepted[0] == 3
    assert result.tokens[0].tolist() == greedy_drafts.tolist() + [int(logits[0, 3].argmax())]
    committed = result.tokens[1, : int(result.num_accepted[1]) + 1]
    assert bool((committed >= 0).all()) and bool((result.tokens[1, len(committed):] == NO_TOKEN).all())


def test_verify_rejects_inconsistent_shapes() -> None:
    block = greedy_block([[1, 2]])
    with pytest.raises(ValueError, match="verify_lens must be in 0..1"):
        verify(block, torch.zeros(1, 2, 4), torch.tensor([2]), SamplingParams.uniform(1, 0.0))
    with pytest.raises(ValueError, match="1..gamma\\+1"):
        verify(block, torch.zeros(1, 4, 4), torch.tensor([1]), SamplingParams.uniform(1, 0.0))
    with pytest.raises(ValueError, match="need draft.probs"):
        verify(block, torch.zeros(1, 3, 4), torch.tensor([1]), SamplingParams.uniform(1, 1.0))


# --- the Markov walk ------------------------------------------------------------------------


class BigramDrafter:
    """A drafter whose block distribution is a fixed bigram chain: base logits are zero and the
    Markov bias is the row of ``table`` for the previous (target) token. ``d2t`` optionally
    restricts drafts to a subset of the target vocabulary."""

    def __init__(self, table: torch.Tensor, d2t: torch.Tensor | None, target_vocab: int) -> None:
        self.table = table  # [V_target, V_draft]
        self.d2t = d2t
        self.has_confidence_head = True
        self.config = SimpleNamespace(vocab_size=target_vocab)

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.new_zeros(hidden.shape[0], hidden.shape[1], self.table.shape[1])

    def markov_bias(self, prev: torch.Tensor, hidden: torch.Tensor, state: object) -> tuple[torch.Tensor, object]:
        return self.table[prev], state

    def confidence_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        return prev.float()  # lets the test see which previous token each slot was scored with


def test_walk_conditions_each_slot_on_the_previous_draft() -> None:
    table = torch.full((6, 6), -30.0)
    for token in range(6):
        table[token, (token + 2) % 6] = 30.0  # deterministic successor: token + 2
    drafter = BigramDrafter(table, None, 6)
    block = sample_block(drafter, torch.zeros(2, 4, 1), torch.tensor([0, 3]), SamplingParams.uniform(2, 0.0))
    assert block.tokens.tolist() == [[2, 4, 0, 2], [5, 1, 3, 5]]
    assert block.probs is None
    assert block.confidence_logits.tolist() == [[0, 2, 4, 0], [3, 5, 1, 3]]


def test_walk_maps_a_reduced_draft_vocabulary_to_target_ids() -> None:
    d2t = torch.tensor([1, 4, 5])
    table = torch.zeros(7, 3)
    table[:, 2] = 40.0  # always draft id 2 = target id 5
    block = sample_block(BigramDrafter(table, d2t, 7), torch.zeros(3, 2, 1), torch.tensor([0, 1, 6]),
                         SamplingParams.uniform(3, 1.0), torch.Generator().manual_seed(0))
    assert block.tokens.tolist() == [[5, 5]] * 3
    assert block.probs.shape == (3, 2, 3) and block.probs_vocab.tolist() == [1, 4, 5], "kept in the draft vocabulary"
    dense = block.dense_probs(torch.tensor([0, 2]), torch.tensor([1, 0]), 7)
    outside = torch.tensor([0, 2, 3, 6])
    assert dense.shape == (2, 7) and float(dense[:, outside].abs().max()) == 0.0
    torch.testing.assert_close(dense.sum(-1), torch.ones(2))
    assert block.token_probs(torch.tensor([1]), torch.tensor([1])).item() == pytest.approx(1.0)


# --- statistical losslessness --------------------------------------------------------------

VOCAB = 6
GAMMA = 4
TOKENS_CHECKED = 3
SAMPLES = 20_000
ANCHOR = 0


def simulate(
    target_table: torch.Tensor,
    drafter: BigramDrafter,
    params_one: tuple[float, float, int],
    seed: int,
    sampler=None,
) -> torch.Tensor:
    """Counts ``[V]*TOKENS_CHECKED`` of the first committed tokens over SAMPLES decodes (the
    target's distributions served by `sampler` when given, see `verify_packed`)."""
    generator = torch.Generator().manual_seed(seed)
    params = SamplingParams.uniform(SAMPLES, *params_one)
    committed = torch.full((SAMPLES, TOKENS_CHECKED + GAMMA + 1), NO_TOKEN)
    filled = torch.zeros(SAMPLES, dtype=torch.long)
    anchors = torch.full((SAMPLES,), ANCHOR)
    rows = torch.arange(SAMPLES)
    while bool((filled < TOKENS_CHECKED).any()):
        block = sample_block(drafter, torch.zeros(SAMPLES, GAMMA, 1), anchors, params, generator)
        verify_lens = torch.randint(0, GAMMA + 1, (SAMPLES,), generator=generator)  # blind to drafts
        conditioning = torch.cat([anchors.unsqueeze(1), block.tokens], dim=1)
        result = verify(block, target_table[conditioning], verify_lens, params, generator, sampler=sampler)
        new = result.num_accepted + 1
        slot = torch.arange(GAMMA + 1).unsqueeze(0)
        positions = (filled.unsqueeze(1) + slot).clamp(max=committed.shape[1] - 1)
        write = slot < new.unsqueeze(1)
        committed[rows.unsqueeze(1).expand_as(positions)[write], positions[write]] = result.tokens[write]
        filled += new
        anchors = result.tokens[rows, result.num_accepted]
    first = committed[:, :TOKENS_CHECKED]
    flat_index = (first * torch.tensor([VOCAB**2, VOCAB, 1])).sum(-1)
    return torch.bincount(flat_index, minlength=VOCAB**TOKENS_CHECKED).reshape([VOCAB] * TOKENS_CHECKED)


def exact_joint(target_table: torch.Tensor, params_one: tuple[float, float, int]) -> torch.Tensor:
    """P(y1, y2, y3) of the target chain from ANCHOR, by enumeration."""
    step = logits_to_probs(target_table, SamplingParams.uniform(VOCAB, *params_one)).double()  # [prev, next]
    first = step[ANCHOR]
    return first[:, None, None] * step[:, :, None] * step[None, :, :]


def tables(reduced_draft_vocab: bool) -> tuple[torch.Tensor, BigramDrafter]:
    generator = torch.Generator().manual_seed(11)
    target = torch.randn(VOCAB, VOCAB, generator=generator) * 1.5
    draft_full = 0.6 * target + torch.randn(VOCAB, VOCAB, generator=generator)
    if not reduced_draft_vocab:
        return target, BigramDrafter(draft_full, None, VOCAB)
    d2t = torch.tensor([0, 2, 3, 5])
    return target, BigramDrafter(draft_full[:, d2t], d2t, VOCAB)


LOSSLESS_CASES = {
    "T=1": ((1.0, 1.0, 0), False),
    "T=0.7,top_p=0.9": ((0.7, 0.9, 0), False),
    "T=1,top_k=3,reduced_draft_vocab": ((1.0, 1.0, 3), True),
}


@pytest.mark.parametrize("case", list(LOSSLESS_CASES))
def test_rejection_sampling_is_lossless(case: str) -> None:
    params_one, reduced = LOSSLESS_CASES[case]
    target, drafter = tables(reduced)
    counts = simulate(target, drafter, params_one, seed=5)
    expected = exact_joint(target, params_one)
    p_value = chi_square_p_value(counts, expected)
    assert p_value > FALSE_ALARM_RATE, (
        f"{case}: first {TOKENS_CHECKED} tokens deviate from the target (chi-square p={p_value:.2e}, "
        f"TV={total_variation(counts, expected):.4f})"
    )


def correction_from_target_only(target_probs, rejected, draft_probs):
    """Broken: on rejection, resample from p_t instead of norm(max(0, p_t - p_d))."""
    return target_probs


def bonus_from_draft(target_probs, rejected, draft_probs):
    """Broken: after a fully accepted window, draw the bonus from p_d instead of p_t."""
    every = draft_probs(torch.arange(len(target_probs)))
    residual = (target_probs - every).clamp_min(0.0)
    residual = residual / residual.sum(-1, keepdim=True).clamp_min(1e-8)
    return torch.where(rejected.unsqueeze(-1), residual, every)


@pytest.mark.parametrize("broken_rule", [correction_from_target_only, bonus_from_draft])
@pytest.mark.parametrize("case", ["T=1", "T=0.7,top_p=0.9"])
def test_the_same_test_catches_a_broken_rule(monkeypatch: pytest.MonkeyPatch, broken_rule, case: str) -> None:
    monkeypatch.setattr(verification, "_final_distributions", broken_rule)
    params_one, reduced = LOSSLESS_CASES[case]
    target, drafter = tables(reduced)
    counts = simulate(target, drafter, params_one, seed=5)
    p_value = chi_square_p_value(counts, exact_joint(target, params_one))
    assert p_value < FALSE_ALARM_RATE, f"{broken_rule.__name__} went unnoticed (p={p_value:.3f})"


KERNEL_CASES = {"T=0.7,reduced_draft_vocab": ((0.7, 1.0, 0), True)} | LOSSLESS_CASES


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_rejection_sampling_is_lossless_with_the_target_sampling_kernel(case: str) -> None:
    """The served sampler (`kernels_cpu.target_sampling`) in place of the materialised softmax,
    top-k and top-p included."""
    from sglang_dspark.kernels_cpu.target_sampling import kernel_sampler

    params_one, reduced = KERNEL_CASES[case]
    target, drafter = tables(reduced)
    used = []

    def sampler(logits, rows, params):
        used.append(kernel_sampler(logits, rows, params))
        return used[-1]

    counts = simulate(target, drafter, params_one, seed=7, sampler=sampler)
    assert used and all(rows is not None for rows in used), "the kernel served every step"
    expected = exact_joint(target, params_one)
    p_value = chi_square_p_value(counts, expected)
    assert p_value > FALSE_ALARM_RATE, f"{case}: chi-square p={p_value:.2e}, TV={total_variation(counts, expected):.4f}"
