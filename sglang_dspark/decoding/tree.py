"""A best-first tree of drafts for one request, and its acceptance, greedy or sampled (pure torch).

At batch 1 on a CPU a verify row costs a few percent of the forward, so more drafts per step pay
if they are the right ones. A chain spends every row on one guess per position; a tree spends
them where the drafter is least sure. `grow_tree` keeps the `nodes` continuations of the bonus
token with the highest drafter probability (each slot's distribution is the drafter's base
logits plus the Markov head's bias from the node's own parent token, so every node is scored
exactly as the walk would score it). Offline, teacher-forced on 18 eval prompts with the shipped
SmolLM2 drafter (session 53), greedy tau: a chain of 7 drafts 2.14, a chain of 5 plus a runner-up
branch of 2 (what batch 1 served before) 2.29, a tree of 7 nodes 2.43, of 15 nodes 2.72.

Row 0 of a tree is the bonus token (the root); rows 1.. are its nodes, each after its parent,
so a row's ancestors all come before it. Acceptance walks from the root, each time to the child
holding the target's next token, and commits those tokens plus the target's token after the
last. Greedy, that token is the row's argmax: exactly greedy decoding, whatever the tree holds.
Sampled (`accept_sampled`), each reached row's token is drawn from the target's distribution
there (temperature, top-k, top-p, min-p), one row after the other: ancestral sampling of the
target, so the output distribution is exactly the target's, whatever the tree holds. A node
reached that way survives with the target's probability of its token (p_t(x)); a draft drawn
from the drafter survives a rejection test with probability min(1, p_t(x) / p_d(x)), which is
worth more where the two distributions agree but are flat (temperature 1: sum p_d p_t against
sum min(p_t, p_d) a position). So a sampled request's tree holds its sampled chain: on the
chain's rows its draft is tested first, and only a rejection draws from the residual, which may
still lead to a sibling. The walk then accepts at least what the chain alone would.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

from sglang_dspark.decoding.sampling import SamplingParams
from sglang_dspark.decoding.verification import DraftBlock, TargetSampler, TorchTargetRows

MarkovBias = Callable[[torch.Tensor, int], torch.Tensor]
"""(parent target ids `[n]`, block slot k) -> the drafter's bias `[n, V_draft]` at slot k."""


@dataclass(frozen=True)
class DraftTree:
    """Nodes in row order (row r >= 1 is node r - 1): target ids, parent rows (0: the bonus) and
    depths (1: right after the bonus, at most the block width)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]

    def __post_init__(self) -> None:
        if not len(self.tokens) == len(self.parents) == len(self.depths):
            raise ValueError(f"a tree of {len(self.tokens)} tokens, {len(self.parents)} parents and "
                             f"{len(self.depths)} depths: expected one of each per node")
        for row, (parent, depth) in enumerate(zip(self.parents, self.depths), start=1):
            parent_depth = 0 if parent == 0 else self.depths[parent - 1] if 0 < parent < row else None
            if parent_depth is None or depth != parent_depth + 1:
                raise ValueError(f"node row {row}: parent row {parent} at depth {parent_depth}, depth {depth}: "
                                 "expected an earlier parent one level up")

    @property
    def rows(self) -> int:
        """Verify rows: the bonus and every node."""
        return 1 + len(self.tokens)

    def ancestry(self, row: int) -> list[int]:
        """Rows from the root down to `row`, both included: the window rows its query sees."""
        path = [row]
        while path[-1] != 0:
            path.append(self.parents[path[-1] - 1])
        return path[::-1]

    @cached_property
    def _children(self) -> dict[tuple[int, int], int]:
        """(parent row, token) -> the first child row holding it."""
        children: dict[tuple[int, int], int] = {}
        for row, (parent, token) in enumerate(zip(self.parents, self.tokens), start=1):
            children.setdefault((parent, token), row)
        return children

    def follow(self, tokens: list[int]) -> list[int]:
        """The rows of the path from the root along `tokens` (drafts after the bonus), as far as
        the tree holds it."""
        rows, row = [], 0
        for token in tokens:
            if (row := self._children.get((row, token))) is None:
                break
            rows.append(row)
        return rows

    def first(self, nodes: int) -> DraftTree:
        """The tree of the first `nodes` nodes (each row's parent comes before it, so they are a
        tree): a best-first tree's `nodes` best."""
        return DraftTree(tokens=self.tokens[:nodes], parents=self.parents[:nodes], depths=self.depths[:nodes])

    def with_path(self, tokens: list[int]) -> DraftTree:
        """This tree holding `tokens` (drafts after the bonus) as a path: the nodes it lacks are
        added after its own rows, each after its parent."""
        rows = self.follow(tokens)
        own_tokens, parents, depths = list(self.tokens), list(self.parents), list(self.depths)
        row = rows[-1] if rows else 0
        for token in tokens[len(rows):]:
            own_tokens.append(token)
            parents.append(row)
            depths.append(1 if row == 0 else depths[row - 1] + 1)
            row = len(own_tokens)
        return DraftTree(tokens=own_tokens, parents=parents, depths=depths)

    def chain_depth(self, chain: list[int]) -> int:
        """How many leading tokens of `chain` (drafts after the bonus) the tree holds as a path."""
        return len(self.follow(chain))

    def accept(self, target_token: Callable[[int], int]) -> tuple[list[int], list[int]]:
        """(accepted node rows, committed tokens) given `target_token(row)`, the target's token
        after a row, asked once for each row the walk reaches, in order: the walk from the root to
        the child holding each token; the committed tokens are the accepted nodes' tokens and the
        target's token after the last of them."""
        accepted, row = [], 0
        while (child := self._children.get((row, token := target_token(row)))) is not None:
            accepted.append(child)
            row = child
        return accepted, [self.tokens[r - 1] for r in accepted] + [token]

    def accept_greedy(self, target_argmax: list[int]) -> tuple[list[int], list[int]]:
        """`accept` given the target's argmax after every row."""
        if len(target_argmax) != self.rows:
            raise ValueError(f"{len(target_argmax)} target choices for a tree of {self.rows} rows")
        return self.accept(target_argmax.__getitem__)


