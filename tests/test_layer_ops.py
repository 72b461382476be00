"""RMSNorm, rotary embedding and SiLU-and-multiply kernels against SGLang's own `forward_native`,
and the hooks that route SGLang's CPU layers through them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_dspark.kernels_cpu import layer_hooks
from sglang_dspark.kernels_cpu.layer_ops import add_rmsnorm, rope_neox, row_argmax, silu_and_mul


@pytest.fixture
def kernels_on(monkeypatch):
    monkeypatch.delenv("DSPARK_CPU_LAYER_OPS", raising=False)
    layer_hooks.kernels_enabled.cache_clear()
    yield
    layer_hooks.kernels_enabled.cache_clear()


def _norm(dtype, hidden=576):
    from sglang.srt.layers.layernorm import RMSNorm

    norm = RMSNorm(hidden, eps=1e-5).to(dtype)
    norm.weight.data.normal_(generator=torch.Generator().manual_seed(1))
    return norm


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_rmsnorm_hook_returns_what_sglang_returns(kernels_on, dtype, tolerance):
    from sglang.srt.layers.layernorm import RMSNorm

    norm = _norm(dtype)
    x, residual = torch.randn(5, 576).to(dtype), torch.randn(5, 576).to(dtype)
    want_out, want_residual = RMSNorm.forward_native(norm, x, residual)
    out, new_residual = layer_hooks.around_rmsnorm(RMSNorm.forward_native, norm, x, residual)
    assert torch.equal(new_residual, want_residual), "x + residual is rounded once, as SGLang does"
    torch.testing.assert_close(out, want_out, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(layer_hooks.around_rmsnorm(RMSNorm.forward_native, norm, x),
                               RMSNorm.forward_native(norm, x), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_alone_gives_the_bits_it_gets_in_a_batch(dtype):
    norm = _norm(dtype)
    x, residual = torch.randn(7, 576).to(dtype), torch.randn(7, 576).to(dtype)
    batched, _ = add_rmsnorm(x, residual, norm.weight, 1e-5)
    assert torch.equal(add_rmsnorm(x[3:4], residual[3:4], norm.weight, 1e-5)[0], batched[3:4])
    cache = _rope_cache(dtype)
    positions = torch.tensor([4, 90, 700])
    q, k = torch.randn(3, 9 * 64).to(dtype), torch.randn(3, 3 * 64).to(dtype)
    q_out, k_out = rope_neox(positions, q, k, 64, 64, cache)
    q_one, k_one = rope_neox(positions[1:2], q[1:2], k[1:2], 64, 64, cache)
    assert torch.equal(q_one, q_out[1:2]) and torch.equal(k_one, k_out[1:2])


def _rope_cache(dtype, head=64, positions=1024):
    inverse = 1.0 / (10000 ** (torch.arange(0, head, 2).float() / head))
    angles = torch.outer(torch.arange(positions).float(), inverse)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary_hook_rotates_like_sglang_neox(kernels_on, dtype, tolerance, rotary_dim):
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    from sglang.srt.layers.rotary_embedding.utils import apply_rotary_emb

    rotary = SimpleNamespace(cos_sin_cache=_rope_cache(dtype, head=rotary_dim), is_neox_style=True, head_size=64,
                             rotary_dim=rotary_dim, _apply_rotary_emb_wrapped=apply_rotary_emb)
    qkv = torch.randn(3, 14 * 64).to(dtype)  # q and k as strided views of a packed projection, as in serving
    q, k = qkv[:, : 9 * 64], qkv[:, 9 * 64 : 12 * 64]
    positions = torch.tensor([0, 17, 1000])
    q_out, k_out = layer_hooks.around_rotary(RotaryEmbedding.forward_native, rotary, positions, q, k)
    q_want, k_want = RotaryEmbedding.forward_native(rotary, positions, q.float(), k.float())
    torch.testing.assert_close(q_out.float(), q_want, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(k_out.float(), k_want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_hook_computes_what_sglang_computes_and_rows_do_not_depend_on_each_other(kernels_on, dtype):
    from sglang.srt.layers.activation import SiluAndMul

    generator = torch.Generator().manual_seed(2)
    # SmolLM2's MLP width, a width that is no multiple of 16, and 40 rows (torch's own threaded size)
    for rows, width in ((3, 1536), (40, 1536), (5, 37)):
        x = (4 * torch.randn(rows, 2 * width, generator=generator)).to(dtype)
        got = layer_hooks.around_silu_and_mul(SiluAndMul.forward_native, None, x)
        want = SiluAndMul.forward_native(None, x)
        assert got.shape == want.shape and got.dtype == dtype
        if dtype == torch.bfloat16:  # the SiLU rounds to bfloat16 before the product, as in torch
            assert (got != want).float().mean() < 1e-3
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
        else:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert torch.equal(silu_and_mul(x[rows - 1 :]), got[rows - 1 :])
    strided = torch.randn(4, 64).to(dtype)[:, :32]  # not unit-stride rows of [gate, up]: SGLang's code
    assert torch.equal(layer_hooks.around_silu_and_mul(SiluAndMul.forward_native, None, strided.t().contiguous().t()),
                       SiluAndMul.forward_native(None, strided.t().contiguous().t()))


def test_positions_outside_the_rotary_cache_are_refused():
    cache = _rope_cache(torch.float32, positions=16)
    with pytest.raises(ValueError, match="outside a cache of 16 positions"):
        rope_neox(torch.tensor([3, 16]), torch.randn(2, 64), torch.randn(2, 64), 64, 64, cache)


def test_norms_and_rotaries_the_kernels_do_not_serve_keep_sglangs_code(kernels_on):
    calls = []

    def sglang(*args, **kwargs):
        calls.append(args)
        return "sglang"

    norm = _norm(torch.float32)
    norm.variance_size_override = 128
    assert layer_hooks.around_rmsnorm(sglang, norm, torch.randn(2, 576)) == "sglang"
    gptj = SimpleNamespace(cos_sin_cache=_rope_cache(torch.float32), is_neox_style=False, head_size=64, rotary_dim=64)
    assert layer_hooks.around_rotary(sglang, gptj, torch.tensor([1]), torch.randn(1, 64), torch.randn(1, 64)) == "sglang"
    assert len(calls) == 2


def test_the_torch_setting_keeps_sglangs_ops_and_a_bad_one_is_refused(monkeypatch):
    monkeypatch.setenv("DSPARK_CPU_LAYER_OPS", "torch")
    layer_hooks.kernels_enabled.cache_clear()
    try:
        assert not layer_hooks.kernels_enabled()
        monkeypatch.setenv("DSPARK_CPU_LAYER_OPS", "fast")
        with pytest.raises(ValueError, match="expected one of kernel, torch"):
            layer_hooks.layer_ops_mode()
    finally:
        layer_hooks.kernels_enabled.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax_picks_what_torch_argmax_picks_ties_nans_and_strided_rows_included(dtype):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 49153, generator=generator).to(dtype)  # not a multiple of 16 columns
    logits[1, 100] = logits[1, 40000] = 50.0  # a tie: the first one wins
    logits[2, 49152] = 60.0  # the maximum in the scalar tail
    logits[3, 300] = logits[3, 20] = float("nan")  # NaN counts as the maximum, the first one
    logits[4] = float("-inf")
    logits[5, 17] = float("inf")
    assert torch.equal(row_argmax(logits), logits.argmax(-1))
    assert row_argmax(logits).tolist()[1:4] == [100, 49152, 20]
    wide = torch.randn(3, 200, generator=generator).to(dtype)
    assert torch.equal(row_argmax(wide[:, 50:150]), wide[:, 50:150].argmax(-1)), "a row stride wider than the row"
    short = torch.randn(4, 5, generator=generator).to(dtype)
    assert torch.equal(row_argmax(short), short.argmax(-1))
