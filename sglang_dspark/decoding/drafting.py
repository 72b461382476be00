"""Draft sampling: the Markov walk over one block of drafter hidden states.

The parallel backbone gives base logits U_k for all gamma slots at once; the Markov head makes
the block a left-to-right chain (dspark-algorithm.md section 2): with prev_0 = anchor,

    x_k ~ transform(U_k + B_k(prev_k)),   prev_{k+1} = x_k,

where ``transform`` is :func:`logits_to_probs` (the same temperature/top-p/top-k the target
uses, or argmax when greedy). Each step is an exact softmax, so the kept fp32 probabilities are
exactly the p_d that rejection sampling needs. The confidence head scores slot k from h_k and
the sampled previous token, so it must run inside the walk too.

A ``Steering`` may restrict each slot to some columns (a constrained request's grammar): the slot
then drafts from its logits with the other columns masked out, and that masked distribution is
the p_d kept, so rejection sampling stays exact whatever the steering allows.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from sglang_dspark.decoding.sampling import SamplingParams, logits_to_probs, sample_from_probs
from sglang_dspark.decoding.verification import DraftBlock


class BlockDrafter(Protocol):
    """What the walk needs from a drafter (``sglang_dspark.model.DSparkDrafter`` provides it)."""

    d2t: torch.Tensor | None
    has_confidence_head: bool

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def markov_bias(
        self, prev_tokens: torch.Tensor, hidden: torch.Tensor, state: Any
    ) -> tuple[torch.Tensor, Any]: ...

    def confidence_logits(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor: ...


class Steering(Protocol):
    """Which draft columns each slot may propose (for example, what a request's grammar allows next)."""

    def allowed(self, slot: int, prev_tokens: torch.Tensor) -> torch.Tensor | None:
        """``[B, V_draft]`` bool: the columns slot ``slot`` may draft after ``prev_tokens [B]``
        (target ids: the anchors at slot 0, then the previous slot's drafts). Every row allows at
        least one column; None restricts nothing."""
        ...


def sample_block(
    drafter: BlockDrafter,
    hidden: torch.Tensor,
    anchors: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    steering: Steering | None = None,
) -> DraftBlock:
    """Walk the block ``hidden [B, gamma, d]`` from ``anchors [B]`` (target ids).

    Returns drafts as target ids, their fp32 distributions (``None`` if every row is greedy) over
    the drafter's vocabulary, whose target ids are ``probs_vocab`` (the drafter's ``d2t``; None for
    a full-vocabulary drafter), and the confidence logits (``None`` for a drafter without a
    confidence head). ``steering`` masks each slot's logits to the columns it allows.
    """
    if hidden.dim() != 3 or anchors.shape != (hidden.shape[0],):
        raise ValueError(
            f"expected hidden [B, gamma, d] and anchors [B], got {tuple(hidden.shape)} and "
            f"{tuple(anchors.shape)}"
        )
    batch, gamma, _ = hidden.shape
    d2t = drafter.d2t
    vocab_map = None if d2t is None else d2t.to(hidden.device)
    all_greedy = bool(params.greedy.all())

    base = drafter.base_logits(hidden)
    prev = anchors.to(device=hidden.device, dtype=torch.long)
    state = None
    tokens, probs, confidences = [], [], []
    for slot in range(gamma):
        slot_hidden = hidden[:, slot]
        if drafter.has_confidence_head:
            confidences.append(drafter.confidence_logits(slot_hidden, prev).float())
        bias, state = drafter.markov_bias(prev, slot_hidden, state)
        logits = base[:, slot].float() + bias.float()
        allowed = None if steering is None else steering.allowed(slot, prev)
        if allowed is not None:
            logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
        if all_greedy:
            draft_ids = logits.argmax(-1)
        else:
            slot_probs = logits_to_probs(logits, params)
            draft_ids = sample_from_probs(slot_probs, generator)
            probs.append(slot_probs)
        prev = draft_ids if vocab_map is None else vocab_map[draft_ids]
        tokens.append(prev)
    return DraftBlock(
        tokens=torch.stack(tokens, dim=1),
        probs=None if all_greedy else torch.stack(probs, dim=1),
        confidence_logits=torch.stack(confidences, dim=1) if confidences else None,
        probs_vocab=None if all_greedy else vocab_map,
    )
