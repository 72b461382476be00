"""Process-level torch settings and machine facts, so control/ never imports torch itself."""

from pathlib import Path

import torch

NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


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
