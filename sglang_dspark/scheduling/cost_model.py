"""SPS cost models: how long one target forward takes for a given batch shape.

Three models, one contract (`predict(StepShape) -> seconds`, vectorised `step_seconds`):

* `StepCostTable`: the paper's SPS(B) table, batch tokens -> steps/s, looked up as a step
  function that pads up to the next probed size (what CUDA-graph buckets do).
* `AdditiveCostModel`: T(bs, M) = bias + alpha(bs) + theta(M), bs requests, M batch tokens,
  alpha and theta piecewise linear and non-decreasing.
* `ContextCostModel`: the additive model plus what the paper's table leaves out, the KV context:
  + kv_read * C + attention * C * M / bs, C the batch's cached tokens (each of the M / bs query
  tokens of a request attends to that request's context).

All three serialise to versioned JSON with hardware and model metadata; `validate()` says what is
wrong with a table, and `CostModelSlot` keeps the table in force when a replacement fails.
"""

from __future__ import annotations

import bisect
import json
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

COST_MODEL_FORMAT = "sglang-dspark/cost-model"
COST_MODEL_VERSION = 1
REQUIRED_METADATA = ("hardware", "model")


class CostModelError(ValueError):
    """A cost model that cannot be used; the message says what is wrong and what was expected."""


@dataclass(frozen=True)
class StepShape:
    """One decode step as the target sees it.

    num_requests: requests in the batch; batch_tokens: tokens of the verify forward (one anchor
    per request plus the admitted drafts); context_tokens: cached KV tokens summed over the batch.
    """

    num_requests: int
    batch_tokens: int
    context_tokens: int = 0


def _check_knots(name: str, knots: list[float]) -> list[str]:
    problems = []
    if not knots:
        problems.append(f"{name} is empty; expected at least one probe")
    if any(not math.isfinite(k) or k < 1 for k in knots):
        problems.append(f"{name} must hold finite values >= 1, got {knots}")
    if any(b <= a for a, b in zip(knots, knots[1:])):
        problems.append(f"{name} must be strictly increasing, got {knots}")
    return problems


def _check_non_decreasing(name: str, values: list[float], allow_zero: bool) -> list[str]:
    problems = []
    low = 0.0 if allow_zero else 1e-12
    if any(not math.isfinite(v) or v < low for v in values):
        bound = ">= 0" if allow_zero else "> 0"
        problems.append(f"{name} must be finite and {bound}, got {values}")
    if any(b < a for a, b in zip(values, values[1:])):
        problems.append(f"{name} must be non-decreasing (more work never costs less), got {values}")
    return problems


