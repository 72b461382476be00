"""Bounded per-step records of the DSPARK_LIVE worker, kept in the scheduler process.

The control plane reads them (status, steps, calibration samples); the ring never grows past
`max_records`, so a long-running server keeps constant memory.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class RequestStep:
    """One request in one decode step."""

    rid: str
    slot: int
    context_len: int
    verify_len: int
    accepted: int
    temperature: float
    confidence_logits: list[float]
    survivals: list[float]
    lookup_drafts: int = 0  # drafts taken from the request's own earlier text (`engine.lookup`), not the drafter
    lookup_match: int = 0  # the length of the match that proposed them (2-4; 0: none)
    # drafts verified as a tree (`DSPARK_TREE_NODES`, batch 1; 0: a chain): `accepted` counts the
    # tree's committed drafts, `verify_len` the walked chain's drafts the tree held (calibrated)
    tree_drafts: int = 0
    tree_gain: int = 0  # drafts the tree committed beyond those of the walked chain it held


@dataclass(frozen=True)
class StepRecord:
    """One decode (verify) step of the whole batch."""

    step: int
    wall_time: float
    batch_size: int
    capacity: int | None
    verify_tokens: int
    accepted_tokens: int
    committed_tokens: int
    predicted_seconds: float | None
    measured_seconds: float
    draft_seconds: float
    verify_seconds: float
    overlap: bool
    drafted: bool = True  # False: the planner skipped the drafter (drafts not worth their cost)
    vetoed: bool = False  # ran plain (no drafter, no lookup drafts): speculated steps measurably lost
    catch_up_rows: int = 0  # committed taps first projected into the drafter context this step
    catch_up_seconds: float = 0.0  # their share of draft_seconds
    decide_seconds: float = 0.0  # the planner's draft-or-skip decision: its share of draft_seconds
    block_seconds: float = 0.0  # the drafter's block forward: its share
    walk_seconds: float = 0.0  # the Markov walk sampling the drafts: its share
    plan_seconds: float = 0.0  # the verify lengths: its share
    forward_seconds: float = 0.0  # the target's verify forward alone: its share of verify_seconds
    # since the previous decode step ended: SGLang's scheduler between two steps (result processing,
    # streaming, the next batch); None when a prefill or an idle step came between
    between_steps_seconds: float | None = None
    # after measured_seconds ended: the planner taking in this step (step rates, cost table, verify
    # rounds), with a live recalibration refit when one was due (0.1-0.2 s of 4,096 rounds here)
    observe_seconds: float = 0.0
    requests: list[RequestStep] = field(default_factory=list)

    def to_json(self) -> dict:
        """A plain dict (shares the record's lists: read it, do not change it). `asdict` deep-copies
        every field: 0.75 ms a step at batch 16, on the step's critical path when steps are logged."""
        return {**vars(self), "requests": [vars(request) for request in self.requests]}


class StepRecorder:
    """Thread-safe ring of the last `max_records` steps plus running totals since start."""

    def __init__(self, max_records: int, log_path: Path | None = None) -> None:
        if max_records < 1:
            raise ValueError(f"max_records={max_records}: expected >= 1")
        self._log = open(log_path, "a", buffering=1) if log_path is not None else None
        self._records: deque[StepRecord] = deque(maxlen=max_records)
        self._lock = threading.Lock()
        self.started = time.time()
        self.total_steps = 0
        self.total_prefills = 0
        self.total_committed = 0
        self.total_verify_tokens = 0
        self.total_request_steps = 0
        self.total_drafted_steps = 0

    def note_prefill(self) -> None:
        with self._lock:
            self.total_prefills += 1

    def add(self, record: StepRecord) -> None:
        with self._lock:
            self._records.append(record)
            self.total_steps += 1
            self.total_committed += record.committed_tokens
            self.total_verify_tokens += record.verify_tokens
            self.total_request_steps += record.batch_size
            self.total_drafted_steps += record.drafted
            if self._log is not None:
                self._log.write(json.dumps(record.to_json()) + "\n")

    def last(self, count: int | None = None) -> list[StepRecord]:
        with self._lock:
            records = list(self._records)
        return records if count is None else records[-count:]

    def summary(self) -> dict:
        """Totals since start: tau is committed tokens per request-step (bonus included)."""
        with self._lock:
            steps = self.total_request_steps
            return {
                "decode_steps": self.total_steps,
                "prefill_steps": self.total_prefills,
                "drafted_steps": self.total_drafted_steps,
                "committed_tokens": self.total_committed,
                "verify_tokens": self.total_verify_tokens,
                "tau": self.total_committed / steps if steps else None,
                "verify_tokens_per_request_step": self.total_verify_tokens / steps if steps else None,
                "records_kept": len(self._records),
                "records_capacity": self._records.maxlen,
            }
