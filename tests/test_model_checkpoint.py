"""DeepSpec checkpoints: the published layout loads and runs, save/load is exact, bad input is named."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
from tiny import make_tiny_drafter, make_tiny_target, tiny_taps  # noqa: E402

from sglang_dspark.model import (  # noqa: E402
    CheckpointError,
    TargetWeights,
    load_drafter,
    save_drafter,
)

D, HEADS, KV, HD, FFN, V, R, M, LAYERS = 32, 4, 2, 8, 48, 96, 8, 2, 2


def published_config() -> dict:
    """A config.json as DeepSpec's `build_draft_config` writes it (tiny dims, Qwen3 target)."""
    return {
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_size": D,
        "intermediate_size": FFN, "num_attention_heads": HEADS, "num_key_value_heads": KV,
        "head_dim": HD, "hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_bias": False,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "vocab_size": V, "max_position_embeddings": 512, "num_hidden_layers": LAYERS,
        "num_target_layers": 6, "block_size": 5, "mask_token_id": V - 1,
        "target_layer_ids": [1, 3], "num_anchors": 512, "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * LAYERS, "markov_rank": R,
        "markov_head_type": "vanilla", "enable_confidence_head": True,
        "confidence_head_with_markov": True, "torch_dtype": "bfloat16",
    }


def published_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights under the published key names of dspark-algorithm.md section 8, in bf16."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.2).to(torch.bfloat16)

    w = {"embed_tokens.weight": rand(V, D), "lm_head.weight": rand(V, D), "fc.weight": rand(D, M * D),
         "hidden_norm.weight": 1 + rand(D), "norm.weight": 1 + rand(D),
         "markov_head.markov_w1.weight": rand(V, R), "markov_head.markov_w2.weight": rand(V, R),
         "confidence_head.proj.weight": rand(1, D + R), "confidence_head.proj.bias": rand(1)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        w.update({
            p + "input_layernorm.weight": 1 + rand(D), p + "post_attention_layernorm.weight": 1 + rand(D),
            p + "self_attn.q_proj.weight": rand(HEADS * HD, D), p + "self_attn.k_proj.weight": rand(KV * HD, D),
            p + "self_attn.v_proj.weight": rand(KV * HD, D), p + "self_attn.o_proj.weight": rand(D, HEADS * HD),
            p + "self_attn.q_norm.weight": 1 + rand(HD), p + "self_attn.k_norm.weight": 1 + rand(HD),
            p + "mlp.gate_proj.weight": rand(FFN, D), p + "mlp.up_proj.weight": rand(FFN, D),
            p + "mlp.down_proj.weight": rand(D, FFN),
        })
    return w


def write_published(path: Path, config: dict | None = None, weights: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or published_config()))
    save_file(weights or published_weights(), str(path / "model.safetensors"))
    return path


def run_one_block(drafter, context_len: int = 6, seed: int = 1) -> torch.Tensor:
    """Append a random context to one slot, draft one block; returns the corrected slot-0 logits."""
    g = torch.Generator().manual_seed(seed)
    d = drafter.config.hidden_size * drafter.config.num_taps
    taps = torch.randn(context_len, d, generator=g)
    cache = drafter.new_cache(num_slots=1)
    drafter.append_context(cache, [0], taps, [context_len])
    anchor = torch.tensor([3])
    hidden = drafter.forward_block(cache, [0], anchor)
    bias, _ = drafter.markov_bias(anchor, hidden[:, 0])
    return drafter.base_logits(hidden[:, 0]) + bias


def test_published_layout_loads_with_its_exact_weights_and_drafts(tmp_path: Path) -> None:
    weights = published_weights()
    drafter = load_drafter(write_published(tmp_path / "ckpt", weights=weights))
    assert drafter.gamma == 5 and drafter.target_layer_ids == (1, 3)
    assert drafter.dtype == torch.bfloat16
    loaded = dict(drafter.state_dict(), **{"embed_tokens.weight": drafter.embed_tokens.weight,
                                           "lm_head.weight": drafter.lm_head.weight})
    assert loaded.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(loaded[name], tensor), name
    logits = run_one_block(drafter)
    assert logits.shape == (1, V) and torch.isfinite(logits.float()).all()
    hidden = drafter.forward_block(_filled_cache(drafter), [0], torch.tensor([3]))
    conf = drafter.confidence_logits(hidden[:, 0], torch.tensor([3]))
    assert conf.shape == (1,) and torch.isfinite(conf.float()).all()


