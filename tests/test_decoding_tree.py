"""Draft trees: the best-first growth, greedy acceptance, and the KV slot order after acceptance."""

from __future__ import annotations

import itertools

import pytest
import torch

from sglang_dspark.decoding.sampling import SamplingParams, logits_to_probs
from sglang_dspark.decoding.verification import DraftBlock
from sglang_dspark.decoding.tree import DraftTree, accept_sampled, grow_tree, tree_slot_order
from sglang_dspark.kernels_cpu.target_sampling import kernel_sampler


def _markov(vocab: int, seed: int):
    """A bias table `[prev, slot, vocab]` and the `MarkovBias` reading it."""
    table = torch.randn(vocab, 4, vocab, generator=torch.Generator().manual_seed(seed)) * 2

    def bias(parents: torch.Tensor, slot: int) -> torch.Tensor:
        return table[parents, slot]
    return table, bias


def _path_scores(base: torch.Tensor, table: torch.Tensor, bonus: int) -> dict[tuple[int, ...], float]:
    """Every path of every depth after `bonus`, with its summed log-probability (brute force)."""
    width, vocab = base.shape
    scores: dict[tuple[int, ...], float] = {}
    for depth in range(1, width + 1):
        for path in itertools.product(range(vocab), repeat=depth):
            score, prev = 0.0, bonus
            for slot, token in enumerate(path):
                score += float(torch.log_softmax(base[slot] + table[prev, slot], -1)[token])
                prev = token
            scores[path] = score
    return scores


def _paths(tree: DraftTree) -> list[tuple[int, ...]]:
    return [tuple(tree.tokens[row - 1] for row in tree.ancestry(node)[1:]) for node in range(1, tree.rows)]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("nodes", [1, 3, 7, 12])
