"""The target-sampling kernel serves the distributions `logits_to_probs` gives temperature-only rows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from decoding_stats import FALSE_ALARM_RATE, chi_square_p_value  # noqa: E402

from sglang_dspark.decoding import DraftBlock, SamplingParams, logits_to_probs
from sglang_dspark.kernels_cpu.target_sampling import KernelTargetRows, temperature_sampler


@pytest.mark.parametrize("vocab", [7, 40, 49152])  # one masked chunk, a tail past whole chunks, SmolLM2's
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_probabilities_are_the_tempered_softmax(vocab, temperature):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, vocab, generator=generator) * 4
    logits[1, 3] = float("-inf")  # a masked token has no mass
    rows = torch.tensor([4, 1, 2])
    target = KernelTargetRows(logits, rows, torch.full((3,), temperature))
    tokens = torch.tensor([0, 3, vocab - 1, 2])
    index = torch.tensor([0, 1, 2, 2])
    want = torch.softmax(logits[rows] / temperature, -1)[index, tokens]
    got = target.probs_at(index, tokens)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-9)
    assert got[1] == 0.0


def _draws(target, rejected, draft, count, vocab):
    index = torch.zeros(count, dtype=torch.long)
    tokens = target.sample_final(index, torch.full((count,), rejected), draft, torch.zeros(count, dtype=torch.long),
                                 torch.zeros(count, dtype=torch.long), torch.Generator().manual_seed(3))
    return torch.bincount(tokens, minlength=vocab)


def test_the_bonus_and_the_correction_follow_their_distributions():
    vocab, count = 37, 40_000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(1)) * 2
    target = KernelTargetRows(logits, torch.tensor([0]), torch.tensor([0.8]))
    p = torch.softmax(logits[0] / 0.8, -1).double()
    columns = torch.tensor([1, 5, 6, 20, 33])  # a reduced draft vocabulary
    q = torch.softmax(torch.randn(5, generator=torch.Generator().manual_seed(2)), -1)
    draft = DraftBlock(tokens=torch.zeros(1, 1, dtype=torch.long), probs=q.view(1, 1, 5), confidence_logits=None,
                       probs_vocab=columns)
    assert chi_square_p_value(_draws(target, False, draft, count, vocab), p) > FALSE_ALARM_RATE
    residual = p.clone()
    residual[columns] = (p[columns] - q.double()).clamp_min(0.0)
    residual /= residual.sum()
    counts = _draws(target, True, draft, count, vocab)
    assert chi_square_p_value(counts, residual) > FALSE_ALARM_RATE
    assert chi_square_p_value(counts, p) < FALSE_ALARM_RATE, "the correction is not p_t itself"


def test_rows_with_top_k_or_top_p_are_left_to_torch():
    logits = torch.randn(2, 50)
    rows = torch.arange(2)
    assert temperature_sampler(logits, rows, SamplingParams.uniform(2, 0.9)) is not None
    assert temperature_sampler(logits, rows, SamplingParams.uniform(2, 0.9, top_p=0.95)) is None
    assert temperature_sampler(logits, rows, SamplingParams.uniform(2, 0.9, top_k=20)) is None
    assert temperature_sampler(logits.double(), rows, SamplingParams.uniform(2, 0.9)) is None
    probs = logits_to_probs(logits, SamplingParams.uniform(2, 0.9))  # what the torch path would serve
    kernel = temperature_sampler(logits, rows, SamplingParams.uniform(2, 0.9))
    torch.testing.assert_close(kernel.probs_at(torch.tensor([1]), torch.tensor([7])), probs[1, 7:8], rtol=2e-5, atol=0)
