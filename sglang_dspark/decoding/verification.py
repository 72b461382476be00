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
pass; ragged verify lengths are a mask, not a loop. `verify_packed` takes the verify forward's
own layout (each request's window rows one after the other) and turns only sampled requests'
rows into target distributions; `verify` takes them padded to ``[B, S, V]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from sglang_dspark.decoding.sampling import SamplingParams, logits_to_probs, sample_from_probs

RESIDUAL_MASS_EPS = 1e-8
"""Below this the residual ``max(0, p_t - p_d)`` counts as empty (DeepSpec's threshold)."""

NO_TOKEN = -1
"""Fills ``VerifyResult.tokens`` past the committed tokens of a row."""

LIST_WALK_MAX_ROWS = 48
"""`verify_greedy` walks Python lists up to this many requests, tensors beyond."""


@dataclass
class DraftBlock:
    """One block of drafts per request.

    tokens: ``[B, gamma]`` target vocabulary ids, sampled left to right.
    probs: ``[B, gamma, V]`` fp32, the distribution each draft was sampled from; ``None`` when
        every row is greedy. Its columns are the target vocabulary, or, with ``probs_vocab``,
        the drafter's reduced vocabulary (zero mass outside it): kept so, a block at batch 16
        holds 4,096 columns a slot instead of 49,152 (scattering them took ~10 ms a step).
    confidence_logits: ``[B, gamma]`` fp32 raw confidence-head logits (slot k conditioned on
        the sampled previous token); ``None`` for a drafter without a confidence head.
    probs_vocab: ``[V]`` int64, strictly increasing target ids of the columns of ``probs``
        (the drafter's ``d2t``), or ``None`` when ``probs`` spans the target vocabulary.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None
    confidence_logits: torch.Tensor | None
    probs_vocab: torch.Tensor | None = None

    @property
    def gamma(self) -> int:
        return self.tokens.shape[1]

    def token_probs(self, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """p_d of the drafts at (rows[i], slots[i]): ``[n]``."""
        tokens = self.tokens[rows, slots].to(self.probs.device)
        probs = self.probs[rows, slots]
        if self.probs_vocab is None:
            return probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        columns = torch.searchsorted(self.probs_vocab, tokens).clamp(max=self.probs_vocab.numel() - 1)
        found = self.probs_vocab[columns] == tokens  # a token outside the draft vocabulary has p_d = 0
        return torch.where(found, probs.gather(-1, columns.unsqueeze(-1)).squeeze(-1), 0.0)

    def dense_probs(self, rows: torch.Tensor, slots: torch.Tensor, vocab: int) -> torch.Tensor:
        """The draft distributions at (rows[i], slots[i]) over the target vocabulary: ``[n, vocab]``."""
        probs = self.probs[rows, slots]
        if self.probs_vocab is None:
            return probs
        return probs.new_zeros(probs.shape[0], vocab).index_copy_(1, self.probs_vocab, probs)


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
    sampler: TargetSampler | None = None,
) -> VerifyResult:
    """Accept a prefix of each row's drafts and sample the correction or bonus token.

    ``target_logits [B, S, V]``: slot 0 is the target's prediction after the anchor, slot k after
    draft k-1; ``S`` is at least ``max(verify_lens) + 1`` and at most ``gamma + 1``.
    ``verify_lens [B]``: how many drafts of each row were verified (0..S-1); logits past a
    row's ``verify_lens[b] + 1`` slots are ignored.
    ``target_argmax [B, S]``: ``target_logits.argmax(-1)`` if the caller already has it (a faster
    kernel); it must agree with the logits in every verified slot.
    ``sampler``: see `verify_packed`.
    """
    batch, slots = _check_verify_inputs(draft, target_logits, verify_lens)
    if target_argmax is not None and target_argmax.shape != (batch, slots):
        raise ValueError(f"target_argmax has shape {tuple(target_argmax.shape)}; expected [{batch}, {slots}]")
    verify_lens = verify_lens.to(device=target_logits.device, dtype=torch.long)
    window = torch.arange(slots, device=target_logits.device).unsqueeze(0) <= verify_lens.unsqueeze(-1)
    result = verify_packed(draft, target_logits[window], verify_lens, params, generator,
                           None if target_argmax is None else target_argmax.to(target_logits.device)[window], sampler)
    width = result.tokens.shape[1]
    if width < slots:  # one column per logits slot, as the caller laid them out
        result.tokens = torch.nn.functional.pad(result.tokens, (0, slots - width), value=NO_TOKEN)
    return result


def verify_packed(
    draft: DraftBlock,
    logits: torch.Tensor,
    verify_lens: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    target_argmax: torch.Tensor | None = None,
    sampler: TargetSampler | None = None,
) -> VerifyResult:
    """`verify` on the verify forward's own layout: ``logits [N, V]`` holds each row's
    ``verify_lens[b] + 1`` slots one row after the other (N = sum), ``target_argmax [N]`` their
    argmax if the caller has it. Only the rows of sampled requests become distributions: at batch
    16 a padded ``[B, S, V]`` had ~2.5x the rows a planner verifies, each a 49,152-way softmax.
    ``sampler(logits, rows, params)`` may serve those rows' distributions without materialising
    them (a kernel); where it returns None, or without one, `TorchTargetRows` serves them."""
    batch, vocab = len(verify_lens), logits.shape[-1]
    device = logits.device
    verify_lens = verify_lens.to(device=device, dtype=torch.long)
    window_lens = verify_lens + 1
    if logits.dim() != 2 or logits.shape[0] != int(window_lens.sum()):
        raise ValueError(f"verify_packed: logits {tuple(logits.shape)}, expected [{int(window_lens.sum())}, V] "
                         f"(verify_lens + 1 rows per request)")
    num_drafts = int(verify_lens.max()) if batch else 0
    _check_draft(draft, batch, num_drafts + 1, vocab, params)
    request, offset = _packed_positions(window_lens)
    argmax = logits.argmax(-1) if target_argmax is None else target_argmax.to(device=device, dtype=torch.long)
    drafts = draft.tokens[:, :num_drafts].to(device)
    padded_argmax = torch.full((batch, num_drafts + 1), NO_TOKEN, dtype=torch.long, device=device)
    padded_argmax[request, offset] = argmax
    accepted = drafts == padded_argmax[:, :num_drafts]
    sampled = ~params.greedy.to(device)
    first_row = torch.cumsum(window_lens, 0) - window_lens
    if bool(sampled.any()):  # their drafts are accepted with probability min(1, p_t / p_d)
        in_sampled = sampled[request]
        rows = in_sampled.nonzero().squeeze(-1)  # the packed rows of sampled requests, in order
        row_params = params.to(device).select(request[rows])
        target = (sampler(logits, rows, row_params) if sampler is not None else None) \
            or TorchTargetRows(logits, rows, row_params)
        drafted = offset[rows] < verify_lens[request[rows]]  # rows whose slot holds a verified draft
        b, k = request[rows][drafted], offset[rows][drafted]
        p_target = target.probs_at(drafted.nonzero().squeeze(-1), drafts[b, k])
        p_draft = draft.token_probs(b.to(draft.probs.device), k.to(draft.probs.device)).to(device)
        uniform = torch.rand(p_target.shape, generator=generator, device=device)
        accepted[b, k] = uniform * p_draft < p_target  # no division: p_d = 0 accepts iff p_t > 0
    num_accepted = _accepted_prefix(accepted, verify_lens)
    final_token = argmax[first_row + num_accepted]
    if bool(sampled.any()):  # the correction (first rejection) or bonus token, from the target
        which = sampled.nonzero().squeeze(-1)
        target_row = torch.cumsum(in_sampled, 0) - 1  # packed row -> its row among the target's
        last_slot = num_accepted[which]
        final_token[which] = target.sample_final(target_row[first_row[which] + last_slot],
                                                 last_slot < verify_lens[which], draft, which, last_slot, generator)
    return _committed_tokens(drafts, num_accepted, final_token, num_drafts + 1)


def _packed_positions(window_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each packed row's request and its slot in that request's window."""
    ends = torch.cumsum(window_lens, 0)
    rows = torch.arange(int(ends[-1]) if len(ends) else 0, device=window_lens.device)
    request = torch.searchsorted(ends, rows, right=True)
    return request, rows - (ends - window_lens)[request]


def verify_greedy(draft_tokens: torch.Tensor, target_argmax: torch.Tensor, verify_lens: torch.Tensor) -> VerifyResult:
    """`verify` for a batch of greedy rows, from the target's argmax alone (no logits, no copy).

    ``draft_tokens [B, >= S-1]``, ``target_argmax [B, S]`` (slot k: the target's choice after
    draft k-1), ``verify_lens [B]`` in 0..S-1. Gives exactly what `verify` gives greedy rows.

    Up to `LIST_WALK_MAX_ROWS` requests, a walk over the ids as Python lists: it runs on every
    greedy decode step, and there the ~20 tensor ops of the vectorised version cost ~70 us at batch
    1 and 16 alike (3-4x that inside the server) where the walk costs 11 us at batch 1 and 28 at 16;
    at 64 the two cost the same, and beyond the tensor ops win.
    """
    batch, slots = target_argmax.shape
    if draft_tokens.shape[0] != batch or draft_tokens.shape[1] < slots - 1 or verify_lens.shape != (batch,):
        raise ValueError(f"verify_greedy: draft tokens {tuple(draft_tokens.shape)} and verify_lens "
                         f"{tuple(verify_lens.shape)} do not fit target_argmax {tuple(target_argmax.shape)}")
    lens = verify_lens.tolist()
    if any(not 0 <= length <= slots - 1 for length in lens):
        raise ValueError(f"verify_lens must be in 0..{slots - 1}, got {lens}")
    device = target_argmax.device
    if slots == 1:  # a one-token step: the target's choice is the token
        return VerifyResult(num_accepted=torch.zeros(batch, dtype=torch.long, device=device),
                            tokens=target_argmax.to(torch.long).clone())
    if batch > LIST_WALK_MAX_ROWS:
        drafts = draft_tokens[:, : slots - 1].to(device)
        target_argmax = target_argmax.to(torch.long)
        num_accepted = _accepted_prefix(drafts == target_argmax[:, : slots - 1], verify_lens.to(device))
        final_token = target_argmax[torch.arange(batch, device=device), num_accepted]
        return _committed_tokens(drafts, num_accepted, final_token, slots)
    num_accepted, tokens = [], []
    for drafts, choices, length in zip(draft_tokens[:, : slots - 1].tolist(), target_argmax.tolist(), lens):
        accepted = 0
        while accepted < length and drafts[accepted] == choices[accepted]:
            accepted += 1
        num_accepted.append(accepted)
        tokens.append(drafts[:accepted] + [choices[accepted]] + [NO_TOKEN] * (slots - 1 - accepted))
    return VerifyResult(num_accepted=torch.tensor(num_accepted, dtype=torch.long, device=device),
                        tokens=torch.tensor(tokens, dtype=torch.long, device=device))


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


class TargetRows(Protocol):
    """The target's sampling distributions of the verify rows of sampled requests, as
    `verify_packed` reads them (row i: the i-th such row in packed order)."""

    def probs_at(self, index: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """p_t of ``tokens[j]`` in row ``index[j]``: ``[n]``."""

    def sample(self, index: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """A token drawn from p_t in each row ``index[j]``: ``[n]``."""

    def sample_final(self, index: torch.Tensor, rejected: torch.Tensor, draft: DraftBlock, requests: torch.Tensor,
                     slots: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """Each request's last token, drawn in row ``index[j]``: where ``rejected[j]``, from the
        correction norm(max(0, p_t - p_d)) with p_d the draft's at (``requests[j]``, ``slots[j]``)
        (p_t if that has no mass), else from p_t (the bonus). ``[n]``."""


TargetSampler = Callable[[torch.Tensor, torch.Tensor, SamplingParams], "TargetRows | None"]
"""``sampler(logits [N, V], rows [n], params of those rows)``: their `TargetRows`, or None."""


class TorchTargetRows:
    """`TargetRows` materialised by `logits_to_probs` (any temperature, top-k, top-p)."""

    def __init__(self, logits: torch.Tensor, rows: torch.Tensor, params: SamplingParams) -> None:
        rows_logits = logits if len(rows) == len(logits) else logits[rows]  # (a copy of 5 MB at batch 16)
        self.probs = logits_to_probs(rows_logits.float(), params)

    def probs_at(self, index: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.probs[index, tokens]

    def sample(self, index: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        return sample_from_probs(self.probs[index], generator)

    def sample_final(self, index: torch.Tensor, rejected: torch.Tensor, draft: DraftBlock, requests: torch.Tensor,
                     slots: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        vocab, device = self.probs.shape[-1], self.probs.device

        def draft_probs(chosen: torch.Tensor) -> torch.Tensor:
            at = requests[chosen].to(draft.probs.device), slots[chosen].clamp(max=draft.gamma - 1).to(draft.probs.device)
            return draft.dense_probs(*at, vocab).to(device)

        return sample_from_probs(_final_distributions(self.probs[index], rejected, draft_probs), generator)


def _final_distributions(target_probs: torch.Tensor, rejected: torch.Tensor,
                         draft_probs: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``[n, V]``: what each row's last token is drawn from. A rejected row: the correction
    norm(max(0, p_t - p_d)) at its first rejected slot (p_t where that has no mass, which only
    numerics can cause); a fully accepted row: the bonus, p_t. ``target_probs`` (a copy the
    caller made) gets the rejected rows in place; ``draft_probs(index)`` gives p_d of the rows at
    ``index`` over the target vocabulary, asked for the rejected rows only (49,152 floats each)."""
    rows = rejected.nonzero().squeeze(-1)
    if rows.numel():
        residual = (target_probs[rows] - draft_probs(rows)).clamp_min(0.0)
        mass = residual.sum(-1, keepdim=True)
        target_probs[rows] = torch.where(mass > RESIDUAL_MASS_EPS, residual / mass.clamp_min(RESIDUAL_MASS_EPS),
                                         target_probs[rows])
    return target_probs


def _check_verify_inputs(draft: DraftBlock, target_logits: torch.Tensor, verify_lens: torch.Tensor) -> tuple[int, int]:
    """The padded layout's own checks; `_check_draft` checks the draft and params against it."""
    if target_logits.dim() != 3:
        raise ValueError(f"target_logits must be [B, S, V], got shape {tuple(target_logits.shape)}")
    batch, slots, _ = target_logits.shape
    if verify_lens.shape != (batch,):
        raise ValueError(f"verify_lens has shape {tuple(verify_lens.shape)}, expected [{batch}] "
                         "(one per target_logits row)")
    if not 1 <= slots <= draft.gamma + 1:
        raise ValueError(
            f"target_logits has {slots} slots; expected 1..gamma+1 = 1..{draft.gamma + 1} "
            "(the anchor's prediction plus one per verified draft)"
        )
    if bool(((verify_lens < 0) | (verify_lens > slots - 1)).any()):
        raise ValueError(
            f"verify_lens must be in 0..{slots - 1} (target_logits slots - 1), got {verify_lens.tolist()}"
        )
    return batch, slots


def _check_draft(draft: DraftBlock, batch: int, slots: int, vocab: int, params: SamplingParams) -> None:
    if draft.tokens.shape[0] != batch or params.batch_size != batch:
        raise ValueError(f"batch sizes disagree: {batch} verify lengths, draft tokens {draft.tokens.shape[0]}, "
                         f"params {params.batch_size}")
    if not 1 <= slots <= draft.gamma + 1:
        raise ValueError(f"{slots} slots verified; expected 1..gamma+1 = 1..{draft.gamma + 1} "
                         "(the anchor's prediction plus one per verified draft)")
    if bool(params.greedy.all()):
        return
    if draft.probs is None:
        raise ValueError("rows with temperature > 0 need draft.probs (the draft distribution p_d)")
    columns = vocab if draft.probs_vocab is None else draft.probs_vocab.numel()
    if draft.probs.shape[-1] != columns:
        raise ValueError(
            f"draft.probs has {draft.probs.shape[-1]} columns, expected {columns} "
            + ("(the target vocabulary; or give probs_vocab, the target id of each column)"
               if draft.probs_vocab is None else "(one per probs_vocab id)"))
    if draft.probs_vocab is not None and draft.probs_vocab.numel() and int(draft.probs_vocab.max()) >= vocab:
        raise ValueError(f"draft.probs_vocab holds ids up to {int(draft.probs_vocab.max())}, "
                         f"outside the target vocabulary of {vocab}")
