"""Frequency, presence and repetition penalties on DSPARK_LIVE's verify rows.

SGLang's penalizers count a request's output tokens as its scheduler processes each step's
result; under the overlap scheduler that lags the verify by a step, and its speculative decode
path does not feed them at all. The worker therefore keeps the output tokens of each request whose
verify rows depend on them (a penalty, or a custom logit processor that reads the request) itself
(it commits them), checks them against the committed length on every step, and penalises every
verify row by the outputs before it (`decoding.penalties`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sglang_dspark.decoding.penalties import Penalties, penalise_window


def penalties_of(sampling_params) -> Penalties:
    """A request's penalties from SGLang's `SamplingParams`; a field it leaves None means off
    (0 for the additive penalties, 1 for the multiplicative one), as SGLang itself reads them."""
    return Penalties(frequency=float(getattr(sampling_params, "frequency_penalty", 0.0) or 0.0),
                     presence=float(getattr(sampling_params, "presence_penalty", 0.0) or 0.0),
                     repetition=float(getattr(sampling_params, "repetition_penalty", 1.0) or 1.0))


def penalise_rows(logits: torch.Tensor, reqs, penalties: Sequence[Penalties], outputs: Sequence[list[int] | None],
                  drafts: torch.Tensor, window_lens: torch.Tensor) -> None:
    """Penalise the packed verify rows (request b's `window_lens[b]` rows, its window being the
    bonus and `drafts[b, :window_lens[b] - 1]`) of every request whose `penalties[b]` (from
    `penalties_of`, read once a step by the caller) are active; `outputs[b]` are its output tokens
    through the bonus (`OutputHistories.refresh`)."""
    if not any(p.active for p in penalties):
        return
    starts = (torch.cumsum(window_lens, 0) - window_lens).tolist()
    for b, (req, request_penalties) in enumerate(zip(reqs, penalties)):
        if not request_penalties.active:
            continue
        if outputs[b] is None:
            raise RuntimeError(f"DSPARK_LIVE: request {req.rid} sets a penalty but its outputs were not tracked")
        width = int(window_lens[b])
        penalise_window(logits[starts[b]:starts[b] + width], torch.tensor(outputs[b]), drafts[b, : width - 1],
                        request_penalties)


class OutputHistories:
    """The output tokens, through the bonus token, of the requests in the decode batch that need them."""

    def __init__(self) -> None:
        self._outputs: dict[str, list[int]] = {}

    def refresh(self, reqs, bonus: torch.Tensor, seq_lens: torch.Tensor,
                wanted: Sequence[bool]) -> list[list[int] | None]:
        """Each wanted request's outputs through its bonus (None for the others). Requests that
        left the batch, or are no longer wanted, are forgotten (a request comes back only by a new
        prefill)."""
        kept: dict[str, list[int]] = {}
        histories: list[list[int] | None] = []
        for b, req in enumerate(reqs):
            outputs = self._outputs_through_bonus(req, int(bonus[b]), int(seq_lens[b])) if wanted[b] else None
            if outputs is not None:
                kept[req.rid] = outputs
            histories.append(outputs)
        self._outputs = kept
        return histories

    def commit(self, reqs, tokens: torch.Tensor, accept_lens: torch.Tensor) -> None:
        """After acceptance: request b outputs `tokens[b, :accept_lens[b]]` (accepted drafts, then the next bonus)."""
        for b, req in enumerate(reqs):
            outputs = self._outputs.get(req.rid)
            if outputs is not None:
                outputs.extend(tokens[b, : int(accept_lens[b])].tolist())

    def _outputs_through_bonus(self, req, bonus: int, seq_len: int) -> list[int]:
        """The bonus sits at position `seq_len`, so the request has output `seq_len - prompt + 1`
        tokens. Ours match unless the request is new to decoding or was retracted and prefilled
        again: then SGLang's `output_ids` (a step behind at most) supply all but the bonus."""
        count = seq_len - len(req.origin_input_ids) + 1
        outputs = self._outputs.get(req.rid)
        if outputs is not None and len(outputs) == count and outputs[-1] == bonus:
            return outputs
        known = list(req.output_ids)
        if len(known) < count - 1:
            raise RuntimeError(
                f"DSPARK_LIVE: request {req.rid} has output {count} tokens but only {len(known)} are known; "
                "its outputs cannot be rebuilt for its penalties or logit processor")
        return known[: count - 1] + [bonus]
