"""Time one forward's attention for a request's window at a context length: the paged kernel
(`paged_attention`) against torch's SDPA over keys gathered from the cache (what SGLang's
`torch_native` backend runs, and the plugin's `DSPARK_CPU_ATTENTION=sdpa`).

SmolLM2-135M's shapes by default (30 layers, 9 query heads over 3 KV heads of 64). Each layer
has its own cache, so keys come from memory as in serving; the request's KV slots are
consecutive, as for a request that was never retracted. A window of 1 is a decode step, a window
of w a verify of w - 1 drafts. Backs `dspark-ctl bench attention`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from sglang_dspark.kernels_cpu.gemm_bench import alternating_median_ms
from sglang_dspark.kernels_cpu.paged_attention import KeyLayout, paged_attention

@dataclass(frozen=True)
class AttentionTiming:
    context: int  # keys before the window
    window: int  # query rows (1: a decode step)
    sdpa_ms: float
    kernel_ms: float

    @property
    def speedup(self) -> float:
        return self.sdpa_ms / self.kernel_ms

    def to_json(self) -> dict:
        return {**asdict(self), "speedup": round(self.speedup, 3)}


def time_attention(contexts: list[int], windows: list[int], dtype_name: str, *, layers: int = 30, heads: int = 9,
                   kv_heads: int = 3, head_dim: int = 64, repeats: int = 7) -> list[AttentionTiming]:
    """Milliseconds per forward (every layer's attention) for each (context, window), in
    `dtype_name` ("float32" or "bfloat16": the callers, control/ included, need no torch)."""
    if dtype_name not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype_name!r}")
    if min(contexts) < 0 or min(windows) < 1:
        raise ValueError(f"contexts must be >= 0 and windows >= 1, got {contexts} and {windows}")
    dtype = getattr(torch, dtype_name)
    generator = torch.Generator().manual_seed(0)
    rows = max(contexts) + max(windows) + 1  # cache row 0 stays unused, as SGLang's padding slot
    caches = [(torch.randn(rows, kv_heads, head_dim, generator=generator).to(dtype),
               torch.randn(rows, kv_heads, head_dim, generator=generator).to(dtype)) for _ in range(layers)]
    req_to_token = torch.arange(1, rows, dtype=torch.int32)[None, :]
    scale = head_dim**-0.5
    timings = []
    for context in contexts:
        for window in windows:
            layout = KeyLayout.build(req_to_token, [0], [(context, window)], cache_rows=rows)
            query = torch.randn(window, heads, head_dim, generator=generator).to(dtype)
            slots = req_to_token[0, : context + window].long()
            # window row j sees the context and window rows 0..j
            visible = torch.ones(window, context + window, dtype=torch.bool).tril(diagonal=context)
            sdpa_query = query.transpose(0, 1)[None]  # [1, heads, window, d]

            def sdpa_forward():
                for k_cache, v_cache in caches:
                    keys, values = k_cache[slots].transpose(0, 1)[None], v_cache[slots].transpose(0, 1)[None]
                    F.scaled_dot_product_attention(sdpa_query, keys, values, attn_mask=visible, scale=scale,
                                                   enable_gqa=True)

            def kernel_forward():
                for k_cache, v_cache in caches:
                    paged_attention(query, k_cache, v_cache, layout, scale)

            sdpa_ms, kernel_ms = alternating_median_ms(sdpa_forward, kernel_forward, repeats)
            timings.append(AttentionTiming(context=context, window=window, sdpa_ms=sdpa_ms, kernel_ms=kernel_ms))
    return timings
