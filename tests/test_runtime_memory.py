"""`keep_freed_memory`: a trainer's large per-step tensors stop costing page faults every step."""

import os
import platform
import subprocess
import sys

import pytest

# 30 steps that each allocate, touch and free three blocks of 40-64 MiB (a step's logits over the
# draft vocabulary and their gradients are this size); prints the page faults of the last 20
STEPS = """
import resource, sys, torch
from sglang_dspark.runtime import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
for step in range(30):
    if step == 10:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [torch.ones(mib * 256 * 1024) for mib in (64, 48, 40)]
    del blocks
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _page_faults(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # glibc's defaults
    done = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt tuning is glibc's")
def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    default, kept = _page_faults("default"), _page_faults("keep")
    assert default > 20 * 30_000  # every step faults its 38k pages in afresh
    assert kept < default / 20  # the first steps' pages serve the later ones
