"""Time a model's linears per forward: the BLAS (as SGLang runs them) against the weight panels.

Random weights of the model's shapes (timing-equivalent), all layers streamed in turn so that the
weights come from memory as in serving, medians of `repeats` forwards. Backs `dspark-ctl bench
gemm` and the table in `panel_gemm`'s docstring.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from sglang_dspark.kernels_cpu.panel_gemm import pack_all_panels, panel_linear

# SmolLM2-135M: (in, out) of qkv, o, gate_up, down per layer; 30 layers; tied lm_head 576 -> 49152
SMOLLM2_LAYER_SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))
SMOLLM2_LAYERS = 30
SMOLLM2_HEAD = (576, 49152)


@dataclass(frozen=True)
class GemmTiming:
    rows: int
    blas_ms: float
    panels_ms: float

    @property
    def speedup(self) -> float:
        return self.blas_ms / self.panels_ms

    def to_json(self) -> dict:
        return {**asdict(self), "speedup": round(self.speedup, 3)}


def _blas_weight(weight: torch.Tensor) -> torch.Tensor:
    """What the plugin gives the BLAS: float32 column-major, bf16 as loaded."""
    return weight.t().contiguous().t() if weight.dtype == torch.float32 else weight


def time_linears(rows: list[int], dtype_name: str, layer_shapes=SMOLLM2_LAYER_SHAPES,
                 layers: int = SMOLLM2_LAYERS, head=SMOLLM2_HEAD, repeats: int = 7) -> list[GemmTiming]:
    """Milliseconds per forward (every layer's linears plus the head) for each row count, in
    `dtype_name` ("float32" or "bfloat16": the callers, control/ included, need no torch)."""
    if dtype_name not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype_name!r}")
    dtype = getattr(torch, dtype_name)
    generator = torch.Generator().manual_seed(0)
    shapes = [shape for _ in range(layers) for shape in layer_shapes] + ([head] if head else [])
    weights = [torch.randn(n, k, generator=generator).to(dtype) for k, n in shapes]
    blas = [_blas_weight(w) for w in weights]
    panels = pack_all_panels(weights)  # as served: one block of memory, 2 MB pages where allowed
    timings = []
    for count in rows:
        inputs = {k: torch.randn(count, k, generator=generator).to(dtype) for k, _ in shapes}

        def blas_forward():
            for (k, _), weight in zip(shapes, blas):
                F.linear(inputs[k], weight)

        def panel_forward():
            for (k, n), packed in zip(shapes, panels):
                panel_linear(inputs[k], packed, n)

        blas_ms, panels_ms = alternating_median_ms(blas_forward, panel_forward, repeats)
        timings.append(GemmTiming(rows=count, blas_ms=blas_ms, panels_ms=panels_ms))
    return timings


def alternating_median_ms(first, second, repeats: int) -> tuple[float, float]:
    """Both callables timed in alternation (this VM's speed drifts), after one warm-up each."""
    first(), second()
    samples: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, sink in ((first, samples[0]), (second, samples[1])):
            started = time.perf_counter()
            fn()
            sink.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples[0]), statistics.median(samples[1])
