"""Lookup drafts: where a request's text repeats itself, its own earlier continuation is the draft.

A request whose last 2-4 tokens (the bonus token included) occurred before in its prompt or
output proposes the tokens that followed their latest occurrence, in place of the drafter's block,
and the verify forward checks them like any draft: output stays exactly the target's (for a
sampled request the proposal is a point mass, so rejection sampling accepts each draft with the
target's probability of it).
SmolLM2-135M's greedy answers repeat (lists, code, loops before `max_new_tokens`): on 180 eval
prompts' greedy answers (`scripts/lookup_replay.py`) 45 % of the positions had such a match, where
the proposal survived to position 1 in 75 % of rounds and to position 7 in 30-37 % (the drafter,
on all rounds: 55 % / 1-4 %), and using the lookup wherever it matched and filled the block
committed 2.54 tokens a round against the drafter's 2.01.

Each slot keeps its committed tokens and a dict from every 2-, 3- and 4-gram to where its latest
occurrence continues, updated as tokens commit: a proposal is three dict look-ups, whatever the
context length. The confidence head does not score these drafts, so their survivals come from the
served lookup rounds themselves (`LookupSurvival`, one per temperature class and match length: a
4-token match survived its first draft 84 % of the time, a 2-token one 51 %), and their rounds stay
out of the confidence calibration.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_MATCH = 2
MAX_MATCH = 4
PRIOR_ROUNDS = 32.0
"""Pseudo-rounds behind the prior conditional acceptance, so a few served rounds cannot swing it."""
PRIOR_GREEDY = {
    2: (0.51, 0.65, 0.72, 0.80, 0.76, 0.80, 0.85),
    3: (0.68, 0.71, 0.80, 0.77, 0.82, 0.86, 0.85),
    4: (0.84, 0.87, 0.89, 0.91, 0.92, 0.93, 0.93),
}
"""Conditional acceptance at positions 1-7 of lookup drafts on SmolLM2-135M's greedy eval answers, by
the length of the match that proposed them (session 48: 180 eval answers, 8,362 lookup rounds, 1,750
of 2 tokens, 1,082 of 3, 5,530 of 4): a 4-token match is right first 84 % of the time, a 2-token
one 51 %, no better than the drafter's first draft."""
PRIOR_SAMPLED = {
    2: (0.38, 0.65, 0.79, 0.76, 0.88, 0.91, 0.88),
    3: (0.63, 0.65, 0.79, 0.76, 0.88, 0.91, 0.88),
    4: (0.68, 0.78, 0.86, 0.76, 0.88, 0.91, 0.88),
}
"""The same for sampled requests at temperature 1 (each draft accepted with the target's probability
of it): served lookup rounds on the eval prompts at concurrency 4 and 16 (session 48: 345, 151 and 206
rounds of 2-, 3- and 4-token matches) where at least 50 rounds tested a position, elsewhere the
served rounds of all lengths together (session 28, `bench serve --temperature 1.0`), which the
planner verified too rarely that deep to split."""


class SequenceLookup:
    """One request's committed tokens and the latest continuation of each of their n-grams."""

    def __init__(self, tokens: list[int] | None = None) -> None:
        self.tokens: list[int] = []
        self._continuations: dict[tuple[int, ...], int] = {}
        self.extend(tokens or [])

    def extend(self, tokens: list[int]) -> None:
        """Commit tokens; every n-gram that now ends one position before the end is indexed
        (its continuation, the next token, exists)."""
        for token in tokens:
            self.tokens.append(int(token))
            end = len(self.tokens) - 1  # the n-grams ending at `end - 1` continue at `end`
            for n in range(MIN_MATCH, MAX_MATCH + 1):
                if end - n >= 0:
                    self._continuations[tuple(self.tokens[end - n:end])] = end

    def match(self, bonus: int) -> tuple[int, int]:
        """(where the continuation starts, suffix length n) of the latest earlier occurrence of
        the longest suffix (2-4 tokens, ending with `bonus`) of the committed tokens plus `bonus`;
        (-1, 0) without one."""
        committed = len(self.tokens)
        for n in range(MAX_MATCH, MIN_MATCH - 1, -1):
            if committed < n - 1:
                continue
            suffix = (*self.tokens[committed - n + 1:], int(bonus))
            # the occurrence ending at the last committed token (a run: "a a a") continues into the
            # bonus; it is not indexed yet, since its continuation is not committed
            start = (committed if committed >= n and tuple(self.tokens[committed - n:]) == suffix
                     else self._continuations.get(suffix))
            if start is not None:
                return start, n
        return -1, 0

    def propose(self, bonus: int, width: int) -> list[int]:
        """`width` tokens that followed the latest earlier occurrence of the longest suffix (2-4
        tokens, ending with `bonus`) of the committed tokens plus `bonus`; [] without one.

        Where that continuation reaches the bonus before `width` tokens, the text repeats with a
        period shorter than the block ("a a a", "x y x y"), and the proposal goes on repeating it:
        a run would otherwise never fill a block, since its latest occurrence always ends at the
        text's end."""
        start, _ = self.match(bonus)
        return [] if start < 0 else self.continuation(start, bonus, width)

    def continuation(self, start: int, bonus: int, width: int) -> list[int]:
        """`width` tokens from `start` on, the committed tokens and then `bonus`, repeated from
        `start` where they run out (`propose`)."""
        continued = self.tokens[start:start + width]
        if len(continued) == width:
            return continued
        period = continued + [int(bonus)]  # what followed the occurrence, up to the bonus
        return [period[k % len(period)] for k in range(width)]


