"""Refuse, per request and with a clear 400, what the DSPARK_LIVE verify path does not implement.

The verify path samples with `decoding.verify`, not SGLang's sampler, so every logit change the
sampler makes must be made on the verify rows too, or a request would silently get a different
output distribution. The plugin hooks the scheduler's request validation (which already aborts
a request with a message) to refuse what is not. `min_new_tokens` is served: `min_new_tokens_bans` tells the
worker which stop tokens to ban on which verify rows, as SGLang's penalizer does; so is
`return_logprob` (the worker hands SGLang's `compute_spec_logprobs` the verify rows), and so is
`logit_bias` (the batch's bias rows added to each request's verify rows), `min_p` (the verify
path's sampling keeps SGLang's top-k / top-p / min-p set, `decoding.sampling`) and the frequency,
presence and repetition penalties (each verify row penalised by the outputs before it,
`engine.penalties`), and so are grammars (JSON schema, regex, EBNF, structural tags: each verify
row masked by the grammar after the drafts before it, `engine.grammar`), and so are custom logit
processors (each verify row processed with the request as it would stand at that row,
`engine.logit_processors`).
"""

from __future__ import annotations

from dataclasses import dataclass

ALGORITHM_NAME = "DSPARK_LIVE"


def unsupported_request_reason(req) -> str | None:
    """Why `req` (an SGLang `Req`) cannot be served by DSPARK_LIVE, or None if it can."""
    problems = []
    if getattr(req, "return_hidden_states", False):
        problems.append("return_hidden_states")
    if not problems:
        return None
    return (f"{ALGORITHM_NAME} does not support {', '.join(problems)} yet; supported: temperature, top_p, "
            "top_k, min_p, frequency/presence/repetition_penalty, json_schema, regex, ebnf, structural_tag, stop, "
            "stop_token_ids, min_new_tokens, max_new_tokens, ignore_eos, logit_bias, custom_logit_processor, "
            "return_logprob, streaming")


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


def validate_request_hook(result, scheduler, req, *args, **kwargs):
    """AFTER hook on `Scheduler.validate_dllm_request`: add our refusal when serving DSPARK_LIVE."""
    if result is not None:
        return result
    algorithm = getattr(scheduler, "spec_algorithm", None)
    if getattr(algorithm, "name", None) != ALGORITHM_NAME:
        return None
    return unsupported_request_reason(req)
