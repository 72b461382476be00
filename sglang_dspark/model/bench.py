"""Benchmark: one DSpark draft block vs one target decode step, on this machine.

    python -m sglang_dspark.model.bench [--threads 1] [--repeats 15] [--markov-rank 256]

The target has SmolLM2-135M-Instruct's shape (random weights: timing only) with a transformers KV
cache of `--context` tokens and q_len 1. The drafter is 1 layer at gamma 7 with the same context
in its `DraftContextCache`. A draft block is `forward_block` + base logits for all gamma slots +
the Markov walk (bias, fp32 softmax and a sample per slot, left to right) + confidence logits.
Target and drafter are timed alternately in one loop so that machine load hits both alike; the
JSON reports medians and their ratio (goal: under 0.2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch

from sglang_dspark.model.config import DSparkConfig
from sglang_dspark.model.drafter import DSparkDrafter

SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=100000.0, hidden_act="silu", tie_word_embeddings=True,
)
TAPPED_LAYERS = [1, 10, 19, 28]


def build_target(dtype: torch.dtype):
    """A random LlamaForCausalLM of SmolLM2-135M's shape (sdpa attention, eval mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SMOLLM2_135M)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype).eval()


def build_drafter(target, dtype: torch.dtype, gamma: int, markov_rank: int,
                  draft_vocab_size: int | None) -> DSparkDrafter:
    config = DSparkConfig.from_target_config(
        target.config, num_draft_layers=1, block_size=gamma, mask_token_id=0,
        target_layer_ids=TAPPED_LAYERS, markov_rank=markov_rank, markov_head_type="vanilla",
        enable_confidence_head=True, confidence_head_with_markov=markov_rank > 0,
        draft_vocab_size=draft_vocab_size,
    )
    d2t = torch.arange(draft_vocab_size) if draft_vocab_size else None
    torch.manual_seed(1)
    return DSparkDrafter(config, target=target, d2t=d2t, dtype=dtype).eval()


def draft_block(drafter: DSparkDrafter, cache, slots: torch.Tensor, anchors: torch.Tensor,
                generator: torch.Generator) -> torch.Tensor:
    """What one drafting step costs: backbone, base logits, the Markov walk and confidences."""
    hidden = drafter.forward_block(cache, slots, anchors)
    base = drafter.base_logits(hidden)
    prev, state, tokens = anchors, None, []
    for k in range(drafter.gamma):
        bias, state = drafter.markov_bias(prev, hidden[:, k], state)
        probs = torch.softmax((base[:, k] + bias).float(), dim=-1)
        drafter.confidence_logits(hidden[:, k], prev)
        draft_ids = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        prev = draft_ids if drafter.d2t is None else drafter.d2t[draft_ids]
        tokens.append(prev)
    return torch.stack(tokens, dim=1)


def time_pair(first: Callable[[], object], second: Callable[[], object], repeats: int,
              warmup: int = 3) -> tuple[list[float], list[float]]:
    """Alternate the two calls; return their wall times in milliseconds."""
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(warmup + repeats):
        for fn, out in ((first, times[0]), (second, times[1])):
            start = time.perf_counter()
            fn()
            if i >= warmup:
                out.append(1000 * (time.perf_counter() - start))
    return times


@torch.inference_mode()
def bench_case(target, drafter: DSparkDrafter, batch: int, context: int, repeats: int) -> dict:
    from transformers import DynamicCache

    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.config.vocab_size, (batch, context), generator=generator)
    target_cache = DynamicCache(config=target.config)
    out = target(prompt, past_key_values=target_cache, use_cache=True, output_hidden_states=True)
    taps = torch.cat([out.hidden_states[i + 1] for i in TAPPED_LAYERS], dim=-1)
    next_token = out.logits[:, -1].argmax(-1, keepdim=True)

    def target_step() -> None:
        target(next_token, past_key_values=target_cache, use_cache=True)
        target_cache.crop(-1)  # drop the decoded token: every step sees `context` cached tokens

    slots = torch.arange(batch)
    cache = drafter.new_cache(batch, capacity=context + 16)
    drafter.append_context(cache, slots, taps.reshape(batch * context, -1), torch.full((batch,), context))
    anchors = next_token.squeeze(-1)
    target_ms, draft_ms = time_pair(target_step, lambda: draft_block(drafter, cache, slots, anchors, generator), repeats)

    new_taps = taps[:, :3].reshape(batch * 3, -1)  # ~3 accepted positions per request per step

    def append_step() -> None:
        drafter.append_context(cache, slots, new_taps, torch.full((batch,), 3))
        cache.truncate(slots, torch.full((batch,), context))

    append_ms, _ = time_pair(append_step, lambda: None, repeats)
    target_med, draft_med, append_med = (statistics.median(t) for t in (target_ms, draft_ms, append_ms))
    return {
        "batch": batch,
        "target_step_ms": round(target_med, 3),
        "draft_block_ms": round(draft_med, 3),
        "ratio": round(draft_med / target_med, 4),
        "append_3_positions_ms": round(append_med, 3),
        "ratio_with_append": round((draft_med + append_med) / target_med, 4),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--gamma", type=int, default=7)
    parser.add_argument("--markov-rank", type=int, default=256)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--draft-vocabs", type=int, nargs="+", default=[0, 8192],
                        help="draft vocabulary sizes; 0 = the full target vocabulary")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    results = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        target = build_target(dtype)
        for vocab in args.draft_vocabs:
            drafter = build_drafter(target, dtype, args.gamma, args.markov_rank, vocab or None)
            for batch in args.batches:
                case = bench_case(target, drafter, batch, args.context, args.repeats)
                case.update(dtype=dtype_name, draft_vocab=vocab or target.config.vocab_size)
                results.append(case)
        del target
    print(json.dumps({
        "target": "SmolLM2-135M-Instruct shape, random weights",
        "drafter": {"layers": 1, "gamma": args.gamma, "markov_rank": args.markov_rank,
                    "markov_head": "vanilla", "confidence_head": True, "taps": TAPPED_LAYERS},
        "context_tokens": args.context, "threads": args.threads, "repeats": args.repeats,
        "torch": torch.__version__, "goal_ratio": 0.2,
        "results": results,
    }, indent=2))


if __name__ == "__main__":
    main()
