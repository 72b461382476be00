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

from array import array
from collections.abc import Sequence

import torch

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


def apply_custom_logit_processors(logits: torch.Tensor, sampling_info, outputs: Sequence[list[int] | None],
                                  drafts: torch.Tensor, window_lens: torch.Tensor) -> None:
    """Run each processor of the batch (`sampling_info.custom_logit_processor`: processor and the
    batch rows that use it) once over all its requests' packed verify rows, in place.

    `outputs[b]`: request b's output tokens through its bonus, needed where its processor reads
    the request; `drafts[b, :window_lens[b] - 1]`: its window's drafts."""
    if not getattr(sampling_info, "has_custom_logit_processor", False):
        return
    starts = (torch.cumsum(window_lens, 0) - window_lens).tolist()
    for entry in sampling_info.custom_logit_processor.values():
        rows: list[int] = []
        params: list = []
        for b in entry.rows:
            width = int(window_lens[b])
            rows.extend(range(starts[b], starts[b] + width))
            params.extend(_row_params(sampling_info.custom_params[b], outputs[b], drafts[b, : width - 1].tolist()))
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        selected = logits.index_select(0, index)
        processed = entry.processor(selected, params)
        if not isinstance(processed, torch.Tensor) or processed.shape != selected.shape:
            raise RuntimeError(
                f"DSPARK_LIVE: custom logit processor {type(entry.processor).__name__} returned "
                f"{getattr(processed, 'shape', type(processed))} for logits of shape {tuple(selected.shape)}; "
                "a processor must return logits of the shape it was given")
        logits.index_copy_(0, index, processed.to(logits.dtype))


def _row_params(base, outputs: list[int] | None, drafts: list[int]) -> list:
    """The params of a window's rows: the request's own, its request seen through each row."""
    if not (isinstance(base, dict) and REQUEST_KEY in base):
        return [base] * (len(drafts) + 1)
    if outputs is None:
        raise RuntimeError("DSPARK_LIVE: a logit processor reads its request but the request's outputs were not tracked")
    request = base[REQUEST_KEY]
    return [{**base, REQUEST_KEY: RowRequest(request, outputs + drafts[:j])} for j in range(len(drafts) + 1)]
