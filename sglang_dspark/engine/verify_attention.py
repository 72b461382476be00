"""Verify attention for SGLang's `torch_native` backend whose cost grows linearly with context.

The stock `TorchNativeAttnBackend.forward_extend` pads every request's queries to its whole KV
length and runs causal SDPA over it, so a verify of w tokens after L context tokens costs
O(L^2). A verify only needs the w new queries against the L + w keys (query t sees keys
0..L+t), i.e. O(w * L), the same order as w decode steps' attention. Two ways to compute it:

- the paged kernel (`kernels_cpu.paged_attention`, the default where it fits and builds): reads
  the keys in place, and each window row computes exactly what the decode step seeing the same
  keys computes (the plugin routes decode attention through the same kernel), so speculation
  changes no bit of a greedy answer, in bfloat16 too;
- SDPA over the gathered keys with an offset causal mask (`DSPARK_CPU_ATTENTION=sdpa`, or where
  the kernel does not fit or build).

`install(backend)` wraps the backend instance; every non-verify forward goes to the original
method unchanged.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang_dspark.kernels_cpu.cpu_attention import attend_in_place, layer_fits, plain_self_attention
from sglang_dspark.kernels_cpu.paged_attention import KeyLayout, LayoutPerForward, paged_attention


def verify_spans(forward_batch) -> list[tuple[int, int]] | None:
    """Per request (prefix_len, window_len) of a DSPARK_LIVE verify, or None for any other forward.

    The worker shapes its TARGET_VERIFY forward as an extend over the prefix, so the spans travel
    in the standard `extend_prefix_lens_cpu`/`extend_seq_lens_cpu` fields: SGLang's eager runner
    copies the ForwardBatch into static buffers before the model runs, and only dataclass fields
    survive that copy.
    """
    if not forward_batch.forward_mode.is_target_verify():
        return None
    prefix, window = forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu
    if prefix is None or window is None:
        return None
    return list(zip(prefix, window))


@dataclass(frozen=True)
class VerifyLayout:
    """What every layer of one verify forward shares: the KV slots of each request's prefix +
    window (one gather per layer for the whole batch) and each window's causal mask.

    Built once per forward: per layer, the slot gather's Python loop and the mask cost ~40 us at
    batch 1 (two threads, 150 tokens of context), ~1.5 ms over SmolLM2's 30 layers."""

    spans: list[tuple[int, int]]
    token_slots: torch.Tensor
    masks: list[torch.Tensor | None]
    group: int
    dtype: torch.dtype

    @classmethod
    def build(cls, req_to_token: torch.Tensor, req_pool_indices: list[int], spans: list[tuple[int, int]],
              group: int, dtype: torch.dtype) -> "VerifyLayout":
        """`group` query heads share a KV head; `dtype` is the queries' (an additive mask must match)."""
        device = req_to_token.device
        token_slots = torch.cat([req_to_token[pool_index, : prefix_len + window_len]
                                 for pool_index, (prefix_len, window_len) in zip(req_pool_indices, spans)])
        masks = []
        for prefix_len, window_len in spans:
            if window_len == 1:  # one query sees every key: no mask
                masks.append(None)
                continue
            total = prefix_len + window_len  # query t (position prefix_len + t) sees keys 0 .. prefix_len + t
            query_pos = torch.arange(prefix_len, total, device=device).repeat_interleave(group)
            visible = torch.arange(total, device=device).unsqueeze(0) <= query_pos.unsqueeze(1)
            masks.append(torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf")))
        return cls(spans=list(spans), token_slots=token_slots, masks=masks, group=group, dtype=dtype)


def verify_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: VerifyLayout,
    scaling: float | None,
) -> torch.Tensor:
    """Attention of each request's window queries over its prefix + window keys.

    query: `[sum(w), heads, head_dim]` packed in request order; returns the same shape.
    layout.spans[i] = (prefix_len, window_len): the window's KV is already written at positions
    `prefix_len .. prefix_len + window_len - 1` of the request's `req_to_token` row.

    Two things make this cheaper than SGLang's own decode attention on CPU (measured at batch 16,
    ~300 tokens of context: about half the time per layer for one-token windows): one gather of
    every request's keys per layer instead of one per request, and grouped queries: the query
    heads that share a KV head are stacked along the query axis (`[kv_heads, w * group, d]`), so
    SDPA never expands K/V for grouped-query attention.
    """
    kv_heads = k_cache.shape[1]
    group = query.shape[1] // kv_heads
    head_dim = query.shape[2]
    keys = k_cache.index_select(0, layout.token_slots).to(query.dtype).transpose(0, 1)  # [kv_heads, sum(T), d]
    values = v_cache.index_select(0, layout.token_slots).to(query.dtype).transpose(0, 1)
    output = torch.empty_like(query)
    start = key_start = 0
    for (prefix_len, window_len), mask in zip(layout.spans, layout.masks):
        total = prefix_len + window_len
        queries = (query[start : start + window_len].view(window_len, kv_heads, group, head_dim)
                   .transpose(0, 1).reshape(kv_heads, window_len * group, head_dim))
        attended = scaled_dot_product_attention(
            queries, keys[:, key_start : key_start + total], values[:, key_start : key_start + total],
            attn_mask=mask, scale=scaling,
        )
        output[start : start + window_len] = (attended.view(kv_heads, window_len, group, head_dim)
                                              .transpose(0, 1).reshape(window_len, kv_heads * group, head_dim))
        start += window_len
        key_start += total
    return output


