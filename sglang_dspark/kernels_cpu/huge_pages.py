"""CPU memory in 2 MB pages (Linux transparent huge pages) for the weights streamed every step.

A forward of SmolLM2-135M streams its ~270 MB of weight panels from memory. In 4 KB pages that is
~66,000 pages a forward: a TLB miss on each, the hardware prefetchers stopping at every page
boundary, and the TLB emptied of everything else; the Python that runs between two forwards (the
scheduler, the drafter, the planner) ran 2-3x slower after such a forward than alone. Measured on
the Zen 4 EPYC (session 46; the target's linears plus lm_head per forward, then the planner's
decide + plan at batch 1): 4 KB pages 10.5 ms at 1 row, 12.1 at 8, 17.2 at 16, and
the planner 1.12-1.16 ms after it; 2 MB pages 8.6, 10.4 and 15.6 ms, the planner 0.76-1.12 ms
(0.41 ms with no forward before it).

Most kernels ship transparent huge pages in `madvise` mode (this VM's does): memory gets 2 MB pages
only where the process asks, before first touching it. `empty` asks. Where the kernel has them
off (`never`), the platform is not Linux, or `DSPARK_CPU_HUGE_PAGES=off`, it returns ordinary
memory (and logs why once, but for `off`): the same values, only slower.
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
PAGE_BYTES = 4096
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MODES = ("auto", "off")


def huge_pages_mode() -> str:
    """`DSPARK_CPU_HUGE_PAGES`: `auto` (default: 2 MB pages where the kernel allows) or `off`."""
    mode = os.environ.get("DSPARK_CPU_HUGE_PAGES", "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"DSPARK_CPU_HUGE_PAGES={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def transparent_huge_pages(setting: Path = THP_SETTING) -> str | None:
    """The kernel's THP mode (`always`, `madvise` or `never`: the bracketed word of `setting`),
    or None where there is no such file (not Linux, or a kernel without THP)."""
    try:
        text = setting.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


@functools.cache
def unavailable_reason() -> str | None:
    """Why `empty` cannot ask for 2 MB pages here (`off` when told not to), or None when it can
    (checked once)."""
    if huge_pages_mode() == "off":
        return "off"
    mode = transparent_huge_pages()
    if mode not in ("always", "madvise"):
        return f"transparent huge pages are {mode or 'not available'} on this kernel"
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "this Python has no madvise(MADV_HUGEPAGE)"
    return None


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of `nbytes`, starting on a page boundary, whose memory the
    kernel backs with 2 MB pages as it is first written where it can (see the module doc) and the
    block spans at least one; 4 KB pages otherwise.

    The 2 MB kind is a private anonymous mapping of its own: memory from the allocator may have
    been written before (glibc serves blocks below its mmap threshold, up to 32 MB, from reused
    heap), and a page written before `madvise` stays a 4 KB page."""
    if nbytes < 0:
        raise ValueError(f"huge_pages.empty: nbytes={nbytes}, expected >= 0")
    reason = unavailable_reason()
    if reason not in (None, "off"):
        _log_once(f"sglang-dspark: weight panels in 4 KB pages ({reason})")
    if reason is not None or nbytes < HUGE_PAGE_BYTES:
        raw = torch.empty(nbytes + PAGE_BYTES, dtype=torch.uint8)
        offset = _round_up(raw.data_ptr(), PAGE_BYTES) - raw.data_ptr()
        return raw[offset:offset + nbytes]
    span = _round_up(nbytes, HUGE_PAGE_BYTES)
    mapping = mmap.mmap(-1, span + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping; nothing written yet
    offset = _round_up(raw.data_ptr(), HUGE_PAGE_BYTES) - raw.data_ptr()
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, offset, span)
    except OSError as error:
        _log_once(f"sglang-dspark: weight panels in 4 KB pages (madvise: {error.strerror})")
    return raw[offset:offset + nbytes]


@functools.cache
def _log_once(message: str) -> None:
    logger.info(message)
