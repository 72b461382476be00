"""SGLang plugin entry point (`sglang.srt.plugins: dspark`), run by SGLang in every process.

`register()` (1) installs the pure-torch `sgl_kernel` stand-in when SGLang's CPU engine is requested
and the CUDA-only PyPI build cannot load, (2) on the CPU engine, lays out the target's linear
weights for small batches after loading (`kernels_cpu.gemm_layout`: column-major float32 and
weight panels, 2-4x faster 2-32-row GEMMs), routes decode and prefill attention through a kernel that
reads the KV cache in place (`kernels_cpu.cpu_attention`) and RMSNorm, rotary embedding and
SiLU-and-multiply through one-call kernels (`kernels_cpu.layer_hooks`), in plain and speculative servers alike, and (3) registers the speculative algorithm `DSPARK_LIVE` (overlap-capable, V2 result schema). Serving then needs only:

    SGLANG_USE_CPU_ENGINE=1 python -m sglang.launch_server --device cpu \
        --model-path TARGET --speculative-algorithm DSPARK_LIVE --speculative-draft-model-path DRAFTER

Our knobs that SGLang has no flags for come from `DSPARK_*` environment variables and the draft
checkpoint folder (see `sglang_dspark.engine.settings`).
"""

from __future__ import annotations

import logging
import sys

from sglang_dspark.kernels_cpu import cpu_engine_requested
from sglang_dspark.kernels_cpu import install as install_cpu_kernels

ALGORITHM_NAME = "DSPARK_LIVE"
logger = logging.getLogger(__name__)


def register() -> None:
    """Install the CPU kernels if needed and register `DSPARK_LIVE` (idempotent per process)."""
    install_cpu_kernels()
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    if get_spec(ALGORITHM_NAME) is not None:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_dspark.engine.algorithm import DSparkLiveAlgorithm, create_worker_class, validate_server_args

    if "sglang.srt.managers.scheduler" in sys.modules:  # only scheduler processes run the model
        if cpu_engine_requested():
            import torch

            from sglang_dspark.kernels_cpu.cpu_attention import (DECODE_TARGET, EXTEND_TARGET, around_forward_decode,
                                                                around_forward_extend, attention_mode)
            from sglang_dspark.kernels_cpu.gemm_layout import after_load_model, gemm_layout_mode, panel_rows_setting
            from sglang_dspark.kernels_cpu.layer_hooks import (RMSNORM_TARGET, ROTARY_TARGET, SILU_AND_MUL_TARGET,
                                                               around_rmsnorm, around_rotary, around_silu_and_mul,
                                                               layer_ops_mode)

            gemm_layout_mode()  # a bad DSPARK_CPU_* value fails at start, not after loading
            panel_rows_setting(torch.float32)
            attention_mode()
            layer_ops_mode()
            HookRegistry.register("sglang.srt.model_executor.model_runner.ModelRunner.load_model",
                                  after_load_model, HookType.AFTER)
            HookRegistry.register(DECODE_TARGET, around_forward_decode, HookType.AROUND)
            HookRegistry.register(EXTEND_TARGET, around_forward_extend, HookType.AROUND)
            HookRegistry.register(RMSNORM_TARGET, around_rmsnorm, HookType.AROUND)
            HookRegistry.register(ROTARY_TARGET, around_rotary, HookType.AROUND)
            HookRegistry.register(SILU_AND_MUL_TARGET, around_silu_and_mul, HookType.AROUND)

    SpeculativeAlgorithm.register(
        ALGORITHM_NAME,
        supports_overlap=True,
        validate_server_args=validate_server_args,
        spec_class=DSparkLiveAlgorithm,
    )(create_worker_class)
