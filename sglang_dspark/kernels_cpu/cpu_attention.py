"""Decode and prefill attention of SGLang's `torch_native` backend through the paged kernel (`paged_attention`).

AROUND hooks on `TorchNativeAttnBackend.forward_decode` and `.forward_extend` (registered by the
plugin in every CPU server, plain serving included, so benchmarks compare like with like). A
decode step is a window of one query per request over its whole sequence; the same kernel serves
DSPARK_LIVE's verify windows (`engine.verify_attention`), so a verify row and the decode step it
replaces compute the same bits. Layers the kernel does not fit (sliding window, cross attention,
other head sizes or dtypes) keep SGLang's own attention.

A prefill (an extend) is a window of the prompt's new tokens over the cached prefix plus
themselves. SGLang's extend pads every request's queries to its whole length and runs causal
SDPA over prefix + window, so a request whose prompt is mostly cached (a radix hit: the same
system prompt, a chat's next turn) pays for its whole context squared in every layer: per layer
(SmolLM2's 9/3 heads of 64, bf16, this project's 2-core Zen 4) a one-token extend after 64 cached
tokens took 0.42 ms there against 0.07 in the kernel, after 2,000 cached tokens 43 ms against
0.13. A fresh prompt of 45-1,000 tokens is 1.1-2.6x faster in the kernel too; from ~1,200 new
tokens with no prefix SDPA's blocked loops win (2,000: 43 against 51 ms), so such extends keep
SGLang's own (`kernel_serves_extend`).

`DSPARK_CPU_ATTENTION`: `kernel` (default) or `sdpa` (SGLang's decode and extend; DSPARK_LIVE verifies with
SDPA over gathered keys). Where the kernel cannot be built (no AVX-512F or AVX2 + FMA, or no
compiler) the server logs why once and serves as with `sdpa`.
"""

from __future__ import annotations

import functools

import torch

from sglang_dspark.kernels_cpu.build import env_choice, kernel_loads
from sglang_dspark.kernels_cpu.paged_attention import KeyLayout, LayoutPerForward, kernel_fits, load_attention_kernel, paged_attention

MODES = ("kernel", "sdpa")
DECODE_TARGET = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_decode"
EXTEND_TARGET = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend"
KERNEL_EXTEND_MAX_FRESH_WINDOW = 1024
"""New tokens a request may extend by, beyond its cached prefix, and still go to the kernel: past
this SDPA's blocked causal loops beat the kernel's row-at-a-time scan (module docstring)."""


def attention_mode() -> str:
    return env_choice("DSPARK_CPU_ATTENTION", MODES)


@functools.cache
def kernel_enabled() -> bool:
    """`DSPARK_CPU_ATTENTION=kernel` and the kernel loads here (why not is logged once)."""
    return attention_mode() == "kernel" and kernel_loads(
        load_attention_kernel, "no paged attention kernel, SGLang's decode attention serves (slower)",
        "decode, prefill and verify attention read the KV cache in place (DSPARK_CPU_ATTENTION=kernel)")


def plain_self_attention(layer) -> bool:
    """A layer the kernel can serve: self-attention, equal q/k and v head sizes, no sliding window."""
    return (not layer.is_cross_attention and layer.qk_head_dim == layer.v_head_dim
            and (layer.sliding_window_size is None or layer.sliding_window_size < 0))


