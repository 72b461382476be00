"""Grammar-constrained decoding (JSON schema, regex, EBNF, structural tags) on DSPARK_LIVE's verify rows.

SGLang keeps each constrained request's grammar matcher on the request and advances it over the
tokens each step commits. Our algorithm does not advance it inside verify, so SGLang runs a batch
that holds a grammar synchronously (`ScheduleBatch.grammar_needs_sync`): when the worker sees the
batch, every matcher stands after the request's bonus token. A verify window is a chain (bonus,
then the drafts), so SGLang's own tree walk for speculative grammars (`traverse_tree`) fills each
row's bitmask: the grammar's allowed next tokens after the drafts before that row, accepting and
rolling back each draft, and leaving the rows after a draft the grammar refuses unconstrained
(that draft's target probability is zero, so acceptance stops there).

While the drafter walks its block, `GrammarSteering` shows it what each constrained request's
grammar allows next: each slot drafts the drafter's best allowed token (sampled rows: a draw from
the drafter's distribution masked to the allowed tokens, which is then their p_d), so a draft
the grammar would refuse is never proposed where the draft vocabulary holds an allowed one
(unsteered, one refused draft ended the drafts worth verifying, even where the drafter ranked an
allowed token second). Where the walk kernel serves, it walks first, unmasked, and
`steer_walked_block` draws again, steered, only the rows and slots from a draft the grammar
refuses, a slot's rows in one batched call: the drafter mostly drafts what the grammar allows,
and a whole walk in Python cost ~2.7 against ~0.6 ms for one request's block.

Before planning, `guide_drafts` walks the same chains: a position where the grammar allows one
token takes it (accepted for certain), and drafts from the first one the grammar refuses on are
not verified (rejected for certain), so a constrained request neither wastes verify rows nor loses
the tokens its grammar dictates.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from sglang.srt.speculative.spec_utils import traverse_tree

from sglang_dspark.decoding import DraftBlock, SamplingParams
from sglang_dspark.decoding.sampling import logits_to_probs, sample_from_probs


def apply_grammar_masks(logits: torch.Tensor, reqs, bonus: torch.Tensor, drafts: torch.Tensor,
                        window_lens: torch.Tensor, vocab_size: int) -> None:
    """Mask, in place, the packed verify rows of every request with a grammar (request b's
    `window_lens[b]` rows, its window being the bonus and `drafts[b, :window_lens[b] - 1]`)."""
    grammars = [req.grammar for req in reqs if req.grammar is not None]
    if not grammars:
        return
    masks = grammars[0].allocate_vocab_mask(vocab_size=vocab_size, batch_size=int(window_lens.sum()), device="cpu")
    first = 0
    for b, req in enumerate(reqs):
        width = int(window_lens[b])
        if req.grammar is not None and not req.finished():
            chain = torch.cat([bonus[b:b + 1].cpu(), drafts[b, : width - 1].cpu()]).to(torch.int64)
            next_token = torch.arange(1, width + 1)
            next_token[-1] = -1
            traverse_tree(next_token, torch.full((width,), -1), chain, req.grammar, masks[first:first + width],
                          vocab_size=vocab_size)
        first += width
    grammars[0].apply_vocab_mask(logits, grammars[0].move_vocab_mask(masks, logits.device))


class _DraftColumns:
    """Grammar bitmasks (target ids, 32 a int32 word, lowest bit first) read as the draft
    vocabulary's columns."""

    def __init__(self, vocab_size: int, draft_ids: torch.Tensor) -> None:
        draft_ids = draft_ids.to(device="cpu", dtype=torch.long)
        self.ids = draft_ids.clamp(0, vocab_size - 1).numpy()
        self.in_vocab = ((draft_ids >= 0) & (draft_ids < vocab_size)).numpy()

    def allowed(self, masks: torch.Tensor) -> np.ndarray:
        """`[B, words]` bitmasks -> `[B, V_draft]` bool, in one unpack for the whole batch."""
        bits = np.unpackbits(masks.numpy().view(np.uint8), axis=1, bitorder="little")
        return bits[:, self.ids].astype(bool) & self.in_vocab