def _filled_cache(drafter):
    cache = drafter.new_cache(1)
    drafter.append_context(cache, [0], torch.ones(4, drafter.config.num_taps * drafter.config.hidden_size), [4])
    return cache


def test_dflash_config_nesting_is_accepted_and_contradictions_are_named(tmp_path: Path) -> None:
    config = published_config()
    config["dflash_config"] = {"mask_token_id": config.pop("mask_token_id"),
                               "target_layer_ids": config.pop("target_layer_ids")}
    drafter = load_drafter(write_published(tmp_path / "nested", config))
    assert drafter.config.mask_token_id == V - 1 and drafter.target_layer_ids == (1, 3)

    config = published_config()
    config["dflash_config"] = {"target_layer_ids": [0, 2]}
    with pytest.raises(CheckpointError, match="target_layer_ids.*inconsistent"):
        load_drafter(write_published(tmp_path / "contradiction", config))


@pytest.mark.parametrize("key", ["mask_token_id", "block_size", "markov_rank", "target_layer_ids",
                                 "enable_confidence_head", "markov_head_type",
                                 "confidence_head_with_markov"])
def test_missing_behaviour_key_fails_naming_it(tmp_path: Path, key: str) -> None:
    config = published_config()
    del config[key]
    with pytest.raises(CheckpointError, match=key):
        load_drafter(write_published(tmp_path / key, config))


def test_inconsistent_keys_fail_with_the_expected_value(tmp_path: Path) -> None:
    config = dict(published_config(), markov_head_type="lstm")
    with pytest.raises(CheckpointError, match=r"markov_head_type.*expected one of \['vanilla', 'gated', 'rnn'\]"):
        load_drafter(write_published(tmp_path / "a", config))
    config = dict(published_config(), mask_token_id=V)
    with pytest.raises(CheckpointError, match=rf"mask_token_id.*\[0, {V - 1}\]"):
        load_drafter(write_published(tmp_path / "b", config))
    config = dict(published_config(), target_layer_ids=[1, 5])
    with pytest.raises(CheckpointError, match=r"target_layer_ids.*\[-1, 4\]"):
        load_drafter(write_published(tmp_path / "c", config))
    config = dict(published_config(), architectures=["DFlashDraftModel"])
    with pytest.raises(CheckpointError, match="architectures.*Qwen3DSparkModel"):
        load_drafter(write_published(tmp_path / "d", config))


def test_wrong_shaped_weight_names_the_weight_and_both_shapes(tmp_path: Path) -> None:
    weights = published_weights()
    weights["layers.1.self_attn.k_proj.weight"] = torch.zeros(KV * HD + 1, D, dtype=torch.bfloat16)
    with pytest.raises(CheckpointError) as err:
        load_drafter(write_published(tmp_path / "ckpt", weights=weights))
    message = str(err.value)
    assert "layers.1.self_attn.k_proj.weight" in message
    assert str((KV * HD + 1, D)) in message and str((KV * HD, D)) in message


def test_missing_and_unexpected_weights_are_named(tmp_path: Path) -> None:
    weights = published_weights()
    del weights["markov_head.markov_w2.weight"]
    with pytest.raises(CheckpointError, match="markov_head.markov_w2.weight"):
        load_drafter(write_published(tmp_path / "missing", weights=weights))
    weights = dict(published_weights(), **{"markov_head.gate_proj.weight": torch.zeros(R, D + R)})
    with pytest.raises(CheckpointError, match="markov_head.gate_proj.weight"):
        load_drafter(write_published(tmp_path / "unexpected", weights=weights))


def test_checkpoint_without_token_weights_needs_a_target(tmp_path: Path) -> None:
    weights = published_weights()
    embed, head = weights.pop("embed_tokens.weight"), weights.pop("lm_head.weight")
    path = write_published(tmp_path / "ckpt", weights=weights)
    with pytest.raises(CheckpointError, match="target="):
        load_drafter(path)
    drafter = load_drafter(path, target=TargetWeights(embed_tokens=embed, lm_head=head))
    assert drafter.embed_tokens.weight.data_ptr() == embed.data_ptr()
    assert drafter.lm_head.weight.data_ptr() == head.data_ptr()
    assert run_one_block(drafter).shape == (1, V)


