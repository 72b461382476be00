"""The served drafter's small operations as kernel calls: RMSNorms and q/k norm + RoPE one
`layer_ops` call each, and a block's attention over the context cache read in place.

`model.layers.RMSNorm` is 6 torch ops and `apply_rotary` 6 more. A drafted step with the one-layer
drafter ran ~50 of them: the catch-up's context norm and key norm + RoPE, the block layer's four
norms and its q and k RoPE, the final norm. Each costs more right after the target's forward has
emptied the caches. The kernels read a row once and round once (float32 inside, as the torch
norm computes), so the drafts may differ from the torch path's in the last bit of a bfloat16
value: the drafter needs no bit-exactness (the target verifies every draft)."""

from __future__ import annotations

import torch

from sglang_dspark.kernels_cpu.layer_ops import (add_rmsnorm, head_norm_rope, head_norm_rope_fits, load_layer_ops,
                                                rmsnorm_input_fits, rmsnorm_weight_fits)
from sglang_dspark.kernels_cpu.paged_attention import KeyLayout, kernel_fits, paged_attention
from sglang_dspark.model.cache import BlockContext
from sglang_dspark.model.layers import InjectedAttention, RMSNorm


class KernelRMSNorm(RMSNorm):
    """An `RMSNorm` (same weight, same state_dict) whose unit-stride rows go through
    `layer_ops.add_rmsnorm`; anything else takes the torch norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if not rmsnorm_input_fits(rows, None, self.weight.shape[0]):
            return super().forward(x)
        return add_rmsnorm(rows, None, self.weight, self.eps).view(x.shape)


class KernelInjectedAttention(InjectedAttention):
    """An `InjectedAttention` whose q/k norm + RoPE is one `layer_ops.head_norm_rope` call, and
    whose block steps attend over the context cache in place (`paged_attention`).

    The torch path gathers each slot's cached K/V into a padded `[B, C, kv_heads, head_dim]`
    copy, appends the block's K/V (another copy) and runs SDPA with a mask over the padding: at
    batch 16 with ~300 cached positions that moved ~4 MB a layer. Here the block's K/V are written
    into the cache right after each slot's context (rows past its length, which the next append
    overwrites; nothing reads them later), and each block row attends to its slot's rows
    `0..start + width - 1` where they lie."""

    def norm_rope(self, norm: RMSNorm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not head_norm_rope_fits(x, norm.weight, cos, sin):
            return super().norm_rope(norm, x, cos, sin)
        return head_norm_rope(x, norm.weight, norm.eps, cos, sin)

    def attend_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: BlockContext,
                      layer: int, queries: int | None = None) -> torch.Tensor:
        cache = context.cache
        if (cache.device.type != "cpu" or x.dtype != cache.dtype
                or not kernel_fits(x.dtype, cache.dtype, self.head_dim, self.num_heads // self.num_kv_heads)):
            return super().attend_cached(x, cos, sin, context, layer, queries)
        batch, width, _ = x.shape
        rows = width if queries is None else queries
        key = ("paged_layout", rows)  # layers that attend with all rows share one, the last may not
        layout = context.shared.get(key) or _block_layout(context, rows)
        context.shared[key] = layout
        q = self.q_proj(x[:, :rows]).view(batch, rows, self.num_heads, self.head_dim)
        q = self.norm_rope(self.q_norm, q, cos[:, :rows], sin[:, :rows])
        block_k, block_v = self.key_value(x, cos, sin)
        keys, values = cache.keys[layer], cache.values[layer]
        positions = context.starts.unsqueeze(-1) + torch.arange(width)
        keys[context.slots.unsqueeze(-1), positions] = block_k
        values[context.slots.unsqueeze(-1), positions] = block_v
        cache_rows = keys.shape[0] * keys.shape[1]
        out = paged_attention(q.reshape(batch * rows, self.num_heads, self.head_dim),
                              keys.view(cache_rows, self.num_kv_heads, self.head_dim),
                              values.view(cache_rows, self.num_kv_heads, self.head_dim), layout, self.head_dim ** -0.5)
        return self.o_proj(out.view(batch, rows, -1))


def _block_layout(context: BlockContext, queries: int) -> KeyLayout:
    """Which cache rows each of the first `queries` rows of each block sees: slot b's rows
    `0..starts[b] + width - 1`, as rows of the cache flattened to `[num_slots * capacity]`. Grows
    the cache first where a block would not fit behind its context."""
    cache, width = context.cache, context.width
    cache.ensure_capacity(int(context.starts.max()) + width)
    seen = context.starts + width
    columns = torch.arange(int(seen.max()))
    # a [B, longest] grid cut to each slot's rows: ~20 us at batch 16, where searchsorted over the
    # ~5,000 packed rows (`packed_rows`) took 50-380 us
    grid = (context.slots * cache.capacity).unsqueeze(-1) + columns
    cache_rows = grid[columns < seen.unsqueeze(-1)].to(torch.int32)
    first = torch.cumsum(seen, 0) - seen
    return KeyLayout(spans=[], slots=cache_rows, key_start=first.repeat_interleave(queries),
                     key_count=seen.repeat_interleave(queries))


def add_drafter_kernels(drafter: torch.nn.Module) -> int:
    """Turn the drafter's `RMSNorm`s and `InjectedAttention`s into their kernel subclasses in place
    (same parameters); returns how many modules. Raises `KernelUnavailable` where the kernels
    cannot be built."""
    load_layer_ops()
    count = 0
    for module in drafter.modules():
        if type(module) is RMSNorm and rmsnorm_weight_fits(module.weight):
            module.__class__ = KernelRMSNorm
            count += 1
        elif type(module) is InjectedAttention:
            module.__class__ = KernelInjectedAttention
            count += 1
    return count
