"""Per-step verify lengths for the DSPARK_LIVE worker (`DSPARK_PLANNER`).

* `all`: every request verifies all gamma drafts (no cost model needed).
* `fixed:N`: every request verifies N drafts (a measurement knob).
* `production`: capacity K from survivals two steps back (known before the target forward is
  launched, as overlap scheduling needs), then a global top-K over this step's survivals
  (`scheduling.TwoStepCapacityPlanner` + `fill_capacity`). Non-anticipating, so lossless.

Survivals a_k = prod_{i<=k} sigmoid(c_i / T_i) use the STS temperatures from `DSPARK_STS_PATH` or
`<draft>/sts.json` (identity without one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_dspark.engine.settings import LiveSettings


@dataclass(frozen=True)
class Plan:
    """verify_lens [B]: drafts verified per request (the bonus position comes on top)."""

    verify_lens: torch.Tensor
    capacity: int | None
    predicted_seconds: float | None
    confidence_logits: torch.Tensor | None
    survivals: torch.Tensor | None


class VerifyPlanner:
    """Holds the planner state across decode steps of one worker."""

    def __init__(self, settings: LiveSettings) -> None:
        self.settings = settings
        self.gamma = settings.gamma
        self.calibration = self._load_calibration()
        self.capacity_planner = None
        self.cost_model = None
        if settings.planner == "production":
            from sglang_dspark.scheduling.cost_model import load_cost_model
            from sglang_dspark.scheduling.planner import TwoStepCapacityPlanner

            self.cost_model = load_cost_model(settings.sps_path)
            self.capacity_planner = TwoStepCapacityPlanner(self.cost_model, gamma=self.gamma, lag=2)

    def _load_calibration(self):
        """STS temperatures (and biases) cut to gamma, or None for identity."""
        if self.settings.sts_path is None:
            return None
        from sglang_dspark.calibration.sts import StsCalibration

        calibration = StsCalibration.load(self.settings.sts_path)
        if calibration.gamma < self.gamma:
            raise ValueError(
                f"STS file {self.settings.sts_path} has {calibration.gamma} temperatures; expected at least "
                f"gamma={self.gamma}"
            )
        biases = None if calibration.biases is None else calibration.biases[: self.gamma]
        return StsCalibration(temperatures=calibration.temperatures[: self.gamma], biases=biases)

    def survivals(self, confidence_logits: torch.Tensor) -> torch.Tensor:
        """Prefix survivals a_k from raw confidence logits [B, gamma]."""
        if self.calibration is not None:
            return self.calibration.apply(confidence_logits).to(torch.float32)
        return torch.cumprod(torch.sigmoid(confidence_logits.to(torch.float32)), dim=-1)

    def plan(self, request_ids: list, confidence_logits: torch.Tensor | None, context_lens: torch.Tensor) -> Plan:
        """Verify lengths for this step. `confidence_logits` is None for a drafter without a
        confidence head (a DFlash drafter): only `all` and `fixed` can plan without survivals, and
        `load_settings` refuses `production` for such a drafter at launch."""
        batch = len(request_ids)
        if confidence_logits is None:
            if self.settings.planner == "production":
                raise ValueError("the production planner needs a drafter with a confidence head")
            drafts = self.gamma if self.settings.planner == "all" else self.settings.fixed_drafts
            return Plan(verify_lens=torch.full((batch,), drafts, dtype=torch.long), capacity=None,
                        predicted_seconds=None, confidence_logits=None, survivals=None)
        confidence_logits = confidence_logits[:, : self.gamma].float().cpu()
        survivals = self.survivals(confidence_logits)
        capacity = predicted = None
        if self.settings.planner == "all":
            verify_lens = torch.full((batch,), self.gamma, dtype=torch.long)
        elif self.settings.planner == "fixed":
            verify_lens = torch.full((batch,), self.settings.fixed_drafts, dtype=torch.long)
        else:
            from sglang_dspark.scheduling.cost_model import StepShape
            from sglang_dspark.scheduling.planner import fill_capacity

            context = float(context_lens.sum())
            capacity = self.capacity_planner.capacity(request_ids, context_tokens=context)
            verify_lens = fill_capacity(survivals, capacity)
            self.capacity_planner.publish(request_ids, survivals)
            predicted = self.cost_model.predict(StepShape(num_requests=batch, batch_tokens=batch + int(verify_lens.sum()),
                                                          context_tokens=int(context)))
        return Plan(verify_lens=verify_lens, capacity=capacity, predicted_seconds=predicted,
                    confidence_logits=confidence_logits, survivals=survivals)
