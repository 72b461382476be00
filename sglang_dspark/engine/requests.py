"""The `min_new_tokens` bans of a decode batch's verify rows.

The verify path samples with `decoding.verify`, not SGLang's sampler, so every logit change the
sampler makes is made on the verify rows instead: `min_new_tokens` here (the stop tokens SGLang's
penalizer bans, on the rows it would ban them), frequency / presence / repetition penalties in
`engine.penalties`, grammars in `engine.grammar`, custom logit processors in
`engine.logit_processors`, logit_bias, min_p and logprobs in the worker. Every per-request
feature SGLang lets a request ask of plain serving is served, so nothing is refused per request
(SGLang itself refuses, at launch or per request, LoRA, watermarking and sampling masks with this
algorithm).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopBan:
    """A request under `min_new_tokens`: its stop tokens may not be sampled at any input position
    below `until_position` (the position whose logits choose the request's min_new_tokens-th
    output token is `until_position - 1`)."""

    batch_index: int
    until_position: int
    token_ids: tuple[int, ...]


def min_new_tokens_bans(reqs) -> list[StopBan]:
    """What SGLang's `BatchedMinNewTokensPenalizer` bans, for the requests of a batch that set
    `min_new_tokens`: the same stop tokens (the request's `stop_token_ids`, its EOS ids and the
    tokenizer's), up to the same output length. The verify path bypasses SGLang's sampler and its
    penalizers, so without this a request would stop early where plain serving may not.

    Output token k (0-based) is chosen by the logits at input position `P + k - 1` (P prompt
    tokens; token 0 by the prefill, which SGLang's sampler serves), so tokens 0..min-1 are banned
    at positions below `P + min - 1`."""
    bans = []
    for index, req in enumerate(reqs):
        minimum = getattr(req.sampling_params, "min_new_tokens", 0) or 0
        if minimum <= 0:
            continue
        tokenizer = getattr(req, "tokenizer", None)
        ids = set(req.sampling_params.stop_token_ids or ()) | set(getattr(req, "eos_token_ids", None) or ())
        if tokenizer is not None:
            ids |= set(getattr(tokenizer, "additional_stop_token_ids", None) or ())
            ids.add(getattr(tokenizer, "eos_token_id", None))
        ids.discard(None)
        if ids:
            bans.append(StopBan(index, len(req.origin_input_ids) + minimum - 1, tuple(sorted(ids))))
    return bans
