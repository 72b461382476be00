"""The target-sampling kernel serves the distributions `logits_to_probs` gives sampled rows
(temperature, top-k, top-p)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from decoding_stats import FALSE_ALARM_RATE, chi_square_p_value  # noqa: E402

from sglang_dspark.decoding import DraftBlock, SamplingParams, logits_to_probs
from sglang_dspark.kernels_cpu.target_sampling import KernelTargetRows, kernel_sampler


@pytest.mark.parametrize("vocab", [7, 40, 49152])  # one masked chunk, a tail past whole chunks, SmolLM2's
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_probabilities_are_the_tempered_softmax(vocab, temperature):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, vocab, generator=generator) * 4
    logits[1, 3] = float("-inf")  # a masked token has no mass
    rows = torch.tensor([4, 1, 2])
    target = KernelTargetRows(logits, rows, SamplingParams.uniform(3, temperature))
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
    target = KernelTargetRows(logits, torch.tensor([0]), SamplingParams.uniform(1, 0.8))
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


def test_only_float32_cpu_logits_of_sampled_rows_take_the_kernel():
    logits = torch.randn(2, 50)
    rows = torch.arange(2)
    assert kernel_sampler(logits, rows, SamplingParams.uniform(2, 0.9, top_p=0.95, top_k=20)) is not None
    assert kernel_sampler(logits.double(), rows, SamplingParams.uniform(2, 0.9)) is None
    assert kernel_sampler(logits, rows, SamplingParams.uniform(2, 0.0)) is None


NUCLEUS = SamplingParams(  # temperature only, top-p, top-k, both, top-k past the vocabulary, top-k 1, tight top-p
    temperature=torch.tensor([0.9, 1.0, 0.7, 1.3, 1.0, 1.0, 0.5]),
    top_p=torch.tensor([1.0, 0.9, 1.0, 0.8, 1.0, 1.0, 0.05]),
    top_k=torch.tensor([0, 0, 20, 50, 10**6, 1, 0]),
)


@pytest.mark.parametrize("vocab", [40, 49152])
def test_top_k_and_top_p_rows_read_logits_to_probs_distribution(vocab):
    """Every column's probability (so the kept set too) is `logits_to_probs`'s."""
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(4)) * 3
    target = KernelTargetRows(logits, torch.arange(7), NUCLEUS)
    want = logits_to_probs(logits, NUCLEUS)
    index = torch.arange(7).repeat_interleave(vocab)
    got = target.probs_at(index, torch.arange(vocab).repeat(7)).view(7, vocab)
    assert torch.equal(got > 0, want > 0), "the kept sets differ"
    torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-9)
    assert int((got[5] > 0).sum()) == 1 and 1 < int((got[2] > 0).sum()) <= 20


MIN_P = SamplingParams(  # min-p alone, with top-p, with top-k, min-p 1, a min-p under the first floor (1e-3)
    temperature=torch.tensor([1.0, 0.8, 1.2, 1.0, 1.0]),
    top_p=torch.tensor([1.0, 0.9, 1.0, 1.0, 1.0]),
    top_k=torch.tensor([0, 0, 30, 0, 0]),
    min_p=torch.tensor([0.05, 0.1, 0.01, 1.0, 1e-5]),
)


@pytest.mark.parametrize("vocab", [40, 49152])
def test_min_p_rows_read_logits_to_probs_distribution(vocab):
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(7)) * 3
    target = KernelTargetRows(logits, torch.arange(5), MIN_P)
    want = logits_to_probs(logits, MIN_P)
    got = target.probs_at(torch.arange(5).repeat_interleave(vocab), torch.arange(vocab).repeat(5)).view(5, vocab)
    assert torch.equal(got > 0, want > 0), "the kept sets differ"
    torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-9)
    assert int((got[3] > 0).sum()) == 1 and int((got[4] > 0).sum()) > int((got[0] > 0).sum()) > 1


def test_a_nucleus_reaching_into_the_light_tail_keeps_every_column_it_should():
    """A peaked row whose top-p set takes columns under a thousandth of the heaviest one (the kernel
    sorts only the heavy columns first, then widens)."""
    logits = torch.randn(1, 4096, generator=torch.Generator().manual_seed(5)) * 0.1
    logits[0, 17] = 9.0  # ~0.8 of the mass; the rest spread over 4,095 light columns
    params = SamplingParams.uniform(1, 1.0, top_p=0.9)
    want = logits_to_probs(logits, params)[0]
    assert float(want[17]) < 0.9 and int((want > 0).sum()) > 100
    got = KernelTargetRows(logits, torch.tensor([0]), params).probs_at(torch.zeros(4096, dtype=torch.long),
                                                                       torch.arange(4096))
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-9)


def test_ties_at_the_edge_of_top_k_keep_the_lowest_columns():
    """Exactly k columns, as argmax picks the first of equal maxima (so top-k 1 is greedy)."""
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0] + [-5.0] * 34])
    target = KernelTargetRows(logits, torch.tensor([0]), SamplingParams.uniform(1, 1.0, top_k=2))
    got = target.probs_at(torch.zeros(6, dtype=torch.long), torch.arange(6))
    assert got.tolist() == [0.0, 0.5, 0.0, 0.5, 0.0, 0.0]
    greedy = KernelTargetRows(logits, torch.tensor([0]), SamplingParams.uniform(1, 1.0, top_k=1))
    assert greedy.probs_at(torch.zeros(1, dtype=torch.long), torch.tensor([1])).tolist() == [1.0]


def test_top_p_bonus_and_correction_draws_stay_in_the_kept_set():
    vocab, count = 37, 40_000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(6)) * 2
    params = SamplingParams.uniform(1, 1.0, top_p=0.7)
    target = KernelTargetRows(logits, torch.tensor([0]), params)
    p = logits_to_probs(logits, params)[0].double()
    columns = torch.tensor([int(p.argmax()), int(p.argmin())])  # one kept column, one dropped
    q = torch.tensor([0.3, 0.7])
    draft = DraftBlock(tokens=torch.zeros(1, 1, dtype=torch.long), probs=q.view(1, 1, 2), confidence_logits=None,
                       probs_vocab=columns)
    bonus = _draws(target, False, draft, count, vocab)
    assert int(bonus[p == 0].sum()) == 0 and chi_square_p_value(bonus[p > 0], p[p > 0]) > FALSE_ALARM_RATE
    residual = p.clone()
    residual[columns] = (p[columns] - q.double()).clamp_min(0.0)
    residual /= residual.sum()
    corrected = _draws(target, True, draft, count, vocab)
    assert int(corrected[residual == 0].sum()) == 0
    assert chi_square_p_value(corrected[residual > 0], residual[residual > 0]) > FALSE_ALARM_RATE
