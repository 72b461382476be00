"""CPU weight layouts for SGLang's linears: small batches stream each weight once.

SGLang's CPU path without AMX runs every unquantized linear as `F.linear(x, W)` with `W` stored
row-major `[out, in]`. Two changes, applied after the model loads (`after_load_model`):

1. **Column-major float32 weights** (`relayout_weights`): the storage of `W.T`, seen through a
   transposed view, so shape, values and every consumer stay the same; MKL then takes its fast
   path for 4 to ~32 rows (SmolLM2-135M's linears plus lm_head, ms per forward: 8 rows 54.4
   row-major against 22.2 column-major; 64 rows 101.7 / 96.4).
2. **Panels for small batches** (`add_panels`, `kernels_cpu.panel_gemm`): each linear (and the
   lm_head) keeps a copy of its weight in 32-column panels, used for inputs of
   `DSPARK_CPU_PANEL_ROWS` rows (default 2-32 for float32, every row count for bfloat16, where the
   panels won: see `panel_gemm`'s table; a bf16 verify of 8 rows costs what one row costs instead
   of 3x). The drafter's linears get panels too, where they are the faster path on this CPU
   (`add_linear_panels`, `fastest_panel_rows`).
   Twice the linear weights in memory, skipped when that would take over a quarter of the
   available memory, and when the kernel cannot run here (no AVX-512F or AVX2 + FMA, or no
   compiler: logged,
   the BLAS layouts alone then serve).

This is a property of the engine, not of speculation: the plugin applies it in every CPU server
it is loaded into, plain serving included, so that benchmarks compare like with like. The lm_head
is included (a tied input embedding then gathers rows from strided storage: ~3 ms per 1,000
prompt tokens). `DSPARK_CPU_GEMM_LAYOUT=column` stores float32 weights column-major only, `off`
keeps SGLang's layout.
"""

from __future__ import annotations

import logging
import os
import sys

import torch

from sglang_dspark.kernels_cpu import huge_pages
from sglang_dspark.kernels_cpu.panel_gemm import (SUPPORTED_DTYPES, PanelKernelUnavailable, amx_panels, load_kernel,
                                                pack_all_panels, panel_linear)
from sglang_dspark.runtime import cpu_flags

logger = logging.getLogger(__name__)

MODES = ("auto", "column", "off")
# Where the panels beat MKL on this project's CPU (see panel_gemm's table): float32 from 2 to 32
# rows; bfloat16 at every row count measured (1-512: 1.1-3.8x, MKL converts bf16 weights first;
# with AMX, the panels on the tiles 1.1-1.9x over oneDNN on the tiles).
# The target keeps them at every bf16 row count: the panels' rows do not depend on the rows beside
# them, and oneDNN's do (a row's bf16 result changes with the batch), so only the panels keep a
# verify window, or a prefill batched differently, bit for bit equal to plain serving.
DEFAULT_PANEL_ROWS = {torch.float32: "2-32", torch.bfloat16: "1-"}
# The drafter need not match anything bit for bit, so it takes the panels only where they are
# faster. On an AMX CPU whose panels cannot use the tiles (`DSPARK_CPU_AMX=off`, or Linux refused
# them), oneDNN on the tiles wins from 16 bf16 rows (SmolLM2's linears per forward, `dspark-ctl
# bench gemm`: 8 rows 22.2 ms panels / 32.1 BLAS, 16 rows 35.6 / 34.1, 128 rows 167.4 / 65.9).
AMX_WITHOUT_TILES_PANEL_ROWS = {torch.bfloat16: range(1, 16)}
LINEAR_METHOD = "UnquantizedLinearMethod"


def fastest_panel_rows(dtype: torch.dtype, flags: set[str] | None = None, tiles: bool | None = None) -> range:
    """The row counts where the panels beat the BLAS for `dtype` on a CPU with these feature
    flags (default: this machine's), the panels on the AMX tiles or not (default: `amx_panels()`):
    the drafter's range."""
    flags = cpu_flags() if flags is None else flags
    if "amx_bf16" in flags and dtype in AMX_WITHOUT_TILES_PANEL_ROWS and not (amx_panels() if tiles is None else tiles):
        return AMX_WITHOUT_TILES_PANEL_ROWS[dtype]
    return _parse_rows(DEFAULT_PANEL_ROWS.get(dtype, ""), "default")


