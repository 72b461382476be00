"""Portable CPU kernels: lets SGLang's CPU engine run without a CPU build of `sgl_kernel`.

PyPI's `sglang-kernel` is CUDA-only; on a CPU machine its import fails, and SGLang's CPU path
imports two ops from it at module import time. `install()` puts a stand-in package (in `shadow/`)
ahead of the real one on `sys.path`. Spawned SGLang processes (scheduler, detokenizer) receive the
parent's `sys.path` before they import anything, and `PYTHONPATH` is set for any other child, so
the user only needs `SGLANG_USE_CPU_ENGINE=1 --device cpu`.

Control with `DSPARK_CPU_KERNELS`: `auto` (default: install only when the CPU engine is requested
and the real `sgl_kernel` cannot load), `on` (always), `off` (never).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

SHADOW_DIR = str(Path(__file__).resolve().parent / "shadow")
_MODES = ("auto", "on", "off")


def cpu_engine_requested() -> bool:
    """True when SGLang will take its CPU code path (it keys on this env var)."""
    return os.environ.get("SGLANG_USE_CPU_ENGINE", "").strip().lower() in ("1", "true", "yes", "on")


def real_sgl_kernel_loads() -> bool:
    """Try the installed `sgl_kernel`; on failure remove its half-imported submodules."""
    try:
        import sgl_kernel  # noqa: F401
    except (ImportError, OSError) as error:
        for name in [m for m in sys.modules if m == "sgl_kernel" or m.startswith("sgl_kernel.")]:
            del sys.modules[name]
        logger.info("real sgl_kernel cannot load here (%s)", str(error).splitlines()[0][:200])
        return False
    return not getattr(sgl_kernel, "IS_DSPARK_STANDIN", False)


def standin_active() -> bool:
    """True when `sgl_kernel` in this process is our stand-in."""
    module = sys.modules.get("sgl_kernel")
    return bool(module is not None and getattr(module, "IS_DSPARK_STANDIN", False))


def install() -> bool:
    """Install the stand-in if `DSPARK_CPU_KERNELS` and the machine call for it; return whether active."""
    mode = os.environ.get("DSPARK_CPU_KERNELS", "auto").strip().lower()
    if mode not in _MODES:
        raise ValueError(f"DSPARK_CPU_KERNELS={mode!r}: expected one of {', '.join(_MODES)}")
    if standin_active() or mode == "off":
        return standin_active()
    if SHADOW_DIR in sys.path:
        import sgl_kernel  # noqa: F401  (inherited sys.path from a parent that installed it)

        return standin_active()
    if mode == "auto" and (not cpu_engine_requested() or real_sgl_kernel_loads()):
        return False
    sys.path.insert(0, SHADOW_DIR)
    paths = [SHADOW_DIR] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    for name in [m for m in sys.modules if m == "sgl_kernel" or m.startswith("sgl_kernel.")]:
        del sys.modules[name]
    import sgl_kernel  # noqa: F401

    logger.info("sglang-dspark: pure-torch sgl_kernel stand-in active (%s)", SHADOW_DIR)
    return True
