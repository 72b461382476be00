"""The live sample buffer stays bounded and weights recent rounds more; the drift detector
fires on a calibration shift and stays quiet on calibrated traffic."""

import pytest
import torch

from sglang_dspark.calibration.buffer import CalibrationSampleBuffer
from sglang_dspark.calibration.drift import EceDriftDetector
from sglang_dspark.calibration.metrics import CalibrationDataError


def test_buffer_is_bounded_and_keeps_the_newest_rounds():
    buffer = CalibrationSampleBuffer(capacity=5, gamma=3)
    for step in range(4):
        logits = torch.full((2, 3), float(step))
        buffer.add(logits, torch.tensor([1, 2]), domains="math", timestamp=float(step))
    assert len(buffer) == 5
    snap = buffer.snapshot()
    assert snap.confidence_logits[:, 0].tolist() == [1.0, 2.0, 2.0, 3.0, 3.0]  # oldest first
    buffer.add(torch.zeros(9, 3), torch.zeros(9, dtype=torch.long), timestamp=9.0)
    assert len(buffer) == 5 and buffer.snapshot().timestamps.tolist() == [9.0] * 5


def test_recency_weights_halve_per_half_life_and_domains_filter():
    buffer = CalibrationSampleBuffer(capacity=10, gamma=2, half_life_seconds=10.0)
    buffer.add(torch.zeros(1, 2), torch.tensor([1]), domains="code", timestamp=100.0)
    buffer.add(torch.zeros(2, 2), torch.tensor([0, 2]), verified_lengths=torch.tensor([1, 2]),
               domains=["chat", "code"], timestamp=110.0)
    snap = buffer.snapshot(now=120.0)
    assert snap.weights.tolist() == pytest.approx([0.25, 0.5, 0.5])
    assert snap.domains == ["code", "chat", "code"]
    code = buffer.snapshot(now=120.0, domain="code")
    assert code.accepted_lengths.tolist() == [1, 2]
    assert len(buffer.snapshot(domain="unseen").domains) == 0
    data = snap.calibration_data()
    assert data.valid[1].tolist() == [True, False]  # only one draft was verified in that round


def test_buffer_rejects_inconsistent_rounds():
    buffer = CalibrationSampleBuffer(capacity=4, gamma=3)
    with pytest.raises(CalibrationDataError, match="accepted <= verified"):
        buffer.add(torch.zeros(1, 3), torch.tensor([3]), verified_lengths=torch.tensor([2]))
    with pytest.raises(CalibrationDataError, match="expected logits"):
        buffer.add(torch.zeros(1, 4), torch.tensor([1]))
    with pytest.raises(CalibrationDataError, match="domain tags"):
        buffer.add(torch.zeros(2, 3), torch.tensor([1, 1]), domains=["a"])


def draw(n: int, gamma: int, seed: int, overconfidence: float):
    g = torch.Generator().manual_seed(seed)
    true = torch.randn(n, gamma, generator=g, dtype=torch.float64) + 1.0
    accepted = torch.cumprod((torch.rand(n, gamma, generator=g, dtype=torch.float64) < torch.sigmoid(true)).long(), 1).sum(1)
    return torch.cumprod(torch.sigmoid(true * overconfidence), dim=1), accepted


def test_drift_detector_fires_after_a_shift_and_not_before():
    detector = EceDriftDetector(gamma=5, window=1024, tolerance=0.03, min_samples=256, patience=3)
    statuses = [detector.update(*draw(128, 5, seed, 1.0)) for seed in range(16)]
    assert statuses[-1].rolling_ece is not None and not any(s.drifted for s in statuses)
    reference = statuses[-1].reference_ece
    shifted = [detector.update(*draw(128, 5, 100 + seed, 3.0)) for seed in range(16)]
    assert shifted[-1].drifted and shifted[-1].rolling_ece > reference + 0.03
    assert not shifted[0].drifted  # patience: one bad batch is not drift
    detector.set_reference(shifted[-1].rolling_ece)
    assert detector.update(*draw(128, 5, 999, 3.0)).rolling_ece is None  # window restarted
