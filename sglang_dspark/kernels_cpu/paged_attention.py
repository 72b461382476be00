"""Decode and verify attention read in place from a paged KV cache (`paged_attention.cpp`).

SGLang's `torch_native` decode attention gathers each request's keys and values into new tensors
(`k_cache[req_to_token[...]]`) and runs SDPA per request, per layer: at batch 1 on this project's
2-core CPU the gathers and SDPA took ~29 % of a SmolLM2-135M decode step (py-spy). The kernel reads
each key row where the cache holds it, one call per layer for the whole batch.

It also makes a verify window exact: every (query row, head) is computed by one thread in the same
order whatever the batch, so verify row i gives the bits of the decode step that sees the same
keys. Served together with the batch-invariant weight panels, greedy DSPARK_LIVE answers equal
plain greedy answers in bfloat16 as well as float32.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from sglang_dspark.kernels_cpu.build import load_library

SOURCE = Path(__file__).with_name("paged_attention.cpp")
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def load_attention_kernel() -> ctypes.CDLL:
    """The compiled kernel, built on first use; raises `KernelUnavailable` with the reason."""
    c = ctypes
    return load_library(SOURCE, {"dspark_paged_attention": [
        c.c_void_p, c.c_int64, c.c_int64, c.c_void_p, c.c_void_p, c.c_int64, c.c_int64, c.c_void_p, c.c_void_p,
        c.c_void_p, c.c_void_p, c.c_int64, c.c_int64, c.c_int64, c.c_int, c.c_int, c.c_int, c.c_float, c.c_int,
        c.c_int]})


def kernel_fits(query_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """Whether the kernel serves this layer (else the caller keeps its own attention); `group`
    query heads share each KV head."""
    return (query_dtype == cache_dtype and query_dtype in SUPPORTED_DTYPES
            and bool(load_attention_kernel().dspark_attention_supports(head_dim, group)))


@dataclass(frozen=True)
class KeyLayout:
    """Which cache rows each query row of one forward sees, shared by all its layers.

    `spans[i] = (prefix_len, window_len)` of request i: its window's queries are rows
    `prefix_len .. prefix_len + window_len - 1` of its `req_to_token` row (a decode step is a
    window of one), and query row j of the window sees cache rows `0 .. prefix_len + j`."""

    spans: list[tuple[int, int]]
    slots: torch.Tensor
    key_start: torch.Tensor
    key_count: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.key_start.shape[0])

    @classmethod
    def build(cls, req_to_token: torch.Tensor, pool_indices: list[int], spans: list[tuple[int, int]],
              cache_rows: int) -> "KeyLayout":
        """Raises ValueError if a slot lies outside the cache (the kernel would read out of bounds)."""
        slots = torch.cat([req_to_token[pool_index, : prefix_len + window_len]
                           for pool_index, (prefix_len, window_len) in zip(pool_indices, spans)])
        slots = slots.to(torch.int32).contiguous()
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= cache_rows):
            raise ValueError(f"KV slots {int(slots.min())}..{int(slots.max())} outside a cache of {cache_rows} rows")
        starts: list[int] = []
        counts: list[int] = []
        offset = 0
        for prefix_len, window_len in spans:
            starts.extend([offset] * window_len)
            counts.extend(range(prefix_len + 1, prefix_len + window_len + 1))
            offset += prefix_len + window_len
        return cls(spans=list(spans), slots=slots, key_start=torch.tensor(starts, dtype=torch.int64),
                   key_count=torch.tensor(counts, dtype=torch.int64))

    @classmethod
    def for_tree(cls, prefix_slots: torch.Tensor, window_slots: torch.Tensor, ancestries: list[list[int]],
                 cache_rows: int) -> "KeyLayout":
        """One request's verify window holding a tree of drafts (`decoding.tree`): window row r sees
        the prefix and the window rows of `ancestries[r]` (root to r), each row its own key list.
        Raises ValueError if a slot lies outside the cache."""
        if len(ancestries) != window_slots.numel():
            raise ValueError(f"{len(ancestries)} ancestries for a window of {window_slots.numel()} rows")
        prefix_slots = prefix_slots.to(torch.int32)
        window_slots = window_slots.to(torch.int32)
        slots = torch.cat([torch.cat((prefix_slots, window_slots[ancestry])) for ancestry in ancestries]).contiguous()
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= cache_rows):
            raise ValueError(f"KV slots {int(slots.min())}..{int(slots.max())} outside a cache of {cache_rows} rows")
        counts = [prefix_slots.numel() + len(ancestry) for ancestry in ancestries]
        starts = [0]
        for count in counts[:-1]:
            starts.append(starts[-1] + count)
        return cls(spans=[(prefix_slots.numel(), len(ancestries))], slots=slots,
                   key_start=torch.tensor(starts, dtype=torch.int64), key_count=torch.tensor(counts, dtype=torch.int64))


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: KeyLayout,
                    scale: float) -> torch.Tensor:
    """`query [rows, q_heads, D]` over `k_cache`/`v_cache [cache rows, kv_heads, D]` -> `[rows, q_heads, D]`."""
    rows, q_heads, head_dim = query.shape
    kv_heads = k_cache.shape[1]
    if (rows != layout.rows or q_heads % kv_heads or k_cache.shape[2] != head_dim or k_cache.stride() != v_cache.stride()
            or k_cache.stride(2) != 1 or query.stride(2) != 1
            or not kernel_fits(query.dtype, k_cache.dtype, head_dim, q_heads // kv_heads)):
        raise ValueError(f"paged_attention: query {tuple(query.shape)} {query.dtype}, cache {tuple(k_cache.shape)} "
                         f"{k_cache.dtype} strides {k_cache.stride()}/{v_cache.stride()}, layout of {layout.rows} rows")
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    load_attention_kernel().dspark_paged_attention(
        query.data_ptr(), query.stride(0), query.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.stride(0), k_cache.stride(1), layout.slots.data_ptr(), layout.key_start.data_ptr(),
        layout.key_count.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1), rows, q_heads, kv_heads,
        head_dim, scale, query.dtype == torch.bfloat16, torch.get_num_threads())
    return out


class LayoutPerForward:
    """Builds a layout at the first attention layer of each forward and reuses it for the others.

    Layer ids rise within a forward, so a layer id not above the last one served starts a new
    forward (SGLang may reuse one ForwardBatch object across steps, so it cannot be the key)."""

    def __init__(self) -> None:
        self._layout = None
        self._last_layer = -1

    def get(self, layer_id: int, build):
        if self._layout is None or layer_id <= self._last_layer:
            self._layout = build()
        self._last_layer = layer_id
        return self._layout