def accept_sampled(tree: DraftTree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                   sampler: TargetSampler | None = None, chain: DraftBlock | None = None, chain_len: int = 0
                   ) -> tuple[list[int], list[int]]:
    """`DraftTree.accept` for a sampled request: `logits [tree.rows, V]` its verify rows, `params`
    its sampling parameters (one request). Each row the walk reaches gives the target's token
    there (`sampler` serves its distribution without materialising it where it can, as in
    `verification.verify_packed`; only reached rows are ever normalised): drawn from p_t, except
    on the rows of `chain`'s first `chain_len` drafts (drawn from the drafter's distributions in
    `chain.probs`, which the tree must hold as a path). There the chain's next draft x is tested
    first, as a chain verify would: accepted with probability min(1, p_t(x) / p_d(x)), else the
    token is drawn from the residual norm(max(0, p_t - p_d)), which may still lead to a sibling.
    Either way the token is distributed as p_t, so the output is the target's, and the walk accepts
    the chain's drafts exactly as far as its rejection sampling would (the residual never holds a
    rejected draft): the committed tokens' common prefix with the chain is the chain's outcome."""
    if logits.dim() != 2 or logits.shape[0] != tree.rows or params.batch_size != 1:
        raise ValueError(f"logits {tuple(logits.shape)} and {params.batch_size} requests' parameters for a tree "
                         f"of {tree.rows} rows: expected [{tree.rows}, V] and one request")
    drafts = [] if chain is None else chain.tokens[0, :chain_len].tolist()
    chain_rows = [0] + tree.follow(drafts)
    if len(chain_rows) != len(drafts) + 1:
        raise ValueError(f"the tree holds {len(chain_rows) - 1} of the chain's {len(drafts)} drafts as a path")
    depth_of = {row: depth for depth, row in enumerate(chain_rows[:-1])}  # rows whose next token a draft tests
    first = torch.tensor([0])

    def target_token(row: int) -> int:
        rows = torch.tensor([row])
        target = (sampler(logits, rows, params) if sampler is not None else None) or TorchTargetRows(logits, rows, params)
        if (depth := depth_of.get(row)) is None:
            return int(target.sample(first, generator)[0])
        slot = torch.tensor([depth])
        p_target = float(target.probs_at(first, torch.tensor([drafts[depth]]))[0])
        p_draft = float(chain.token_probs(first, slot)[0])
        if float(torch.rand((), generator=generator, dtype=torch.float64)) * p_draft < p_target:
            return drafts[depth]
        return int(target.sample_final(first, torch.tensor([True]), chain, first, slot, generator)[0])

    return tree.accept(target_token)


