"""Compile and load this package's C++ CPU kernels (`*.cpp` beside this file) on first use.

Each kernel is built with `g++ -O3 -march=native -fopenmp` (or `$CXX`) into
`$DSPARK_CACHE/kernels/<name>-<hash>.so`, where the hash covers the source, the headers beside
it and the CPU's feature flags (`-march=native` code only depends on the CPU), then loaded with
ctypes. The libraries link libgomp, which resolves to the copy torch already loaded, so the
kernels share torch's OpenMP threads. Builds are atomic renames: servers that start together may
both build, never half-read.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from sglang_dspark.runtime import cpu_flags
from sglang_dspark.training.prepare import cache_root


logger = logging.getLogger(__name__)


class KernelUnavailable(RuntimeError):
    """A kernel cannot run here (neither AVX-512F nor AVX2 + FMA, no compiler, or the build failed); says which."""


def vector_isa(flags: set[str] | None = None) -> str | None:
    """The build the kernels get on a CPU with these feature flags (default: this one's): `avx512`
    (AVX-512F), `avx2` (AVX2 and FMA), or None where they cannot run (not x86-64, or neither)."""
    flags = cpu_flags() if flags is None else flags
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else None


def vector_isa_supported(flags: set[str] | None = None) -> bool:
    """Whether the kernels build here: an x86-64 CPU with AVX-512F, or with AVX2 and FMA."""
    return vector_isa(flags) is not None


def _compiler() -> str:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise KernelUnavailable("no C++ compiler found (install g++ or set CXX)")
    return compiler


def _build(source: Path, library: Path) -> None:
    command = [_compiler(), "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(source)]
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        output = Path(scratch) / library.name
        result = subprocess.run([*command, "-o", str(output)], capture_output=True, text=True)
        if result.returncode != 0:
            raise KernelUnavailable(f"building {source.name} failed: {result.stderr.strip()[:2000]}")
        os.replace(output, library)


def load_library(source: Path, signatures: dict[str, list] | None = None) -> ctypes.CDLL:
    """The compiled `source` (built into the cache if absent), its `signatures` (function name ->
    ctypes argument types, returning void) declared; raises `KernelUnavailable`.

    The kernels use AVX-512F or AVX2 + FMA intrinsics (`simd16.h`), so another CPU gets the reason,
    not a crash."""
    if not vector_isa_supported():
        raise KernelUnavailable("the CPU has neither AVX-512F nor AVX2 with FMA")
    headers = b"".join(header.read_bytes() for header in sorted(source.parent.glob("*.h")))  # what it includes
    key = hashlib.sha256(source.read_bytes() + headers + str(sorted(cpu_flags())).encode())
    library = cache_root() / "kernels" / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if not library.exists():
        _build(source, library)
    kernel = ctypes.CDLL(str(library))
    for name, argtypes in (signatures or {}).items():
        function = getattr(kernel, name)
        function.argtypes, function.restype = argtypes, None
    return kernel


def env_choice(variable: str, choices: tuple[str, ...]) -> str:
    """The value of a `DSPARK_*` switch (default: the first choice), or ValueError naming the choices."""
    value = os.environ.get(variable, choices[0]).strip().lower()
    if value not in choices:
        raise ValueError(f"{variable}={value!r}: expected one of {', '.join(choices)}")
    return value


def kernel_loads(load, without: str, with_it: str) -> bool:
    """Whether `load()` gives a kernel here; logs once which path serves (`without`: a warning
    with the reason; `with_it`: info). Callers cache the answer per process."""
    try:
        load()
    except KernelUnavailable as error:
        logger.warning("sglang-dspark: %s: %s", without, error)
        return False
    logger.info("sglang-dspark: %s", with_it)
    return True
