"""The one-call C++ walk drafts what `decoding.sample_block` drafts: the same greedy drafts, and
sampled drafts (top-k / top-p too, greedy rows beside them) from the distributions it reports."""

from __future__ import annotations

import pytest
import torch

from sglang_dspark.decoding import SamplingParams, sample_block
from sglang_dspark.decoding.tree import grow_tree
from sglang_dspark.kernels_cpu.draft_walk import KernelWalk, kernel_walk_fits
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
    walk = KernelWalk(drafter, head_panels=served_layout)
    with torch.inference_mode():
        for width in (7, 2):  # the worker walks the first `width` slots of a block: a strided view
            hidden = block[:, :width]
            want = sample_block(drafter, hidden, anchors, SamplingParams.uniform(9, temperature=0.0))
            got = walk.greedy(hidden, anchors)
            assert torch.equal(got.tokens, want.tokens), f"width {width}"
            assert got.probs is None
            if want.confidence_logits is None:
                assert got.confidence_logits is None
            else:  # float32 sums in another order: equal up to one rounding of the drafter's dtype
                ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-5
                torch.testing.assert_close(got.confidence_logits, want.confidence_logits, rtol=ulp, atol=ulp)
    assert len(set(got.tokens.flatten().tolist())) > 3, "the drafts depend on the rows (not a constant)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["dspark, reduced vocabulary", "dspark, full vocabulary", "dflash twin (no heads)"])
def test_the_kernel_grows_the_tree_the_torch_growth_grows(dtype, name):
    """`KernelWalk.tree` (best first, in one call) holds the nodes `decoding.tree.grow_tree` holds:
    the same paths, or where bfloat16 scores tie, paths of the same scores. Both score drafts as
    the walk does: the best first draft scores what the walk's first draft scores."""
    drafter = _drafter(dtype, DRAFTERS[name], served_layout=True)
    generator = torch.Generator().manual_seed(8)
    hidden = torch.randn(3, 7, 64, generator=generator).to(dtype)
    anchors = torch.randint(0, 512, (3,), generator=generator)
    walk = KernelWalk(drafter)
    draft_ids = drafter.d2t if drafter.d2t is not None else torch.arange(drafter.config.draft_vocab_size)
    column = {int(token): index for index, token in enumerate(draft_ids)}
    with torch.inference_mode():
        base = walk.base_logits(hidden)
        chain = walk.greedy(hidden, anchors, base)
        for row in range(3):
            def bias(parents, slot, row=row):
                return drafter.markov_bias(parents, hidden[row, slot].expand(len(parents), -1), None)[0]

            first = base[row, 0].float() + bias(anchors[row : row + 1], 0)[0].float()
            assert float(first[column[int(chain.tokens[row, 0])]]) == float(first.max())

            def score(path, row=row):
                total, prev = 0.0, int(anchors[row])
                for slot, token in enumerate(path):
                    logits = base[row, slot].float() + bias(torch.tensor([prev]), slot)[0].float()
                    total += float(torch.log_softmax(logits, -1)[column[token]])
                    prev = token
                return total

            for nodes in (1, 6, 15):
                got = walk.tree(base[row], int(anchors[row]), nodes)
                want = grow_tree(base[row], int(anchors[row]), bias, drafter.d2t, nodes)
                assert got.rows == want.rows == nodes + 1
                assert float(first[column[got.tokens[0]]]) == float(first.max()), "the best first draft comes first"
                assert all(parent < node for node, parent in enumerate(got.parents, start=1)), "a child before its parent"
                listed = [score(tuple(got.tokens[r - 1] for r in got.ancestry(n)[1:])) for n in range(1, got.rows)]
                assert all(a >= b - 1e-3 for a, b in zip(listed, listed[1:])), "nodes not listed best first"
                got_paths = sorted(tuple(got.tokens[r - 1] for r in got.ancestry(n)[1:]) for n in range(1, got.rows))
                want_paths = sorted(tuple(want.tokens[r - 1] for r in want.ancestry(n)[1:]) for n in range(1, want.rows))
                if got_paths != want_paths:
                    assert dtype == torch.bfloat16, "float32 scores do not tie: the paths must be the same"
                    torch.testing.assert_close(sorted(map(score, got_paths)), sorted(map(score, want_paths)),
                                               rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="kernel tree"):
        walk.tree(base[0, :, :5], 1, 3)