def _allows(mask_row: torch.Tensor, token: int, vocab_size: int) -> bool:
    return 0 <= token < vocab_size and bool(int(mask_row[token // 32]) >> (token % 32) & 1)


class GrammarSteering:
    """A `decoding.Steering` over the constrained requests of one block walk.

    At slot 0 each grammar stands after the bonus token (SGLang's grammar accepted it); before
    each later slot it accepts the slot before's draft, and `close` rolls every grammar back. A
    row whose grammar has terminated, or allows no token of the draft vocabulary, is no longer
    steered: its drafts from there on are the drafter's own, and `guide_drafts` verifies none of
    them."""

    def __init__(self, reqs, vocab_size: int, draft_ids: torch.Tensor) -> None:
        """`draft_ids` [V_draft]: the target id of each draft column."""
        self._grammars = [None if req.grammar is None or req.finished() else req.grammar for req in reqs]
        self._steered = list(self._grammars)
        self._accepted = [0] * len(reqs)
        self._columns = _DraftColumns(vocab_size, draft_ids)
        first = next((grammar for grammar in self._grammars if grammar is not None), None)
        self._masks = None if first is None else first.allocate_vocab_mask(
            vocab_size=vocab_size, batch_size=len(reqs), device="cpu")

    @property
    def steers(self) -> bool:
        """Whether any request of the walk has a grammar to steer by."""
        return self._masks is not None

    def allowed(self, slot: int, prev_tokens: torch.Tensor) -> torch.Tensor:
        self._masks.fill_(-1)  # every token allowed: rows without a grammar to steer by
        for row, grammar in enumerate(self._steered):
            if grammar is None:
                continue
            if slot > 0:
                grammar.accept_token(int(prev_tokens[row]))
                self._accepted[row] += 1
            if grammar.is_terminated():
                self._steered[row] = None
            else:
                grammar.fill_vocab_mask(self._masks, row)
        allowed = self._columns.allowed(self._masks)
        for row in np.flatnonzero(~allowed.any(axis=1)):  # nothing the drafter can propose: leave it be
            self._steered[row] = None
            allowed[row] = True
        return torch.from_numpy(allowed)

    def close(self) -> None:
        """Roll every grammar back to where the walk found it."""
        for row, grammar in enumerate(self._grammars):
            if self._accepted[row]:
                grammar.rollback(self._accepted[row])
        self._accepted = [0] * len(self._accepted)


SlotLogits = Callable[[torch.Tensor, int, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]
"""`slot_logits(rows, slot, prev_tokens)`: the drafter's logits `[n, V_draft]` at `slot` for these
block rows after `prev_tokens [n]` (target ids), and its confidence logits there `[n]` (None
without a confidence head). The Markov head is assumed state-free (vanilla, or none): the walk
kernel, whose blocks this steers, serves no other."""


def steer_walked_block(draft: DraftBlock, reqs, params: SamplingParams, bonus: torch.Tensor, vocab_size: int,
                       draft_ids: torch.Tensor, slot_logits: SlotLogits, generator: torch.Generator | None) -> None:
    """Steer, after the fact, a block the walk kernel drew without masks, in place.

    Slot by slot, each constrained request's draft goes through its grammar. A draft it allows
    stands; from the first one it refuses, the row is drawn again at every later slot, steered
    (the Markov head conditions each slot on the draft before), all such rows of a slot in one
    batched call. A kept sampled draft's distribution becomes the drafter's masked to what the
    grammar allowed there, renormalised: a draw from q kept where allowed and otherwise redrawn
    from the masked q is a draw from the masked q, and rejection sampling must be told the
    distribution the draft came from. Every grammar ends where it began."""
    live = {row: req.grammar for row, req in enumerate(reqs) if req.grammar is not None and not req.finished()}
    if not live:
        return
    columns = _DraftColumns(vocab_size, draft_ids)
    masks = next(iter(live.values())).allocate_vocab_mask(vocab_size=vocab_size, batch_size=len(reqs), device="cpu")
    tokens = draft.tokens.cpu().clone()
    accepted = dict.fromkeys(live, 0)
    redrawn: set[int] = set()
    try:
        for slot in range(tokens.shape[1]):
            for row, grammar in list(live.items()):
                if grammar.is_terminated():  # `guide_drafts` verifies nothing from here on
                    del live[row]
                else:
                    grammar.fill_vocab_mask(masks, row)
            redrawn |= {row for row in live if not _allows(masks[row], int(tokens[row, slot]), vocab_size)}
            # the allowed columns, unpacked only where a draw or a distribution needs them
            unpacked = [row for row in live if row in redrawn or (draft.probs is not None and not bool(params.greedy[row]))]
            allowed = dict(zip(unpacked, columns.allowed(masks[unpacked]))) if unpacked else {}
            for row in [row for row in unpacked if not allowed[row].any()]:  # nothing to draft: cut there too
                del live[row], allowed[row]
            redraw = [row for row in allowed if row in redrawn]
            if redraw:
                _redraw(draft, tokens, redraw, slot, torch.from_numpy(np.stack([allowed[row] for row in redraw])),
                        params, bonus, draft_ids, slot_logits, generator)
            for row in allowed:
                if row not in redrawn:  # a kept sampled draft
                    masked = draft.probs[row, slot] * torch.from_numpy(allowed[row]).to(draft.probs.device)
                    draft.probs[row, slot] = masked / masked.sum()
            for row, grammar in live.items():
                grammar.accept_token(int(tokens[row, slot]))
                accepted[row] += 1
    finally:
        for row, count in accepted.items():
            if count:
                reqs[row].grammar.rollback(count)
    draft.tokens.copy_(tokens.to(draft.tokens.device))


def _redraw(draft: DraftBlock, tokens: torch.Tensor, rows: list[int], slot: int, allowed: torch.Tensor,
            params: SamplingParams, bonus: torch.Tensor, draft_ids: torch.Tensor, slot_logits: SlotLogits,
            generator: torch.Generator | None) -> None:
    """Draw `rows` again at `slot` from the drafter's logits masked to `allowed` [n, V_draft]."""
    index = torch.tensor(rows)
    prev = tokens[index, slot - 1] if slot else bonus.cpu()[index].to(torch.long)
    logits, confidences = slot_logits(index, slot, prev)
    logits = logits.float().masked_fill(~allowed.to(logits.device), float("-inf"))
    if bool(params.greedy[index].all()):
        picked = logits.argmax(-1)
    else:
        probs = logits_to_probs(logits, params.select(index).to(logits.device))
        picked = sample_from_probs(probs, generator)
        if draft.probs is not None:
            draft.probs[index.to(draft.probs.device), slot] = probs.to(draft.probs.device)
    tokens[index, slot] = draft_ids[picked.cpu()].to(tokens.dtype)
    if confidences is not None and draft.confidence_logits is not None:
        device = draft.confidence_logits.device
        draft.confidence_logits[index.to(device), slot] = confidences.float().to(device)


FORCED_CONFIDENCE_LOGIT = 20.0
"""Confidence logit of a draft the grammar forces: the target's masked distribution is a point mass
on it, so it survives for certain (sigmoid(20) ~ 1 - 2e-9)."""


def guide_drafts(draft: DraftBlock, reqs, greedy: torch.Tensor, vocab_size: int,
                 draft_columns: Callable[[list[int]], torch.Tensor]) -> torch.Tensor | None:
    """Walk each constrained request's drafts through its grammar before planning.

    Where the grammar allows a single token, that token becomes the draft, with a certain
    confidence (the target, masked, is certain of it: jump-forward decoding inside the block) and,
    for sampled rows, a point-mass draft distribution (only inside the draft vocabulary, which
    `draft_columns` maps to; -1 outside).
    From the first draft the grammar refuses on, every draft is a certain rejection. Returns the
    drafts worth verifying per request [B] (None: no request has a grammar); the block's tokens,
    probabilities and confidences are updated in place. Every grammar is rolled back to where it
    stood."""
    if not any(req.grammar is not None for req in reqs):
        return None
    tokens = draft.tokens.cpu()
    width = tokens.shape[1]
    limits = torch.full((len(reqs),), width, dtype=torch.long)
    forced: list[tuple[int, int, int]] = []  # (request, position, token)
    for b, req in enumerate(reqs):
        if req.grammar is None or req.finished():
            continue
        limits[b], replaced = _walk_chain(req.grammar, tokens[b].tolist(), vocab_size,
                                          lambda token: bool(greedy[b]) or int(draft_columns([token])[0]) >= 0)
        forced += [(b, j, token) for j, token in replaced]
    if forced:
        _force(draft, forced, greedy, draft_columns)
    return limits


def _walk_chain(grammar, drafts: list[int], vocab_size: int, representable: Callable[[int], bool]
                ) -> tuple[int, list[tuple[int, int]]]:
    """(drafts worth verifying, [(position, forced token)]) of one chain; the grammar ends where it began."""
    mask = grammar.allocate_vocab_mask(vocab_size=vocab_size, batch_size=1, device="cpu")
    accepted, replaced, limit = 0, [], len(drafts)
    try:
        for j, token in enumerate(drafts):
            if grammar.is_terminated():
                limit = j
                break
            grammar.fill_vocab_mask(mask, 0)
            only = _single_allowed(mask[0])
            if only is not None and representable(only):  # certain, drafted already (steered) or not
                replaced.append((j, only))
                token = only
            elif not _allows(mask[0], token, vocab_size):
                limit = j
                break
            grammar.accept_token(token)
            accepted += 1
    finally:
        if accepted:
            grammar.rollback(accepted)
    return limit, replaced


def _single_allowed(bits: torch.Tensor) -> int | None:
    """The one token a bitmask row (32 tokens per int32 word) allows, or None."""
    words = bits.nonzero()
    if words.numel() != 1:
        return None
    index = int(words[0, 0])
    word = int(bits[index]) & 0xFFFFFFFF
    return index * 32 + word.bit_length() - 1 if word & (word - 1) == 0 else None


def _force(draft: DraftBlock, forced: list[tuple[int, int, int]], greedy: torch.Tensor,
           draft_columns: Callable[[list[int]], torch.Tensor]) -> None:
    rows, positions, tokens = (torch.tensor(column) for column in zip(*forced))
    draft.tokens[rows.to(draft.tokens.device), positions.to(draft.tokens.device)] = tokens.to(draft.tokens.device)
    if draft.confidence_logits is not None:
        draft.confidence_logits[rows, positions] = FORCED_CONFIDENCE_LOGIT
    sampled = ~greedy[rows].bool().cpu()
    if draft.probs is not None and bool(sampled.any()):
        rows, positions, tokens = rows[sampled], positions[sampled], tokens[sampled]
        device = draft.probs.device
        draft.probs[rows.to(device), positions.to(device)] = 0.0
        draft.probs[rows.to(device), positions.to(device), draft_columns(tokens.tolist()).to(device)] = 1.0
