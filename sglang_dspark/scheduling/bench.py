"""Planner latency on this CPU: what `dspark-ctl bench planner` and `bench sim` report."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from sglang_dspark.scheduling.cost_model import StepShape, load_cost_model
from sglang_dspark.scheduling.planner import EarlyStopPlanner, plan_algorithm1, survivals_from_confidences


def plan_speed(cost_model_path: Path, batch: int, gamma: int, iterations: int, seed: int = 0) -> dict[str, Any]:
    """Median wall time (and thread CPU time: on a shared machine wall time includes waiting for
    a core) of each planner call at (batch, gamma), with the measured CPU table. `scheduled_step`
    is the worker's whole per-step planner work: decide + verify lengths + publish + observe."""
    model = load_cost_model(cost_model_path)
    generator = torch.Generator().manual_seed(seed)
    survivals = [
        survivals_from_confidences(torch.randn(batch, gamma, generator=generator) * 1.5 + 1.5)
        for _ in range(8)
    ]
    ids = list(range(batch))
    planner = EarlyStopPlanner(model, gamma)
    for s in survivals[:4]:
        planner.publish(ids, s)
    draft_costs = [0.0] + [0.01 * w for w in range(1, gamma + 1)]

    def algorithm1(i: int) -> None:
        plan_algorithm1(survivals[i % 8], model, context_tokens=batch * 512.0)

    def production(i: int) -> None:
        decision = planner.decide(ids, context_tokens=batch * 512.0, draft_seconds=draft_costs)
        width = max(decision.draft_width, 1)
        lens = planner.verify_lens(survivals[i % 8], width, context_tokens=batch * 512.0)
        planner.publish(ids, survivals[i % 8], width)
        planner.observe(StepShape(batch, batch + int(lens.sum()), batch * 512), 0.1)

    report: dict[str, Any] = {"batch": batch, "gamma": gamma, "iterations": iterations,
                              "torch_threads": torch.get_num_threads()}
    for name, call in (("algorithm1", algorithm1), ("scheduled_step", production)):
        for i in range(20):
            call(i)
        times, cpu_times = [], []
        for i in range(iterations):
            start, cpu_start = time.perf_counter(), time.thread_time()
            call(i)
            times.append(time.perf_counter() - start)
            cpu_times.append(time.thread_time() - cpu_start)
        report[f"{name}_median_us"] = round(statistics.median(times) * 1e6, 1)
        report[f"{name}_p90_us"] = round(sorted(times)[int(0.9 * len(times))] * 1e6, 1)
        report[f"{name}_cpu_median_us"] = round(statistics.median(cpu_times) * 1e6, 1)
    return report