@pytest.mark.parametrize("options", [
    dict(markov_head_type="vanilla"),
    dict(markov_head_type="gated", num_layers=2),
    dict(markov_head_type="rnn"),
    dict(markov_rank=0, markov_head_type=None, confidence=False),
    dict(markov_head_type="vanilla", draft_vocab_size=100),
], ids=["vanilla", "gated-2layers", "rnn", "dflash", "reduced-vocab"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_save_load_round_trip_is_bit_exact(tmp_path: Path, options: dict, dtype: torch.dtype) -> None:
    target = make_tiny_target(seed=3)
    drafter = make_tiny_drafter(target, seed=3, dtype=dtype, **options)
    save_drafter(drafter, tmp_path / "ckpt")
    stored = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert not any(name.startswith("model.") for name in stored)
    loaded = load_drafter(tmp_path / "ckpt")
    assert loaded.config == drafter.config and loaded.dtype == dtype
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert torch.equal(loaded.embed_tokens.weight, drafter.embed_tokens.weight)
    assert torch.equal(loaded.lm_head.weight, drafter.lm_head.weight)
    assert (loaded.d2t is None) == (drafter.d2t is None)
    if drafter.d2t is not None:
        assert torch.equal(loaded.d2t, drafter.d2t)
    ids = torch.randint(0, 500, (1, 9), generator=torch.Generator().manual_seed(0))
    taps = tiny_taps(target, ids)[0]
    outputs = []
    for model in (drafter, loaded):
        cache = model.new_cache(1)
        model.append_context(cache, [0], taps, [9])
        outputs.append(model.base_logits(model.forward_block(cache, [0], ids[:, -1])))
    assert torch.equal(outputs[0], outputs[1])


def test_target_tensors_are_shared_not_copied() -> None:
    target = make_tiny_target()
    drafter = make_tiny_drafter(target)
    assert drafter.embed_tokens.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    assert drafter.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    assert not any(p.data_ptr() == target.lm_head.weight.data_ptr() for p in drafter.parameters())


def test_load_with_a_target_uses_the_targets_tensors(tmp_path: Path) -> None:
    target = make_tiny_target()
    save_drafter(make_tiny_drafter(target), tmp_path / "ckpt", include_token_weights=False)
    assert "embed_tokens.weight" not in load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    drafter = load_drafter(tmp_path / "ckpt", target=target)
    assert drafter.embed_tokens.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()


def test_reduced_vocab_without_d2t_is_rejected(tmp_path: Path) -> None:
    target = make_tiny_target()
    save_drafter(make_tiny_drafter(target, draft_vocab_size=64), tmp_path / "ckpt")
    weights = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    del weights["d2t"]
    save_file(weights, str(tmp_path / "ckpt" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="d2t"):
        load_drafter(tmp_path / "ckpt")


def test_rope_settings_are_read_strictly(tmp_path: Path) -> None:
    config = published_config()
    del config["rope_parameters"]
    config["rope_theta"] = 5000.0  # transformers-4 style top-level key
    assert load_drafter(write_published(tmp_path / "top", config)).config.rope_theta == 5000.0
    config = dict(published_config(), rope_theta=5000.0)
    with pytest.raises(CheckpointError, match="rope_theta.*inconsistent"):
        load_drafter(write_published(tmp_path / "both", config))
    config = dict(published_config(), rope_parameters={"rope_theta": 1e4, "rope_type": "llama3"})
    with pytest.raises(CheckpointError, match="rope_type='llama3'.*expected 'default'"):
        load_drafter(write_published(tmp_path / "llama3", config))
    config = published_config()
    del config["rope_parameters"]
    with pytest.raises(CheckpointError, match="rope_theta"):
        load_drafter(write_published(tmp_path / "none", config))


def test_drafter_for_a_target_copies_its_geometry_and_default_taps() -> None:
    from sglang_dspark.model import DSparkDrafter, default_target_layer_ids

    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(40, 5) == [1, 10, 19, 28, 37]
    assert default_target_layer_ids(30, 1) == [15]
    target = make_tiny_target(num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=8)
    drafter = DSparkDrafter.for_target(target, num_draft_layers=2, block_size=3, mask_token_id=5, markov_rank=4)
    cfg = drafter.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (8, 4, 8)
    assert cfg.num_target_layers == 8 and cfg.num_hidden_layers == 2 and drafter.target_layer_ids == (1, 5)
    assert cfg.rope_theta == target.config.rope_parameters["rope_theta"]
