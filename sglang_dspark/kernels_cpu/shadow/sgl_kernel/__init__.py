"""Stand-in for `sgl_kernel` on CPUs where the CUDA-only PyPI build cannot load.

Put on `sys.path` by `sglang_dspark.kernels_cpu.install()` (the DSPARK_LIVE plugin does this when
`SGLANG_USE_CPU_ENGINE=1` and the real package fails to import). The two ops SGLang's CPU serving
path calls are real pure-torch implementations; every other name resolves to a callable that raises
a clear error if anything ever calls it, so an unexpected kernel use fails loudly instead of
silently computing garbage. Submodules (`sgl_kernel.kvcacheio`, `sgl_kernel.speculative`, ...)
resolve the same way.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

from sglang_dspark.kernels_cpu.ops import assign_req_to_token_pool_cpu, copy_all_layer_kv_cache_cpu

__version__ = "0.0.0+dspark-cpu-standin"
IS_DSPARK_STANDIN = True

_IMPLEMENTED = {
    "assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu,
    "copy_all_layer_kv_cache_cpu": copy_all_layer_kv_cache_cpu,
}


class MissingKernel:
    """A kernel that the stand-in does not implement: importing it works, calling it raises."""

    def __init__(self, qualified_name: str) -> None:
        self._qualified_name = qualified_name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self._qualified_name} is a CUDA/CPU sgl_kernel op that the sglang-dspark pure-torch "
            "stand-in does not implement. The DSPARK_LIVE CPU path should never call it; if it did, "
            "install a CPU build of sgl-kernel or report this code path."
        )

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return MissingKernel(f"{self._qualified_name}.{name}")

    def __repr__(self) -> str:
        return f"<missing sgl_kernel op {self._qualified_name}>"


def _module_getattr(module_name: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name in _IMPLEMENTED:
            return _IMPLEMENTED[name]
        return MissingKernel(f"{module_name}.{name}")

    return __getattr__


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves any `sgl_kernel.<sub>` import with a module that resolves names like the package."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(__name__ + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        return None


__getattr__ = _module_getattr(__name__)
if not any(isinstance(finder, _SubmoduleFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _SubmoduleFinder())
