"""Acceptance traces for the serving simulator: what the planner sees and what actually happens.

Each decode round of a request yields confidence logits [gamma] (what the planner sees, through
survivals) and the *natural* accepted length (how many drafts would be accepted if all gamma were
verified; verifying l drafts accepts min(l, natural)).

Two sources:

* `SyntheticTraces`: per-domain shapes from the paper (DSpark on Qwen3-4B, gamma 7, T=1): mean
  tau incl. bonus math 5.57 / code 5.12 / chat 3.49 (Table 1 domain means), first-slot
  conditional acceptance math 0.93 (Fig. 2) and lower for code and chat. The conditional
  acceptance of slot k has logit
      base_k(domain) + u_request + s_round + v_{round,k},
  base_k linear in k from `first` to `last` (`DOMAIN_SHAPES`, chosen so the mean tau matches the
  paper within 0.05 under this noise; the
  effective first-slot acceptance after noise is ~0.93 / 0.92 / 0.80), u ~ N(0, 0.6^2) per request (easy and hard prompts),
  s ~ N(0, 0.5^2) per round (a hard passage), v ~ N(0, 0.5^2) per slot. The planner sees the true
  logit plus N(0, 0.5^2) noise: informative, not exact. Acceptance is drawn from the true
  probabilities. Deterministic by seed.
* `FileTraces`: JSONL rounds from the offline evaluator (schema in docs/interfaces.md), drawn per
  domain with replacement, seeded.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

TRACE_DOMAINS = ("math", "code", "chat")


class TraceError(ValueError):
    """A trace file or request that cannot be used; names the line and field."""


@dataclass(frozen=True)
class DomainShape:
    """Conditional acceptance of slot 1 and slot gamma (linear in logit space between them)."""

    first: float
    last: float
    paper_tau: float


# Fitted once (see module docstring); tests check that the generated tau matches paper_tau.
DOMAIN_SHAPES: dict[str, DomainShape] = {
    "math": DomainShape(first=0.96, last=0.685, paper_tau=5.57),
    "code": DomainShape(first=0.95, last=0.573, paper_tau=5.12),
    "chat": DomainShape(first=0.85, last=0.28, paper_tau=3.49),
}
REQUEST_SIGMA = 0.6
ROUND_SIGMA = 0.5
SLOT_SIGMA = 0.5
CONFIDENCE_NOISE = 0.5


class RoundSource(Protocol):
    """What the simulator needs from a trace source."""

    gamma: int
    domains: tuple[str, ...]

    def new_request_offset(self, generator: torch.Generator | None = None) -> float:
        """Hidden per-request difficulty (0 where the source has none)."""

    def draw(
        self,
        domain_ids: torch.Tensor,
        request_offsets: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One round per row: confidence logits [N, gamma], natural accepted length [N]. With
        `generator`, draws come from it (a request's own stream) instead of the source's."""


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


