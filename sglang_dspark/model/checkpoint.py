"""DeepSpec checkpoint load/save: `config.json` + `model.safetensors` (dspark-algorithm.md 8).

Weight names are the drafter's module names with no `model.` prefix (`fc.weight`,
`layers.{i}.self_attn.q_proj.weight`, `markov_head.markov_w1.weight`, ...). `embed_tokens.weight`
and `lm_head.weight` are optional: they are frozen copies of the target's, so a checkpoint without
them needs the target. Our one extension is `d2t` (reduced draft vocabulary, docs/interfaces.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sglang_dspark.model.config import DSparkConfig
from sglang_dspark.model.drafter import DSparkDrafter
from sglang_dspark.model.errors import CheckpointError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKEN_WEIGHTS = ("embed_tokens.weight", "lm_head.weight")


def load_drafter(
    path: str | Path,
    target: object | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> DSparkDrafter:
    """Load a DeepSpec-format drafter directory; returns the module in eval mode.

    `target` (a transformers causal LM or `TargetWeights`) provides the frozen embedding and
    lm_head, shared rather than copied when dtype and device match. `dtype` defaults to the
    stored dtype of `fc.weight`.
    """
    root = Path(path)
    config = DSparkConfig.from_dict(_read_config(root))
    tensors = _read_tensors(root)
    d2t = tensors.pop("d2t", None)
    token_weights = {name: tensors.pop(name) for name in TOKEN_WEIGHTS if name in tensors}
    if "fc.weight" not in tensors:
        raise CheckpointError(f"{root}: weight 'fc.weight' is missing")
    dtype = dtype or tensors["fc.weight"].dtype
    drafter = DSparkDrafter(config, d2t=d2t, dtype=dtype, device=device)
    _check_weights(drafter, tensors)
    drafter.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=True)
    if target is not None:
        drafter.attach_target(target)
    else:
        absent = [name for name in TOKEN_WEIGHTS if name not in token_weights]
        if absent:
            raise CheckpointError(
                f"{root}: checkpoint has no {' / '.join(absent)}; pass target= (the transformers "
                "target model or TargetWeights) to use the target's frozen tensors"
            )
        drafter.set_token_weights(
            token_weights["embed_tokens.weight"], token_weights["lm_head.weight"],
            lm_head_is_full_vocab=False, share=False,
        )
    return drafter.eval()


def save_drafter(drafter: DSparkDrafter, path: str | Path, include_token_weights: bool = True) -> None:
    """Write `config.json` + `model.safetensors` in the DeepSpec layout (the drafter's dtype).

    With `include_token_weights` the frozen embedding and lm_head are stored too (as DeepSpec
    does), so the checkpoint loads without a target.
    """
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous() for name, t in drafter.state_dict().items()}
    if include_token_weights:
        if not (drafter.embed_tokens.loaded and drafter.lm_head.loaded):
            raise CheckpointError(
                "cannot include embed_tokens/lm_head: the drafter has none (attach a target first, "
                "or pass include_token_weights=False)"
            )
        # clones: safetensors refuses tensors that share storage (tied target embeddings do)
        tensors["embed_tokens.weight"] = drafter.embed_tokens.weight.detach().clone(memory_format=torch.contiguous_format)
        tensors["lm_head.weight"] = drafter.lm_head.weight.detach().clone(memory_format=torch.contiguous_format)
    if drafter.d2t is not None:
        tensors["d2t"] = drafter.d2t.detach().cpu().clone()
    tensors = {name: t.cpu() for name, t in tensors.items()}
    config = drafter.config.to_dict()
    config["torch_dtype"] = str(drafter.dtype).removeprefix("torch.")
    (root / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(root / WEIGHTS_FILE), metadata={"format": "pt"})


def _read_config(root: Path) -> dict:
    config_path = root / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"{root}: no {CONFIG_FILE}; expected a DeepSpec drafter directory")
    try:
        return json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{config_path}: not valid JSON ({err})") from err


def _read_tensors(root: Path) -> dict[str, torch.Tensor]:
    """All tensors of `model.safetensors`, or of the shards listed in its index file."""
    if (root / WEIGHTS_FILE).is_file():
        files = [root / WEIGHTS_FILE]
    elif (root / INDEX_FILE).is_file():
        weight_map = json.loads((root / INDEX_FILE).read_text()).get("weight_map", {})
        files = [root / name for name in sorted(set(weight_map.values()))]
    else:
        raise CheckpointError(f"{root}: no {WEIGHTS_FILE} (or {INDEX_FILE})")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name)
    return tensors


def _check_weights(drafter: DSparkDrafter, tensors: dict[str, torch.Tensor]) -> None:
    """Every expected weight present with its exact shape, and nothing unexpected."""
    expected = {name: tuple(t.shape) for name, t in drafter.state_dict().items()}
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"checkpoint is missing weights {missing}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(
            f"checkpoint has unexpected weights {unexpected} (is the config consistent with them? "
            f"markov_rank={drafter.config.markov_rank}, markov_head_type="
            f"{drafter.config.markov_head_type!r}, enable_confidence_head="
            f"{drafter.config.enable_confidence_head})"
        )
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(
                f"weight {name!r} has shape {tuple(tensors[name].shape)}, expected {shape}"
            )
