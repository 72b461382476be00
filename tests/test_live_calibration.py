"""Live recalibration: STS refitted on served verify rounds replaces a miscalibrated file."""

from __future__ import annotations


import json
from pathlib import Path

import pytest
import torch

from sglang_dspark.calibration.sts import StsCalibration
from sglang_dspark.engine.live_calibration import LiveRecalibrator
from sglang_dspark.engine.planning import VerifyPlanner
from sglang_dspark.engine.settings import load_settings

GAMMA = 4


def _rounds(n: int, temperature: float, seed: int, verify: int = GAMMA):
    """Rounds whose drafts truly survive with prod sigmoid(z_k / temperature): raw confidences
    are miscalibrated unless temperature is 1. Each round verifies `verify` drafts."""
    generator = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(n, GAMMA, generator=generator)
    accepts = torch.rand(n, GAMMA, generator=generator) < torch.sigmoid(logits / temperature)
    accepted = torch.cumprod(accepts.long(), dim=1).sum(dim=1).clamp(max=verify)
    return logits, torch.full((n,), verify), accepted


def test_a_refit_on_served_rounds_replaces_an_overconfident_calibration_and_keeps_a_good_one():
    recalibrator = LiveRecalibrator(GAMMA, every=2000, seed=0)
    logits, verified, accepted = _rounds(2000, temperature=3.0, seed=1)
    recalibrator.add(logits[:1000], verified[:1000], accepted[:1000], torch.ones(1000, dtype=torch.bool))
    assert recalibrator.due() == [], "not before `every` rounds of the class"
    recalibrator.add(logits[1000:], verified[1000:], accepted[1000:], torch.ones(1000, dtype=torch.bool))
    assert recalibrator.due() == ["greedy"]
    refitted = recalibrator.refit("greedy", None)  # raw confidences: too sure by a factor of 3
    report = recalibrator.reports[-1]
    assert refitted is not None and report.adopted and report.ece_after < report.ece_before - 0.02, report
    assert all(2.0 < t < 4.5 for t in refitted.temperatures[:2]), refitted.temperatures
    assert recalibrator.due() == [], "the count restarts after a refit"

    # the same traffic again, with the true calibration in force: no refit beats it
    logits, verified, accepted = _rounds(2000, temperature=3.0, seed=2)
    recalibrator.add(logits, verified, accepted, torch.ones(2000, dtype=torch.bool))
    assert recalibrator.refit("greedy", StsCalibration(temperatures=[3.0] * GAMMA)) is None
    assert not recalibrator.reports[-1].adopted


def test_greedy_and_sampled_rounds_are_calibrated_apart_and_unverified_rounds_are_dropped():
    recalibrator = LiveRecalibrator(GAMMA, every=64)
    logits = torch.zeros(4, 3)  # a drafted width of 3 < gamma
    recalibrator.add(logits, torch.tensor([3, 0, 2, 1]), torch.tensor([1, 0, 2, 0]),
                     torch.tensor([True, True, False, False]))
    assert len(recalibrator._buffers["greedy"]) == 1 and len(recalibrator._buffers["sampled"]) == 2


def test_recalibration_needs_enough_rounds_to_hold_some_out():
    with pytest.raises(ValueError, match="at least 64"):
        LiveRecalibrator(GAMMA, every=10)


def _production_planner(tmp_path, monkeypatch) -> VerifyPlanner:
    """The production planner for a 7-slot drafter with a confidence head and no STS files."""
    folder = tmp_path / "drafter"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"block_size": 7, "enable_confidence_head": True}))
    profile = Path(__file__).resolve().parent.parent / "profiles" / "cpu-smollm2-135m-target-context.json"
    monkeypatch.setenv("DSPARK_SPS_PATH", str(profile))
    monkeypatch.setenv("DSPARK_PLANNER", "production")
    return VerifyPlanner(load_settings(folder))


def test_the_production_planner_swaps_in_a_refit_for_greedy_rows_only(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_RECALIBRATE_EVERY", "512")
    planner = _production_planner(tmp_path, monkeypatch)
    assert planner.calibration is None and planner.greedy_calibration is None
    generator = torch.Generator().manual_seed(3)
    served = 0
    while planner.greedy_calibration is None and served < 8192:  # drafts truly survive at temperature 3
        logits = 2.0 * torch.randn(8, 7, generator=generator)
        survives = torch.rand(8, 7, generator=generator) < torch.sigmoid(logits / 3.0)
        plan = planner.plan([f"r{served + i}" for i in range(8)], logits, torch.full((8,), 50))
        accepted = torch.cumprod(survives.long(), dim=1).sum(dim=1).minimum(plan.verify_lens)
        planner.observe_rounds(plan, accepted, torch.ones(8, dtype=torch.bool))
        served += 8
    assert isinstance(planner.greedy_calibration, StsCalibration), "greedy rows got a refitted calibration"
    assert planner.calibration is None, "sampled rows keep theirs: no sampled round was served"
    z = torch.full((1, 7), 4.0)
    assert float(planner.survivals(z, torch.tensor([True]))[0, 0]) < float(planner.survivals(z)[0, 0]) - 0.1


def test_refits_that_change_nothing_come_ever_more_rarely():
    recalibrator = LiveRecalibrator(GAMMA, every=256, seed=0)
    waits = []
    for seed in range(4):
        logits, verified, accepted = _rounds(4096, temperature=1.0, seed=10 + seed)  # raw is right
        fed = 0
        while not recalibrator.due():
            recalibrator.add(logits[fed:fed + 64], verified[fed:fed + 64], accepted[fed:fed + 64],
                             torch.ones(64, dtype=torch.bool))
            fed += 64
        waits.append(fed)
        assert recalibrator.refit("greedy", None) is None
    assert waits == [256, 512, 1024, 2048], waits
