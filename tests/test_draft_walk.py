"""The one-call C++ greedy walk drafts what `decoding.sample_block` drafts for greedy rows."""

from __future__ import annotations

import pytest
import torch

from sglang_dspark.decoding import SamplingParams, sample_block
from sglang_dspark.kernels_cpu.draft_walk import GreedyWalk, greedy_walk_fits
from sglang_dspark.kernels_cpu.gemm_layout import add_linear_panels, relayout_linears
from tiny import make_tiny_drafter, make_tiny_target

DRAFTERS = {
    "dspark, reduced vocabulary": dict(draft_vocab_size=300),
    "dspark, full vocabulary": dict(),
    "confidence without the Markov embedding": dict(confidence_with_markov=False),
    "dflash twin (no heads)": dict(markov_rank=0, markov_head_type=None, confidence=False),
}


def _drafter(dtype: torch.dtype, options: dict, served_layout: bool):
    drafter = make_tiny_drafter(make_tiny_target(), gamma=7, dtype=dtype, **options)
    for parameter in drafter.parameters():  # trained heads are far from their tiny init
        parameter.data.mul_(4.0)
    if served_layout:  # as the worker loads it: column-major linears, panel copies
        relayout_linears(drafter)
        add_linear_panels(drafter)
    return drafter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("served_layout", [False, True])
def test_the_greedy_walk_drafts_what_sample_block_drafts(dtype, name, served_layout):
    drafter = _drafter(dtype, DRAFTERS[name], served_layout)
    generator = torch.Generator().manual_seed(3)
    block = torch.randn(9, 7, 64, generator=generator).to(dtype)
    anchors = torch.randint(0, 512, (9,), generator=generator)
    walk = GreedyWalk(drafter, head_panels=served_layout)
    with torch.inference_mode():
        for width in (7, 2):  # the worker walks the first `width` slots of a block: a strided view
            hidden = block[:, :width]
            want = sample_block(drafter, hidden, anchors, SamplingParams.uniform(9, temperature=0.0))
            got = walk(hidden, anchors)
            assert torch.equal(got.tokens, want.tokens), f"width {width}"
            assert got.probs is None
            if want.confidence_logits is None:
                assert got.confidence_logits is None
            else:  # float32 sums in another order: equal up to one rounding of the drafter's dtype
                ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-5
                torch.testing.assert_close(got.confidence_logits, want.confidence_logits, rtol=ulp, atol=ulp)
    assert len(set(got.tokens.flatten().tolist())) > 3, "the drafts depend on the rows (not a constant)"


def test_a_drafter_the_kernel_cannot_walk_is_refused_with_the_reason():
    gated = make_tiny_drafter(make_tiny_target(), markov_head_type="gated")
    assert not greedy_walk_fits(gated)
    with pytest.raises(ValueError, match="vanilla Markov head"):
        GreedyWalk(gated)
    drafter = make_tiny_drafter(make_tiny_target())
    with pytest.raises(ValueError, match=r"expected \[B, W, d\]"):
        GreedyWalk(drafter)(torch.zeros(2, 4, 64, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.long))
