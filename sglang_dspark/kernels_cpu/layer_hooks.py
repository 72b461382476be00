"""SGLang's RMSNorm, rotary embedding and SiLU-and-multiply on CPU through `layer_ops` (AROUND
hooks on `forward_native`).

Registered by the plugin in every CPU server, plain serving included. A call the kernels do not
fit (a variance or dtype override, a float32 residual, a GPT-J rotary, offsets, another device)
goes to SGLang's own `forward_native` unchanged.

SiLU-and-multiply is two torch ops, ~20 us a layer at batch 1; from 22 rows (32,768 elements of
SmolLM2's MLP) torch runs each as an OpenMP region over both cores, and on a 2-core server whose
tokenizer and detokenizer processes take turns on those cores a region can wait for a
descheduled thread (with both cores busy elsewhere, 22-100 rows took ~10 ms a layer where the
kernel, on one thread up to 170 rows, took 0.1-0.35 ms). Verify windows of 22+ rows (batch 16
with drafts) and prefills run it on every layer: served at concurrency 16, their forwards spent
0.8 ms (verify) and 2.8 ms (prefill) less outside the linears, 139.9 -> 145.0 tok/s.

`DSPARK_CPU_LAYER_OPS`: `kernel` (default) or `torch` (SGLang's ops). Where the kernels cannot be
built (no AVX-512F or AVX2 + FMA, or no compiler) the server logs why once and serves as with
`torch`.
"""

from __future__ import annotations

import functools

from sglang_dspark.kernels_cpu.build import env_choice, kernel_loads
from sglang_dspark.kernels_cpu.layer_ops import (add_rmsnorm, load_layer_ops, rmsnorm_input_fits, rmsnorm_weight_fits,
                                                rope_fits, rope_neox, silu_and_mul, silu_and_mul_fits)

MODES = ("kernel", "torch")
RMSNORM_TARGET = "sglang.srt.layers.layernorm.RMSNorm.forward_native"
ROTARY_TARGET = "sglang.srt.layers.rotary_embedding.base.RotaryEmbedding.forward_native"
SILU_AND_MUL_TARGET = "sglang.srt.layers.activation.SiluAndMul.forward_native"


def layer_ops_mode() -> str:
    return env_choice("DSPARK_CPU_LAYER_OPS", MODES)


@functools.cache
def kernels_enabled() -> bool:
    """`DSPARK_CPU_LAYER_OPS=kernel` and the kernels load here (why not is logged once)."""
    return layer_ops_mode() == "kernel" and kernel_loads(
        load_layer_ops, "no layer-op kernels, SGLang's torch RMSNorm and rotary serve (slower)",
        "RMSNorm, rotary embedding and SiLU-and-multiply run as one kernel call each (DSPARK_CPU_LAYER_OPS=kernel)")


def _kernel_serves_norm(norm) -> bool:
    """Decided once per RMSNorm module: no variance or dtype override, no float32 residual, a
    weight the kernel reads (the module's configuration does not change while serving)."""
    decided = norm.__dict__.get("_dspark_kernel_serves")
    if decided is None:
        decided = (kernels_enabled() and getattr(norm, "variance_size_override", None) is None
                   and not getattr(norm, "fp32_residual", False) and not getattr(norm, "cast_x_before_out_mul", False)
                   and getattr(norm, "override_orig_dtype", None) is None and getattr(norm, "has_weight", True)
                   and rmsnorm_weight_fits(norm.weight))
        norm.__dict__["_dspark_kernel_serves"] = decided
    return decided


def around_rmsnorm(original, norm, x, residual=None, post_residual_addition=None, quant_linear=None, **kwargs):
    """AROUND `RMSNorm.forward_native`: returns what it returns (the norm, or (norm, x + residual))."""
    if (kwargs or post_residual_addition is not None or quant_linear is not None or not _kernel_serves_norm(norm)
            or not rmsnorm_input_fits(x, residual, norm.weight.shape[0])):
        return original(norm, x, residual, post_residual_addition, quant_linear, **kwargs)
    return add_rmsnorm(x, residual, norm.weight, norm.variance_epsilon)


def around_rotary(original, rotary, positions, query, key, offsets=None, fused_set_kv_buffer_arg=None, **kwargs):
    """AROUND `RotaryEmbedding.forward_native`: the rotated (query, key), as new tensors."""
    if (kwargs or offsets is not None or fused_set_kv_buffer_arg is not None or not rotary.is_neox_style
            or hasattr(rotary, "sin_cos_cache") or not kernels_enabled()
            or not rope_fits(positions, query, key, rotary.head_size, rotary.rotary_dim, rotary.cos_sin_cache)):
        return original(rotary, positions, query, key, offsets, fused_set_kv_buffer_arg, **kwargs)
    return rope_neox(positions, query, key, rotary.head_size, rotary.rotary_dim, rotary.cos_sin_cache)


def around_silu_and_mul(original, op, x, **kwargs):
    """AROUND `SiluAndMul.forward_native`: `silu(x[:, :d]) * x[:, d:]` as a new tensor."""
    if kwargs or not kernels_enabled() or not silu_and_mul_fits(x):
        return original(op, x, **kwargs)
    return silu_and_mul(x)
