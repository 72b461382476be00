"""The served drafter's norms and q/k RoPE as kernel calls compute what the torch modules compute."""

from __future__ import annotations

import copy

import pytest
import torch

from sglang_dspark.kernels_cpu.drafter_ops import KernelInjectedAttention, KernelRMSNorm, add_drafter_kernels
from sglang_dspark.kernels_cpu.layer_ops import head_norm_rope
from sglang_dspark.model.layers import apply_rotary
from tiny import make_tiny_drafter, make_tiny_target, tiny_taps


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_head_norm_rope_is_the_norm_then_the_rotation(dtype, tolerance):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 4, 64, generator=generator).to(dtype)  # [B, L, heads, head_dim]
    weight = torch.rand(64, generator=generator).to(dtype) + 0.5
    angles = torch.rand(3, 5, 1, 32, generator=generator) * 100
    cos, sin = torch.cat((angles, angles), -1).cos().to(dtype), torch.cat((angles, angles), -1).sin().to(dtype)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()
    want = apply_rotary(normed, cos.float(), sin.float())
    torch.testing.assert_close(head_norm_rope(x, weight, 1e-6, cos, sin).float(), want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 6e-2)])
def test_a_drafter_with_kernels_drafts_the_blocks_the_torch_drafter_drafts(dtype, tolerance):
    target = make_tiny_target()
    drafter = make_tiny_drafter(target, gamma=7, dtype=dtype)
    served = copy.deepcopy(drafter)
    assert add_drafter_kernels(served) == 2 + 5 * len(served.layers)  # context and final norms; a layer: 4 norms, attention
    assert any(isinstance(m, KernelRMSNorm) for m in served.modules())
    assert any(isinstance(m, KernelInjectedAttention) for m in served.modules())
    assert served.state_dict().keys() == drafter.state_dict().keys()
    ids = torch.randint(0, 500, (2, 30), generator=torch.Generator().manual_seed(1))
    taps = tiny_taps(target, ids).to(dtype)
    slots, anchors = torch.tensor([3, 1]), ids[:, -1]
    blocks = []
    with torch.inference_mode():
        for model in (drafter, served):
            cache = model.new_cache(num_slots=4)
            # a ragged context: 29 and 17 committed positions, appended in two calls
            model.append_context(cache, slots, torch.cat((taps[0, :20], taps[1, :10])), torch.tensor([20, 10]))
            model.append_context(cache, slots, torch.cat((taps[0, 20:29], taps[1, 10:17])), torch.tensor([9, 7]))
            first = model.forward_block(cache, slots, anchors).float()
            # the block's K/V may sit past each context's end: the next append must replace them
            model.append_context(cache, slots, torch.cat((taps[0, 29:], taps[1, 17:20])), torch.tensor([1, 3]))
            blocks.append((first, model.forward_block(cache, slots, ids[:, 20]).float()))
    for served_block, torch_block in zip(blocks[1], blocks[0]):
        torch.testing.assert_close(served_block, torch_block, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("num_layers", [1, 2])
def test_a_block_of_fewer_slots_drafts_what_the_whole_block_drafts_there(kernels, num_layers):
    """A step that drafts w < gamma slots computes only those w rows in the last layer (they still
    attend to all gamma block rows, so every earlier layer runs whole): the same hidden states."""
    target = make_tiny_target()
    drafter = make_tiny_drafter(target, gamma=7, num_layers=num_layers)
    if kernels:
        add_drafter_kernels(drafter)
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(2))
    taps = tiny_taps(target, ids)
    slots = torch.tensor([2, 0])
    with torch.inference_mode():
        cache = drafter.new_cache(num_slots=3)
        drafter.append_context(cache, slots, torch.cat((taps[0, :23], taps[1, :15])), torch.tensor([23, 15]))
        whole = drafter.forward_block(cache, slots, ids[:, 23])
        for width in range(1, 8):
            part = drafter.forward_block(cache, slots, ids[:, 23], width)
            assert part.shape == (2, width, whole.shape[-1])
            torch.testing.assert_close(part, whole[:, :width], rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="block width 8: expected 1..gamma=7"):
            drafter.forward_block(cache, slots, ids[:, 23], 8)
