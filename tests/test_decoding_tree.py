"""Draft trees: the best-first growth, greedy acceptance, and the KV slot order after acceptance."""

from __future__ import annotations

import itertools

import pytest
import torch

from sglang_dspark.decoding.tree import DraftTree, grow_tree, tree_slot_order


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