def test_a_drafter_the_kernel_cannot_walk_is_refused_with_the_reason():
    gated = make_tiny_drafter(make_tiny_target(), markov_head_type="gated")
    assert not kernel_walk_fits(gated)
    with pytest.raises(ValueError, match="vanilla Markov head"):
        KernelWalk(gated)
    drafter = make_tiny_drafter(make_tiny_target())
    with pytest.raises(ValueError, match=r"expected \[B, W, d\]"):
        KernelWalk(drafter).greedy(torch.zeros(2, 4, 64, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["dspark, reduced vocabulary", "dflash twin (no heads)"])
def test_the_sampled_walk_reports_the_torch_walks_first_slot_distribution(dtype, name):
    """Slot 0 reads only the anchor, so its distribution is comparable with `sample_block`'s."""
    drafter = _drafter(dtype, DRAFTERS[name], served_layout=True)
    block = torch.randn(6, 7, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    anchors = torch.randint(0, 512, (6,), generator=torch.Generator().manual_seed(5))
    temperatures = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5, 2.0])
    params = SamplingParams(temperature=temperatures, top_p=torch.ones(6), top_k=torch.zeros(6, dtype=torch.long))
    with torch.inference_mode():
        want = sample_block(drafter, block, anchors, params, torch.Generator().manual_seed(0))
        got = KernelWalk(drafter).sampled(block, anchors, params, torch.Generator().manual_seed(0))
    assert got.probs.shape == want.probs.shape and got.tokens.shape == (6, 7)
    if drafter.d2t is not None:
        assert torch.equal(got.probs_vocab, drafter.d2t)
    torch.testing.assert_close(got.probs[:, 0], want.probs[:, 0], rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(got.probs.sum(-1), torch.ones(6, 7), rtol=1e-4, atol=1e-4)
    assert bool((got.token_probs(torch.arange(6).repeat_interleave(7), torch.arange(7).repeat(6)) > 0).all()), \
        "every draft has mass in the distribution reported for it"


def test_sampled_drafts_follow_the_distribution_the_walk_reports():
    from decoding_stats import FALSE_ALARM_RATE, chi_square_p_value

    drafter = _drafter(torch.float32, dict(draft_vocab_size=24), served_layout=False)
    rows = 20_000
    hidden = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(6)).expand(rows, 1, 64).contiguous()
    anchors = torch.full((rows,), 7)
    with torch.inference_mode():
        block = KernelWalk(drafter).sampled(hidden, anchors, SamplingParams.uniform(rows, temperature=1.5),
                                            torch.Generator().manual_seed(1))
    columns = torch.searchsorted(block.probs_vocab, block.tokens[:, 0])
    counts = torch.bincount(columns, minlength=24)
    assert chi_square_p_value(counts, block.probs[0, 0].double()) > FALSE_ALARM_RATE


MIXED = SamplingParams(  # greedy, temperature only, top-p, top-k, both, a top-k wider than the vocabulary
    temperature=torch.tensor([0.0, 0.8, 1.0, 1.2, 0.7, 1.0, 0.0, 2.0]),
    top_p=torch.tensor([1.0, 1.0, 0.9, 1.0, 0.8, 1.0, 0.5, 0.6]),
    top_k=torch.tensor([0, 0, 0, 5, 20, 100_000, 3, 0]),
)


