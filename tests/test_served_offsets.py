"""Served acceptance offsets: a calibration that under-predicts deep acceptance on served traffic
is corrected from the server's own verify rounds, and the planner then verifies the drafts that pay."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sglang_dspark.calibration.served_offsets import ServedOffsets
from sglang_dspark.engine.planning import StepDecision, VerifyPlanner
from sglang_dspark.engine.settings import SettingsError, load_settings

GAMMA = 5


def _serve(offsets: ServedOffsets, rounds: int, true_shift: list[float], seed: int, threshold: float = 0.15):
    """Rounds whose draft k is accepted (after 1..k-1) with sigmoid(x_k + true_shift[k]); each
    round verifies the drafts whose predicted survival (with the offsets learnt so far) is at least
    `threshold`, as the early stop does, so deep positions are tested only where they look good."""
    generator = torch.Generator().manual_seed(seed)
    shift = torch.tensor(true_shift, dtype=torch.float64)
    for _ in range(rounds // 8):
        logits = 1.5 * torch.randn(8, GAMMA, generator=generator, dtype=torch.float64)
        accepts = torch.rand(8, GAMMA, generator=generator, dtype=torch.float64) < torch.sigmoid(logits + shift)
        accepted = torch.cumprod(accepts.long(), dim=1).sum(dim=1)
        verify = (offsets.apply(logits) >= threshold).long().cumprod(dim=1).sum(dim=1)
        offsets.add(logits, verify, accepted.minimum(verify))


def test_offsets_learn_that_deep_drafts_survive_more_than_predicted_and_position_one_does_not():
    offsets = ServedOffsets(GAMMA)
    _serve(offsets, 4000, [0.0, 0.8, 0.8, 0.8, 0.8], seed=1)
    assert abs(offsets.offsets[0]) < 0.2, offsets.offsets
    assert np.all(np.abs(offsets.offsets[1:4] - 0.8) < 0.3), offsets.offsets
    logits = torch.full((1, GAMMA), 0.0, dtype=torch.float64)
    truth = torch.cumprod(torch.sigmoid(logits + torch.tensor([0.0] + [0.8] * 4, dtype=torch.float64)), dim=1)
    learnt, uncorrected = offsets.apply(logits).double(), torch.cumprod(torch.sigmoid(logits), dim=1)
    assert float((learnt - truth).abs().max()) < 0.05 < float((uncorrected - truth).abs().max())


def test_a_calibration_that_is_right_keeps_offsets_near_zero():
    offsets = ServedOffsets(GAMMA)
    _serve(offsets, 4000, [0.0] * GAMMA, seed=2)
    assert np.all(np.abs(offsets.offsets) < 0.2), offsets.offsets


def test_untested_deep_positions_take_their_shallower_neighbours_offset():
    offsets = ServedOffsets(GAMMA, refit_every=1)
    generator = torch.Generator().manual_seed(3)
    for _ in range(200):  # every round verifies 2 drafts: positions 3.. are never tested
        logits = torch.randn(8, GAMMA, generator=generator, dtype=torch.float64)
        accepts = torch.rand(8, 2, generator=generator, dtype=torch.float64) < torch.sigmoid(logits[:, :2] + 1.0)
        offsets.add(logits, torch.full((8,), 2), torch.cumprod(accepts.long(), dim=1).sum(dim=1))
    assert offsets.tests()[2:] == [0, 0, 0]
    assert offsets.offsets[1] > 0.6 and np.allclose(offsets.offsets[2:], offsets.offsets[1])


def test_a_few_tests_move_an_offset_little():
    offsets = ServedOffsets(GAMMA, refit_every=1)
    offsets.add(torch.zeros(4, GAMMA, dtype=torch.float64), torch.full((4,), 1), torch.ones(4, dtype=torch.long))
    assert 0.0 < offsets.offsets[0] < 0.6, "4 acceptances at a predicted 0.5 are weak evidence"
    offsets.reset()
    assert offsets.tests() == [0] * GAMMA and not offsets.offsets.any()


def _planner(tmp_path, monkeypatch, offsets: str) -> VerifyPlanner:
    folder = tmp_path / f"drafter-{offsets}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"block_size": 7, "enable_confidence_head": True}))
    profile = Path(__file__).resolve().parent.parent / "profiles" / "cpu-smollm2-135m-target-context.json"
    monkeypatch.setenv("DSPARK_SPS_PATH", str(profile))
    monkeypatch.setenv("DSPARK_PLANNER", "production")
    monkeypatch.setenv("DSPARK_RECALIBRATE_EVERY", "0")
    monkeypatch.setenv("DSPARK_SERVED_OFFSETS", offsets)
    return VerifyPlanner(load_settings(folder))


@pytest.mark.parametrize("offsets", ["on", "off"])
def test_the_planner_verifies_more_drafts_once_served_rounds_show_they_survive(tmp_path, monkeypatch, offsets):
    planner = _planner(tmp_path, monkeypatch, offsets)
    probe = torch.tensor([[3.0] + [0.0] * 6])  # predicted conditional acceptance 0.95, then 0.5
    whole_block = StepDecision(draft_width=7, capacity=None)  # the early stop alone decides

    def plan(request: str, logits: torch.Tensor):
        return planner.plan([request], logits, torch.tensor([50]), whole_block, greedy=torch.tensor([True]))

    before = plan("probe", probe)
    generator = torch.Generator().manual_seed(4)
    for step in range(300):  # served drafts after the first survive far more than predicted
        logits = torch.randn(1, 7, generator=generator)
        shift = torch.tensor([0.0] + [2.0] * 6)
        accepts = torch.rand(1, 7, generator=generator) < torch.sigmoid(logits + shift)
        served = plan(f"r{step}", logits)
        accepted = torch.cumprod(accepts.long(), dim=1).sum(dim=1).minimum(served.verify_lens)
        planner.observe_rounds(served, accepted, torch.tensor([True]))
    after = plan("probe", probe)
    if offsets == "on":
        assert float(after.survivals[0, 3]) > float(before.survivals[0, 3]) + 0.2
        assert int(after.verify_lens[0]) > int(before.verify_lens[0])
    else:
        assert torch.equal(after.survivals, before.survivals)


def test_a_bad_served_offsets_knob_fails_with_what_was_expected(tmp_path, monkeypatch):
    with pytest.raises(SettingsError, match="DSPARK_SERVED_OFFSETS='maybe': expected on or off"):
        _planner(tmp_path, monkeypatch, "maybe")


def test_refits_come_more_rarely_as_the_buffers_fill():
    """A refit over full buffers takes ~1 ms; with thousands of tests held, 64 more move the
    offsets little, so they wait for a sixteenth of those held."""
    offsets = ServedOffsets(GAMMA, capacity=4096, refit_every=64)
    all_verified, all_accepted = torch.full((8,), GAMMA), torch.full((8,), GAMMA)
    for _ in range(1000):  # 8 rounds x 5 positions, every draft accepted at a predicted 0.5
        offsets.add(torch.zeros(8, GAMMA, dtype=torch.float64), all_verified, all_accepted)
    held = sum(offsets.tests())
    assert held == 5 * 4096
    fitted = offsets.offsets.copy()
    assert fitted[0] > 2.0, "every test accepted: the offsets rose"
    rejected = torch.zeros(8, dtype=torch.long)  # now every first draft is rejected
    for _ in range(8):  # 64 new tests: not yet a sixteenth of 20,480
        offsets.add(torch.zeros(8, GAMMA, dtype=torch.float64), all_verified, rejected)
    assert np.array_equal(offsets.offsets, fitted)
    for _ in range(held // 16 // 8):
        offsets.add(torch.zeros(8, GAMMA, dtype=torch.float64), all_verified, rejected)
    assert offsets.offsets[0] < fitted[0], "a sixteenth of the tests held later, the refit came"