def _interpolate(knots: np.ndarray, values: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Piecewise-linear interpolation, flat below the first knot, last slope beyond the last."""
    if knots.size == 1:
        return np.full_like(x, values[0], dtype=np.float64)
    inside = np.interp(x, knots, values)
    slope = (values[-1] - values[-2]) / (knots[-1] - knots[-2])
    return np.where(x > knots[-1], values[-1] + slope * (x - knots[-1]), inside)


def _interpolate_scalar(knots: list[int], values: list[float], x: float) -> float:
    """`_interpolate` for one point in plain Python (the planner calls it every step)."""
    if len(knots) == 1 or x <= knots[0]:
        return values[0]
    index = min(max(bisect.bisect_left(knots, x), 1), len(knots) - 1)
    x0, x1, y0, y1 = knots[index - 1], knots[index], values[index - 1], values[index]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class CostModel(ABC):
    """Seconds per target forward for a batch shape."""

    kind: ClassVar[str]
    metadata: dict[str, Any]

    @abstractmethod
    def seconds_curve(
        self, num_requests: int, batch_tokens: np.ndarray, context_tokens: float = 0.0
    ) -> np.ndarray:
        """Vectorised over batch tokens (float64 numpy), for one request count and context: the
        planner evaluates every candidate budget of a step in one call (numpy: these arrays are
        a few hundred numbers, where torch's per-op overhead would dominate)."""

    def step_seconds(
        self, num_requests: int, batch_tokens: torch.Tensor, context_tokens: float = 0.0
    ) -> torch.Tensor:
        """`seconds_curve` for torch tensors."""
        tokens = batch_tokens.detach().cpu().numpy().astype(np.float64)
        return torch.from_numpy(self.seconds_curve(num_requests, tokens, context_tokens))

    @abstractmethod
    def _params(self) -> dict[str, Any]:
        """The kind-specific JSON fields."""

    @abstractmethod
    def _problems(self) -> list[str]:
        """Everything wrong with the parameters (empty when usable)."""

    def predict(self, step: StepShape) -> float:
        """Seconds for one forward of this shape."""
        if step.num_requests < 1 or step.batch_tokens < step.num_requests:
            raise CostModelError(
                f"a step needs num_requests >= 1 and batch_tokens >= num_requests, got {step}"
            )
        tokens = np.array([float(step.batch_tokens)])
        return float(self.seconds_curve(step.num_requests, tokens, float(step.context_tokens))[0])

    def steps_per_second(self, step: StepShape) -> float:
        return 1.0 / self.predict(step)

    def validate(self) -> None:
        """Raise CostModelError listing every problem; return quietly when the model is usable."""
        problems = self._problems()
        missing = [key for key in REQUIRED_METADATA if key not in self.metadata]
        if missing:
            problems.append(f"metadata lacks {missing}; expected keys {list(REQUIRED_METADATA)}")
        if problems:
            raise CostModelError(f"{self.kind} cost model refused: " + "; ".join(problems))

    def to_json(self) -> dict[str, Any]:
        return {
            "format": COST_MODEL_FORMAT,
            "version": COST_MODEL_VERSION,
            "kind": self.kind,
            "metadata": self.metadata,
            **self._params(),
        }

    def save(self, path: str | Path) -> None:
        self.validate()
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


@dataclass
class StepCostTable(CostModel):
    """SPS(B): steps per second at probed batch-token counts, a step function padding up.

    Beyond the last probe the time grows in proportion to the tokens (a conservative guess, never
    cheaper than the largest measured batch), except for a flat table, which stays flat.
    """

    batch_tokens: list[int]
    steps_per_second: list[float]
    metadata: dict[str, Any] = field(default_factory=dict)
    kind: ClassVar[str] = "step"

    def __post_init__(self) -> None:
        self.validate()
        self._knots = np.asarray(self.batch_tokens, dtype=np.float64)
        self._seconds = 1.0 / np.asarray(self.steps_per_second, dtype=np.float64)

    def _problems(self) -> list[str]:
        problems = _check_knots("batch_tokens", [float(b) for b in self.batch_tokens])
        if len(self.batch_tokens) != len(self.steps_per_second):
            problems.append(
                f"batch_tokens has {len(self.batch_tokens)} entries but steps_per_second has "
                f"{len(self.steps_per_second)}; expected one rate per probe"
            )
        seconds = [1.0 / s if s > 0 else -1.0 for s in self.steps_per_second]
        if any(s <= 0 or not math.isfinite(s) for s in self.steps_per_second):
            problems.append(f"steps_per_second must be finite and > 0, got {self.steps_per_second}")
        elif any(b < a for a, b in zip(seconds, seconds[1:])):
            problems.append(
                "steps_per_second must be non-increasing in batch tokens, got "
                f"{self.steps_per_second}"
            )
        return problems

    def seconds_curve(
        self, num_requests: int, batch_tokens: np.ndarray, context_tokens: float = 0.0
    ) -> np.ndarray:
        index = np.minimum(np.searchsorted(self._knots, batch_tokens), self._knots.size - 1)
        padded = self._seconds[index]
        if self.is_flat:
            return padded
        beyond = self._seconds[-1] * batch_tokens / self._knots[-1]
        return np.where(batch_tokens > self._knots[-1], beyond, padded)

    def _params(self) -> dict[str, Any]:
        return {"batch_tokens": self.batch_tokens, "steps_per_second": self.steps_per_second}

    @property
    def is_flat(self) -> bool:
        """True for a table that charges the same for any batch (the uninitialised table)."""
        return max(self.steps_per_second) == min(self.steps_per_second)


@dataclass
class AdditiveCostModel(CostModel):
    """T(bs, M) = bias + alpha(bs) + theta(M); alpha, theta piecewise linear, zero at the first
    knot, non-decreasing; beyond the last knot they continue with the last segment's slope."""

    bias_seconds: float
    request_knots: list[int]
    alpha_seconds: list[float]
    token_knots: list[int]
    theta_seconds: list[float]
    metadata: dict[str, Any] = field(default_factory=dict)
    kind: ClassVar[str] = "additive"

    def __post_init__(self) -> None:
        self.validate()
        self._tk = np.asarray(self.token_knots, dtype=np.float64)
        self._theta = np.asarray(self.theta_seconds, dtype=np.float64)

    def _problems(self) -> list[str]:
        problems = []
        if not (math.isfinite(self.bias_seconds) and self.bias_seconds > 0):
            problems.append(f"bias_seconds must be finite and > 0, got {self.bias_seconds}")
        for name, knots, values in (
            ("request", self.request_knots, self.alpha_seconds),
            ("token", self.token_knots, self.theta_seconds),
        ):
            problems += _check_knots(f"{name}_knots", [float(k) for k in knots])
            if len(knots) != len(values):
                problems.append(
                    f"{name}_knots has {len(knots)} entries but its values have {len(values)}"
                )
            problems += _check_non_decreasing(f"{name} curve", list(values), allow_zero=True)
        return problems

    def _additive(self, num_requests: int, batch_tokens: np.ndarray) -> np.ndarray:
        alpha = _interpolate_scalar(self.request_knots, self.alpha_seconds, float(num_requests))
        theta = _interpolate(self._tk, self._theta, batch_tokens)
        return self.bias_seconds + alpha + theta

    def seconds_curve(
        self, num_requests: int, batch_tokens: np.ndarray, context_tokens: float = 0.0
    ) -> np.ndarray:
        return self._additive(num_requests, batch_tokens)

    def _params(self) -> dict[str, Any]:
        return {
            "bias_seconds": self.bias_seconds,
            "request_knots": self.request_knots,
            "alpha_seconds": self.alpha_seconds,
            "token_knots": self.token_knots,
            "theta_seconds": self.theta_seconds,
        }


@dataclass
class ContextCostModel(AdditiveCostModel):
    """The additive model plus the KV context: + kv_read * C + attention * C * M / bs."""

    kv_read_seconds_per_token: float = 0.0
    attention_seconds_per_token_pair: float = 0.0
    kind: ClassVar[str] = "context"

    def _problems(self) -> list[str]:
        problems = super()._problems()
        for name in ("kv_read_seconds_per_token", "attention_seconds_per_token_pair"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                problems.append(f"{name} must be finite and >= 0, got {value}")
        return problems

    def seconds_curve(
        self, num_requests: int, batch_tokens: np.ndarray, context_tokens: float = 0.0
    ) -> np.ndarray:
        tokens = batch_tokens
        context = float(context_tokens)
        return (
            self._additive(num_requests, tokens)
            + self.kv_read_seconds_per_token * context
            + self.attention_seconds_per_token_pair * context * tokens / num_requests
        )

    def _params(self) -> dict[str, Any]:
        return {
            **super()._params(),
            "kv_read_seconds_per_token": self.kv_read_seconds_per_token,
            "attention_seconds_per_token_pair": self.attention_seconds_per_token_pair,
        }


_KINDS: dict[str, type[CostModel]] = {
    cls.kind: cls for cls in (StepCostTable, AdditiveCostModel, ContextCostModel)
}


class ScaledCostModel(CostModel):
    """`base` with its one-token step times `step_scale` and what tokens beyond it add times
    `token_scale`: the table in force, corrected for how fast the machine runs now.

    A live planner learns both factors from its own steps (`TwoStepCapacityPlanner.observe`):
    a profiled table's absolute seconds do not hold for hours on a shared VM (this project's
    one-token step moved between 62 and 93 ms from minute to minute), nor does its ratio of a
    verify token to a step (2-3 tokens at batch 1 cost 1.3x a step, the table said 1.2x), and
    the drafter's cost, weighed against them, is measured live. Not a file format: the table on
    disk stays the profiled one."""

    kind = "scaled"

    def __init__(self, base: CostModel, step_scale: float, token_scale: float) -> None:
        self.base, self.metadata = base, base.metadata
        self.step_scale, self.token_scale = float(step_scale), float(token_scale)

    def seconds_curve(
        self, num_requests: int, batch_tokens: np.ndarray, context_tokens: float = 0.0
    ) -> np.ndarray:
        # one call to the table for the curve and its one-token step (this runs on every decode step)
        points = np.append(np.asarray(batch_tokens, dtype=np.float64), float(num_requests))
        values = self.base.seconds_curve(num_requests, points, context_tokens)
        curve, step = values[:-1], values[-1]
        return self.step_scale * step + self.token_scale * (curve - step)

    def _params(self) -> dict[str, Any]:
        return {"base": self.base.to_json(), "step_scale": self.step_scale, "token_scale": self.token_scale}

    def _problems(self) -> list[str]:
        problems = self.base._problems()
        for name in ("step_scale", "token_scale"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                problems.append(f"{name} must be a positive number, got {value}")
        return problems


def cost_model_from_json(data: dict[str, Any]) -> CostModel:
    """Parse and validate; CostModelError names the field that is wrong."""
    if not isinstance(data, dict):
        raise CostModelError(f"a cost model is a JSON object, got {type(data).__name__}")
    if data.get("format") != COST_MODEL_FORMAT:
        raise CostModelError(f"expected format {COST_MODEL_FORMAT!r}, got {data.get('format')!r}")
    if data.get("version") != COST_MODEL_VERSION:
        raise CostModelError(
            f"expected version {COST_MODEL_VERSION}, got {data.get('version')!r}"
        )
    kind = data.get("kind")
    if kind not in _KINDS:
        raise CostModelError(f"unknown kind {kind!r}; expected one of {sorted(_KINDS)}")
    fields = {k: v for k, v in data.items() if k not in ("format", "version", "kind")}
    try:
        return _KINDS[kind](**fields)
    except TypeError as error:
        raise CostModelError(f"{kind} cost model has wrong fields: {error}") from error


def load_cost_model(path: str | Path) -> CostModel:
    """Read a cost model file; a missing, unparsable or invalid file raises CostModelError."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CostModelError(f"cannot read cost model {path}: {error}") from error
    return cost_model_from_json(data)


def uninitialised_cost_model() -> StepCostTable:
    """A flat table (every batch costs the same): the planner then verifies every draft."""
    return StepCostTable(
        batch_tokens=[1],
        steps_per_second=[1.0],
        metadata={"hardware": "none", "model": "none", "note": "uninitialised: verify-all"},
    )


class CostModelSlot:
    """The cost model in force. A replacement that fails validation is refused with the reason,
    and the model in force stays (a bad upload never leaves the planner without a table)."""

    def __init__(self, model: CostModel | None = None) -> None:
        self._model = model if model is not None else uninitialised_cost_model()
        self._model.validate()

    @property
    def model(self) -> CostModel:
        return self._model

    def replace(self, candidate: CostModel | dict[str, Any]) -> CostModel:
        """Install `candidate` (a model or its JSON) and return the one it replaced."""
        model = cost_model_from_json(candidate) if isinstance(candidate, dict) else candidate
        model.validate()
        previous, self._model = self._model, model
        return previous
