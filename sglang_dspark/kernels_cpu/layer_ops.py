"""Residual add + RMSNorm, neox rotary embedding and SiLU-and-multiply in one C++ call each (`layer_ops.cpp`).

SGLang's CPU path without AMX runs these as `forward_native`: 10-13 torch ops per RMSNorm and
~37 per rotary embedding, each ~3-6 us of dispatch on this project's CPU, so for SmolLM2-135M
(61 norms and 30 rotary embeddings a forward) they cost more than the attention at batch 1. The
kernels compute in float32 and round once; each row alone gives the same bits as in a batch.

The Python side is kept to a few checks and two allocations: on this CPU one `torch.empty(shape,
dtype=...)` costs ~5 us, `torch.empty_like` ~2 us, and the ctypes call itself ~5 us.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from sglang_dspark.kernels_cpu.build import load_library

SOURCE = Path(__file__).with_name("layer_ops.cpp")
DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def load_layer_ops() -> ctypes.CDLL:
    """The compiled kernels, built on first use; raises `KernelUnavailable` with the reason."""
    c = ctypes
    library = load_library(SOURCE, {
        "dspark_add_rmsnorm": [c.c_void_p, c.c_int64, c.c_void_p, c.c_int64, c.c_void_p, c.c_void_p, c.c_void_p,
                               c.c_int64, c.c_int64, c.c_float, c.c_int, c.c_int, c.c_int],
        "dspark_rope_neox": [c.c_void_p, c.c_void_p, c.c_int64, c.c_void_p, c.c_int, c.c_void_p, c.c_int64,
                             c.c_void_p, c.c_int, c.c_int64, c.c_int, c.c_int, c.c_void_p, c.c_int64, c.c_int64,
                             c.c_int, c.c_int],
        "dspark_row_argmax": [c.c_void_p, c.c_int64, c.c_int64, c.c_int64, c.c_int, c.c_void_p, c.c_int],
        "dspark_head_norm_rope": [c.c_void_p, c.c_int64, c.c_void_p, c.c_int64, c.c_int, c.c_int, c.c_void_p,
                                  c.c_float, c.c_void_p, c.c_int64, c.c_void_p, c.c_int64, c.c_int],
        "dspark_silu_and_mul": [c.c_void_p, c.c_int64, c.c_void_p, c.c_int64, c.c_int64, c.c_int, c.c_int],
    })
    library.dspark_rope_neox.restype = c.c_int  # -1: a position outside the cache
    return library


def rmsnorm_weight_fits(weight: torch.Tensor) -> bool:
    """The per-module half of the check (the norm's weight never changes while serving)."""
    return (weight.device.type == "cpu" and weight.dtype in DTYPES and weight.dim() == 1 and weight.is_contiguous()
            and weight.shape[0] <= load_layer_ops().dspark_layer_ops_max_hidden())


def rmsnorm_input_fits(x: torch.Tensor, residual: torch.Tensor | None, hidden: int) -> bool:
    """The per-call half: 2-D rows of `hidden` unit-stride elements, a residual of the same kind."""
    return (x.dim() == 2 and x.dtype in DTYPES and x.shape[1] == hidden and x.stride(1) == 1 and x.device.type == "cpu"
            and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape and residual.stride(1) == 1)))


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """`rmsnorm(x + residual) * weight` and `x + residual` (in x's dtype), or the norm alone
    without a residual: what SGLang's `RMSNorm.forward_native` returns. Check both fits first."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    residual_out = None if residual is None else torch.empty_like(out)
    load_layer_ops().dspark_add_rmsnorm(
        x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0), weight.data_ptr(), out.data_ptr(),
        None if residual_out is None else residual_out.data_ptr(), x.shape[0], x.shape[1], eps,
        x.dtype == torch.bfloat16, weight.dtype == torch.bfloat16, torch.get_num_threads())
    return out if residual_out is None else (out, residual_out)


def rope_fits(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int, rotary_dim: int,
              cache: torch.Tensor) -> bool:
    return (query.dim() == 2 and key.dim() == 2 and query.dtype in DTYPES and key.dtype == query.dtype
            and cache.dtype in DTYPES and positions.dtype == torch.int64 and positions.dim() == 1
            and positions.is_contiguous() and query.shape[0] == key.shape[0] == positions.shape[0]
            and query.stride(1) == 1 and key.stride(1) == 1 and query.shape[1] % head_size == 0
            and key.shape[1] % head_size == 0 and cache.dim() == 2 and cache.stride(1) == 1
            and cache.shape[1] == rotary_dim and rotary_dim % 2 == 0 and 0 < rotary_dim <= head_size
            and query.device.type == "cpu")


def rope_neox(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int, rotary_dim: int,
              cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding of `query`/`key [tokens, heads * head_size]` (new tensors of
    their shapes); `cache [max_position, rotary_dim]` holds cos then sin. Check `rope_fits` first."""
    query_out = torch.empty_like(query, memory_format=torch.contiguous_format)
    key_out = torch.empty_like(key, memory_format=torch.contiguous_format)
    status = load_layer_ops().dspark_rope_neox(
        positions.data_ptr(), query.data_ptr(), query.stride(0), query_out.data_ptr(), query.shape[1] // head_size,
        key.data_ptr(), key.stride(0), key_out.data_ptr(), key.shape[1] // head_size, positions.shape[0], head_size,
        rotary_dim, cache.data_ptr(), cache.stride(0), cache.shape[0], query.dtype == torch.bfloat16,
        cache.dtype == torch.bfloat16)
    if status != 0:
        raise ValueError(f"rotary positions {int(positions.min())}..{int(positions.max())} outside a cache of "
                         f"{cache.shape[0]} positions")
    return query_out, key_out


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)` for `x [rows, cols]` (first maximum, first NaN, as torch), int64 `[rows]`.

    Why: torch's CPU argmax reads ~1.2 G float32/s here, ~0.7 ms for a batch-16 step's logits and
    ~2 ms for a drafted step's verify rows; the kernel runs at memory speed. Other devices, dtypes
    and layouts go to torch."""
    if not (x.device.type == "cpu" and x.dim() == 2 and x.dtype in DTYPES and x.stride(1) == 1 and x.shape[1] > 0):
        return x.argmax(-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    load_layer_ops().dspark_row_argmax(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0),
                                       x.dtype == torch.bfloat16, out.data_ptr(), torch.get_num_threads())
    return out


def head_norm_rope_fits(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """`x [..., heads, head_size]` with packed heads, cos/sin `[..., 1, head_size]` with one row per
    row of x, everything CPU and of one float32/bfloat16 dtype, an even head size up to 1024."""
    head_size = x.shape[-1] if x.dim() >= 2 else 0
    return (x.dim() >= 2 and x.device.type == "cpu" and x.dtype in DTYPES and weight.dtype == x.dtype
            and cos.dtype == x.dtype and sin.dtype == x.dtype and 0 < head_size <= 1024 and head_size % 2 == 0
            and x.stride(-1) == 1 and x.stride(-2) == head_size and weight.shape == (head_size,)
            and weight.is_contiguous() and cos.shape == sin.shape and cos.shape[-1] == head_size
            and cos.numel() * x.shape[-2] == x.numel())


def head_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary(rmsnorm(x) * weight, cos, sin)` per head, as a new tensor of x's shape: the
    drafter's q and k paths (12 torch ops) in one call. Check `head_norm_rope_fits` first."""
    heads, head_size = x.shape[-2], x.shape[-1]
    rows = x.reshape(-1, heads * head_size)
    cos_rows, sin_rows = cos.reshape(-1, head_size), sin.reshape(-1, head_size)
    if cos_rows.stride(-1) != 1:
        cos_rows, sin_rows = cos_rows.contiguous(), sin_rows.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    load_layer_ops().dspark_head_norm_rope(rows.data_ptr(), rows.stride(0), out.data_ptr(), rows.shape[0], heads,
                                           head_size, weight.data_ptr(), eps, cos_rows.data_ptr(), cos_rows.stride(0),
                                           sin_rows.data_ptr(), sin_rows.stride(0), x.dtype == torch.bfloat16)
    return out


def silu_and_mul_fits(x: torch.Tensor) -> bool:
    """2-D CPU rows `[gate, up]` of an even width, unit-stride, float32 or bfloat16."""
    return (x.dim() == 2 and x.device.type == "cpu" and x.dtype in DTYPES and x.shape[1] % 2 == 0
            and x.stride(1) == 1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`F.silu(x[:, :d]) * x[:, d:]` (SGLang's `SiluAndMul`): two torch ops and a strided view,
    ~60 us a layer at batch 1 on this CPU, where the kernel takes a few. bfloat16 rounds the SiLU
    before the product, as torch does; the SiLU's exponential is the kernels' own (within 2 ulp
    of expf, floored at e^-88), so a product may differ from torch's in its last bit, and a gate
    below -88 gives a SiLU of ~-1e-36 where torch's is -0. Check `silu_and_mul_fits` first."""
    d = x.shape[1] // 2
    out = torch.empty((x.shape[0], d), dtype=x.dtype)
    load_layer_ops().dspark_silu_and_mul(x.data_ptr(), x.stride(0), out.data_ptr(), x.shape[0], d,
                                         x.dtype == torch.bfloat16, torch.get_num_threads())
    return out
