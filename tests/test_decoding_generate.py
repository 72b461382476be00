"""The reference speculative decoder over a tiny random Llama target.

Greedy: the speculative output must equal the target's own greedy decode token for token. A
random drafter almost never gets a draft accepted, which would leave the interesting paths
(partial acceptance, holes in the batched target cache, ragged drafter context) untested, so
most checks use an *oracle* drafter: the real tiny DSparkDrafter runs its backbone and caches
as usual, but its Markov bias is replaced by a strong push towards the target's true greedy
continuation, wrong at a pseudo-random third of the slots. Drafts are then accepted in runs of
varying length, different per prompt and round.

Sampling: the first two generated tokens are compared with the target's exact distribution,
computed by enumerating the target.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from decoding_stats import FALSE_ALARM_RATE, chi_square_p_value, total_variation  # noqa: E402
from tiny import TINY_VOCAB, make_tiny_drafter, make_tiny_target  # noqa: E402

from sglang_dspark.decoding import SamplingParams, generate, logits_to_probs, verification

PROMPTS = [[1, 5, 9, 33, 7], [1, 7], [1, 100, 200, 300, 400, 17, 18, 19, 20]]
MAX_NEW = 14


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return make_tiny_target(seed=0, dtype=torch.float64)


def greedy_reference(target: torch.nn.Module, prompt: list[int], count: int) -> list[int]:
    """The target's own greedy continuation, recomputed from scratch each token (no cache)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(count):
            next_id = target(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


class OracleDrafter:
    """A real drafter whose Markov bias pushes slot k towards the target's greedy token at that
    position (``strength``), except at a pseudo-random third of (row, position, slot)."""

    def __init__(self, drafter: torch.nn.Module, sequences: list[list[int]], strength: float) -> None:
        self.inner, self.sequences, self.strength = drafter, sequences, strength
        self.rows: list[int] = []
        self.positions: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def forward_block(self, cache, slots, anchors):
        self.rows = slots.tolist()
        self.positions = cache.lengths[slots].tolist()
        return self.inner.forward_block(cache, slots, anchors)

    def markov_bias(self, prev, hidden, state):
        slot = 0 if state is None else state
        vocab = self.inner.config.vocab_size
        bias = torch.zeros(len(self.rows), vocab, dtype=hidden.dtype)
        for index, (row, position) in enumerate(zip(self.rows, self.positions)):
            wanted = position + slot + 1
            sequence = self.sequences[row]
            if wanted < len(sequence):
                token = sequence[wanted]
                if (row * 7 + wanted * 13 + slot * 5) % 3 == 0:
                    token = (token + 1) % vocab
                bias[index, token] = self.strength
        return bias, slot + 1


MAX_GAMMA = 8


@pytest.fixture(scope="module")
def greedy_sequences(target) -> list[list[int]]:
    """Each prompt followed by the target's greedy continuation, long enough for any oracle."""
    return [p + greedy_reference(target, p, MAX_NEW + MAX_GAMMA + 1) for p in PROMPTS]


@pytest.fixture(scope="module")
def expected_greedy(greedy_sequences) -> list[list[int]]:
    return [s[len(p): len(p) + MAX_NEW] for p, s in zip(PROMPTS, greedy_sequences)]


def oracle_for(target, greedy_sequences, gamma: int) -> OracleDrafter:
    return OracleDrafter(make_tiny_drafter(target, gamma=gamma), greedy_sequences, strength=1e3)


@pytest.mark.parametrize("gamma", range(1, 9))
def test_greedy_equals_target_greedy_for_every_gamma(target, greedy_sequences, expected_greedy, gamma: int) -> None:
    drafter = oracle_for(target, greedy_sequences, gamma)
    out = generate(target, drafter, PROMPTS, MAX_NEW, temperature=0.0)
    assert out.tokens == expected_greedy
    accepted = [a for r in out.rounds for a in r.accepted]
    assert max(accepted) >= min(gamma, 2) and min(accepted) == 0, "oracle should give mixed acceptance"
    assert all(sum(r.committed[r.prompts.index(p)] for r in out.rounds if p in r.prompts) + 1 == MAX_NEW
               for p in range(len(PROMPTS)))


CAPS = {
    "fixed_cap": 2,
    "zero_drafts": 0,
    "per_round": [3, 0, 5, 1, 6, 2] * 10,
    "per_prompt": [[6, 1, 3]] * 30,
    "callable": lambda round_index, conf: [(round_index + p) % 7 for p in range(len(PROMPTS))],
}


@pytest.mark.parametrize("cap", list(CAPS))
def test_greedy_equals_target_greedy_under_capped_verify_lengths(
    target, greedy_sequences, expected_greedy, cap: str
) -> None:
    drafter = oracle_for(target, greedy_sequences, gamma=6)
    out = generate(target, drafter, PROMPTS, MAX_NEW, temperature=0.0, verify_lengths=CAPS[cap])
    assert out.tokens == expected_greedy
    for round_stats in out.rounds:
        assert all(a <= d for a, d in zip(round_stats.accepted, round_stats.drafted))
    if cap == "zero_drafts":
        assert all(d == 0 for r in out.rounds for d in r.drafted)


def test_real_random_drafter_greedy_also_matches(target, expected_greedy) -> None:
    drafter = make_tiny_drafter(target, gamma=5, markov_head_type="rnn")
    out = generate(target, drafter, PROMPTS, MAX_NEW, temperature=0.0)
    assert out.tokens == expected_greedy
    assert out.rounds[0].confidence_logits.shape == (len(PROMPTS), 5)


def test_greedy_matches_for_a_qwen3_target() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from sglang_dspark.model import DSparkDrafter

    config = Qwen3Config(vocab_size=256, hidden_size=48, intermediate_size=96, num_hidden_layers=6,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=16, rope_theta=1e6,
                         max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        qwen = Qwen3ForCausalLM(config).to(torch.float64).eval()
        drafter = DSparkDrafter.for_target(qwen, num_draft_layers=1, block_size=5, mask_token_id=255, markov_rank=8)
    prompts = [[3, 4, 5, 6, 7, 8], [9, 10]]
    sequences = [p + greedy_reference(qwen, p, 16) for p in prompts]
    out = generate(qwen, OracleDrafter(drafter, sequences, 1e3), prompts, 10, temperature=0.0)
    assert out.tokens == [s[len(p): len(p) + 10] for p, s in zip(prompts, sequences)]
    assert max(a for r in out.rounds for a in r.accepted) >= 2


def test_reduced_draft_vocabulary_drafter(target, expected_greedy) -> None:
    drafter = make_tiny_drafter(target, gamma=4, draft_vocab_size=128)
    greedy = generate(target, drafter, PROMPTS, MAX_NEW, temperature=0.0)
    assert greedy.tokens == expected_greedy
    sampled = generate(target, drafter, PROMPTS, 8, temperature=1.0, seed=3)
    assert [len(t) for t in sampled.tokens] == [8, 8, 8]
    assert all(0 <= t < TINY_VOCAB for tokens in sampled.tokens for t in tokens)


def test_stops_exactly_at_max_new_tokens_and_at_eos(target, greedy_sequences, expected_greedy) -> None:
    drafter = oracle_for(target, greedy_sequences, gamma=7)
    for limit in (1, 2, 5):
        out = generate(target, drafter, PROMPTS, limit, temperature=0.0)
        assert out.tokens == [e[:limit] for e in expected_greedy]
    stop = expected_greedy[0][3]
    out = generate(target, drafter, PROMPTS, MAX_NEW, temperature=0.0, eos_token_id=stop)
    for tokens, expected in zip(out.tokens, expected_greedy):
        cut = expected.index(stop) + 1 if stop in expected else MAX_NEW
        assert tokens == expected[:cut]


def test_seeded_sampling_is_reproducible(target, greedy_sequences) -> None:
    drafter = OracleDrafter(make_tiny_drafter(target, gamma=4), greedy_sequences, strength=3.0)
    first = generate(target, drafter, PROMPTS, 10, temperature=0.8, top_k=20, seed=7)
    again = generate(target, drafter, PROMPTS, 10, temperature=0.8, top_k=20, seed=7)
    assert first.tokens == again.tokens and all(len(t) == 10 for t in first.tokens)


def test_bad_arguments_fail_clearly(target) -> None:
    drafter = make_tiny_drafter(target, gamma=3)
    with pytest.raises(ValueError, match="0..gamma=0..3"):
        generate(target, drafter, PROMPTS, 4, verify_lengths=4)
    with pytest.raises(ValueError, match="every prompt at least one token"):
        generate(target, drafter, [[1, 2], []], 4)
    with pytest.raises(ValueError, match="lists 1 rounds"):
        generate(target, drafter, PROMPTS, 6, temperature=0.0, verify_lengths=[0])


# --- end-to-end losslessness ---------------------------------------------------------------

E2E_PROMPT = [1, 40, 41, 42]
E2E_SAMPLES = 2000
LOGIT_SCALE = 4.0
"""The tiny random target is nearly uniform over 512 tokens; scaling its lm_head makes the first
two tokens concentrate on ~50 pairs (86% of the mass), so 2000 samples give the test power."""


@pytest.fixture(scope="module")
def peaked_target() -> torch.nn.Module:
    model = make_tiny_target(seed=0, dtype=torch.float64)
    with torch.no_grad():
        model.lm_head.weight.mul_(LOGIT_SCALE)
    return model


def second_token_logits(target) -> torch.Tensor:
    """``[V, V]``: the target's logits for y2 after E2E_PROMPT + [y1], for every y1."""
    every_first = torch.arange(TINY_VOCAB).unsqueeze(1)
    batch = torch.cat([torch.tensor([E2E_PROMPT]).expand(TINY_VOCAB, -1), every_first], dim=1)
    with torch.no_grad():
        return target(batch).logits[:, -1]


def exact_first_two(target, params_one: tuple[float, float, int]) -> torch.Tensor:
    """P(y1, y2) ``[V, V]`` of the target after E2E_PROMPT, by enumerating y1."""
    with torch.no_grad():
        first_logits = target(torch.tensor([E2E_PROMPT])).logits[:, -1]
    first = logits_to_probs(first_logits, SamplingParams.uniform(1, *params_one))[0].double()
    second = logits_to_probs(second_token_logits(target), SamplingParams.uniform(TINY_VOCAB, *params_one))
    return first[:, None] * second.double()


class TableDrafter:
    """A real drafter (backbone, caches, confidence head) whose draft distribution is a bigram
    table: zero base logits plus ``table[prev]``. With the table set to a flattened, noisy copy
    of the target's y2 logits, slot 0 drafts overlap the target's often but not always, so both
    acceptance and the residual correction carry weight."""

    def __init__(self, drafter: torch.nn.Module, table: torch.Tensor) -> None:
        self.inner, self.table = drafter, table

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros(hidden.shape[:-1] + (TINY_VOCAB,))

    def markov_bias(self, prev, hidden, state):
        return self.table[prev], state


def table_drafter_for(target) -> TableDrafter:
    generator = torch.Generator().manual_seed(3)
    logits = second_token_logits(target).float()
    table = 0.6 * logits + 0.5 * torch.randn(logits.shape, generator=generator)
    return TableDrafter(make_tiny_drafter(target, gamma=4), table)


def sample_first_two(target, params_one: tuple[float, float, int]) -> tuple[torch.Tensor, int]:
    """Counts ``[V, V]`` of (y1, y2) over E2E_SAMPLES decodes, and the drafts accepted.

    y1 comes from the prefill; y2 is the first speculative token (slot 0 of round 1: accepted
    draft or correction), so three tokens are generated to let round 1 verify drafts."""
    temperature, top_p, top_k = params_one
    prompts = [E2E_PROMPT] * E2E_SAMPLES
    out = generate(target, table_drafter_for(target), prompts, 3, temperature=temperature, top_p=top_p, top_k=top_k, seed=1)
    pairs = torch.tensor(out.tokens)[:, :2]
    counts = torch.zeros(TINY_VOCAB, TINY_VOCAB, dtype=torch.long)
    counts.index_put_((pairs[:, 0], pairs[:, 1]), torch.ones(E2E_SAMPLES, dtype=torch.long), accumulate=True)
    return counts, sum(out.rounds[0].accepted)


def first_two_p_value(target, params_one) -> tuple[float, str]:
    counts, accepted = sample_first_two(target, params_one)
    expected = exact_first_two(target, params_one)
    p_joint = chi_square_p_value(counts, expected)
    p_second = chi_square_p_value(counts.sum(0), expected.sum(0))
    detail = (f"p_joint={p_joint:.2e}, p_second={p_second:.2e}, TV={total_variation(counts, expected):.3f}, "
              f"drafts accepted in round 1: {accepted}/{E2E_SAMPLES}")
    return min(1.0, 2 * min(p_joint, p_second)), detail  # Bonferroni over the two tests


E2E_CASES = {"T=1": (1.0, 1.0, 0), "T=0.7,top_p=0.9": (0.7, 0.9, 0)}


@pytest.mark.parametrize("case", list(E2E_CASES))
def test_generate_is_lossless_end_to_end(peaked_target, case: str) -> None:
    p_value, detail = first_two_p_value(peaked_target, E2E_CASES[case])
    assert p_value > FALSE_ALARM_RATE, f"{case}: first two tokens deviate from the target: {detail}"


def test_end_to_end_check_catches_a_broken_correction(peaked_target, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verification, "_final_distributions", lambda target_probs, rejected, draft_probs: target_probs)
    p_value, detail = first_two_p_value(peaked_target, E2E_CASES["T=1"])
    assert p_value < FALSE_ALARM_RATE, f"correction drawn from p_t went unnoticed: {detail}"
