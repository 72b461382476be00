"""Tiny deterministic fixtures shared by the test suite: a random Llama target and a DSpark drafter.

Everything is built from a seed, in milliseconds, with nothing downloaded. The target is a
transformers `LlamaForCausalLM` (hidden 64, 4 layers, 4/2 heads, vocab 512); the drafter copies its
geometry and taps layers 0 and 2 (the final layer 3 is post-norm in transformers and not tappable).
The global RNG state is left untouched.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sglang_dspark.model import DSparkDrafter, save_drafter

TINY_VOCAB = 512
TINY_MASK_TOKEN_ID = TINY_VOCAB - 1
TINY_LAYER_IDS = (0, 2)
# Larger than HF's 0.02 so that random logits are peaked enough for distribution tests to bite.
TINY_INIT_STD = 0.1


def tiny_target_config(**overrides: object) -> LlamaConfig:
    """The tiny target's config; keyword arguments override any field."""
    fields = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False,
        initializer_range=TINY_INIT_STD, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def make_tiny_target(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: object) -> LlamaForCausalLM:
    """A random tiny Llama target in eval mode (sdpa attention), deterministic by `seed`."""
    config = tiny_target_config(**overrides)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


def tiny_d2t(draft_vocab_size: int, seed: int = 0, vocab_size: int = TINY_VOCAB) -> torch.Tensor:
    """A sorted random subset of target ids (int64) for a reduced draft vocabulary."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(vocab_size, generator=generator)[:draft_vocab_size].sort().values


def make_tiny_drafter(
    target: LlamaForCausalLM,
    seed: int = 0,
    gamma: int = 4,
    num_layers: int = 1,
    markov_rank: int = 16,
    markov_head_type: str | None = "vanilla",
    confidence: bool = True,
    confidence_with_markov: bool = True,
    draft_vocab_size: int | None = None,
    target_layer_ids: tuple[int, ...] = TINY_LAYER_IDS,
    dtype: torch.dtype = torch.float32,
) -> DSparkDrafter:
    """A random DSpark drafter sharing `target`'s embedding and lm_head, deterministic by `seed`."""
    d2t = None
    if draft_vocab_size is not None and draft_vocab_size < target.config.vocab_size:
        d2t = tiny_d2t(draft_vocab_size, seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = DSparkDrafter.for_target(
            target, num_draft_layers=num_layers, block_size=gamma, mask_token_id=TINY_MASK_TOKEN_ID,
            target_layer_ids=list(target_layer_ids), markov_rank=markov_rank,
            markov_head_type=markov_head_type, enable_confidence_head=confidence,
            confidence_head_with_markov=confidence_with_markov and markov_rank > 0, d2t=d2t, dtype=dtype,
        )
    return drafter.eval()


def write_tiny_checkpoint(path: str | Path, seed: int = 0, **drafter_options: object) -> Path:
    """Save a tiny drafter (for the tiny target of the same `seed`) in the DeepSpec layout."""
    drafter = make_tiny_drafter(make_tiny_target(seed), seed=seed, **drafter_options)
    save_drafter(drafter, path)
    return Path(path)


def tiny_taps(target: LlamaForCausalLM, input_ids: torch.Tensor,
              layer_ids: tuple[int, ...] = TINY_LAYER_IDS) -> torch.Tensor:
    """Target taps `[B, T, m*d]` of `input_ids [B, T]` (one plain forward, no cache)."""
    from sglang_dspark.model import taps_from_hidden_states

    with torch.no_grad():
        out = target(input_ids, output_hidden_states=True)
    return taps_from_hidden_states(out.hidden_states, layer_ids)
