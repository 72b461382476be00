"""The drafter benchmark command runs end to end and prints its JSON (slow: builds a 135M target)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_bench_prints_ratios_as_json() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sglang_dspark.model.bench", "--repeats", "1", "--batches", "1",
         "--dtypes", "float32", "--draft-vocabs", "8192", "--context", "16"],
        capture_output=True, text=True, check=True, timeout=600,
    )
    report = json.loads(out.stdout)
    (case,) = report["results"]
    assert case["draft_vocab"] == 8192 and case["batch"] == 1
    assert case["ratio"] == pytest.approx(case["draft_block_ms"] / case["target_step_ms"], rel=1e-2)
