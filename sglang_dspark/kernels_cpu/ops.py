"""Pure-torch versions of the two `sgl_kernel` CPU ops that SGLang's CPU serving path calls.

SGLang's CPU engine imports `assign_req_to_token_pool_cpu` (decode-time KV slot bookkeeping) and
`copy_all_layer_kv_cache_cpu` (KV row moves) from a CPU build of `sgl_kernel` that PyPI does not
ship. These implementations follow the Triton kernels they replace
(`sglang/srt/mem_cache/allocation.py::assign_req_to_token_pool` and
`sglang/kernels/ops/kvcache/cache_move.py::copy_all_layer_kv_cache_tiled`).
"""

from __future__ import annotations

import ctypes

import torch


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV slots into its `req_to_token` row.

    Request i receives `out_cache_loc[sum_{j<i}(end_j - start_j) : ...]` at columns
    `start_offset[i]:end_offset[i]` of row `req_pool_indices[i]`.
    """
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    cursor = 0
    for row, start, end in zip(rows, starts, ends):
        if end > pool_len:
            raise ValueError(f"assign_req_to_token_pool_cpu: end offset {end} exceeds pool_len {pool_len}")
        count = end - start
        if count > 0:
            req_to_token[row, start:end] = out_cache_loc[cursor : cursor + count].to(req_to_token.dtype)
        cursor += max(count, 0)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Copy KV rows `src_loc -> tgt_loc` in every buffer whose base address is in `data_ptrs`.

    `strides[i]` is both the row stride and the row width in bytes of buffer i. All source rows
    are read before any target row is written, so overlapping moves are safe (as in the Triton
    kernel, which loads a whole tile before storing it).
    """
    sources = src_loc.tolist()
    targets = tgt_loc.tolist()
    if len(sources) != len(targets):
        raise ValueError(f"copy_all_layer_kv_cache_cpu: {len(sources)} source rows but {len(targets)} targets")
    for base, row_bytes in zip(data_ptrs.tolist(), strides.tolist()):
        staged = [ctypes.create_string_buffer(row_bytes) for _ in sources]
        for buffer, src in zip(staged, sources):
            ctypes.memmove(buffer, base + src * row_bytes, row_bytes)
        for buffer, tgt in zip(staged, targets):
            ctypes.memmove(base + tgt * row_bytes, buffer, row_bytes)
