"""Column-major float32 weights for SGLang's CPU linears: small-batch GEMMs 2-3x faster.

SGLang's CPU path without AMX runs every unquantized linear as `F.linear(x, W)` with `W` stored
row-major `[out, in]`. For 4 to ~32 rows of `x` (a decode batch, or a verify window of a few
requests) the BLAS picks a slow transposed-B path. Storing the same tensor column-major (the
storage of `W.T`, seen through a transposed view, so shape, values and every consumer stay the
same) sends those GEMMs to the fast path. Measured on this project's CPU (2 cores, AVX-512
without AMX, MKL), SmolLM2-135M's linears plus lm_head per forward:

| rows | 1 | 2 | 4 | 8 | 16 | 32 | 64 |
|---|---|---|---|---|---|---|---|
| row-major (SGLang) ms | 14.4 | 15.4 | 44.8 | 54.4 | 102.7 | 119.4 | 101.7 |
| column-major ms | 14.9 | 19.2 | 19.5 | 22.2 | 32.1 | 56.2 | 96.4 |

The same BLAS is faster row-major for 2-3 rows (a batch-1 verify of 1-2 drafts, or a decode
batch of 2-3): all linears plus lm_head 31.9 / 33.1 ms row-major against 37.9 / 41.3 column-major,
most of it in the lm_head. So by default (`auto`) each linear keeps a row-major copy as well,
used for inputs of `DSPARK_CPU_ROW_MAJOR_ROWS` rows (default 2,3; `RowCountLayouts`): twice the
float32 linear weights in memory, skipped when that would take over a quarter of the available
memory. The row counts are fixed, not measured at load: servers that start together (a benchmark's
arms) timed each other's loading and picked row-major for 4-6 rows, where it is 2x slower.

This is a property of the engine, not of speculation: the plugin applies it in every CPU server
it is loaded into, plain serving included, so that benchmarks compare like with like. The lm_head
is included (a tied input embedding then gathers rows from strided storage: ~3 ms per 1,000
prompt tokens). `DSPARK_CPU_GEMM_LAYOUT=column` stores column-major only, `off` keeps SGLang's
layout.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

MODES = ("auto", "column", "off")
DEFAULT_ROW_MAJOR_ROWS = "2,3"
LINEAR_METHOD = "UnquantizedLinearMethod"


def row_major_rows_setting() -> frozenset[int]:
    """`DSPARK_CPU_ROW_MAJOR_ROWS`: comma-separated row counts for the row-major copies ("" = none)."""
    raw = os.environ.get("DSPARK_CPU_ROW_MAJOR_ROWS", DEFAULT_ROW_MAJOR_ROWS).strip()
    parts = [part.strip() for part in raw.split(",") if part.strip()]
    if not all(part.isdigit() and int(part) >= 1 for part in parts):
        raise ValueError(f"DSPARK_CPU_ROW_MAJOR_ROWS={raw!r}: expected comma-separated row counts >= 1, e.g. 2,3")
    return frozenset(int(part) for part in parts)


def gemm_layout_mode() -> str:
    mode = os.environ.get("DSPARK_CPU_GEMM_LAYOUT", "auto").strip().lower()
    if mode not in MODES:
        raise ValueError(f"DSPARK_CPU_GEMM_LAYOUT={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def _column_major(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.t().is_contiguous()


def _float32_cpu_matrix(weight) -> bool:
    return (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype == torch.float32
            and weight.device.type == "cpu")


def _eligible(weight) -> bool:
    """A float32 CPU matrix still stored row-major."""
    return _float32_cpu_matrix(weight) and not _column_major(weight)


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


class RowCountLayouts:
    """A layer's quant method that multiplies `row_major_rows`-row inputs by a row-major copy.

    Wraps SGLang's unquantized method (whose `apply` is `F.linear` on the column-major weight) and
    forwards everything else to it (`embedding` of a tied lm_head, `create_weights`, ...). Its class
    name is not one of SGLang's unquantized lm_head methods, so the logits processor calls `apply`
    for the lm_head too. Both copies hold the same values."""

    def __init__(self, inner, row_major: torch.Tensor, row_major_rows: frozenset[int]) -> None:
        self.inner = inner
        self.row_major = row_major
        self.row_major_rows = row_major_rows

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.numel() // x.shape[-1] in self.row_major_rows:
            return F.linear(x.to(self.row_major.dtype), self.row_major, bias)
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


def add_row_major_copies(model: torch.nn.Module, rows: frozenset[int], available_bytes: int | None = None) -> int:
    """Give each column-major float32 linear (and lm_head) a `RowCountLayouts` method with a
    row-major copy for inputs of `rows` rows. Returns how many layers got one; none when `rows` is
    empty or the copies would take more than a quarter of `available_bytes` (default: the
    machine's available memory)."""
    modules = [m for m in _target_modules(model)
               if _float32_cpu_matrix(getattr(m, "weight", None)) and _column_major(m.weight)
               and getattr(m, "quant_method", None) is not None
               and not isinstance(m.quant_method, RowCountLayouts)]
    if not rows or not modules:
        return 0
    extra = sum(m.weight.numel() * m.weight.element_size() for m in {id(m.weight): m for m in modules}.values())
    available = available_memory_bytes() if available_bytes is None else available_bytes
    if available is not None and extra > available // 4:
        logger.info("sglang-dspark: no row-major copies (%.1f GB, over a quarter of the %.1f GB available)",
                    extra / 2**30, available / 2**30)
        return 0
    copies: dict[int, torch.Tensor] = {}
    for module in modules:
        row_major = copies.setdefault(id(module.weight), module.weight.detach().contiguous())
        module.quant_method = RowCountLayouts(module.quant_method, row_major, rows)
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


def after_load_model(result, model_runner, *args, **kwargs):
    """AFTER hook on SGLang's `ModelRunner.load_model`: re-lay out the target on CPU."""
    mode = gemm_layout_mode()
    if mode == "off" or torch.device(model_runner.device).type != "cpu":
        return None
    count = relayout_weights(model_runner.model)
    logger.info("sglang-dspark: %d float32 linear weights stored column-major (DSPARK_CPU_GEMM_LAYOUT=%s)", count, mode)
    if mode == "auto":
        rows = row_major_rows_setting()
        copies = add_row_major_copies(model_runner.model, rows)
        logger.info("sglang-dspark: %d linears keep a row-major copy for inputs of %s rows "
                    "(DSPARK_CPU_ROW_MAJOR_ROWS)", copies, sorted(rows))
    return None