def grow_tree(base_logits: torch.Tensor, bonus: int, markov_bias: MarkovBias, draft_to_target: torch.Tensor | None,
              nodes: int, children_per_node: int = 4) -> DraftTree:
    """The `nodes` most probable continuations of `bonus` under the drafter, as a tree.

    `base_logits [width, V_draft]`: the drafter's slot logits of this block; `markov_bias`: the
    Markov head's bias at a slot given parent tokens; `draft_to_target`: draft id -> target id
    (None: the same). Level by level, each node of the frontier offers its `children_per_node`
    best children, scored by the path's summed log-probability. A path's score only falls as it
    grows, so a node scored below the `nodes`-th best score seen so far can be in the tree no
    more than its descendants: it leaves the frontier. The tree is the `nodes` best of all, and
    every kept node's parent is kept too. Its rows are listed best first, so its first m nodes
    are the tree of the m best (`DraftTree.first`).
    """
    width = base_logits.shape[0]
    if nodes < 1 or width < 1:
        raise ValueError(f"a tree of {nodes} nodes over {width} slots: expected at least one of each")
    base_logits = base_logits.float()
    frontier_tokens = torch.tensor([bonus], dtype=torch.long)
    frontier_scores = torch.zeros(1, dtype=torch.float32)
    frontier_ids = [0]  # candidate index of each frontier node (0: the bonus)
    candidates: list[tuple[float, int, int, int]] = [(0.0, 0, -1, bonus)]  # (score, depth, parent candidate, token)
    best_scores: list[float] = []  # a min-heap of the `nodes` best scores so far
    for slot in range(width):
        logits = base_logits[slot].unsqueeze(0) + markov_bias(frontier_tokens, slot).float()
        best, draft_ids = logits.topk(min(children_per_node, logits.shape[-1]), dim=-1)
        # log-probabilities of the best children only (no softmax over the whole vocabulary)
        scores = frontier_scores.unsqueeze(1) + best - torch.logsumexp(logits, dim=-1, keepdim=True)
        tokens = draft_ids if draft_to_target is None else draft_to_target[draft_ids.to(draft_to_target.device)].cpu()
        level = []
        for parent, row_scores, row_tokens in zip(frontier_ids, scores.tolist(), tokens.tolist()):
            for score, token in zip(row_scores, row_tokens):
                if len(best_scores) < nodes:
                    heapq.heappush(best_scores, score)
                elif score > best_scores[0]:
                    heapq.heapreplace(best_scores, score)
                else:
                    continue
                level.append((score, token, len(candidates)))
                candidates.append((score, slot + 1, parent, token))
        level = [entry for entry in level if len(best_scores) < nodes or entry[0] >= best_scores[0]]
        if not level:
            break
        frontier_scores = torch.tensor([score for score, _, _ in level], dtype=torch.float32)
        frontier_tokens = torch.tensor([token for _, token, _ in level], dtype=torch.long)
        frontier_ids = [index for _, _, index in level]
    # best first; a tie goes to the shallower node, so a parent always comes before its child
    chosen = sorted(range(1, len(candidates)), key=lambda i: (-candidates[i][0], candidates[i][1]))[:nodes]
    row_of = {0: 0}
    tokens, parents, depths = [], [], []
    for index in chosen:
        _, depth, parent, token = candidates[index]
        row_of[index] = len(tokens) + 1
        tokens.append(token)
        parents.append(row_of[parent])
        depths.append(depth)
    return DraftTree(tokens=tokens, parents=parents, depths=depths)


def tree_slot_order(node_slots: list[int], accepted_rows: list[int]) -> list[int]:
    """The KV slots of a request's positions past its bonus once `accepted_rows` of its tree were
    committed: theirs first, in path order (their KV was computed at exactly those positions),
    then every other node's, which later windows overwrite. The same slots in another order:
    nothing leaks, nothing is shared."""
    accepted = [node_slots[row - 1] for row in accepted_rows]
    taken = set(accepted_rows)
    return accepted + [slot for row, slot in enumerate(node_slots, start=1) if row not in taken]
