"""Refuse, per request and with a clear 400, what the DSPARK_LIVE verify path does not implement.

SGLang's own sampler applies logprobs, grammars, penalties, min-p and logit bias; the verify path
samples with `decoding.verify` instead, so such a request would silently get a different output
distribution. The plugin hooks the scheduler's request validation (which already aborts a request
with a message) to say so instead.
"""

from __future__ import annotations

ALGORITHM_NAME = "DSPARK_LIVE"


def unsupported_request_reason(req) -> str | None:
    """Why `req` (an SGLang `Req`) cannot be served by DSPARK_LIVE, or None if it can."""
    params = req.sampling_params
    problems = []
    if getattr(req, "return_logprob", False):
        problems.append("return_logprob")
    if getattr(req, "return_hidden_states", False):
        problems.append("return_hidden_states")
    for name in ("json_schema", "regex", "ebnf", "structural_tag"):
        if getattr(params, name, None):
            problems.append(name)
    if getattr(params, "min_p", 0.0):
        problems.append("min_p")
    if getattr(params, "frequency_penalty", 0.0) or getattr(params, "presence_penalty", 0.0):
        problems.append("frequency/presence_penalty")
    if getattr(params, "repetition_penalty", 1.0) != 1.0:
        problems.append("repetition_penalty")
    if getattr(params, "logit_bias", None):
        problems.append("logit_bias")
    if getattr(req, "custom_logit_processor", None):
        problems.append("custom_logit_processor")
    if not problems:
        return None
    return (f"{ALGORITHM_NAME} does not support {', '.join(problems)} yet; supported: temperature, top_p, "
            "top_k, stop, stop_token_ids, max_new_tokens, ignore_eos, streaming")


def validate_request_hook(result, scheduler, req, *args, **kwargs):
    """AFTER hook on `Scheduler.validate_dllm_request`: add our refusal when serving DSPARK_LIVE."""
    if result is not None:
        return result
    algorithm = getattr(scheduler, "spec_algorithm", None)
    if getattr(algorithm, "name", None) != ALGORITHM_NAME:
        return None
    return unsupported_request_reason(req)
