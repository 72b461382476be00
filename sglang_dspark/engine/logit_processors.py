"""Custom logit processors on DSPARK_LIVE's verify rows, as plain serving applies them.

With `--enable-custom-logit-processor`, SGLang's sampler hands a request's processor its row of
logits each step, after every other logit change (penalties, grammar mask, logit_bias), with
the request's `custom_params`; when those are a dict SGLang adds `"__req__"`, the request itself,
which processors read for the tokens so far (SGLang's thinking-budget and no-repeat-n-gram
processors do). A verify window holds one row per drafted position: row j chooses the token after
the bonus and the j drafts before it, so row j's processor must see the request as if those had
been output. Each row's params carry a `RowRequest` with exactly those output ids (the worker's
own record of the outputs, `engine.penalties.OutputHistories`, which does not lag a step under
the overlap scheduler as `Req.output_ids` does); every other attribute is the request's own.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from http import HTTPStatus

import torch
from sglang.srt.managers.schedule_batch import FINISH_ABORT

logger = logging.getLogger(__name__)

REQUEST_KEY = "__req__"
"""The key under which SGLang hands a processor its request (`Req.__init__`)."""


class RowRequest:
    """A request as one verify row's processor must see it: `output_ids` through the tokens
    before the row (of the request's own type: SGLang keeps token ids in `array("q")`, and
    processors concatenate them with `origin_input_ids`), everything else read from the request."""

    __slots__ = ("_request", "output_ids")

    def __init__(self, request, output_ids: list[int]) -> None:
        self._request = request
        own = request.output_ids
        self.output_ids = array(own.typecode, output_ids) if isinstance(own, array) else type(own)(output_ids)

    def __getattr__(self, name: str):
        return getattr(self._request, name)


def reads_request(req) -> bool:
    """Whether `req`'s custom logit processor is handed the request (so its rows need the outputs)."""
    params = getattr(req.sampling_params, "custom_params", None)
    return bool(getattr(req, "custom_logit_processor", None)) and isinstance(params, dict) and REQUEST_KEY in params


def apply_custom_logit_processors(logits: torch.Tensor, sampling_info, reqs, outputs: Sequence[list[int] | None],
                                  drafts: torch.Tensor, window_lens: torch.Tensor) -> None:
    """Run each processor of the batch (`sampling_info.custom_logit_processor`: processor and the
    batch rows that use it) once over all its requests' packed verify rows, in place.

    `outputs[b]`: request b's output tokens through its bonus, needed where its processor reads
    the request; `drafts[b, :window_lens[b] - 1]`: its window's drafts. A request its processor
    fails for is aborted (`run_isolated`)."""
    if not getattr(sampling_info, "has_custom_logit_processor", False):
        return
    starts = (torch.cumsum(window_lens, 0) - window_lens).tolist()
    for entry in sampling_info.custom_logit_processor.values():
        groups = []
        for b in entry.rows:
            width = int(window_lens[b])
            params = _row_params(sampling_info.custom_params[b], outputs[b], drafts[b, : width - 1].tolist())
            groups.append((reqs[b], list(range(starts[b], starts[b] + width)), params))
        run_isolated(logits, entry.processor, groups)


@contextmanager
def isolated_prefill_processors(sampling_info, reqs) -> Iterator[None]:
    """While SGLang's own sampler picks a prefill's first tokens, each of the batch's processors
    runs through `run_isolated` (one logits row a request), so a processor that fails aborts its
    requests there too instead of stopping the server."""
    if not getattr(sampling_info, "has_custom_logit_processor", False):
        yield
        return
    entries = list(sampling_info.custom_logit_processor.values())
    originals = [entry.processor for entry in entries]
    for entry, processor in zip(entries, originals):
        entry.processor = _IsolatedRows(processor, [reqs[b] for b in entry.rows])
    try:
        yield
    finally:
        for entry, processor in zip(entries, originals):
            entry.processor = processor


class _IsolatedRows:
    """A processor as SGLang's sampler calls it (row i of its logits: the i-th of `reqs`), run
    through `run_isolated`."""

    def __init__(self, processor, reqs) -> None:
        self.processor, self.reqs = processor, reqs

    def __call__(self, logits: torch.Tensor, params: list) -> torch.Tensor:
        run_isolated(logits, self.processor, [(req, [i], [params[i]]) for i, req in enumerate(self.reqs)])
        return logits


def run_isolated(logits: torch.Tensor, processor, groups: list[tuple[object, list[int], list]]) -> None:
    """Process each request's rows of `logits` (`groups`: request, its row indices, their params)
    in place, in one call for all. A processor is a client's code: where that call raises or
    returns logits of another shape, it runs again request by request, and each request it fails
    for keeps its rows as they were and is aborted with the error (`Req.to_finish`, as SGLang
    aborts a running request), so the server and the other requests go on (plain serving's
    sampler would stop the server)."""
    rows = [row for _, group_rows, _ in groups for row in group_rows]
    params = [param for _, _, group_params in groups for param in group_params]
    if _process(logits, processor, rows, params) is None:
        return
    name = getattr(processor, "__name__", type(processor).__name__)
    for req, group_rows, group_params in groups:
        error = _process(logits, processor, group_rows, group_params)
        if error is not None:
            message = f"custom logit processor {name} failed: {error}"
            logger.error("DSPARK_LIVE: request %s aborted: %s", req.rid, message)
            req.to_finish = FINISH_ABORT(message, HTTPStatus.BAD_REQUEST, "BadRequestError")


def _process(logits: torch.Tensor, processor, rows: list[int], params: list) -> str | None:
    """Process `logits[rows]` in place; on failure leave them as they were and say why."""
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    selected = logits.index_select(0, index)
    try:
        processed = processor(selected, params)
    except Exception as error:  # noqa: BLE001 - a client's code: any failure is its request's
        return f"{type(error).__name__}: {error}"
    if not isinstance(processed, torch.Tensor) or processed.shape != selected.shape:
        return (f"returned {getattr(processed, 'shape', type(processed).__name__)} for logits of shape "
                f"{tuple(selected.shape)}; a processor must return logits of the shape it was given")
    logits.index_copy_(0, index, processed.to(logits.dtype))
    return None


def _row_params(base, outputs: list[int] | None, drafts: list[int]) -> list:
    """The params of a window's rows: the request's own, its request seen through each row."""
    if not (isinstance(base, dict) and REQUEST_KEY in base):
        return [base] * (len(drafts) + 1)
    if outputs is None:
        raise RuntimeError("DSPARK_LIVE: a logit processor reads its request but the request's outputs were not tracked")
    request = base[REQUEST_KEY]
    return [{**base, REQUEST_KEY: RowRequest(request, outputs + drafts[:j])} for j in range(len(drafts) + 1)]
