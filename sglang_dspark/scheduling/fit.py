"""Fit the three cost models from step-time probes.

Robustness, in order: each probe's repeats collapse to their median (a burst of load spoils one
repeat, not the probe); the least-squares fits weigh relative error (a 10 ms and a 10 s step
matter alike) and re-weigh residuals with Huber weights (an outlier probe pulls less); the
curves are parameterised by non-negative increments so they are non-decreasing by construction.
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable

import torch

from sglang_dspark.scheduling.cost_model import (
    AdditiveCostModel,
    ContextCostModel,
    CostModel,
    StepCostTable,
    StepShape,
)
from sglang_dspark.scheduling.probes import ProbeError, ProbeSet, StepProbe

HUBER_K = 1.345
IRLS_ROUNDS = 6


def isotonic_non_decreasing(values: list[float], weights: list[float]) -> list[float]:
    """Pool-adjacent-violators: the closest non-decreasing sequence in weighted least squares."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for value, weight in zip(values, weights):
        blocks.append([value, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean_b, w_b, n_b = blocks.pop()
            mean_a, w_a, n_a = blocks.pop()
            total = w_a + w_b
            blocks.append([(mean_a * w_a + mean_b * w_b) / total, total, n_a + n_b])
    return [mean for mean, _, count in blocks for _ in range(count)]


def _shortest_context_probes(probes: list[StepProbe]) -> list[StepProbe]:
    """Probes at the smallest per-request context: what a context-blind model should see."""
    per_request = [p.context_tokens / p.num_requests for p in probes]
    shortest = min(per_request)
    return [p for p, c in zip(probes, per_request) if c == shortest]


def _require(probes: list[StepProbe], what: str, minimum: int) -> None:
    if len(probes) < minimum:
        raise ProbeError(f"{what} needs at least {minimum} probes, got {len(probes)}")


def fit_step_table(probes: list[StepProbe], metadata: dict[str, Any]) -> StepCostTable:
    """SPS(B) at each probed batch-token count (median over shapes with that count), made
    non-increasing in B by isotonic regression."""
    selected = _shortest_context_probes(probes)
    _require(selected, "a step table", 1)
    by_tokens: dict[int, list[float]] = {}
    for probe in selected:
        by_tokens.setdefault(probe.batch_tokens, []).append(probe.median_seconds)
    tokens = sorted(by_tokens)
    seconds = [statistics.median(by_tokens[t]) for t in tokens]
    monotone = isotonic_non_decreasing(seconds, [float(len(by_tokens[t])) for t in tokens])
    return StepCostTable(
        batch_tokens=tokens,
        steps_per_second=[1.0 / s for s in monotone],
        metadata={**metadata, "fit": _fit_report(selected, None)},
    )


def _thin_knots(values: Iterable[int], ratio: float) -> list[int]:
    """Sorted unique values, dropping any within `ratio` of the previous kept knot (the largest
    always stays, so the curve covers every probe)."""
    unique = sorted(set(values))
    knots = [unique[0]]
    for value in unique[1:]:
        if value >= knots[-1] * ratio:
            knots.append(value)
    if knots[-1] != unique[-1]:
        knots[-1] = unique[-1]
    return knots


def _ramp_basis(knots: list[int], x: torch.Tensor) -> torch.Tensor:
    """Columns j = 1..n-1: the share of segment j covered by x (the last continues beyond), so a
    curve sum_j delta_j * column_j with delta >= 0 is non-decreasing and zero at knots[0]."""
    k = torch.tensor(knots, dtype=torch.float64)
    lower, upper = k[:-1], k[1:]
    share = ((x[:, None] - lower) / (upper - lower)).clamp(min=0.0)
    share[:, :-1] = share[:, :-1].clamp(max=1.0)
    return share


def _robust_bounded_lstsq(
    design: torch.Tensor, target: torch.Tensor, lower: list[float]
) -> torch.Tensor:
    """min sum(w_i * ((A x - t)_i / t_i)^2) with x >= lower, Huber-reweighted.

    Each solve runs on unit-norm columns: the context columns (tokens x context, ~1e4) dwarf
    the bias column, and unscaled, a reweighted solve ran out of iterations and returned a
    model 3-4x off at batch 1 (a live sweep's fit at 31 % median error instead of 4.5 %)."""
    from scipy.optimize import lsq_linear

    relative = design / target[:, None]
    ones = torch.ones_like(target)
    weights = torch.ones_like(target)
    bounds_upper = [float("inf")] * len(lower)
    solution = None
    for _ in range(IRLS_ROUNDS):
        root = weights.sqrt()
        weighted = relative * root[:, None]
        column_norms = weighted.norm(dim=0).clamp(min=1e-30)
        result = lsq_linear(
            (weighted / column_norms).numpy(),
            (ones * root).numpy(),
            bounds=([bound * norm for bound, norm in zip(lower, column_norms.tolist())], bounds_upper),
        )
        if result.status == 0:
            raise ProbeError(
                f"the cost-model fit did not converge in {result.nit} iterations "
                f"({len(target)} probes); re-run the sweep"
            )
        solution = torch.from_numpy(result.x) / column_norms
        residual = relative @ solution - 1.0
        scale = 1.4826 * residual.abs().median().clamp(min=1e-4)
        weights = (HUBER_K * scale / residual.abs().clamp(min=1e-12)).clamp(max=1.0)
    assert solution is not None
    return solution


def _additive_design(
    probes: list[StepProbe], request_knots: list[int], token_knots: list[int], with_context: bool
) -> torch.Tensor:
    requests = torch.tensor([float(p.num_requests) for p in probes], dtype=torch.float64)
    tokens = torch.tensor([float(p.batch_tokens) for p in probes], dtype=torch.float64)
    columns = [torch.ones_like(tokens)[:, None]]
    if len(request_knots) > 1:
        columns.append(_ramp_basis(request_knots, requests))
    if len(token_knots) > 1:
        columns.append(_ramp_basis(token_knots, tokens))
    if with_context:
        context = torch.tensor([float(p.context_tokens) for p in probes], dtype=torch.float64)
        columns += [context[:, None], (context * tokens / requests)[:, None]]
    return torch.cat(columns, dim=1)


def _fit_additive_like(
    probes: list[StepProbe], metadata: dict[str, Any], with_context: bool
) -> AdditiveCostModel:
    request_knots = _thin_knots((p.num_requests for p in probes), ratio=1.5)
    token_knots = _thin_knots((p.batch_tokens for p in probes), ratio=1.4)
    design = _additive_design(probes, request_knots, token_knots, with_context)
    target = torch.tensor([p.median_seconds for p in probes], dtype=torch.float64)
    solution = _robust_bounded_lstsq(design, target, [1e-9] + [0.0] * (design.shape[1] - 1))
    n_alpha, n_theta = len(request_knots) - 1, len(token_knots) - 1
    alpha = [0.0] + torch.cumsum(solution[1 : 1 + n_alpha], 0).tolist()
    theta = [0.0] + torch.cumsum(solution[1 + n_alpha : 1 + n_alpha + n_theta], 0).tolist()
    fields: dict[str, Any] = dict(
        bias_seconds=float(solution[0]),
        request_knots=request_knots,
        alpha_seconds=alpha,
        token_knots=token_knots,
        theta_seconds=theta,
    )
    if with_context:
        model: AdditiveCostModel = ContextCostModel(
            **fields,
            metadata=metadata,
            kv_read_seconds_per_token=float(solution[-2]),
            attention_seconds_per_token_pair=float(solution[-1]),
        )
    else:
        model = AdditiveCostModel(**fields, metadata=metadata)
    model.metadata = {**metadata, "fit": _fit_report(probes, model)}
    return model


def fit_additive(probes: list[StepProbe], metadata: dict[str, Any]) -> AdditiveCostModel:
    """T(bs, M) from the probes at the shortest context (the model is context-blind)."""
    selected = _shortest_context_probes(probes)
    _require(selected, "an additive model", 3)
    return _fit_additive_like(selected, metadata, with_context=False)


def fit_context(probes: list[StepProbe], metadata: dict[str, Any]) -> ContextCostModel:
    """T(bs, M, C) from every probe; needs probes at two or more context lengths."""
    per_request = {p.context_tokens / p.num_requests for p in probes}
    if len(per_request) < 2:
        raise ProbeError(
            "a context-aware model needs probes at two or more context lengths per request, "
            f"got only {sorted(per_request)}"
        )
    _require(probes, "a context-aware model", 5)
    model = _fit_additive_like(probes, metadata, with_context=True)
    assert isinstance(model, ContextCostModel)
    return model


def _fit_report(probes: list[StepProbe], model: CostModel | None) -> dict[str, Any]:
    """How well the model reproduces the probes it was fitted on (relative error of medians)."""
    report: dict[str, Any] = {"probes": len(probes)}
    if model is None:
        return report
    errors = [
        abs(
            model.predict(StepShape(p.num_requests, p.batch_tokens, p.context_tokens))
            / p.median_seconds
            - 1.0
        )
        for p in probes
    ]
    report["median_relative_error"] = round(statistics.median(errors), 4)
    report["max_relative_error"] = round(max(errors), 4)
    return report


def fit_all(probe_set: ProbeSet, extra_metadata: dict[str, Any] | None = None) -> dict[str, CostModel]:
    """Every model the probes support: step and additive always, context when the probes span
    two or more context lengths. Metadata: hardware and model from the probe set."""
    base = dict(probe_set.metadata)
    metadata = {
        "hardware": {k: v for k, v in base.items() if k not in ("model", "command")},
        "model": base.get("model", "unknown"),
        "command": base.get("command", ""),
        **(extra_metadata or {}),
    }
    models: dict[str, CostModel] = {
        "step": fit_step_table(probe_set.probes, metadata),
        "additive": fit_additive(probe_set.probes, metadata),
    }
    if len({p.context_tokens / p.num_requests for p in probe_set.probes}) >= 2:
        models["context"] = fit_context(probe_set.probes, metadata)
    return models