@pytest.mark.parametrize("name", ["dspark, reduced vocabulary", "dspark, full vocabulary"])
def test_a_mixed_batch_walks_as_sample_block_walks_it(name):
    """Greedy rows draft the greedy walk's tokens; every sampled row's first slot reports
    `logits_to_probs`'s distribution: the same top-k / top-p set, renormalised."""
    drafter = _drafter(torch.float32, DRAFTERS[name], served_layout=True)
    block = torch.randn(8, 7, 64, generator=torch.Generator().manual_seed(7))
    anchors = torch.randint(0, 512, (8,), generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        want = sample_block(drafter, block, anchors, MIXED, torch.Generator().manual_seed(0))
        got = KernelWalk(drafter).sampled(block, anchors, MIXED, torch.Generator().manual_seed(0))
        greedy = sample_block(drafter, block, anchors, SamplingParams.uniform(8, temperature=0.0))
    rows = MIXED.greedy
    assert torch.equal(got.tokens[rows], greedy.tokens[rows])
    assert torch.equal(got.probs[rows], want.probs[rows]), "greedy rows: one-hot on their drafts"
    torch.testing.assert_close(got.probs[:, 0], want.probs[:, 0], rtol=1e-4, atol=1e-6)
    kept = (got.probs[:, 0] > 0).sum(-1)
    assert kept[3] == 5 and kept[4] <= 20 and 1 < kept[2] < got.probs.shape[-1], kept.tolist()
    assert bool((got.token_probs(torch.arange(8).repeat_interleave(7), torch.arange(7).repeat(8)) > 0).all()), \
        "every draft lies in its reported top-k / top-p set"


def test_min_p_rows_walk_as_sample_block_walks_them():
    """min-p alone, beside top-p and top-k, at 1 (only the most likely draft) and below the kernel's
    first floor: each row's reported distribution is `logits_to_probs`'s."""
    drafter = _drafter(torch.float32, DRAFTERS["dspark, reduced vocabulary"], served_layout=True)
    params = SamplingParams(temperature=torch.tensor([1.0, 0.8, 1.2, 1.0, 1.0]),
                            top_p=torch.tensor([1.0, 0.9, 1.0, 1.0, 1.0]), top_k=torch.tensor([0, 0, 30, 0, 0]),
                            min_p=torch.tensor([0.05, 0.1, 0.01, 1.0, 1e-5]))
    block = torch.randn(5, 7, 64, generator=torch.Generator().manual_seed(10)) * 4
    anchors = torch.randint(0, 512, (5,), generator=torch.Generator().manual_seed(11))
    with torch.inference_mode():
        want = sample_block(drafter, block, anchors, params, torch.Generator().manual_seed(0))
        got = KernelWalk(drafter).sampled(block, anchors, params, torch.Generator().manual_seed(0))
    assert torch.equal(got.probs[:, 0] > 0, want.probs[:, 0] > 0), "the kept sets differ"
    torch.testing.assert_close(got.probs[:, 0], want.probs[:, 0], rtol=1e-4, atol=1e-6)
    assert bool(((got.probs[3] > 0).sum(-1) == 1).all()), "min-p 1 keeps only the most likely draft"
    assert bool((got.token_probs(torch.arange(5).repeat_interleave(7), torch.arange(7).repeat(5)) > 0).all())


def test_a_nucleus_reaching_into_the_light_tail_is_cut_exactly():
    """Peaked rows whose top-p set takes tokens under a thousandth of the heaviest one (the kernel
    sorts only the heavy columns first, then widens) keep what `logits_to_probs` keeps."""
    drafter = _drafter(torch.float32, DRAFTERS["dflash twin (no heads)"], served_layout=False)
    scales = torch.logspace(0, 1.6, 12)  # from the drafter's spread to far more peaked rows
    block = torch.randn(12, 1, 64, generator=torch.Generator().manual_seed(9)) * scales[:, None, None]
    anchors = torch.zeros(12, dtype=torch.long)
    params = SamplingParams.uniform(12, temperature=1.0, top_p=0.995)
    with torch.inference_mode():
        want = sample_block(drafter, block, anchors, params, torch.Generator().manual_seed(0))
        got = KernelWalk(drafter).sampled(block, anchors, params, torch.Generator().manual_seed(0))
    kept = want.probs[:, 0]
    lightest_kept = torch.where(kept > 0, kept, torch.inf).min(-1).values
    assert bool((lightest_kept < 1e-3 * kept.max(-1).values).any()), "no row tested the widening"
    assert torch.equal(got.probs[:, 0] > 0, kept > 0)
    torch.testing.assert_close(got.probs[:, 0], kept, rtol=1e-4, atol=1e-7)


def test_top_p_drafts_follow_the_distribution_the_walk_reports():
    from decoding_stats import FALSE_ALARM_RATE, chi_square_p_value

    drafter = _drafter(torch.float32, dict(draft_vocab_size=24), served_layout=False)
    rows = 20_000
    hidden = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(6)).expand(rows, 1, 64).contiguous()
    params = SamplingParams.uniform(rows, temperature=1.5, top_p=0.7, top_k=6)
    with torch.inference_mode():
        block = KernelWalk(drafter).sampled(hidden, torch.full((rows,), 7), params, torch.Generator().manual_seed(2))
    reported = block.probs[0, 0].double()
    assert 1 < int((reported > 0).sum()) <= 6
    counts = torch.bincount(torch.searchsorted(block.probs_vocab, block.tokens[:, 0]), minlength=24)
    assert int(counts[reported == 0].sum()) == 0, "a draft outside the top-k / top-p set"
    assert chi_square_p_value(counts[reported > 0], reported[reported > 0]) > FALSE_ALARM_RATE
