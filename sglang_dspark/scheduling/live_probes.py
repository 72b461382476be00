"""Step probes from a live server's step records (`DSPARK_STEP_LOG`), for `bench sps-serve`.

The offline probes (`measure.py`) time a transformers model in-process; the engine that serves
has its own per-step costs (scheduling, the verify attention, acceptance). Fitting the cost model
from the server's own steps measures what the planner actually pays. A step's target-side time is
its measured time minus its drafter time: the planner charges the drafter separately.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from sglang_dspark.scheduling.probes import StepProbe

CONTEXT_BUCKET_TOKENS = 256
"""Steps whose per-request context falls in the same bucket join one probe (their repeats)."""


def probes_from_step_records(records: Iterable[dict], skip_first: int = 0) -> list[StepProbe]:
    """One probe per (requests, batch tokens, per-request context bucket), its steps as repeats.

    `skip_first` drops warm-up steps. Probe context is the group's mean total context."""
    groups: dict[tuple[int, int, int], list[tuple[int, float]]] = defaultdict(list)
    for index, record in enumerate(records):
        if index < skip_first:
            continue
        batch = int(record["batch_size"])
        context = sum(int(r["context_len"]) for r in record["requests"])
        seconds = float(record["measured_seconds"]) - float(record["draft_seconds"])
        if batch < 1 or seconds <= 0:
            continue
        bucket = round(context / batch / CONTEXT_BUCKET_TOKENS)
        groups[(batch, int(record["verify_tokens"]), bucket)].append((context, seconds))
    return [
        StepProbe(num_requests=batch, batch_tokens=tokens,
                  context_tokens=round(sum(c for c, _ in steps) / len(steps)),
                  seconds=tuple(s for _, s in steps))
        for (batch, tokens, _), steps in sorted(groups.items())
    ]
