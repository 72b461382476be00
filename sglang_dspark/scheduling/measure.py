"""Measure step-time probes of a transformers causal LM on this machine.

Why a random-weight model is enough: a forward pass costs the same whatever the weights hold, so
timing a randomly initialised model of the exact target shape (or the real weights, when a local
checkpoint exists) gives the cost model the scheduler needs. KV caches are filled with random
tensors instead of running a prefill: only their length matters for the step time.

Repeats are interleaved (pass 1 over every shape, then pass 2, ...) so a burst of load from
another process on a shared machine spoils one repeat of many shapes, not every repeat of one.

The clock is the measuring thread's CPU time (`time.thread_time`) with torch on one thread: on a
machine shared with other busy processes, wall time mostly measures how long the scheduler kept
us waiting (we saw one 0.9 s forward take 140 s of wall time). CPU time is what the forward
costs a core of its own, which is what a serving process that owns its cores sees.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from sglang_dspark.scheduling.probes import ProbeSet, StepProbe

SMOLLM2_135M_SHAPE: dict[str, Any] = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
}


@dataclass(frozen=True)
class ProbeShape:
    """One batch shape: requests, tokens per request (anchor + drafts), cached tokens per request."""

    num_requests: int
    width: int
    context_len: int


def probe_grid(
    batch_sizes: list[int], widths: list[int], context_lens: list[int]
) -> list[ProbeShape]:
    """The full cross product, in a fixed order."""
    return [
        ProbeShape(b, w, c) for c in context_lens for b in batch_sizes for w in widths
    ]


def build_llama(
    shape: dict[str, Any], num_layers: int | None = None, dtype: torch.dtype = torch.bfloat16
) -> torch.nn.Module:
    """A randomly initialised LlamaForCausalLM of the given shape (optionally fewer layers)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**shape, "num_hidden_layers": num_layers or shape["num_hidden_layers"]})
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype).eval()


def load_local_llama(path: str, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """Real weights from a local directory (never a hub download)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype).eval()


def llama_step_timer(
    model: torch.nn.Module, clock: Callable[[], float] = time.thread_time
) -> Callable[[ProbeShape], float]:
    """A function that times one forward of `model` over a batch with a KV cache of that shape."""
    from transformers.cache_utils import DynamicCache

    config = model.config
    num_layers = config.num_hidden_layers
    kv_heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = next(model.parameters()).dtype

    def time_step(shape: ProbeShape) -> float:
        cache = DynamicCache(config=config)
        for layer in range(num_layers):
            keys = torch.randn(shape.num_requests, kv_heads, shape.context_len, head_dim, dtype=dtype)
            cache.update(keys, torch.randn_like(keys), layer)
        input_ids = torch.randint(0, config.vocab_size, (shape.num_requests, shape.width))
        positions = torch.arange(shape.context_len, shape.context_len + shape.width)
        with torch.inference_mode():
            start = clock()
            model(
                input_ids=input_ids,
                past_key_values=cache,
                position_ids=positions.expand(shape.num_requests, shape.width),
                use_cache=True,
                logits_to_keep=0,
            )
            return clock() - start

    return time_step


def measure_probes(
    time_step: Callable[[ProbeShape], float],
    shapes: list[ProbeShape],
    repeats: int,
    progress: Callable[[str], None] | None = None,
) -> list[StepProbe]:
    """Time every shape `repeats` times, interleaving the repeats; one warm-up pass first."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    time_step(shapes[0])
    times: dict[ProbeShape, list[float]] = {s: [] for s in shapes}
    for repeat in range(repeats):
        for shape in shapes:
            times[shape].append(time_step(shape))
        if progress:
            progress(f"pass {repeat + 1}/{repeats} done")
    return [
        StepProbe(
            num_requests=s.num_requests,
            batch_tokens=s.num_requests * s.width,
            context_tokens=s.num_requests * s.context_len,
            seconds=tuple(times[s]),
        )
        for s in shapes
    ]


def machine_metadata() -> dict[str, Any]:
    """What a reader needs to know to trust (or not reuse) a profile."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            cpu = names[0]
    except OSError:
        pass
    return {
        "device": "cpu",
        "cpu": cpu,
        "torch_threads": torch.get_num_threads(),
        "timer": "time.thread_time: CPU seconds of the measuring thread (torch on one thread)",
        "torch": torch.__version__,
        "platform": platform.platform(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def measure_llama_probes(
    model: torch.nn.Module,
    shapes: list[ProbeShape],
    repeats: int,
    model_metadata: dict[str, Any],
    progress: Callable[[str], None] | None = None,
) -> ProbeSet:
    """Probe `model` over `shapes` and bundle the result with machine and model metadata."""
    probes = measure_probes(llama_step_timer(model), shapes, repeats, progress)
    return ProbeSet(probes=probes, metadata={**machine_metadata(), "model": model_metadata})
