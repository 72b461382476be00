"""logits_to_probs: temperature, top-k, top-p and greedy, checked against a plain-Python reference."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from sglang_dspark.decoding import SamplingParams, logits_to_probs


def reference_probs(logits: list[float], temperature: float, top_p: float, top_k: int,
                    min_p: float = 0.0) -> list[float]:
    """SGLang's rule written out longhand: rank by tempered probability, keep rank < top_k,
    mass-before <= top_p and probability >= min_p times the largest (all on the full distribution),
    renormalise; T=0 is argmax."""
    if temperature == 0:
        best = max(range(len(logits)), key=lambda i: logits[i])
        return [1.0 if i == best else 0.0 for i in range(len(logits))]
    weights = [math.exp(x / temperature) for x in logits]
    total = sum(weights)
    probs = [w / total for w in weights]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept = [0.0] * len(probs)
    mass_before = 0.0
    for rank, token in enumerate(order):
        within_k = top_k == 0 or rank < top_k
        within_p = top_p >= 1.0 or mass_before <= top_p
        within_min_p = probs[token] >= min_p * probs[order[0]]
        if rank == 0 or (within_k and within_p and within_min_p):
            kept[token] = probs[token]
        mass_before += probs[token]
    total_kept = sum(kept)
    return [p / total_kept for p in kept]


SETTINGS = [
    (1.0, 1.0, 0),
    (0.7, 1.0, 0),
    (0.7, 0.9, 0),
    (1.3, 0.5, 0),
    (1.0, 1.0, 5),
    (0.5, 0.8, 3),
    (2.0, 0.3, 10),
    (0.0, 1.0, 0),
    (0.0, 0.9, 4),
]


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), SETTINGS)
def test_matches_reference_rule(temperature: float, top_p: float, top_k: int) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 40, generator=generator, dtype=torch.float64) * 3
    params = SamplingParams.uniform(16, temperature, top_p, top_k)
    probs = logits_to_probs(logits, params)
    assert probs.dtype == torch.float32
    expected = torch.tensor(
        [reference_probs(row.tolist(), temperature, top_p, top_k) for row in logits], dtype=torch.float32
    )
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("scale", [1.0, 12.0], ids=["flat:full-sort-fallback", "peaked:partial-sort"])
@pytest.mark.parametrize(("temperature", "top_p", "top_k"), [(0.7, 0.9, 0), (1.0, 0.95, 300), (1.0, 1.0, 20)])
def test_large_vocabulary_matches_reference(scale: float, temperature: float, top_p: float, top_k: int) -> None:
    """Vocabularies beyond NUCLEUS_CANDIDATES take the partial-sort path when the kept set is
    small and the full sort otherwise; both must give the reference rule."""
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 2000, generator=generator, dtype=torch.float64) * scale
    probs = logits_to_probs(logits, SamplingParams.uniform(6, temperature, top_p, top_k))
    expected = torch.tensor(
        [reference_probs(row.tolist(), temperature, top_p, top_k) for row in logits], dtype=torch.float32
    )
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=1e-4)


MIN_P_SETTINGS = [(1.0, 1.0, 0, 0.1), (0.7, 0.9, 0, 0.05), (1.3, 1.0, 5, 0.2), (2.0, 0.95, 0, 0.5),
                  (1.0, 1.0, 0, 0.001), (0.0, 1.0, 0, 0.3)]


@pytest.mark.parametrize(("temperature", "top_p", "top_k", "min_p"), MIN_P_SETTINGS)
def test_min_p_matches_reference_rule(temperature: float, top_p: float, top_k: int, min_p: float) -> None:
    logits = torch.randn(16, 40, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3
    probs = logits_to_probs(logits, SamplingParams.uniform(16, temperature, top_p, top_k, min_p=min_p))
    expected = torch.tensor(
        [reference_probs(row.tolist(), temperature, top_p, top_k, min_p) for row in logits], dtype=torch.float32
    )
    assert torch.equal(probs > 0, expected > 0), "the kept sets differ"
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=1e-5)


def test_min_p_one_keeps_only_the_most_likely_token_and_mixed_rows_keep_their_own() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4)) * 2
    params = SamplingParams(temperature=torch.ones(3), top_p=torch.ones(3), top_k=torch.zeros(3, dtype=torch.long),
                            min_p=torch.tensor([1.0, 0.0, 0.2]))
    probs = logits_to_probs(logits, params)
    torch.testing.assert_close(probs[0], torch.nn.functional.one_hot(logits[0].argmax(), 50).float())
    torch.testing.assert_close(probs[1], torch.softmax(logits[1], -1))
    alone = logits_to_probs(logits[2:], SamplingParams.uniform(1, 1.0, min_p=0.2))
    torch.testing.assert_close(probs[2:], alone)
    assert 1 < int((probs[2] > 0).sum()) < 50


def test_nucleus_keeps_the_token_that_crosses_top_p() -> None:
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()
    probs = logits_to_probs(logits, SamplingParams.uniform(1, 1.0, top_p=0.7))
    torch.testing.assert_close(probs, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))


def test_mixed_rows_each_follow_their_own_params() -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(len(SETTINGS), 3, 50, generator=generator)
    params = SamplingParams(
        temperature=torch.tensor([s[0] for s in SETTINGS]),
        top_p=torch.tensor([s[1] for s in SETTINGS]),
        top_k=torch.tensor([s[2] for s in SETTINGS]),
    )
    probs = logits_to_probs(logits, params)
    for row, (temperature, top_p, top_k) in enumerate(SETTINGS):
        alone = logits_to_probs(logits[row : row + 1], SamplingParams.uniform(1, temperature, top_p, top_k))
        torch.testing.assert_close(probs[row : row + 1], alone)
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(SETTINGS), 3))


def test_greedy_is_one_hot_on_argmax() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0], [5.0, 4.9, 0.0]])
    probs = logits_to_probs(logits, SamplingParams.uniform(2, temperature=0.0))
    torch.testing.assert_close(probs, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": torch.tensor([-0.5]), "top_p": torch.tensor([1.0]), "top_k": torch.tensor([0])}, "temperature"),
        ({"temperature": torch.tensor([1.0]), "top_p": torch.tensor([0.0]), "top_k": torch.tensor([0])}, "top_p"),
        ({"temperature": torch.tensor([1.0]), "top_p": torch.tensor([1.0]), "top_k": torch.tensor([-1])}, "top_k"),
        ({"temperature": torch.tensor([1.0, 1.0]), "top_p": torch.tensor([1.0]), "top_k": torch.tensor([0])}, "one entry per request"),
        ({"temperature": torch.tensor([1.0]), "top_p": torch.tensor([1.0]), "top_k": torch.tensor([0]),
          "min_p": torch.tensor([1.5])}, "min_p"),
    ],
)
def test_bad_params_fail_with_a_clear_message(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_batch_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="2 rows but logits have batch size 3"):
        logits_to_probs(torch.zeros(3, 5), SamplingParams.uniform(2))


def test_importing_decoding_does_not_import_sglang() -> None:
    code = "import sys, sglang_dspark.decoding; assert 'sglang' not in sys.modules, 'sglang imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sample_from_probs_follows_the_distribution_and_never_draws_zeros() -> None:
    from decoding_stats import FALSE_ALARM_RATE, chi_square_p_value

    from sglang_dspark.decoding.sampling import sample_from_probs

    weights = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0, 0.0])
    rows = weights.expand(20_000, -1) * 3.0  # unnormalised rows are fine
    draws = sample_from_probs(rows, torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=len(weights))
    assert int(counts[weights == 0].sum()) == 0
    assert chi_square_p_value(counts, weights) > FALSE_ALARM_RATE
    one_hot = torch.zeros(3, 9)
    one_hot[torch.arange(3), torch.tensor([0, 4, 8])] = 1.0
    assert sample_from_probs(one_hot, None).tolist() == [0, 4, 8]
