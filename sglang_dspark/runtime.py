"""Process-level torch settings and machine facts, so control/ never imports torch itself."""

import ctypes
import ctypes.util
from pathlib import Path

import torch

NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
KEEP_BYTES = 2**31 - 1  # the most mallopt's int takes: 2 GiB of free heap top stays


def set_torch_threads(threads: int) -> None:
    """Use `threads` intra-op threads (1 is often best on a busy 2-core CPU)."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (`avx512f`, `amx_bf16`, ...); empty where /proc/cpuinfo is missing."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX); without it torch converts
    bf16 to fp32 around every matmul, and small bf16 models run slower than fp32 ones."""
    return any(flag in cpu_flags(cpuinfo) for flag in NATIVE_BF16_CPU_FLAGS)


def cpu_profile_tag(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The widest matrix instructions this CPU has, as the tag of its measured cost profiles:
    `amx`, `avx512bf16` (AVX-512 with bf16 dot products: the weight panels multiply by
    VDPBF16PS), `avx512` or `avx2` (None: none of those, or no /proc/cpuinfo). A step's shape
    differs by them: measured live on an AVX2-only EPYC, one more token per request cost 1.33x a
    one-token step at batch 4 and seven more 1.52x at batch 1, where the AVX-512 Xeon's table
    says 1.10x and 1.23x."""
    flags = cpu_flags(cpuinfo)
    for tag, flag in (("amx", "amx_bf16"), ("avx512bf16", "avx512_bf16"), ("avx512", "avx512f"), ("avx2", "avx2")):
        if flag in flags:
            return tag
    return None


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of handing it back to the kernel.

    By default glibc serves blocks above 32 MiB with their own mmap and unmaps them on free, and
    trims the heap's top: a training step's large activations (logits over the draft
    vocabulary, their gradients) then arrive as fresh pages every step, ~100k page faults a
    second, a fifth of the CPU time in the kernel. With mmap off and trimming pushed out of reach
    the pages stay with the process and are reused. Returns False where the C library is not
    glibc (the call is then a no-op)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))
