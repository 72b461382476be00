"""The served drafter's RMSNorms, and its q/k norm + RoPE, as one `layer_ops` call each.

`model.layers.RMSNorm` is 6 torch ops and `apply_rotary` 6 more. A drafted step with the one-layer
drafter ran ~50 of them: the catch-up's context norm and key norm + RoPE, the block layer's four
norms and its q and k RoPE, the final norm. Each costs more right after the target's forward has
emptied the caches. The kernels read a row once and round once (float32 inside, as the torch
norm computes), so the drafts may differ from the torch path's in the last bit of a bfloat16
value: the drafter needs no bit-exactness (the target verifies every draft).
"""

from __future__ import annotations

import torch

from sglang_dspark.kernels_cpu.layer_ops import (add_rmsnorm, head_norm_rope, head_norm_rope_fits, load_layer_ops,
                                                rmsnorm_input_fits, rmsnorm_weight_fits)
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
    """An `InjectedAttention` whose q/k norm + RoPE is one `layer_ops.head_norm_rope` call."""

    def norm_rope(self, norm: RMSNorm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not head_norm_rope_fits(x, norm.weight, cos, sin):
            return super().norm_rope(norm, x, cos, sin)
        return head_norm_rope(x, norm.weight, norm.eps, cos, sin)


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