def install(backend) -> None:
    """Route TARGET_VERIFY forwards of `backend` (a TorchNativeAttnBackend) through the linear
    verify attention; layouts are built by the first layer of each verify forward and reused by
    the others (`LayoutPerForward`)."""
    if getattr(backend, "_dspark_linear_verify", False):
        return
    original_forward_extend = backend.forward_extend

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        spans = verify_spans(forward_batch)
        if spans is None or not plain_self_attention(layer):
            return original_forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        self.dspark_linear_verify_calls += 1
        if save_kv_cache and k is not None and v is not None:
            from sglang.srt.mem_cache.memory_pool import KVWriteLoc

            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        if self._dspark_tree_layout is not None:
            return _attend_tree(self, q, layer, k_cache, self._dspark_tree_layout)
        if layer_fits(layer, q.dtype, k_cache.dtype):
            return attend_in_place(self, q, layer, forward_batch, self._dspark_kernel_layouts, verify_spans)
        group = layer.tp_q_head_num // layer.tp_k_head_num
        layout = self._dspark_sdpa_layouts.get(layer.layer_id, lambda: VerifyLayout.build(
            self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices.tolist(), spans,
            group=group, dtype=q.dtype))
        out = verify_attention(q.view(-1, layer.tp_q_head_num, layer.qk_head_dim), k_cache,
                               self.token_to_kv_pool.get_value_buffer(layer.layer_id), layout, layer.scaling)
        return out.reshape(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)

    backend.forward_extend = types.MethodType(forward_extend, backend)
    backend._dspark_linear_verify = True
    backend._dspark_kernel_layouts = LayoutPerForward()
    backend._dspark_sdpa_layouts = LayoutPerForward()
    backend.dspark_linear_verify_calls = 0
    backend._dspark_tree_layout = None


@contextmanager
def tree_window(backends, layout: KeyLayout) -> Iterator[None]:
    """Within this block, the verify forwards of `backends` (installed ones) attend through
    `layout`: one request whose window holds a tree of drafts, each row seeing its own ancestry
    (`KeyLayout.for_tree`), which no (prefix, window) span can say."""
    for backend in backends:
        backend._dspark_tree_layout = layout
    try:
        yield
    finally:
        for backend in backends:
            backend._dspark_tree_layout = None


def _attend_tree(backend, q, layer, k_cache, layout: KeyLayout) -> torch.Tensor:
    if not layer_fits(layer, q.dtype, k_cache.dtype):  # the worker only grows trees where the kernel serves
        raise RuntimeError(f"DSPARK_LIVE tree verify: layer {layer.layer_id} ({q.dtype}, cache {k_cache.dtype}) is "
                           "not served by the paged attention kernel")
    out = paged_attention(q.view(-1, layer.tp_q_head_num, layer.qk_head_dim), k_cache,
                          backend.token_to_kv_pool.get_value_buffer(layer.layer_id), layout, layer.scaling)
    return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)


def linear_calls(backends) -> int:
    """Layer calls served by the linear verify attention so far (the worker checks it moved)."""
    return sum(getattr(backend, "dspark_linear_verify_calls", 0) for backend in backends)