def panel_rows_setting(dtype: torch.dtype) -> range:
    """`DSPARK_CPU_PANEL_ROWS` ("LO-HI", "LO-" for no upper bound, or "" for none): the input row
    counts the panels serve in the target."""
    return _parse_rows(os.environ.get("DSPARK_CPU_PANEL_ROWS", DEFAULT_PANEL_ROWS.get(dtype, "")), "DSPARK_CPU_PANEL_ROWS")


def _parse_rows(raw: str, name: str) -> range:
    raw = raw.strip()
    if not raw:
        return range(0)
    low, dash, high = (part.strip() for part in raw.partition("-"))
    high = high or (str(sys.maxsize) if dash else "")
    if not (low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high)):
        raise ValueError(f"{name}={raw!r}: expected a row range LO-HI (or LO- for no upper bound) "
                         "with 1 <= LO <= HI, e.g. 2-32")
    return range(int(low), int(high) + 1)


def gemm_layout_mode() -> str:
    mode = os.environ.get("DSPARK_CPU_GEMM_LAYOUT", "auto").strip().lower()
    if mode not in MODES:
        raise ValueError(f"DSPARK_CPU_GEMM_LAYOUT={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def _column_major(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.t().is_contiguous()


def _cpu_matrix(weight, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    return (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype in dtypes
            and weight.device.type == "cpu")


def _eligible(weight) -> bool:
    """A float32 CPU matrix still stored row-major."""
    return _cpu_matrix(weight) and not _column_major(weight)


def _target_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Unquantized linears (not AMX-packed) and `model.lm_head`, each once."""
    modules = [m for m in model.modules() if type(getattr(m, "quant_method", None)).__name__ == LINEAR_METHOD
               and not getattr(m, "use_intel_amx_backend", False)]
    lm_head = getattr(model, "lm_head", None)
    if lm_head is not None and all(m is not lm_head for m in modules):
        modules.append(lm_head)
    return modules


def relayout_weights(model: torch.nn.Module) -> int:
    """Store the float32 CPU weights of unquantized linears and of `model.lm_head` column-major.

    Same shapes and values; returns how many tensors were re-laid out. Other modules (input
    embeddings of an untied model, quantized or packed weights) are left alone."""
    modules = _target_modules(model)
    count = 0
    for parameter in {id(p): p for p in (getattr(m, "weight", None) for m in modules) if _eligible(p)}.values():
        parameter.data = parameter.data.t().contiguous().t()
        count += 1
    return count


class PanelLayouts:
    """A layer's quant method that multiplies inputs of `rows` rows through panels of its weight.

    Wraps SGLang's unquantized method (whose `apply` is `F.linear`) and forwards everything else to
    it (`embedding` of a tied lm_head, `create_weights`, ...). Its class name is not one of SGLang's
    unquantized lm_head methods, so the logits processor calls `apply` for the lm_head too."""

    def __init__(self, inner, panels: torch.Tensor, out_features: int, rows: range) -> None:
        self.inner = inner
        self.panels = panels
        self.out_features = out_features
        self.rows = rows

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.numel() // x.shape[-1] in self.rows and x.dtype in SUPPORTED_DTYPES:
            out = panel_linear(x, self.panels, self.out_features)
            return out if bias is None else out + bias
        return self.inner.apply(layer, x, bias)

    def __getattr__(self, name: str):
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None elsewhere."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def add_panels(model: torch.nn.Module, rows: range | None = None, available_bytes: int | None = None) -> int:
    """Give each float32/bfloat16 linear (and lm_head) a `PanelLayouts` method serving inputs of
    `rows` rows (default: `DSPARK_CPU_PANEL_ROWS` for the weights' dtype). Returns how many layers
    got one; none when no rows are asked for or the panels would take more than a quarter of
    `available_bytes` (default: the machine's available memory). Raises `PanelKernelUnavailable`
    when the kernel cannot run here."""
    modules = [m for m in _target_modules(model)
               if _cpu_matrix(getattr(m, "weight", None), SUPPORTED_DTYPES)
               and getattr(m, "quant_method", None) is not None
               and not isinstance(m.quant_method, PanelLayouts)]
    if not modules:
        return 0
    if rows is None:
        rows = panel_rows_setting(modules[0].weight.dtype)
    if not rows:
        return 0
    load_kernel()
    extra = sum(m.weight.numel() * m.weight.element_size() for m in {id(m.weight): m for m in modules}.values())
    available = available_memory_bytes() if available_bytes is None else available_bytes
    if available is not None and extra > available // 4:
        logger.info("sglang-dspark: no weight panels (%.1f GB, over a quarter of the %.1f GB available)",
                    extra / 2**30, available / 2**30)
        return 0
    weights = {id(m.weight): m.weight for m in modules}  # a tied weight is packed once
    panels = dict(zip(weights, pack_all_panels(list(weights.values()))))
    for module in modules:
        module.quant_method = PanelLayouts(module.quant_method, panels[id(module.weight)], module.weight.shape[0], rows)
    return len(modules)


def relayout_linears(module: torch.nn.Module) -> int:
    """The same for every plain `nn.Linear` of `module` (the drafter: a block of 8 rows per
    request; its forward at batch 1 took 4.5 ms row-major, 2.6 ms column-major here)."""
    count = 0
    for linear in module.modules():
        if isinstance(linear, torch.nn.Linear) and _eligible(linear.weight):
            linear.weight.data = linear.weight.data.t().contiguous().t()
            count += 1
    return count


class PanelLinear(torch.nn.Linear):
    """An `nn.Linear` (the drafter's) that multiplies inputs of `rows` rows through panels of its
    weight: the drafter runs right after the target's forward has pushed its weights out of the
    caches, and a 2-row catch-up or a 7-row block at batch 1 then costs 2-3x less this way."""

    def __init__(self, linear: torch.nn.Linear, panels: torch.Tensor, rows: range) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # shared: same parameters, same state_dict
        self.register_parameter("bias", linear.bias)
        self.panels, self.rows = panels, rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // x.shape[-1] in self.rows and x.dtype in SUPPORTED_DTYPES:
            out = panel_linear(x, self.panels, self.out_features)
            return out if self.bias is None else out + self.bias
        return super().forward(x)


def add_linear_panels(module: torch.nn.Module, rows: range | None = None) -> int:
    """Replace each plain float32/bfloat16 CPU `nn.Linear` of `module` by a `PanelLinear` serving
    inputs of `rows` rows (default: `fastest_panel_rows` for the weights' dtype); returns how many.
    Raises `PanelKernelUnavailable` when the kernel cannot run here."""
    chosen = []  # (parent, name, linear, rows)
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear or not _cpu_matrix(child.weight, SUPPORTED_DTYPES):
                continue
            child_rows = fastest_panel_rows(child.weight.dtype) if rows is None else rows
            if child_rows:
                chosen.append((parent, name, child, child_rows))
    if not chosen:
        return 0
    load_kernel()
    for (parent, name, child, child_rows), panels in zip(chosen, pack_all_panels([c[2].weight for c in chosen])):
        setattr(parent, name, PanelLinear(child, panels, child_rows))
    return len(chosen)


def after_load_model(result, model_runner, *args, **kwargs):
    """AFTER hook on SGLang's `ModelRunner.load_model`: re-lay out the target on CPU."""
    mode = gemm_layout_mode()
    if mode == "off" or torch.device(model_runner.device).type != "cpu":
        return None
    count = relayout_weights(model_runner.model)
    logger.info("sglang-dspark: %d float32 linear weights stored column-major (DSPARK_CPU_GEMM_LAYOUT=%s)", count, mode)
    if mode == "auto":
        try:
            layers = add_panels(model_runner.model)
        except PanelKernelUnavailable as error:
            logger.warning("sglang-dspark: no weight panels, small batches use the BLAS (slower): %s", error)
            return None
        reason = huge_pages.unavailable_reason()
        pages = "2 MB pages where the kernel has them free" if reason is None else f"4 KB pages ({reason})"
        logger.info("sglang-dspark: %d linears multiply small batches through weight panels "
                    "(DSPARK_CPU_PANEL_ROWS) in %s", layers, pages)
    return None
