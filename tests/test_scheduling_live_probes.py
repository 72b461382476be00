"""Cost models fitted from a live server's step records reproduce the engine's step costs."""

import pytest

from sglang_dspark.scheduling.cost_model import StepShape
from sglang_dspark.scheduling.fit import fit_all
from sglang_dspark.scheduling.live_probes import probes_from_step_records
from sglang_dspark.scheduling.probes import ProbeSet


def _engine_seconds(batch: int, tokens: int, context: int) -> float:
    """A made-up engine: 40 ms a step, 2 ms a request, 4 ms a token, 5 us a context token."""
    return 0.040 + 0.002 * batch + 0.004 * tokens + 5e-6 * context


def _records(widths=range(8), batches=(1, 2, 4, 8), contexts=(200, 1200)):
    records = []
    for batch in batches:
        for per_request in contexts:
            for width in widths:
                for repeat in range(3):
                    tokens = batch * (1 + width)
                    context = batch * (per_request + repeat)
                    target = _engine_seconds(batch, tokens, context)
                    records.append({"batch_size": batch, "verify_tokens": tokens, "draft_seconds": 0.01,
                                    "measured_seconds": target + 0.01,
                                    "requests": [{"context_len": per_request + repeat}] * batch})
    return records


def test_probes_group_repeats_and_exclude_the_drafter_time():
    probes = probes_from_step_records(_records(widths=[0, 3], batches=[2], contexts=[200]))
    assert [(p.num_requests, p.batch_tokens, len(p.seconds)) for p in probes] == [(2, 2, 3), (2, 8, 3)]
    assert probes[0].median_seconds == pytest.approx(_engine_seconds(2, 2, 402))
    assert probes_from_step_records(_records(widths=[0], batches=[2], contexts=[200]), skip_first=3) == []


def test_a_context_model_fitted_from_step_records_predicts_the_engine():
    models = fit_all(ProbeSet(probes_from_step_records(_records())))
    model = models["context"]
    for batch, tokens, context in [(1, 1, 300), (4, 20, 3000), (8, 64, 9000)]:
        predicted = model.predict(StepShape(batch, tokens, context))
        assert predicted == pytest.approx(_engine_seconds(batch, tokens, context), rel=0.1)
