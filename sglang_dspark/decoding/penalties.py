"""Frequency, presence and repetition penalties on a verify window, as SGLang's sampler applies them.

Without speculation SGLang penalises each decode step's logits by the request's output tokens so
far: ``- frequency * count - presence * (count > 0)`` (its additive penalties), then, for the
tokens already output, a repetition factor that divides positive logits and multiplies negative
ones (its scaling penalty, applied after the additive ones as its overlap scheduler does). A
verify window's row ``j`` chooses the token after window token ``j``, so it must be penalised as
plain decoding would have penalised that step: by the outputs through the bonus token plus the
window's first ``j`` drafts. Each row therefore gets its own counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Penalties:
    """One request's penalties (SGLang's sampling parameters of the same names)."""

    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0

    def __post_init__(self) -> None:
        if not self.repetition > 0:
            raise ValueError(f"repetition penalty must be > 0 (1 = off), got {self.repetition}")

    @property
    def active(self) -> bool:
        return self.frequency != 0.0 or self.presence != 0.0 or self.repetition != 1.0


def penalise_window(rows: torch.Tensor, outputs: torch.Tensor, drafts: torch.Tensor, penalties: Penalties) -> None:
    """Penalise one request's verify rows in place.

    rows: ``[L + 1, V]`` float logits, row ``j`` choosing the token after window token ``j``.
    outputs: ``[n]`` the request's output token ids so far, through the bonus token (window token 0).
    drafts: ``[L]`` the window's drafts (window tokens 1..L).
    """
    width = rows.shape[0]
    if drafts.numel() != width - 1:
        raise ValueError(f"a window of {width} rows verifies {width - 1} drafts, got {drafts.numel()}")
    # only the tokens output or drafted so far change: count over those columns, not the vocabulary
    tokens, inverse = torch.cat([outputs, drafts]).to(rows.device, torch.long).unique(return_inverse=True)
    counts = torch.zeros(width, tokens.numel(), dtype=torch.float32, device=rows.device)
    counts[0].index_add_(0, inverse[: outputs.numel()], torch.ones(outputs.numel(), device=rows.device))
    if width > 1:  # row j also counts drafts 0..j-1
        counts[torch.arange(1, width, device=rows.device), inverse[outputs.numel():]] += 1.0
        counts = counts.cumsum_(0)
    seen = counts > 0
    columns = rows[:, tokens] - counts.mul_(penalties.frequency).add_(seen.float().mul_(penalties.presence)).to(rows.dtype)
    if penalties.repetition != 1.0:
        scaled = torch.where(columns < 0, columns * penalties.repetition, columns / penalties.repetition)
        columns = torch.where(seen, scaled, columns)
    rows[:, tokens] = columns
