"""Verify-window penalties against SGLang's penalizers applied one decode step at a time."""

from __future__ import annotations

import pytest
import torch

from sglang_dspark.decoding.penalties import Penalties, penalise_window


def stepwise_reference(logits: torch.Tensor, outputs: list[int], drafts: list[int], penalties: Penalties) -> torch.Tensor:
    """What plain decoding computes for each row: SGLang's penalizer state after the outputs so
    far (frequency scatter-added per token, presence and repetition scattered), additive first,
    then scaling."""
    rows = []
    for j, row in enumerate(logits):
        frequency = torch.zeros(row.numel())
        presence = torch.zeros(row.numel())
        repetition = torch.ones(row.numel())
        for token in outputs + drafts[:j]:
            frequency[token] += penalties.frequency
            presence[token] = penalties.presence
            repetition[token] = penalties.repetition
        row = row + (-frequency - presence)
        rows.append(torch.where(row < 0, row * repetition, row / repetition))
    return torch.stack(rows)


@pytest.mark.parametrize("penalties", [Penalties(frequency=0.5), Penalties(presence=1.5), Penalties(repetition=1.3),
                                       Penalties(frequency=0.3, presence=-0.4, repetition=0.8)],
                         ids=["frequency", "presence", "repetition", "all three"])
def test_each_row_is_penalised_as_its_own_decode_step(penalties):
    vocab = 30
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(1)) * 3
    outputs, drafts = [3, 7, 3, 11], [7, 7, 20, 3]  # drafts repeat earlier outputs and each other
    want = stepwise_reference(logits, outputs, drafts, penalties)
    got = logits.clone()
    penalise_window(got, torch.tensor(outputs), torch.tensor(drafts), penalties)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    untouched = [t for t in range(vocab) if t not in outputs + drafts]
    assert torch.equal(got[:, untouched], logits[:, untouched]), "tokens never output must keep their logits"


def test_a_window_of_only_the_bonus_is_one_decode_step():
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(2))
    got = logits.clone()
    penalise_window(got, torch.tensor([4, 4]), torch.tensor([], dtype=torch.long), Penalties(frequency=1.0))
    want = logits.clone()
    want[0, 4] -= 2.0
    torch.testing.assert_close(got, want)


def test_a_penalty_steers_greedy_choice_away_from_repeats():
    logits = torch.tensor([[5.0, 4.0, 0.0]] * 2)
    penalise_window(logits, torch.tensor([0]), torch.tensor([1]), Penalties(presence=6.0))
    assert logits.argmax(-1).tolist() == [1, 2]


def test_bad_input_is_refused_with_what_was_expected():
    with pytest.raises(ValueError, match="repetition penalty must be > 0"):
        Penalties(repetition=0.0)
    with pytest.raises(ValueError, match="verifies 2 drafts, got 1"):
        penalise_window(torch.zeros(3, 5), torch.tensor([1]), torch.tensor([2]), Penalties(frequency=1.0))
