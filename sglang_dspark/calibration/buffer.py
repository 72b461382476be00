"""The live calibration sample buffer: a bounded ring of recent verification rounds.

Each round keeps the raw (pre-STS) confidence logits, how many drafts were verified and accepted,
a domain tag and the time. Recency weighting (a half-life) lets a refit follow drifting traffic
without forgetting everything at once; the bound keeps memory fixed however long the server runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from sglang_dspark.calibration.metrics import CalibrationDataError
from sglang_dspark.calibration.sts import CalibrationData


@dataclass(frozen=True)
class BufferSnapshot:
    """A copy of the buffer's rounds, oldest first, with recency weights [N]."""

    confidence_logits: torch.Tensor
    accepted_lengths: torch.Tensor
    verified_lengths: torch.Tensor
    domains: list[str]
    timestamps: torch.Tensor
    weights: torch.Tensor

    def calibration_data(self) -> CalibrationData:
        return CalibrationData.from_rounds(
            self.confidence_logits, self.accepted_lengths, self.verified_lengths, self.weights
        )


class CalibrationSampleBuffer:
    """Ring buffer of at most `capacity` rounds; the oldest rounds are overwritten first."""

    def __init__(self, capacity: int, gamma: int, half_life_seconds: float | None = None) -> None:
        if capacity < 1 or gamma < 1:
            raise CalibrationDataError(f"need capacity >= 1 and gamma >= 1, got {capacity}, {gamma}")
        if half_life_seconds is not None and half_life_seconds <= 0:
            raise CalibrationDataError(f"half_life_seconds must be > 0, got {half_life_seconds}")
        self.capacity, self.gamma, self.half_life_seconds = capacity, gamma, half_life_seconds
        self._logits = torch.zeros(capacity, gamma, dtype=torch.float32)
        self._accepted = torch.zeros(capacity, dtype=torch.int16)
        self._verified = torch.zeros(capacity, dtype=torch.int16)
        self._times = torch.zeros(capacity, dtype=torch.float64)
        self._domain_ids = torch.zeros(capacity, dtype=torch.int32)
        self._domain_names: list[str] = []
        self._next = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def _domain_id(self, name: str) -> int:
        if name not in self._domain_names:
            self._domain_names.append(name)
        return self._domain_names.index(name)

    def add(
        self,
        confidence_logits: torch.Tensor,
        accepted_lengths: torch.Tensor,
        verified_lengths: torch.Tensor | None = None,
        domains: str | Sequence[str] = "unknown",
        timestamp: float | None = None,
    ) -> None:
        """Append rounds: logits [n, gamma], accepted/verified [n] (verified defaults to gamma)."""
        n = confidence_logits.shape[0]
        if confidence_logits.shape != (n, self.gamma) or accepted_lengths.shape != (n,):
            raise CalibrationDataError(
                f"expected logits ({n}, {self.gamma}) and accepted ({n},), got "
                f"{tuple(confidence_logits.shape)} and {tuple(accepted_lengths.shape)}"
            )
        verified = torch.full((n,), self.gamma) if verified_lengths is None else verified_lengths
        if bool((accepted_lengths > verified).any()) or bool((verified > self.gamma).any()):
            raise CalibrationDataError(f"need accepted <= verified <= gamma={self.gamma}")
        names = [domains] * n if isinstance(domains, str) else list(domains)
        if len(names) != n:
            raise CalibrationDataError(f"{n} rounds but {len(names)} domain tags")
        now = time.time() if timestamp is None else timestamp
        slots = (self._next + torch.arange(n)) % self.capacity
        if n > self.capacity:  # only the newest `capacity` rounds survive anyway
            slots, keep = slots[-self.capacity :], slice(n - self.capacity, n)
        else:
            keep = slice(0, n)
        self._logits[slots] = confidence_logits[keep].to(torch.float32)
        self._accepted[slots] = accepted_lengths[keep].to(torch.int16)
        self._verified[slots] = verified[keep].to(torch.int16)
        self._times[slots] = now
        self._domain_ids[slots] = torch.tensor([self._domain_id(d) for d in names[keep]], dtype=torch.int32)
        self._next = (self._next + n) % self.capacity
        self._size = min(self._size + n, self.capacity)

    def snapshot(self, now: float | None = None, domain: str | None = None) -> BufferSnapshot:
        """Rounds oldest first (optionally one domain), weighted 0.5 ** (age / half-life)."""
        start = (self._next - self._size) % self.capacity
        order = (start + torch.arange(self._size)) % self.capacity
        if domain is not None:
            if domain not in self._domain_names:
                order = order[:0]
            else:
                order = order[self._domain_ids[order] == self._domain_names.index(domain)]
        times = self._times[order]
        if self.half_life_seconds is None:
            weights = torch.ones_like(times)
        else:
            reference = time.time() if now is None else now
            weights = torch.pow(0.5, (reference - times).clamp(min=0) / self.half_life_seconds)
        return BufferSnapshot(
            confidence_logits=self._logits[order].clone(),
            accepted_lengths=self._accepted[order].long(),
            verified_lengths=self._verified[order].long(),
            domains=[self._domain_names[int(i)] for i in self._domain_ids[order]],
            timestamps=times.clone(),
            weights=weights,
        )

    def clear(self) -> None:
        self._next = self._size = 0
