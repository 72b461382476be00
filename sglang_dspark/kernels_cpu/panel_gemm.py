"""Small-batch CPU GEMMs that stream each weight once (`panel_gemm.cpp`, compiled on first use).

A decode step or a verify window multiplies 1-16 rows by every weight of the model. MKL streams
the weight from memory once for one row, but for 2-32 rows it picks paths that cost 1.5-3x more,
and its bf16 GEMM on a CPU without native bf16 math converts the weight first (3x slower at 8
rows). This kernel stores each `[out, in]` weight as 32-column panels `[P][in][32]` (float32, or
bfloat16 widened in registers), streams each panel once per call and reuses it from L2 for every
8 rows. SmolLM2-135M's linears plus lm_head per forward on this project's CPU (2 cores, AVX-512,
no AMX), `dspark-ctl bench gemm` (medians of 7, the two paths alternating; the model's weights do
not fit in cache, and the VM's speed drifts between runs):

| rows | 1 | 2 | 4 | 8 | 16 | 32 | 64 |
|---|---|---|---|---|---|---|---|
| MKL bfloat16 ms | 24.8 | 42.9 | 65.1 | 77.0 | 130.0 | 204.4 | |
| panels bfloat16 ms | 16.2 | 16.7 | 19.1 | 21.4 | 34.6 | 60.6 | |
| MKL float32 (column-major) ms | 40.5 | 37.8 | | 45.8 | | 71.2 | 110.0 |
| panels float32 ms | 46.5 | 30.0 | | 33.9 | | 58.0 | 93.1 |

In bf16 the panels also won at 128 and 512 rows (164 / 858 ms against 629 / 2314), so they serve
every bf16 batch, prefills included. On a CPU with AMX (session 12; oneDNN multiplies bf16 on the
tiles there), bfloat16 ms:

| rows | 1 | 2 | 4 | 8 | 16 | 32 | 64 | 128 | 512 |
|---|---|---|---|---|---|---|---|---|---|
| oneDNN | 37.7 | 39.0 | 42.2 | 38.8 | 38.3 | 40.1 | 56.3 | 74.5 | 147.0 |
| panels on the tiles | 20.0 | 21.1 | 21.8 | 21.8 | 22.1 | 25.6 | 35.5 | 52.5 | 134.1 |

(the AVX-512 panels on the same CPU: 21.7 ms at 1 row, 24.5 at 4, 36.7 at 16, 55.2 at 32, 167.4 at
128 in session 11).

Each output element sums over the input dimension in the same order whatever the number of rows,
so a row's result does not depend on the rows beside it: a verify window reproduces the one-token
decode step's linears bit for bit.

On a CPU with AMX (`amx_bf16`, and Linux granting the tile registers) bfloat16 weights whose input
width is a multiple of 32 are packed as pairs of consecutive inputs per column, `[P][in/2][32][2]`,
and multiplied on the tiles 16 rows at a time, in the same fixed order: still streamed once per
call, and a verify window of many rows then costs little more than one row.

On a CPU with AVX512-BF16 but no AMX tiles (an AMD EPYC Zen 4, session 43) the same pair layout is
multiplied by VDPBF16PS in registers, 8 rows a pass (`dpbf16_panels`): one instruction per 16
columns and two inputs, where the widening panels spend two FMAs and the widening. bfloat16 ms,
the two kernels one after the other (`docs/results/bench-gemm-cpu-s43-zen4-*.json`):

| rows | 1 | 2 | 8 | 16 | 64 | 128 |
|---|---|---|---|---|---|---|
| MKL bfloat16 | 24.1 | 24.3 | 33.3 | 39.6 | 65.7 | 106.2 |
| VDPBF16PS pair panels | 10.8 | 10.6 | 13.8 | 17.3 | 47.3 | 83.9 |
| widening AVX-512 panels | 11.2 | 11.2 | 14.6 | 25.3 | 101.6 | 198.3 |

On a CPU without AVX-512F (an AVX2-only AMD EPYC, sessions 20-21) the same code runs each 16-lane
vector as two AVX2 registers (`simd16.h`), which leaves half the registers: whole panels 4 rows a
pass up to 12 rows, beyond that 16-column halves 6 rows a pass (session 20 took whole panels 4 rows
a pass at every size, and their 16 ymm of accumulators spilt). bfloat16 ms, one run, the two
kernel builds one after the other (`docs/results/bench-gemm-cpu-s21-avx2-*.json`; MKL's own times
moved ~10 % between the two for the VM's drift):

| rows | 1 | 2 | 4 | 8 | 16 | 32 | 64 | 128 |
|---|---|---|---|---|---|---|---|---|
| MKL bfloat16 | 23.7 | 43.3 | 85.5 | 167.2 | 326.7 | 651.9 | 1139.0 | 2277.5 |
| AVX2 panels, whole (session 20) | 16.0 | 15.6 | 15.7 | 27.1 | 46.9 | 89.8 | 159.5 | 315.7 |
| AVX2 panels, halves from 13 rows | 13.6 | 13.2 | 12.9 | 22.5 | 33.6 | 57.1 | 101.8 | 203.9 |

and float32 (MKL column-major against panels) 40.4 / 37.8 at 1 row, 175.4 / 68.6 at 8, 172.9 /
127.5 at 32, 247.4 / 238.3 at 64: the same row ranges win as on AVX-512.

The kernel needs AVX-512F, or AVX2 with FMA, and a C++ compiler (`g++`, or `$CXX`); it is built with `-march=native`
into `$DSPARK_CACHE/kernels/` (about 2 s, once per source and machine) and loaded with ctypes. It
runs on the OpenMP pool torch already loaded (libgomp), with torch's thread count, handing
the panels out one at a time (a thread another process deschedules leaves its panels to the other).
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import torch

from sglang_dspark.kernels_cpu import huge_pages
from sglang_dspark.kernels_cpu.build import KernelUnavailable, env_choice, load_library, vector_isa

SOURCE = Path(__file__).with_name("panel_gemm.cpp")
PANEL_WIDTH = 32
AMX_TILE_K = 32  # inputs per tile multiply: AMX panels need an input width that is a multiple
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
PANEL_ALIGN_BYTES = 4096  # `pack_all_panels` starts each weight's panels on a page of their block


class PanelKernelUnavailable(KernelUnavailable):
    """The panel kernel cannot run here (no AVX-512F or AVX2 + FMA, no compiler, or the build failed)."""


@functools.cache
def load_kernel() -> ctypes.CDLL:
    """The compiled kernel, built on first use; raises `PanelKernelUnavailable` with the reason."""
    try:
        kernel = load_library(SOURCE, {"dspark_panel_gemm": [
            ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
            ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]})
    except KernelUnavailable as error:
        raise PanelKernelUnavailable(str(error)) from error
    kernel.dspark_panel_gemm_amx.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                             ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    kernel.dspark_panel_gemm_amx.restype = ctypes.c_int
    kernel.dspark_panel_gemm_dpbf16.argtypes = kernel.dspark_panel_gemm_amx.argtypes
    kernel.dspark_panel_gemm_dpbf16.restype = ctypes.c_int
    if kernel.dspark_panel_width() != PANEL_WIDTH:
        raise PanelKernelUnavailable(f"{kernel._name} has panels of {kernel.dspark_panel_width()}, expected {PANEL_WIDTH}")
    return kernel


@functools.cache
def amx_panels() -> bool:
    """Whether bfloat16 weights go through the AMX tiles here: the kernel was built with AMX, Linux
    granted the tile registers, and `DSPARK_CPU_AMX` is not `off`. Weights packed before a change
    keep their layout (`panel_linear` reads it from their shape)."""
    if env_choice("DSPARK_CPU_AMX", ("auto", "off")) == "off":
        return False
    return bool(load_kernel().dspark_amx_panels())


@functools.cache
def dpbf16_panels() -> bool:
    """Whether bfloat16 weights without the AMX tiles take the same pair layout and multiply by
    VDPBF16PS in AVX-512 registers: the kernel was built with AVX512-BF16 (an AMD EPYC Zen 4, or a
    Xeon with `DSPARK_CPU_AMX=off`) and `DSPARK_CPU_DPBF16` is not `off`."""
    if env_choice("DSPARK_CPU_DPBF16", ("auto", "off")) == "off":
        return False
    return bool(load_kernel().dspark_dpbf16_panels())


def pair_panels() -> bool:
    """Whether bfloat16 weights whose input width is a multiple of 32 are packed in pairs (the
    tiles' layout), for the tiles or for VDPBF16PS."""
    return amx_panels() or dpbf16_panels()


def panel_kernel_name(dtype: str) -> str:
    """Which kernel multiplies panels of this dtype ("bfloat16", "float32") whose input width is a
    multiple of 32, here (for reports)."""
    if dtype == "bfloat16" and amx_panels():
        return "amx"
    if dtype == "bfloat16" and dpbf16_panels():
        return "avx512-bf16"
    return str(vector_isa())


def _check_weight(weight: torch.Tensor) -> None:
    if weight.dim() != 2 or weight.dtype not in SUPPORTED_DTYPES or weight.device.type != "cpu":
        raise ValueError(f"pack_panels needs a 2-D float32 or bfloat16 CPU weight, got {tuple(weight.shape)} "
                         f"{weight.dtype} on {weight.device}")


def panel_shape(weight: torch.Tensor) -> tuple[int, ...]:
    """The shape `pack_panels(weight)` returns."""
    _check_weight(weight)
    out_features, in_features = weight.shape
    panels = -(-out_features // PANEL_WIDTH)
    if weight.dtype == torch.bfloat16 and in_features % AMX_TILE_K == 0 and pair_panels():
        return (panels, in_features // 2, PANEL_WIDTH, 2)
    return (panels, in_features, PANEL_WIDTH)


def pack_panels(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`[out, in]` float32/bfloat16 weight -> contiguous `[ceil(out/32), in, 32]` panels, same dtype
    (the last panel zero-padded); a bfloat16 weight whose `in` is a multiple of 32 where
    `pair_panels()`: `[ceil(out/32), in/2, 32, 2]`, pairs of consecutive inputs per column.
    `out`: a contiguous tensor of that shape and dtype to pack into (`pack_all_panels`)."""
    shape = panel_shape(weight)
    if out is not None and (tuple(out.shape) != shape or out.dtype != weight.dtype or not out.is_contiguous()):
        raise ValueError(f"pack_panels: out {tuple(out.shape)} {out.dtype} must be contiguous {shape} {weight.dtype}")
    out_features, in_features = weight.shape
    padded = torch.zeros(shape[0] * PANEL_WIDTH, in_features, dtype=weight.dtype)
    padded[:out_features] = weight.detach()
    if len(shape) == 4:
        packed = padded.view(shape[0], PANEL_WIDTH, in_features // 2, 2).transpose(1, 2)
    else:
        packed = padded.view(shape[0], PANEL_WIDTH, in_features).transpose(1, 2)
    if out is None:
        return packed.contiguous()
    return out.copy_(packed)


def pack_all_panels(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """`pack_panels` of each weight, all in one block of memory backed by 2 MB pages where Linux
    allows (`huge_pages.empty`): they are streamed from memory on every forward, and in 4 KB pages
    SmolLM2-135M's linears plus lm_head took 10.5 ms a forward at 1 row against 8.6 (see
    `huge_pages`). Each weight is packed straight into its place (no second copy of the model)."""
    shapes = [panel_shape(weight) for weight in weights]
    sizes = [math.prod(shape) * weight.element_size() for shape, weight in zip(shapes, weights)]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + -(-size // PANEL_ALIGN_BYTES) * PANEL_ALIGN_BYTES)
    arena = huge_pages.empty(starts[-1])
    return [pack_panels(weight, arena[start:start + size].view(weight.dtype).view(shape))
            for weight, shape, start, size in zip(weights, shapes, starts, sizes)]


def panel_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """`F.linear(x, weight)` (no bias) through the panels of `weight`, for float32 or bfloat16 x
    (bfloat16 only for pair panels, as for their weight); the result has x's dtype. Accumulates in
    float32 and rounds once at the end (to nearest even for bfloat16, as torch and the BLAS do)."""
    pairs = panels.dim() == 4
    in_features = panels.shape[1] * 2 if pairs else panels.shape[1]
    if (x.shape[-1] != in_features or out_features > panels.shape[0] * PANEL_WIDTH or x.dtype not in SUPPORTED_DTYPES
            or (pairs and x.dtype != torch.bfloat16)):
        raise ValueError(f"panel_linear: input {tuple(x.shape)} {x.dtype} or {out_features} outputs do not fit "
                         f"panels {tuple(panels.shape)} {panels.dtype}")
    rows = x if x.dim() == 2 else x.reshape(-1, in_features)  # (reshape costs ~2 us; this runs ~200x a step)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=x.dtype)
    kernel = load_kernel()
    if pairs:
        tiles = amx_panels()
        multiply = kernel.dspark_panel_gemm_amx if tiles else kernel.dspark_panel_gemm_dpbf16
        status = multiply(rows.data_ptr(), rows.shape[0], in_features, panels.data_ptr(), out_features,
                          out.data_ptr(), torch.get_num_threads())
        if status != 0:
            raise PanelKernelUnavailable(
                f"pair panels, but the {'AMX' if tiles else 'VDPBF16PS'} kernel refused them (status {status}: "
                "-1 not available in this process, -2 an input width that is not a multiple of 32)")
    else:
        kernel.dspark_panel_gemm(rows.data_ptr(), rows.dtype == torch.bfloat16, rows.shape[0], in_features,
                                 panels.data_ptr(), panels.dtype == torch.bfloat16, out_features,
                                 out.data_ptr(), out.dtype == torch.bfloat16, torch.get_num_threads())
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)