def test_a_tree_holds_the_most_probable_continuations_of_the_bonus(seed: int, nodes: int) -> None:
    vocab, width, bonus = 4, 3, 2
    base = torch.randn(width, vocab, generator=torch.Generator().manual_seed(100 + seed)) * 2
    table, bias = _markov(vocab, seed)
    tree = grow_tree(base, bonus, bias, None, nodes, children_per_node=vocab)
    scores = _path_scores(base, table, bonus)
    threshold = sorted(scores.values(), reverse=True)[nodes - 1]
    got = _paths(tree)
    assert len(got) == len(set(got)) == nodes
    assert min(scores[path] for path in got) >= threshold - 1e-5, "a less probable path displaced a better one"
    ordered = [scores[path] for path in got]
    assert all(a >= b - 1e-5 for a, b in zip(ordered, ordered[1:])), "rows are not listed best first"
    assert _paths(tree.first(nodes // 2)) == got[: nodes // 2]  # the best half, as a tree of its own


def test_a_tree_maps_draft_ids_to_target_ids_and_orders_parents_first() -> None:
    vocab, width = 5, 4
    base = torch.randn(width, vocab, generator=torch.Generator().manual_seed(7))
    _, bias = _markov(100, 3)  # parents are target ids up to 99
    draft_to_target = torch.tensor([10, 20, 30, 40, 99])
    tree = grow_tree(base, 0, lambda parents, slot: bias(parents, slot)[:, :vocab], draft_to_target, 9)
    assert set(tree.tokens) <= {10, 20, 30, 40, 99}
    assert all(parent < row for row, parent in enumerate(tree.parents, start=1))


def test_a_malformed_tree_is_refused() -> None:
    with pytest.raises(ValueError, match="parent"):
        DraftTree(tokens=[5, 6], parents=[0, 0], depths=[1, 2])
    with pytest.raises(ValueError, match="one of each"):
        DraftTree(tokens=[5], parents=[0, 0], depths=[1])


def _next_token(prefix: tuple[int, ...]) -> int:
    """A deterministic 'target': the greedy choice after any prefix."""
    return (sum(prefix) * 7 + len(prefix) * 3) % 5


def test_greedy_acceptance_commits_exactly_what_greedy_decoding_would() -> None:
    generator = torch.Generator().manual_seed(11)
    for _ in range(200):
        tokens, parents, depths = [], [], []
        for row in range(1, 1 + int(torch.randint(1, 12, (1,), generator=generator))):
            parent = int(torch.randint(0, row, (1,), generator=generator))
            tokens.append(int(torch.randint(0, 5, (1,), generator=generator)))
            parents.append(parent)
            depths.append(1 + (depths[parent - 1] if parent else 0))
        tree = DraftTree(tokens=tokens, parents=parents, depths=depths)
        bonus = 3
        row_argmax = [_next_token((bonus,) + tuple(tree.tokens[r - 1] for r in tree.ancestry(row)[1:]))
                      for row in range(tree.rows)]
        accepted, committed = tree.accept_greedy(row_argmax)
        greedy = [bonus]
        for _ in range(len(committed)):
            greedy.append(_next_token(tuple(greedy)))
        assert committed == greedy[1:], "the tree committed something greedy decoding would not"
        assert [tree.tokens[r - 1] for r in accepted] == committed[:-1]
        assert all(tree.parents[b - 1] == a for a, b in zip([0] + accepted, accepted)), "not a path from the root"
        last = accepted[-1] if accepted else 0
        children = [tree.tokens[r - 1] for r in range(1, tree.rows) if tree.parents[r - 1] == last]
        assert committed[-1] not in children, "the walk stopped though a child held the target's choice"


def _target_logits(prefix: tuple[int, ...], vocab: int = 5) -> torch.Tensor:
    """A toy target's logits after `prefix`: far from uniform, different after every prefix."""
    seed = sum((token + 1) * 31 ** i for i, token in enumerate(prefix))
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 1.5


@pytest.mark.parametrize("sampler", [None, kernel_sampler], ids=["torch", "kernel"])
def test_sampled_acceptance_draws_exactly_the_targets_distribution(sampler) -> None:
    """8,000 walks, each over the best nodes plus a chain of two drafts freshly drawn from the
    drafter's distributions (so the tree's shape changes with the chain, as served): the first two
    tokens (the second drawn from the target after the first where the walk stopped there, as the
    next step would) follow the target's p(t1) p(t2 | t1) under its temperature and top-k, and the
    chain's first draft is accepted as often as a chain verify's rejection sampling would accept
    it, sum(min(p_t, p_d))."""
    vocab, bonus = 5, 2
    params = SamplingParams.uniform(1, temperature=0.8, top_k=4)
    paths = [()] + [(a,) for a in range(vocab)]
    logits_of = {path: _target_logits((bonus,) + path) for path in paths}
    probs = {path: logits_to_probs(logits.unsqueeze(0), params)[0] for path, logits in logits_of.items()}
    draft_probs = torch.softmax(torch.randn(1 + vocab, vocab, generator=torch.Generator().manual_seed(5)), -1)
    best = DraftTree(tokens=[0, 1, 3], parents=[0, 0, 1], depths=[1, 1, 2])
    generator, walks = torch.Generator().manual_seed(3), 8_000
    counts: dict[tuple[int, int], int] = {}
    chain_first_accepted = 0
    for _ in range(walks):
        first = int(torch.multinomial(draft_probs[0], 1, generator=generator))
        second = int(torch.multinomial(draft_probs[1 + first], 1, generator=generator))
        chain = DraftBlock(tokens=torch.tensor([[first, second]]), confidence_logits=None,
                           probs=torch.stack((draft_probs[0], draft_probs[1 + first])).unsqueeze(0))
        tree = best.with_path([first, second])
        row_paths = [tuple(tree.tokens[r - 1] for r in tree.ancestry(row)[1:]) for row in range(tree.rows)]
        logits = torch.stack([logits_of.get(path, torch.zeros(vocab)) for path in row_paths])
        accepted, committed = accept_sampled(tree, logits, params, generator, sampler, chain, chain_len=2)
        assert committed[:-1] == [tree.tokens[row - 1] for row in accepted]
        chain_first_accepted += committed[0] == first
        if len(committed) == 1:
            committed.append(int(torch.multinomial(probs[(committed[0],)], 1, generator=generator)))
        counts[tuple(committed[:2])] = counts.get(tuple(committed[:2]), 0) + 1

    def close(seen: float, expected: float) -> bool:
        return abs(seen - expected) < 4 * (expected * (1 - expected) / walks) ** 0.5 + 1e-9

    for pair in itertools.product(range(vocab), repeat=2):
        expected = float(probs[()][pair[0]] * probs[(pair[0],)][pair[1]])
        assert close(counts.get(pair, 0) / walks, expected), f"{pair}: {counts.get(pair, 0) / walks} vs {expected}"
    assert close(chain_first_accepted / walks, float(torch.minimum(probs[()], draft_probs[0]).sum()))


def test_sampled_acceptance_refuses_rows_or_a_chain_that_do_not_fit_the_tree() -> None:
    tree = DraftTree(tokens=[0, 1], parents=[0, 0], depths=[1, 1])
    with pytest.raises(ValueError, match="expected \\[3, V\\]"):
        accept_sampled(tree, torch.zeros(2, 5), SamplingParams.uniform(1), None)
    chain = DraftBlock(tokens=torch.tensor([[0, 4]]), probs=torch.full((1, 2, 5), 0.2), confidence_logits=None)
    with pytest.raises(ValueError, match="holds 1 of the chain's 2 drafts"):
        accept_sampled(tree, torch.zeros(3, 5), SamplingParams.uniform(1), None, chain=chain, chain_len=2)


def test_the_walked_chain_depth_is_the_part_of_it_the_tree_holds_as_a_path() -> None:
    tree = DraftTree(tokens=[4, 5, 6, 7], parents=[0, 0, 1, 3], depths=[1, 1, 2, 3])
    assert tree.chain_depth([4, 6, 7, 1]) == 3
    assert tree.chain_depth([5, 6]) == 1
    assert tree.chain_depth([9]) == 0


def test_accepted_nodes_take_the_first_kv_slots_and_every_slot_is_kept() -> None:
    node_slots = [101, 102, 103, 104, 105]
    order = tree_slot_order(node_slots, [2, 4])
    assert order[:2] == [102, 104]
    assert sorted(order) == node_slots, "a slot was lost or shared"
    assert tree_slot_order(node_slots, []) == node_slots


def test_following_tokens_walks_the_path_the_tree_holds() -> None:
    tree = DraftTree(tokens=[4, 5, 6, 7], parents=[0, 0, 1, 3], depths=[1, 1, 2, 3])
    assert tree.follow([4, 6, 7, 1]) == [1, 3, 4]
    assert tree.follow([5, 6]) == [2]
    assert tree.follow([]) == []


def test_a_tree_takes_a_path_it_lacks_as_new_rows_after_its_own() -> None:
    tree = DraftTree(tokens=[5, 6, 7], parents=[0, 0, 1], depths=[1, 1, 2])
    assert tree.with_path([5, 7]) == tree  # it holds that path already
    grown = tree.with_path([5, 8, 9])
    assert grown.tokens[:3] == tree.tokens and grown.rows == tree.rows + 2
    assert grown.follow([5, 8, 9]) == [1, 4, 5] and grown.depths[3:] == [2, 3]
    assert DraftTree(tokens=[], parents=[], depths=[]).with_path([4, 4]).parents == [0, 1]