MISSES_BEFORE_QUIET = 3
"""Lookup rounds in a row that accepted nothing before a request stops proposing lookups for a while."""
QUIET_TOKENS = (8, 64)
"""A request's first quiet spell lasts 8 committed tokens, each one after it twice the one before, up
to 64, until a lookup round accepts a draft again."""


@dataclass
class _Backoff:
    """One slot's refused lookup rounds in a row and quiet spells (`SlotLookups.observe`)."""

    misses: int = 0
    quiet_until: int = 0  # committed length from which the slot proposes again
    next_quiet: int = QUIET_TOKENS[0]


class SlotLookups:
    """Each request slot's `SequenceLookup`, kept in step with the slot's committed KV length.

    A request whose text nearly repeats (`"s2s3s4s5..."`: each n-gram's latest continuation is
    one step behind) matches every step and is refused every time; the survivals the planner
    learns are shared by all requests of a temperature class, so they cannot single it out (one
    JSON answer verified 161 lookup drafts and accepted none). After `MISSES_BEFORE_QUIET` such
    rounds in a row the slot proposes nothing for a quiet spell (`QUIET_TOKENS`), and the
    drafter drafts for it instead."""

    def __init__(self) -> None:
        self._slots: dict[int, SequenceLookup] = {}
        self._backoffs: dict[int, _Backoff] = {}

    def reset(self, slot: int, tokens: list[int]) -> None:
        """After an extend: the slot holds exactly `tokens` (prompt, cached prefix, earlier output)."""
        self._slots[slot] = SequenceLookup(tokens)
        self._backoffs.pop(slot, None)

    def observe(self, slot: int, accepted: int) -> None:
        """A verified lookup round of the slot accepted `accepted` of its drafts."""
        lookup = self._slots.get(slot)
        if accepted > 0 or lookup is None:
            self._backoffs.pop(slot, None)
            return
        backoff = self._backoffs.setdefault(slot, _Backoff())
        backoff.misses += 1
        if backoff.misses >= MISSES_BEFORE_QUIET:
            backoff.misses = 0
            backoff.quiet_until = len(lookup.tokens) + backoff.next_quiet
            backoff.next_quiet = min(2 * backoff.next_quiet, QUIET_TOKENS[1])

    def quiet(self, slot: int) -> bool:
        """Whether the slot is in a quiet spell (it proposes no lookups)."""
        lookup, backoff = self._slots.get(slot), self._backoffs.get(slot)
        return lookup is not None and backoff is not None and len(lookup.tokens) < backoff.quiet_until

    def commit(self, slot: int, tokens: list[int]) -> None:
        lookup = self._slots.get(slot)
        if lookup is not None:
            lookup.extend(tokens)

    def synced(self, slot: int, committed: int) -> bool:
        """Whether the slot's tokens are the request's `committed` tokens (else it cannot propose)."""
        lookup = self._slots.get(slot)
        return lookup is not None and len(lookup.tokens) == committed

    def propose(self, slots: list[int], bonus: list[int], committed: list[int], eligible: list[bool],
                width: int) -> list[tuple[list[int], int]]:
        """Per request, `width` lookup drafts (a lookup replaces the drafter's whole block, so every
        request still verifies within the width the planner drafted) and the length of the match
        that proposed them, or `([], 0)`: no match, or an ineligible, out-of-step or quiet slot."""
        proposals = []
        for slot, token, length, ok in zip(slots, bonus, committed, eligible):
            lookup = self._slots.get(slot) if ok and self.synced(slot, length) and not self.quiet(slot) else None
            start, n = (-1, 0) if lookup is None else lookup.match(token)
            proposals.append(([], 0) if start < 0 else (lookup.continuation(start, token, width), n))
        return proposals


class LookupSurvival:
    """Prefix survivals of lookup drafts per position, learnt from the served lookup rounds on
    top of a prior (`PRIOR_GREEDY`, `PRIOR_SAMPLED`): conditional acceptance at position k is the
    share of rounds that verified position k having accepted k - 1 drafts which accepted it."""

    def __init__(self, gamma: int, prior_conditional: tuple[float, ...]) -> None:
        padding = (prior_conditional[-1],) * max(0, gamma - len(prior_conditional))
        prior = torch.tensor(prior_conditional[:gamma] + padding, dtype=torch.float64)
        self._tested = torch.full((gamma,), PRIOR_ROUNDS, dtype=torch.float64)
        self._accepted = prior * PRIOR_ROUNDS

    def survivals(self) -> torch.Tensor:
        """`[gamma]` float32: the chance that a lookup draft survives to each position."""
        return torch.cumprod(self._accepted / self._tested, dim=0).to(torch.float32)

    def add(self, verify_lens: torch.Tensor, accepted: torch.Tensor) -> None:
        """Lookup rounds' verified drafts [R] and accepted drafts [R]."""
        positions = torch.arange(1, self._tested.numel() + 1)
        tested = positions[None, :] <= torch.minimum(accepted + 1, verify_lens)[:, None]
        self._tested += tested.sum(0)
        self._accepted += (positions[None, :] <= accepted[:, None]).sum(0)
