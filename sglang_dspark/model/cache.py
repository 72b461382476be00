"""`DraftContextCache`: the drafter's incremental cache of projected-context K/V.

Each slot (a request) holds, per drafter layer, the K (after k_norm and RoPE) and V of its
committed context positions `0..lengths[slot]-1`. Drafting a block reads them; nothing reads a
row past `lengths[slot]`, so nothing needs cropping after a block (the served kernel path parks
a block's own K/V there, `kernels_cpu.drafter_ops`, and the next append overwrites them). After
verification the caller appends the accepted positions' taps (`DSparkDrafter.append_context`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


class DraftContextCache:
    """Per-layer K/V `[num_slots, capacity, kv_heads, head_dim]` plus `lengths [num_slots]`.

    The capacity grows (doubling) when an append needs more room, so callers need not know the
    final sequence length up front.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        kv_heads: int,
        head_dim: int,
        capacity: int = 256,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        if num_layers < 1 or num_slots < 1 or capacity < 1:
            raise ValueError(
                f"num_layers={num_layers}, num_slots={num_slots}, capacity={capacity}: "
                "expected all >= 1"
            )
        shape = (num_slots, capacity, kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = torch.zeros(num_slots, dtype=torch.long, device=device)

    @property
    def num_slots(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    def check_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Return `slots` as a long tensor on the cache device; reject out-of-range or repeats."""
        slots = torch.as_tensor(slots, dtype=torch.long, device=self.device).reshape(-1)
        ids = slots.tolist()  # a few ids a step: checked in Python, ~5 us against ~60 for torch.unique & co
        if ids and (min(ids) < 0 or max(ids) >= self.num_slots):
            raise ValueError(f"slots {ids} out of range: expected ids in [0, {self.num_slots - 1}]")
        if len(set(ids)) != len(ids):
            raise ValueError(f"slots {ids} repeat an id: expected distinct slots")
        return slots

    def ensure_capacity(self, needed: int) -> None:
        """Grow every layer's K/V so that positions `< needed` fit."""
        if needed <= self.capacity:
            return
        new_capacity = max(needed, 2 * self.capacity)
        for tensors in (self.keys, self.values):
            for i, old in enumerate(tensors):
                grown = old.new_zeros((old.shape[0], new_capacity) + old.shape[2:])
                grown[:, : old.shape[1]] = old
                tensors[i] = grown

    def reset(self, slots: torch.Tensor) -> None:
        """Forget the context of `slots` (a finished request's slot can be reused)."""
        self.lengths[self.check_slots(slots)] = 0

    def truncate(self, slots: torch.Tensor, new_lengths: torch.Tensor) -> None:
        """Shorten the context of `slots` to `new_lengths` (never lengthen it)."""
        slots = self.check_slots(slots)
        new_lengths = torch.as_tensor(new_lengths, dtype=torch.long, device=self.device).reshape(-1)
        if new_lengths.shape != slots.shape:
            raise ValueError(
                f"new_lengths has {new_lengths.numel()} entries for {slots.numel()} slots: "
                "expected one per slot"
            )
        current = self.lengths[slots]
        if bool((new_lengths < 0).any()) or bool((new_lengths > current).any()):
            raise ValueError(
                f"new_lengths {new_lengths.tolist()} must lie in [0, current] = "
                f"[0, {current.tolist()}]"
            )
        self.lengths[slots] = new_lengths


@dataclass
class BlockContext:
    """One block step's view of the context cache: slot b's block (`width` rows at positions
    `starts[b]..starts[b] + width - 1`) attends to the slot's cached rows `0..starts[b] - 1` and to
    its own block. `model.layers.InjectedAttention.attend_cached` gathers those rows; a kernel may
    read them in place, building what all layers share once per step (`shared`)."""

    cache: DraftContextCache
    slots: torch.Tensor
    starts: torch.Tensor
    width: int
    shared: dict[str, Any] = field(default_factory=dict)

    def gathered(self, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Layer `layer`'s context K/V `[B, C, kv_heads, head_dim]` (C: the longest context) and the
        mask `[B, 1, 1, C + width]` that hides each shorter context's padding (None: no padding)."""
        if "mask" not in self.shared:
            arange = torch.arange(len(self.slots), device=self.slots.device)
            self.shared["mask"], self.shared["contiguous"] = self._mask(), bool(torch.equal(self.slots, arange))
        context_len = int(self.starts.max())
        keys, values = self.cache.keys[layer], self.cache.values[layer]
        if self.shared["contiguous"]:
            ctx_k, ctx_v = keys[: len(self.slots), :context_len], values[: len(self.slots), :context_len]
        else:
            ctx_k, ctx_v = keys[self.slots, :context_len], values[self.slots, :context_len]
        return ctx_k.to(dtype), ctx_v.to(dtype), self.shared["mask"]

    def _mask(self) -> torch.Tensor | None:
        context_len = int(self.starts.max())
        if int(self.starts.min()) == context_len:
            return None
        visible = torch.arange(context_len, device=self.starts.device) < self.starts.unsqueeze(-1)
        block = visible.new_ones(len(self.slots), self.width)
        return torch.cat((visible, block), dim=-1)[:, None, None, :]


def packed_rows(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows packed run by run (`counts[i]` rows for run i): each row's run and its offset in
    the run, what `torch.repeat_interleave(arange, counts)` and a cumsum give.

    Why not `repeat_interleave`: with a tensor of repeats it opens a parallel region for any two
    runs (grain size 1), and inside the busy 2-core server py-spy showed its barrier waiting for
    the second OpenMP thread; `searchsorted` stays on the calling thread below 200 rows."""
    ends = torch.cumsum(counts, 0)
    rows = torch.arange(int(counts.sum()), device=counts.device)
    run = torch.searchsorted(ends, rows, right=True)
    return run, rows - (ends - counts)[run]
