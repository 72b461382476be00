"""`DSparkConfig`: the DeepSpec drafter config, parsed strictly.

A DeepSpec `config.json` is the whole target config plus the drafter keys (dspark-algorithm.md
section 8). Every key that changes what the drafter computes is required: a checkpoint that omits
one would otherwise run with a silently guessed behaviour. The z-lab `dflash_config` nesting of
`target_layer_ids`/`mask_token_id` is accepted too; if a key is both nested and top-level, the two
must agree.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Mapping

from sglang_dspark.model.errors import CheckpointError

DSPARK_ARCHITECTURE = "Qwen3DSparkModel"
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
_MISSING = object()


@dataclass(frozen=True)
class DSparkConfig:
    """Everything the drafter needs, validated. `raw` keeps the full dict for an exact re-save."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    num_hidden_layers: int
    num_target_layers: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    markov_head_type: str | None
    enable_confidence_head: bool
    confidence_head_with_markov: bool
    draft_vocab_size: int
    initializer_range: float = 0.02
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_taps(self) -> int:
        """m, the number of tapped target layers (`fc` reads m*d features)."""
        return len(self.target_layer_ids)

    @property
    def has_markov_head(self) -> bool:
        return self.markov_rank > 0

    @property
    def has_reduced_vocab(self) -> bool:
        return self.draft_vocab_size < self.vocab_size

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "DSparkConfig":
        """Parse a DeepSpec config dict; raise `CheckpointError` naming any bad key."""
        if not isinstance(raw, Mapping):
            raise CheckpointError(f"config must be a JSON object, got {type(raw).__name__}")
        reader = _KeyReader(raw)
        _check_architecture(raw)
        _check_unsupported(raw)

        hidden = reader.positive_int("hidden_size")
        heads = reader.positive_int("num_attention_heads")
        kv_heads = reader.positive_int("num_key_value_heads")
        if heads % kv_heads:
            raise CheckpointError(
                f"num_key_value_heads={kv_heads} must divide num_attention_heads={heads} (GQA)"
            )
        head_dim = reader.optional_positive_int("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise CheckpointError(
                    f"head_dim is missing and hidden_size={hidden} is not divisible by "
                    f"num_attention_heads={heads}; expected an explicit head_dim"
                )
            head_dim = hidden // heads
        if head_dim % 2:
            raise CheckpointError(f"head_dim={head_dim} must be even for RoPE")

        vocab = reader.positive_int("vocab_size")
        num_target_layers = reader.positive_int("num_target_layers")
        layer_ids = _layer_ids(reader.value("target_layer_ids"), num_target_layers)
        mask_token_id = reader.int_in_range("mask_token_id", 0, vocab - 1)

        markov_rank = reader.int_in_range("markov_rank", 0, None)
        markov_head_type = None
        if markov_rank > 0:
            markov_head_type = reader.value("markov_head_type")
            if markov_head_type not in MARKOV_HEAD_TYPES:
                raise CheckpointError(
                    f"markov_head_type={markov_head_type!r}: expected one of {list(MARKOV_HEAD_TYPES)}"
                )

        enable_conf = reader.boolean("enable_confidence_head")
        conf_with_markov = reader.boolean("confidence_head_with_markov") if enable_conf else False
        if conf_with_markov and markov_rank == 0:
            raise CheckpointError(
                "confidence_head_with_markov=true needs a Markov head: expected markov_rank > 0 "
                "or confidence_head_with_markov=false"
            )

        draft_vocab = vocab
        if "draft_vocab_size" in raw:
            draft_vocab = reader.int_in_range("draft_vocab_size", 1, vocab)

        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=reader.positive_int("intermediate_size"),
            rms_norm_eps=reader.positive_float("rms_norm_eps"),
            rope_theta=_rope_theta(raw),
            vocab_size=vocab,
            num_hidden_layers=reader.positive_int("num_hidden_layers"),
            num_target_layers=num_target_layers,
            block_size=reader.positive_int("block_size"),
            mask_token_id=mask_token_id,
            target_layer_ids=layer_ids,
            markov_rank=markov_rank,
            markov_head_type=markov_head_type,
            enable_confidence_head=enable_conf,
            confidence_head_with_markov=conf_with_markov,
            draft_vocab_size=draft_vocab,
            initializer_range=float(raw.get("initializer_range", 0.02)),
            raw=copy.deepcopy(dict(raw)),
        )

    @classmethod
    def from_target_config(
        cls,
        target_config: Any,
        *,
        num_draft_layers: int,
        block_size: int,
        mask_token_id: int,
        target_layer_ids: list[int],
        markov_rank: int,
        markov_head_type: str | None = "vanilla",
        enable_confidence_head: bool = True,
        confidence_head_with_markov: bool = True,
        draft_vocab_size: int | None = None,
    ) -> "DSparkConfig":
        """Build a drafter config the way DeepSpec's `build_draft_config` does.

        The target's config (a transformers `PretrainedConfig` or its dict) is copied whole, so
        width, heads, GQA, head_dim, FFN size, eps and RoPE match the target; the drafter keys
        are set on top.
        """
        raw = target_config.to_dict() if hasattr(target_config, "to_dict") else dict(target_config)
        raw = copy.deepcopy(raw)
        if "num_hidden_layers" not in raw:
            raise CheckpointError("target config lacks num_hidden_layers; expected the target's depth")
        for stale in ("dflash_config", "draft_vocab_size", "markov_head_type",
                      "confidence_head_with_markov"):
            raw.pop(stale, None)
        raw.update(
            architectures=[DSPARK_ARCHITECTURE],
            num_target_layers=raw["num_hidden_layers"],
            num_hidden_layers=num_draft_layers,
            block_size=block_size,
            tie_word_embeddings=False,
            layer_types=["full_attention"] * num_draft_layers,
            mask_token_id=mask_token_id,
            target_layer_ids=list(target_layer_ids),
            markov_rank=markov_rank,
            enable_confidence_head=enable_confidence_head,
        )
        if markov_rank > 0:
            raw["markov_head_type"] = markov_head_type
        if enable_confidence_head:
            raw["confidence_head_with_markov"] = confidence_head_with_markov
        if draft_vocab_size is not None and draft_vocab_size != raw.get("vocab_size"):
            raw["draft_vocab_size"] = draft_vocab_size
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        """The config.json content: the original dict with the parsed drafter keys written back."""
        out = copy.deepcopy(dict(self.raw))
        out.update(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            rms_norm_eps=self.rms_norm_eps,
            vocab_size=self.vocab_size,
            num_hidden_layers=self.num_hidden_layers,
            num_target_layers=self.num_target_layers,
            block_size=self.block_size,
            markov_rank=self.markov_rank,
            enable_confidence_head=self.enable_confidence_head,
        )
        out.setdefault("architectures", [DSPARK_ARCHITECTURE])
        nested = out.get("dflash_config")
        for key, value in (("mask_token_id", self.mask_token_id),
                           ("target_layer_ids", list(self.target_layer_ids))):
            if isinstance(nested, dict) and key in nested and key not in out:
                nested[key] = value
            else:
                out[key] = value
        if self.markov_head_type is not None:
            out["markov_head_type"] = self.markov_head_type
        if self.enable_confidence_head:
            out["confidence_head_with_markov"] = self.confidence_head_with_markov
        if self.has_reduced_vocab:
            out["draft_vocab_size"] = self.draft_vocab_size
        else:
            out.pop("draft_vocab_size", None)
        return out


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash/DeepSpec's default taps: `num_draft_layers` ids evenly spaced from 1 to L-3.

    One draft layer taps L // 2 (fewer ids come back when the range is too short to hold
    distinct ones). For L=36, 5 layers this gives [1, 9, 17, 25, 33]; for L=40,
    [1, 10, 19, 28, 37] (the published Qwen3 configs).
    """
    if num_target_layers < 4 or num_draft_layers < 1:
        raise ValueError(
            f"num_target_layers={num_target_layers}, num_draft_layers={num_draft_layers}: "
            "expected at least 4 target layers and 1 draft layer"
        )
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    last = num_target_layers - 3
    step = (last - 1) / (num_draft_layers - 1)
    return sorted({round(1 + i * step) for i in range(num_draft_layers)})


class _KeyReader:
    """Reads required keys (top level, or nested under `dflash_config`) with typed checks."""

    def __init__(self, raw: Mapping[str, Any]):
        self.raw = raw
        nested = raw.get("dflash_config", {})
        if nested is None:
            nested = {}
        if not isinstance(nested, Mapping):
            raise CheckpointError(f"dflash_config must be an object, got {type(nested).__name__}")
        self.nested = nested

    def value(self, key: str) -> Any:
        top = self.raw.get(key, _MISSING)
        inner = self.nested.get(key, _MISSING)
        if top is _MISSING and inner is _MISSING:
            raise CheckpointError(f"config is missing required key {key!r}")
        if top is not _MISSING and inner is not _MISSING and top != inner:
            raise CheckpointError(
                f"{key!r} is inconsistent: top level says {top!r}, dflash_config says {inner!r}; "
                "expected the same value in both places"
            )
        return top if top is not _MISSING else inner

    def positive_int(self, key: str) -> int:
        return self.int_in_range(key, 1, None)

    def optional_positive_int(self, key: str) -> int | None:
        if self.raw.get(key) is None and self.nested.get(key) is None:
            return None
        return self.positive_int(key)

    def int_in_range(self, key: str, low: int, high: int | None) -> int:
        value = self.value(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise CheckpointError(f"{key!r} must be an integer, got {value!r}")
        if value < low or (high is not None and value > high):
            bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise CheckpointError(f"{key!r}={value}: expected an integer {bound}")
        return value

    def positive_float(self, key: str) -> float:
        value = self.value(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise CheckpointError(f"{key!r}={value!r}: expected a positive number")
        return float(value)

    def boolean(self, key: str) -> bool:
        value = self.value(key)
        if not isinstance(value, bool):
            raise CheckpointError(f"{key!r}={value!r}: expected true or false")
        return value


def _check_architecture(raw: Mapping[str, Any]) -> None:
    archs = raw.get("architectures")
    if not isinstance(archs, list) or DSPARK_ARCHITECTURE not in archs:
        raise CheckpointError(
            f"architectures={archs!r}: expected [{DSPARK_ARCHITECTURE!r}] (a DeepSpec DSpark/DFlash "
            "drafter; z-lab DFlash and Gemma4 drafters use other block semantics and are not supported)"
        )


def _check_unsupported(raw: Mapping[str, Any]) -> None:
    """Reject target features the Qwen3-style drafter layer does not implement."""
    if raw.get("hidden_act", _MISSING) is _MISSING:
        raise CheckpointError("config is missing required key 'hidden_act' (expected 'silu')")
    if raw["hidden_act"] != "silu":
        raise CheckpointError(f"hidden_act={raw['hidden_act']!r}: expected 'silu'")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise CheckpointError(f"{key}=true is not supported: expected false (Qwen3-style drafter)")
    layer_types = raw.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise CheckpointError(f"layer_types={layer_types!r}: expected only 'full_attention'")


def _rope_theta(raw: Mapping[str, Any]) -> float:
    """RoPE base from `rope_parameters` (transformers 5) or `rope_theta`; only plain RoPE."""
    params = raw.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise CheckpointError(f"rope_parameters must be an object, got {params!r}")
    scaling = raw.get("rope_scaling")
    rope_type = params.get("rope_type", "default")
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", rope_type))
    if rope_type != "default":
        raise CheckpointError(f"rope_type={rope_type!r} is not supported: expected 'default'")
    candidates = [v for v in (params.get("rope_theta"), raw.get("rope_theta")) if v is not None]
    if not candidates:
        raise CheckpointError(
            "config is missing required key 'rope_theta' (top level or in rope_parameters)"
        )
    if len(candidates) == 2 and float(candidates[0]) != float(candidates[1]):
        raise CheckpointError(
            f"'rope_theta' is inconsistent: rope_parameters says {candidates[0]}, top level says "
            f"{candidates[1]}; expected the same value"
        )
    theta = float(candidates[0])
    if theta <= 0:
        raise CheckpointError(f"rope_theta={theta}: expected a positive number")
    return theta


def _layer_ids(value: Any, num_target_layers: int) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise CheckpointError(f"target_layer_ids={value!r}: expected a non-empty list of integers")
    top = num_target_layers - 2
    bad = [v for v in value if v < -1 or v > top]
    if bad:
        raise CheckpointError(
            f"target_layer_ids={value!r}: expected ids in [-1, {top}] (-1 is the embedding output; "
            f"the final layer {num_target_layers - 1} is post-norm in transformers and not tappable)"
        )
    if len(set(value)) != len(value):
        raise CheckpointError(f"target_layer_ids={value!r}: expected distinct ids")
    return tuple(value)
