"""Step-time probes: the raw measurements every cost model is fitted from.

A probe is one batch shape (requests, verify tokens, total context) timed several times. Keeping
the raw repeats (not only their median) lets a later fit choose its own robust statistic and lets
a reader see how noisy the machine was.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PROBES_FORMAT = "sglang-dspark/step-probes"


class ProbeError(ValueError):
    """A probe set that cannot be fitted: says which probe and what was expected."""


@dataclass(frozen=True)
class StepProbe:
    """One timed batch shape.

    num_requests: requests in the batch; batch_tokens: tokens the target forward processes
    (anchors plus verified drafts); context_tokens: KV tokens already cached, summed over the batch;
    seconds: every repeat's wall time.
    """

    num_requests: int
    batch_tokens: int
    context_tokens: int
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.batch_tokens < self.num_requests:
            raise ProbeError(
                f"probe needs num_requests >= 1 and batch_tokens >= num_requests, got "
                f"num_requests={self.num_requests}, batch_tokens={self.batch_tokens}"
            )
        if self.context_tokens < 0:
            raise ProbeError(f"probe context_tokens must be >= 0, got {self.context_tokens}")
        if not self.seconds or any(not (s > 0 and s < float("inf")) for s in self.seconds):
            raise ProbeError(
                f"probe {self.shape} needs at least one finite positive time, got {self.seconds}"
            )

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.num_requests, self.batch_tokens, self.context_tokens)

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds)


@dataclass
class ProbeSet:
    """Probes plus where they were measured (hardware, model, command)."""

    probes: list[StepProbe]
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PROBES_FORMAT,
            "metadata": self.metadata,
            "probes": [{**asdict(p), "seconds": list(p.seconds)} for p in self.probes],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ProbeSet":
        if data.get("format") != PROBES_FORMAT:
            raise ProbeError(f"expected format {PROBES_FORMAT!r}, got {data.get('format')!r}")
        probes = [
            StepProbe(
                num_requests=int(p["num_requests"]),
                batch_tokens=int(p["batch_tokens"]),
                context_tokens=int(p["context_tokens"]),
                seconds=tuple(float(s) for s in p["seconds"]),
            )
            for p in data["probes"]
        ]
        return cls(probes=probes, metadata=dict(data.get("metadata", {})))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "ProbeSet":
        return cls.from_json(json.loads(Path(path).read_text()))
