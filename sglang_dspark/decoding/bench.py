"""Benchmark: the per-step cost of the sampling transform and of verification, on this machine.

    python -m sglang_dspark.decoding.bench [--vocab 49152] [--gamma 7] [--repeats 20] [--logit-scale 8]

The SGLang worker calls ``logits_to_probs`` (inside ``sample_block``, once per slot) and
``verify`` on every decode step, so their cost adds straight to each step. This times both on
random logits with SmolLM2-135M's vocabulary, at batch 1 and 8, for greedy, temperature 1 and
temperature 0.7 with top-p 0.9. Logits are N(0, scale^2): scale 8 gives language-model-like peaked
rows (a nucleus of a few tokens, the partial-sort path); scale 1 gives flat rows whose nucleus
needs the full sort. Prints JSON with median milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from sglang_dspark.decoding.sampling import SamplingParams, logits_to_probs, sample_from_probs
from sglang_dspark.decoding.verification import DraftBlock, verify

SETTINGS = {"greedy": (0.0, 1.0, 0), "T=1": (1.0, 1.0, 0), "T=0.7,top_p=0.9": (0.7, 0.9, 0)}


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def bench_case(
    batch: int, vocab: int, gamma: int, setting: tuple[float, float, int], repeats: int, scale: float
) -> dict:
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams.uniform(batch, *setting)
    draft_logits = torch.randn(batch, gamma, vocab, generator=generator) * scale
    target_logits = torch.randn(batch, gamma + 1, vocab, generator=generator) * scale
    draft_probs = logits_to_probs(draft_logits, params)
    drafts = sample_from_probs(draft_probs.reshape(-1, vocab), generator).reshape(batch, gamma)
    block = DraftBlock(drafts, None if bool(params.greedy.all()) else draft_probs, torch.zeros(batch, gamma))
    lens = torch.full((batch,), gamma)
    return {
        "batch": batch,
        "setting": next(name for name, value in SETTINGS.items() if value == setting),
        "walk_transform_ms": median_ms(
            lambda: [logits_to_probs(draft_logits[:, k], params) for k in range(gamma)], repeats
        ),
        "verify_ms": median_ms(lambda: verify(block, target_logits, lens, params, generator), repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--gamma", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--logit-scale", type=float, default=8.0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = [
        bench_case(batch, args.vocab, args.gamma, setting, args.repeats, args.logit_scale)
        for batch in (1, 8)
        for setting in SETTINGS.values()
    ]
    print(json.dumps({"vocab": args.vocab, "gamma": args.gamma, "logit_scale": args.logit_scale,
                      "threads": torch.get_num_threads(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