def layer_fits(layer, query_dtype, cache_dtype) -> bool:
    """Decided once per attention layer and dtype pair (it runs for every layer of every forward)."""
    decisions = layer.__dict__.setdefault("_dspark_kernel_fits", {})
    key = (query_dtype, cache_dtype)
    if key not in decisions:
        decisions[key] = (kernel_enabled() and plain_self_attention(layer)
                          and layer.tp_q_head_num % layer.tp_k_head_num == 0
                          and kernel_fits(query_dtype, cache_dtype, layer.qk_head_dim,
                                          layer.tp_q_head_num // layer.tp_k_head_num))
    return decisions[key]


def attend_in_place(backend, q, layer, forward_batch, layouts: LayoutPerForward, spans_of) -> torch.Tensor:
    """The kernel over `backend`'s cache for `layer`; `spans_of(forward_batch)` gives the
    (prefix, window) spans, built into a layout once per forward."""
    k_cache = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    layout = layouts.get(layer.layer_id, lambda: KeyLayout.build(
        backend.req_to_token_pool.req_to_token, forward_batch.req_pool_indices.tolist(), spans_of(forward_batch),
        cache_rows=k_cache.shape[0]))
    out = paged_attention(q.view(-1, layer.tp_q_head_num, layer.qk_head_dim), k_cache,
                          backend.token_to_kv_pool.get_value_buffer(layer.layer_id), layout, layer.scaling)
    return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)


def decode_spans(forward_batch) -> list[tuple[int, int]]:
    """A decode step's query is the last of each sequence (its KV is written before attention)."""
    seq_lens = forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None else forward_batch.seq_lens
    return [(int(length) - 1, 1) for length in seq_lens.tolist()]


def around_forward_decode(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    """AROUND hook: decode through the kernel where it fits, else SGLang's own decode."""
    if (kwargs or forward_batch.encoder_lens is not None
            or not layer_fits(layer, q.dtype, backend.token_to_kv_pool.get_key_buffer(layer.layer_id).dtype)):
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
    return _write_kv_and_attend(backend, q, k, v, layer, forward_batch, save_kv_cache, "_dspark_decode_layouts",
                                decode_spans)


def _write_kv_and_attend(backend, q, k, v, layer, forward_batch, save_kv_cache: bool, layouts_name: str,
                         spans_of) -> torch.Tensor:
    """What SGLang's own decode and extend do, through the kernel: write the new tokens' KV, then
    attend each query row over the cache rows it may see (one layout per forward, per kind)."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    if save_kv_cache and k is not None and v is not None:
        backend.token_to_kv_pool.set_kv_buffer(
            layer, KVWriteLoc(forward_batch.out_cache_loc, getattr(backend, "swa_out_cache_loc", None)), k, v)
    layouts = backend.__dict__.setdefault(layouts_name, LayoutPerForward())
    return attend_in_place(backend, q, layer, forward_batch, layouts, spans_of)


def extend_spans(forward_batch) -> list[tuple[int, int]] | None:
    """A prefill's (cached prefix, new tokens) per request, or None where SGLang did not fill the
    host-side lists (its GPU-only path) or the forward is not a plain or mixed extend."""
    if forward_batch.forward_mode.name not in ("EXTEND", "MIXED"):  # a verify has its own (`engine.verify_attention`)
        return None
    prefix, window = forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu
    if prefix is None or window is None:
        return None
    return [(int(p), int(w)) for p, w in zip(prefix, window)]


def kernel_serves_extend(spans: list[tuple[int, int]]) -> bool:
    """The whole forward goes one way, so a request's bits do not depend on what it was batched
    with unless a window this long is in the batch: every window within
    `KERNEL_EXTEND_MAX_FRESH_WINDOW` new tokens or no longer than its cached prefix."""
    return all(window <= KERNEL_EXTEND_MAX_FRESH_WINDOW or prefix >= window for prefix, window in spans)


def around_forward_extend(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    """AROUND hook: a prefill through the kernel where it fits and wins, else SGLang's own extend."""
    spans = None if kwargs or forward_batch.encoder_lens is not None else extend_spans(forward_batch)
    if (spans is None or sum(window for _, window in spans) != q.shape[0] or not kernel_serves_extend(spans)
            or not layer_fits(layer, q.dtype, backend.token_to_kv_pool.get_key_buffer(layer.layer_id).dtype)):
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
    return _write_kv_and_attend(backend, q, k, v, layer, forward_batch, save_kv_cache, "_dspark_extend_layouts",
                                lambda _: spans)