def natural_lengths(accept_probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of accepted slots."""
    accepted = (uniforms < accept_probs).to(torch.int64)
    return torch.cumprod(accepted, dim=-1).sum(dim=-1)


class SyntheticTraces:
    """Paper-shaped survival traces (see module docstring)."""

    def __init__(
        self,
        gamma: int = 7,
        seed: int = 0,
        domains: tuple[str, ...] = TRACE_DOMAINS,
        confidence_noise: float = CONFIDENCE_NOISE,
    ) -> None:
        unknown = [d for d in domains if d not in DOMAIN_SHAPES]
        if unknown or gamma < 1:
            raise TraceError(
                f"synthetic traces know domains {sorted(DOMAIN_SHAPES)} and need gamma >= 1; "
                f"got domains {list(domains)}, gamma {gamma}"
            )
        self.gamma, self.domains, self.confidence_noise = gamma, tuple(domains), confidence_noise
        self._generator = torch.Generator().manual_seed(seed)
        rows = []
        for name in self.domains:
            shape = DOMAIN_SHAPES[name]
            rows.append(
                torch.linspace(_logit(shape.first), _logit(shape.last), gamma, dtype=torch.float64)
                if gamma > 1
                else torch.tensor([_logit(shape.first)], dtype=torch.float64)
            )
        self._base_logits = torch.stack(rows)  # [domains, gamma]

    def new_request_offset(self, generator: torch.Generator | None = None) -> float:
        g = generator or self._generator
        return float(torch.randn(1, generator=g, dtype=torch.float64)) * REQUEST_SIGMA

    def draw(
        self,
        domain_ids: torch.Tensor,
        request_offsets: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch = domain_ids.numel()
        g = generator or self._generator
        noise = (
            torch.randn(batch, 1, generator=g, dtype=torch.float64) * ROUND_SIGMA
            + torch.randn(batch, self.gamma, generator=g, dtype=torch.float64) * SLOT_SIGMA
        )
        true_logits = self._base_logits[domain_ids] + request_offsets.to(torch.float64)[:, None] + noise
        seen = true_logits + torch.randn(batch, self.gamma, generator=g, dtype=torch.float64) * self.confidence_noise
        uniforms = torch.rand(batch, self.gamma, generator=g, dtype=torch.float64)
        return seen.to(torch.float32), natural_lengths(torch.sigmoid(true_logits), uniforms)


class FileTraces:
    """Rounds from a JSONL file, sampled per domain with replacement (seeded).

    A round verified with fewer than gamma drafts whose drafts were all accepted is censored:
    its natural length is taken as the verified length (conservative, never invents acceptance).
    """

    def __init__(self, path: str | Path, seed: int = 0) -> None:
        by_domain: dict[str, tuple[list[list[float]], list[int]]] = {}
        gamma = None
        for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
            if not line.strip():
                continue
            domain, logits, accepted = self._parse(line, number, path)
            if gamma is None:
                gamma = len(logits)
            elif len(logits) != gamma:
                raise TraceError(
                    f"{path}:{number}: confidence_logits has {len(logits)} entries, earlier lines "
                    f"have {gamma}; every round must use the same gamma"
                )
            pool = by_domain.setdefault(domain, ([], []))
            pool[0].append(logits)
            pool[1].append(accepted)
        if gamma is None:
            raise TraceError(f"{path}: no trace records found")
        self.gamma = gamma
        self.domains = tuple(sorted(by_domain))
        self._logits = [torch.tensor(by_domain[d][0], dtype=torch.float32) for d in self.domains]
        self._accepted = [torch.tensor(by_domain[d][1], dtype=torch.int64) for d in self.domains]
        self._generator = torch.Generator().manual_seed(seed)

    @staticmethod
    def _parse(line: str, number: int, path: str | Path) -> tuple[str, list[float], int]:
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise TraceError(f"{where}: not JSON ({error})") from error
        if not isinstance(record, dict):
            raise TraceError(f"{where}: expected a JSON object per line")
        domain = record.get("domain")
        logits = record.get("confidence_logits")
        accepted = record.get("accepted_length")
        if not isinstance(domain, str) or not domain:
            raise TraceError(f"{where}: 'domain' must be a non-empty string, got {domain!r}")
        if not isinstance(logits, list) or not logits or not all(
            isinstance(x, (int, float)) and math.isfinite(x) for x in logits
        ):
            raise TraceError(f"{where}: 'confidence_logits' must be a non-empty list of numbers")
        verified = record.get("verified_length", len(logits))
        if not isinstance(accepted, int) or not isinstance(verified, int) or not (
            0 <= accepted <= verified <= len(logits)
        ):
            raise TraceError(
                f"{where}: need integers 0 <= accepted_length <= verified_length <= "
                f"{len(logits)}, got accepted_length={accepted!r}, verified_length={verified!r}"
            )
        return domain, [float(x) for x in logits], accepted

    def new_request_offset(self, generator: torch.Generator | None = None) -> float:
        return 0.0

    def draw(
        self,
        domain_ids: torch.Tensor,
        request_offsets: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch.empty(domain_ids.numel(), self.gamma, dtype=torch.float32)
        natural = torch.empty(domain_ids.numel(), dtype=torch.int64)
        for domain in domain_ids.unique().tolist():
            rows = (domain_ids == domain).nonzero().flatten()
            pool = self._accepted[domain].numel()
            pick = torch.randint(0, pool, (rows.numel(),), generator=generator or self._generator)
            logits[rows] = self._logits[domain][pick]
            natural[rows] = self._accepted[domain][pick]
        return logits, natural


def expected_tau(source: RoundSource, domain: str, rounds: int = 20000) -> float:
    """Mean tokens per round with full verification (accepted + bonus) for one domain."""
    domain_id = source.domains.index(domain)
    offsets = torch.tensor([source.new_request_offset() for _ in range(rounds)])
    _, natural = source.draw(torch.full((rounds,), domain_id), offsets)
    return float(natural.double().mean()) + 1.0
