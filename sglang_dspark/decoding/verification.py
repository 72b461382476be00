"""Chain verification of a draft block: greedy (argmax match) and rejection sampling.

Rejection sampling (Leviathan et al. 2023; Chen et al. 2023) makes the committed tokens follow
the target distribution exactly, whatever the draft distribution, as long as ``p_d`` is the
distribution each draft was really sampled from and the verify length of a row was fixed without
looking at the drafts it admits (the planner's non-anticipation). Per row b with ``L = verify_lens[b]``:

* draft k < L is accepted with probability ``min(1, p_t(x_k) / p_d(x_k))``; the accepted prefix
  stops at the first rejection;
* at the first rejected slot j the correction token is drawn from ``norm(max(0, p_t - p_d))``
  at slot j (``p_t`` if that residual has no mass, which only numerics can cause);
* if all L drafts are accepted, the bonus token is drawn from ``p_t`` at slot L.

Greedy rows (temperature 0) accept while the draft equals the target's argmax, and emit the
target's argmax at the first mismatch (or at slot L). Every row is processed in one vectorised
pass; ragged verify lengths are a mask, not a loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_dspark.decoding.sampling import SamplingParams, logits_to_probs, sample_from_probs

RESIDUAL_MASS_EPS = 1e-8
"""Below this the residual ``max(0, p_t - p_d)`` counts as empty (DeepSpec's threshold)."""

NO_TOKEN = -1
"""Fills ``VerifyResult.tokens`` past the committed tokens of a row."""


@dataclass
class DraftBlock:
    """One block of drafts per request.

    tokens: ``[B, gamma]`` target vocabulary ids, sampled left to right.
    probs: ``[B, gamma, V_target]`` fp32, the distribution each draft was sampled from (zero
        outside the draft vocabulary); ``None`` when every row is greedy.
    confidence_logits: ``[B, gamma]`` fp32 raw confidence-head logits (slot k conditioned on
        the sampled previous token); ``None`` for a drafter without a confidence head.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None
    confidence_logits: torch.Tensor | None

    @property
    def gamma(self) -> int:
        return self.tokens.shape[1]


@dataclass
class VerifyResult:
    """num_accepted: ``[B]`` accepted drafts per row; tokens: ``[B, S]`` the accepted drafts then
    the correction/bonus token (``num_accepted[b] + 1`` tokens committed), ``NO_TOKEN`` after."""

    num_accepted: torch.Tensor
    tokens: torch.Tensor


def verify(
    draft: DraftBlock,
    target_logits: torch.Tensor,
    verify_lens: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    target_argmax: torch.Tensor | None = None,
) -> VerifyResult:
    """Accept a prefix of each row's drafts and sample the correction or bonus token.

    ``target_logits [B, S, V]``: slot 0 is the target's prediction after the anchor, slot k after
    draft k-1; ``S`` is at least ``max(verify_lens) + 1`` and at most ``gamma + 1``.
    ``verify_lens [B]``: how many drafts of each row were verified (0..S-1); logits past a
    row's ``verify_lens[b] + 1`` slots are ignored.
    ``target_argmax [B, S]``: ``target_logits.argmax(-1)`` if the caller already has it (a faster
    kernel); it must agree with the logits in every verified slot.
    """
    batch, slots, vocab = _check_verify_inputs(draft, target_logits, verify_lens, params)
    device = target_logits.device
    num_drafts = slots - 1
    drafts = draft.tokens[:, :num_drafts].to(device)
    verify_lens = verify_lens.to(device=device, dtype=torch.long)
    greedy = params.greedy.to(device)
    if target_argmax is None:
        target_argmax = target_logits.argmax(-1)
    elif target_argmax.shape != (batch, slots):
        raise ValueError(f"target_argmax has shape {tuple(target_argmax.shape)}; expected [{batch}, {slots}]")
    target_argmax = target_argmax.to(device=device, dtype=torch.long)

    accepted = drafts == target_argmax[:, :num_drafts]
    sampled = ~greedy
    target_probs = None
    if bool(sampled.any()):
        target_probs = logits_to_probs(target_logits, params)
        draft_probs = draft.probs[:, :num_drafts].to(device)
        stochastic_accept = _rejection_accept(target_probs[:, :num_drafts], draft_probs, drafts, generator)
        accepted = torch.where(sampled.unsqueeze(-1), stochastic_accept, accepted)
    num_accepted = _accepted_prefix(accepted, verify_lens)

    rows = torch.arange(batch, device=device)
    final_token = target_argmax[rows, num_accepted]
    if target_probs is not None:
        rejected = num_accepted < verify_lens
        draft_slot = num_accepted.clamp(max=draft.gamma - 1)
        correction = _correction_distribution(
            target_probs[rows, num_accepted], draft.probs[rows, draft_slot].to(device), rejected
        )
        final_token = torch.where(sampled, sample_from_probs(correction, generator), final_token)

    return _committed_tokens(drafts, num_accepted, final_token, slots)


def verify_greedy(draft_tokens: torch.Tensor, target_argmax: torch.Tensor, verify_lens: torch.Tensor) -> VerifyResult:
    """`verify` for a batch of greedy rows, from the target's argmax alone (no logits, no copy).

    ``draft_tokens [B, >= S-1]``, ``target_argmax [B, S]`` (slot k: the target's choice after
    draft k-1), ``verify_lens [B]`` in 0..S-1. Gives exactly what `verify` gives greedy rows.
    """
    batch, slots = target_argmax.shape
    if draft_tokens.shape[0] != batch or draft_tokens.shape[1] < slots - 1 or verify_lens.shape != (batch,):
        raise ValueError(f"verify_greedy: draft tokens {tuple(draft_tokens.shape)} and verify_lens "
                         f"{tuple(verify_lens.shape)} do not fit target_argmax {tuple(target_argmax.shape)}")
    if bool(((verify_lens < 0) | (verify_lens > slots - 1)).any()):
        raise ValueError(f"verify_lens must be in 0..{slots - 1}, got {verify_lens.tolist()}")
    device = target_argmax.device
    target_argmax = target_argmax.to(torch.long)
    num_drafts = slots - 1
    drafts = draft_tokens[:, :num_drafts].to(device)
    num_accepted = _accepted_prefix(drafts == target_argmax[:, :num_drafts], verify_lens.to(device))
    final_token = target_argmax[torch.arange(batch, device=device), num_accepted]
    return _committed_tokens(drafts, num_accepted, final_token, slots)


def _accepted_prefix(accepted: torch.Tensor, verify_lens: torch.Tensor) -> torch.Tensor:
    """``[B]``: how many of each row's first drafts were accepted in a row, within its verify length."""
    in_window = torch.arange(accepted.shape[1], device=accepted.device).unsqueeze(0) < verify_lens.unsqueeze(-1)
    return torch.cumprod((accepted & in_window).long(), dim=-1).sum(-1)


def _committed_tokens(drafts: torch.Tensor, num_accepted: torch.Tensor, final_token: torch.Tensor,
                      slots: int) -> VerifyResult:
    """Each row's accepted drafts, then its correction or bonus token, then `NO_TOKEN`s."""
    batch, num_drafts = drafts.shape
    device = drafts.device
    tokens = torch.full((batch, slots), NO_TOKEN, dtype=torch.long, device=device)
    keep = torch.arange(num_drafts, device=device).unsqueeze(0) < num_accepted.unsqueeze(-1)
    tokens[:, :num_drafts] = torch.where(keep, drafts, tokens[:, :num_drafts])
    tokens[torch.arange(batch, device=device), num_accepted] = final_token
    return VerifyResult(num_accepted=num_accepted, tokens=tokens)


def _rejection_accept(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    drafts: torch.Tensor,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """``[B, n]`` bool: accept draft x with probability min(1, p_t(x) / p_d(x)).

    Written as ``u * p_d < p_t`` so that no division is needed; a draft with ``p_d = 0`` (never
    sampled that way) is accepted iff the target gives it mass.
    """
    index = drafts.unsqueeze(-1)
    p_target = target_probs.gather(-1, index).squeeze(-1)
    p_draft = draft_probs.gather(-1, index).squeeze(-1)
    uniform = torch.rand(p_target.shape, generator=generator, device=p_target.device)
    return uniform * p_draft < p_target


def _correction_distribution(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, rejected: torch.Tensor
) -> torch.Tensor:
    """``[B, V]``: norm(max(0, p_t - p_d)) on rejected rows (p_t if empty), p_t elsewhere (bonus)."""
    residual = (target_probs - draft_probs).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    use_residual = rejected.unsqueeze(-1) & (mass > RESIDUAL_MASS_EPS)
    return torch.where(use_residual, residual / mass.clamp_min(RESIDUAL_MASS_EPS), target_probs)


def _check_verify_inputs(
    draft: DraftBlock,
    target_logits: torch.Tensor,
    verify_lens: torch.Tensor,
    params: SamplingParams,
) -> tuple[int, int, int]:
    if target_logits.dim() != 3:
        raise ValueError(f"target_logits must be [B, S, V], got shape {tuple(target_logits.shape)}")
    batch, slots, vocab = target_logits.shape
    if draft.tokens.shape[0] != batch or params.batch_size != batch or verify_lens.shape != (batch,):
        raise ValueError(
            f"batch sizes disagree: target_logits {batch}, draft tokens {draft.tokens.shape[0]}, "
            f"params {params.batch_size}, verify_lens {tuple(verify_lens.shape)} (expected [{batch}])"
        )
    if not 1 <= slots <= draft.gamma + 1:
        raise ValueError(
            f"target_logits has {slots} slots; expected 1..gamma+1 = 1..{draft.gamma + 1} "
            "(the anchor's prediction plus one per verified draft)"
        )
    if bool(((verify_lens < 0) | (verify_lens > slots - 1)).any()):
        raise ValueError(
            f"verify_lens must be in 0..{slots - 1} (target_logits slots - 1), got {verify_lens.tolist()}"
        )
    if not bool(params.greedy.all()):
        if draft.probs is None:
            raise ValueError("rows with temperature > 0 need draft.probs (the draft distribution p_d)")
        if draft.probs.shape[-1] != vocab:
            raise ValueError(
                f"draft.probs vocabulary {draft.probs.shape[-1]} != target vocabulary {vocab}; "
                "map draft ids into the target vocabulary first (drafter.d2t)"
            )
    return batch, slots, vocab
