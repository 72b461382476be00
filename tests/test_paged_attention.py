"""The paged attention kernel (decode and verify windows read from the KV cache in place) and the
SGLang decode hook that routes plain decode steps through it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kv_fakes import FakeKVPool

from sglang_dspark.kernels_cpu.build import vector_isa_supported
from sglang_dspark.kernels_cpu import cpu_attention
from sglang_dspark.kernels_cpu.paged_attention import KeyLayout, LayoutPerForward, kernel_fits, paged_attention

SPANS = [(300, 1), (17, 5), (120, 8), (0, 3)]
POOL_ROWS = [2, 0, 3, 1]


def _cache(dtype, kv_heads, head_dim, rows=2048, seed=0):
    generator = torch.Generator().manual_seed(seed)
    k = torch.randn(rows, kv_heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(rows, kv_heads, head_dim, generator=generator).to(dtype)
    req_to_token = torch.randperm(rows - 1, generator=generator)[:4 * 400].add(1).to(torch.int32).view(4, 400)
    return k, v, req_to_token


def _reference(q, k, v, req_to_token, spans, pool_rows, scale):
    """float64 softmax attention of each window row over the keys it may see."""
    rows, start = [], 0
    group = q.shape[1] // k.shape[1]
    for (prefix, window), pool_row in zip(spans, pool_rows):
        for j in range(window):
            slots = req_to_token[pool_row, : prefix + j + 1].long()
            keys = k[slots].double().repeat_interleave(group, dim=1)  # [n, heads, d]
            values = v[slots].double().repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,nhd->hn", q[start + j].double(), keys) * scale
            rows.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), values))
        start += window
    return torch.stack(rows)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 16), (8, 8, 128), (8, 1, 32)])
def test_kernel_equals_softmax_attention_over_the_visible_keys(dtype, tolerance, heads, kv_heads, head_dim):
    k, v, req_to_token = _cache(dtype, kv_heads, head_dim)
    layout = KeyLayout.build(req_to_token, POOL_ROWS, SPANS, cache_rows=k.shape[0])
    q = torch.randn(layout.rows, heads, head_dim).to(dtype)
    out = paged_attention(q, k, v, layout, head_dim**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    want = _reference(q, k, v, req_to_token, SPANS, POOL_ROWS, head_dim**-0.5)
    torch.testing.assert_close(out.double(), want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verify_row_gets_the_bits_of_the_decode_step_that_sees_the_same_keys(dtype):
    """What makes speculation lossless bit for bit: each window row alone, as a one-token decode of
    its prefix, and each request alone, give exactly what the batched verify gave."""
    k, v, req_to_token = _cache(dtype, 3, 64)
    layout = KeyLayout.build(req_to_token, POOL_ROWS, SPANS, cache_rows=k.shape[0])
    q = torch.randn(layout.rows, 9, 64).to(dtype)
    batched = paged_attention(q, k, v, layout, 0.125)
    row = 0
    for (prefix, window), pool_row in zip(SPANS, POOL_ROWS):
        alone = KeyLayout.build(req_to_token, [pool_row], [(prefix, window)], cache_rows=k.shape[0])
        assert torch.equal(paged_attention(q[row : row + window], k, v, alone, 0.125), batched[row : row + window])
        for j in range(window):
            decode = KeyLayout.build(req_to_token, [pool_row], [(prefix + j, 1)], cache_rows=k.shape[0])
            assert torch.equal(paged_attention(q[row + j : row + j + 1], k, v, decode, 0.125),
                               batched[row + j : row + j + 1]), f"window row {j} of request {pool_row}"
        row += window


TREE_ANCESTRIES = [[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 3, 4], [0, 2, 5]]  # rows of a tree window, root to row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tree_row_sees_the_prefix_and_its_own_ancestry_with_the_bits_of_a_decode_step(dtype):
    """A tree window (`KeyLayout.for_tree`): each row equals float64 attention over the prefix and
    its ancestry's keys, and equals bit for bit the decode step whose sequence is that path (what
    the request's row holds once the path is accepted and its slots moved into place)."""
    k, v, req_to_token = _cache(dtype, 3, 64)
    prefix, window = req_to_token[2, :150], req_to_token[2, 150:156]
    layout = KeyLayout.for_tree(prefix, window, TREE_ANCESTRIES, cache_rows=k.shape[0])
    q = torch.randn(layout.rows, 9, 64).to(dtype)
    out = paged_attention(q, k, v, layout, 0.125)
    for row, ancestry in enumerate(TREE_ANCESTRIES):
        path = torch.cat((prefix, window[ancestry])).view(1, -1)
        want = _reference(q[row : row + 1], k, v, path, [(path.shape[1] - 1, 1)], [0], 0.125)
        torch.testing.assert_close(out[row : row + 1].double(), want, rtol=2e-2, atol=2e-2)
        decode = KeyLayout.build(path, [0], [(path.shape[1] - 1, 1)], cache_rows=k.shape[0])
        assert torch.equal(paged_attention(q[row : row + 1], k, v, decode, 0.125), out[row : row + 1]), f"row {row}"
    with pytest.raises(ValueError, match="ancestries for a window of 6 rows"):
        KeyLayout.for_tree(prefix, window, TREE_ANCESTRIES[:4], cache_rows=k.shape[0])


def test_layout_refuses_slots_outside_the_cache():
    req_to_token = torch.tensor([[5, 6, 99]], dtype=torch.int32)
    with pytest.raises(ValueError, match="outside a cache of 50 rows"):
        KeyLayout.build(req_to_token, [0], [(2, 1)], cache_rows=50)


def test_shapes_the_kernel_does_not_serve_are_refused_not_guessed():
    assert not kernel_fits(torch.float32, torch.float32, head_dim=48, group=1)
    assert not kernel_fits(torch.float32, torch.float32, head_dim=64, group=9)
    assert not kernel_fits(torch.bfloat16, torch.float32, head_dim=64, group=1)
    k, v, req_to_token = _cache(torch.float32, 1, 48)
    layout = KeyLayout.build(req_to_token, [0], [(3, 1)], cache_rows=k.shape[0])
    with pytest.raises(ValueError, match="paged_attention"):
        paged_attention(torch.randn(1, 1, 48), k, v, layout, 1.0)


def test_one_layout_per_forward_even_when_the_forward_batch_object_is_reused():
    layouts, builds = LayoutPerForward(), []
    for _forward in range(2):
        for layer_id in range(3):
            layouts.get(layer_id, lambda: builds.append(1) or len(builds))
    assert len(builds) == 2


def _layer(layer_id, heads=4, kv_heads=2, head_dim=16, sliding_window_size=None):
    return SimpleNamespace(layer_id=layer_id, tp_q_head_num=heads, tp_k_head_num=kv_heads, qk_head_dim=head_dim,
                           v_head_dim=head_dim, is_cross_attention=False, sliding_window_size=sliding_window_size,
                           scaling=head_dim**-0.5)


def _decode_batch(req_to_token, pool_rows, seq_lens):
    return SimpleNamespace(req_pool_indices=torch.tensor(pool_rows), seq_lens=torch.tensor(seq_lens),
                           seq_lens_cpu=torch.tensor(seq_lens), encoder_lens=None,
                           out_cache_loc=torch.stack([req_to_token[r, n - 1] for r, n in zip(pool_rows, seq_lens)]).long())


@pytest.mark.skipif(not vector_isa_supported(), reason="the kernel needs AVX-512F or AVX2 + FMA, which this CPU lacks")
def test_the_decode_hook_writes_the_new_kv_and_attends_over_each_whole_sequence(monkeypatch):
    monkeypatch.delenv("DSPARK_CPU_ATTENTION", raising=False)
    cpu_attention.kernel_enabled.cache_clear()
    k_cache, v_cache, req_to_token = _cache(torch.float32, 2, 16)
    backend = SimpleNamespace(token_to_kv_pool=FakeKVPool(k_cache, v_cache),
                              req_to_token_pool=SimpleNamespace(req_to_token=req_to_token))
    batch = _decode_batch(req_to_token, [1, 3], [40, 7])
    q, k, v = torch.randn(2, 4 * 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)

    def sglang_decode(*args, **kwargs):
        pytest.fail("a layer the kernel serves went to SGLang's decode")

    out = cpu_attention.around_forward_decode(sglang_decode, backend, q, k, v, _layer(0), batch)
    assert torch.equal(k_cache[batch.out_cache_loc], k) and torch.equal(v_cache[batch.out_cache_loc], v)
    want = _reference(q.view(2, 4, 16), k_cache, v_cache, req_to_token, [(39, 1), (6, 1)], [1, 3], 16**-0.5)
    torch.testing.assert_close(out.double(), want.view(2, 64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["sliding_window", "sdpa_mode"])
def test_layers_or_settings_the_kernel_does_not_serve_keep_sglangs_decode(monkeypatch, case):
    if case == "sdpa_mode":
        monkeypatch.setenv("DSPARK_CPU_ATTENTION", "sdpa")
    cpu_attention.kernel_enabled.cache_clear()
    k_cache, v_cache, req_to_token = _cache(torch.float32, 2, 16)
    backend = SimpleNamespace(token_to_kv_pool=FakeKVPool(k_cache, v_cache),
                              req_to_token_pool=SimpleNamespace(req_to_token=req_to_token))
    layer = _layer(0, sliding_window_size=8 if case == "sliding_window" else None)
    calls = []
    cpu_attention.around_forward_decode(lambda *args, **kwargs: calls.append(args) or "sglang", backend,
                                        torch.randn(1, 64), None, None, layer, _decode_batch(req_to_token, [0], [5]))
    cpu_attention.kernel_enabled.cache_clear()
    assert len(calls) == 1


def test_a_bad_attention_setting_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv("DSPARK_CPU_ATTENTION", "flash")
    with pytest.raises(ValueError, match="expected one of kernel, sdpa"):
        cpu_attention.attention_mode()


def test_a_machine_that_cannot_build_the_kernel_keeps_sglangs_decode_and_says_why(monkeypatch, caplog):
    from sglang_dspark.kernels_cpu.build import KernelUnavailable

    def no_kernel():
        raise KernelUnavailable("the CPU has neither AVX-512F nor AVX2 with FMA")

    monkeypatch.setattr(cpu_attention, "load_attention_kernel", no_kernel)
    cpu_attention.kernel_enabled.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert not cpu_attention.kernel_enabled()
    finally:
        cpu_attention.kernel_enabled.cache_clear()
    assert "no paged attention kernel" in caplog.text and "neither AVX-512F nor AVX2" in caplog.text


def test_the_attention_benchmark_times_both_paths_for_every_context_and_window():
    from sglang_dspark.kernels_cpu.attention_bench import time_attention

    timings = time_attention([5, 40], [1, 3], "bfloat16", layers=2, heads=4, kv_heads=2, head_dim=16, repeats=2)
    assert [(t.context, t.window) for t in timings] == [(5, 1), (5, 3), (40, 1), (40, 3)]
    assert all(t.sdpa_ms > 0 and t.kernel_ms > 0 for t in timings)
    assert timings[0].to_json()["speedup"] == round(timings[0].sdpa_ms / timings[0].kernel_ms, 3)


def test_dspark_ctl_bench_attention_refuses_an_unknown_dtype_or_window():
    from typer.testing import CliRunner

    from dspark_ctl.cli import app

    for arguments, message in ((["--dtype", "float16"], "dtype must be float32 or bfloat16"),
                               (["--windows", "0"], "must list integers >= 1"),
                               (["--contexts", "2k"], "must be comma-separated integers")):
        result = CliRunner().invoke(app, ["bench", "attention", *arguments])
        assert result.exit_code == 2, result.output
        assert message in result.output


def _extend_batch(req_to_token, pool_rows, spans, mode="EXTEND", host_lists=True):
    return SimpleNamespace(
        forward_mode=SimpleNamespace(name=mode), req_pool_indices=torch.tensor(pool_rows), encoder_lens=None,
        extend_prefix_lens_cpu=[p for p, _ in spans] if host_lists else None,
        extend_seq_lens_cpu=[w for _, w in spans] if host_lists else None,
        out_cache_loc=torch.cat([req_to_token[r, p:p + w] for r, (p, w) in zip(pool_rows, spans)]).long())


@pytest.mark.skipif(not vector_isa_supported(), reason="the kernel needs AVX-512F or AVX2 + FMA, which this CPU lacks")
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_prefill_hook_writes_the_new_kv_and_attends_each_prompt_over_its_cached_prefix(monkeypatch, dtype, tolerance):
    """A radix hit (40 cached tokens + 1), a fresh prompt and a chunk after a cached prefix in one
    extend: each new token sees the prefix and the new tokens up to itself."""
    monkeypatch.delenv("DSPARK_CPU_ATTENTION", raising=False)
    cpu_attention.kernel_enabled.cache_clear()
    k_cache, v_cache, req_to_token = _cache(dtype, 2, 16)
    backend = SimpleNamespace(token_to_kv_pool=FakeKVPool(k_cache, v_cache),
                              req_to_token_pool=SimpleNamespace(req_to_token=req_to_token))
    spans, pool_rows = [(40, 1), (0, 6), (12, 3)], [1, 3, 0]
    batch = _extend_batch(req_to_token, pool_rows, spans)
    q, k, v = (torch.randn(10, 4 * 16).to(dtype), torch.randn(10, 2, 16).to(dtype), torch.randn(10, 2, 16).to(dtype))

    def sglang_extend(*args, **kwargs):
        pytest.fail("a prefill the kernel serves went to SGLang's extend")

    out = cpu_attention.around_forward_extend(sglang_extend, backend, q, k, v, _layer(0), batch)
    assert torch.equal(k_cache[batch.out_cache_loc], k) and torch.equal(v_cache[batch.out_cache_loc], v)
    want = _reference(q.view(10, 4, 16), k_cache, v_cache, req_to_token, spans, pool_rows, 16**-0.5)
    torch.testing.assert_close(out.double(), want.view(10, 64), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("case", ["long_fresh_prompt", "verify", "no_host_lists", "sliding_window", "sdpa_mode"])
def test_prefills_the_kernel_does_not_win_or_serve_keep_sglangs_extend(monkeypatch, case):
    monkeypatch.delenv("DSPARK_CPU_ATTENTION", raising=False)
    if case == "sdpa_mode":
        monkeypatch.setenv("DSPARK_CPU_ATTENTION", "sdpa")
    cpu_attention.kernel_enabled.cache_clear()
    k_cache, v_cache, req_to_token = _cache(torch.float32, 2, 16, rows=4096)
    req_to_token = torch.randperm(4095)[:2 * 2000].add(1).to(torch.int32).view(2, 2000)
    backend = SimpleNamespace(token_to_kv_pool=FakeKVPool(k_cache, v_cache),
                              req_to_token_pool=SimpleNamespace(req_to_token=req_to_token))
    # a fresh prompt past KERNEL_EXTEND_MAX_FRESH_WINDOW beside a radix hit: the whole forward keeps SDPA
    spans = [(0, 1100), (30, 1)] if case == "long_fresh_prompt" else [(30, 2)]
    batch = _extend_batch(req_to_token, [0, 1][:len(spans)], spans, mode="TARGET_VERIFY" if case == "verify" else "EXTEND",
                          host_lists=case != "no_host_lists")
    rows = sum(w for _, w in spans)
    calls = []
    cpu_attention.around_forward_extend(lambda *args, **kwargs: calls.append(args) or "sglang", backend,
                                        torch.randn(rows, 64), None, None,
                                        _layer(0, sliding_window_size=8 if case == "sliding_window" else None), batch)
    cpu_attention.kernel_enabled.cache_clear()
    assert len(calls) == 1


def test_a_long_new_chunk_after_a_longer_cached_prefix_still_goes_to_the_kernel():
    """SDPA pads the queries to prefix + window, so past a prefix as long as the window the kernel wins at any length."""
    assert cpu_attention.kernel_serves_extend([(0, 1024), (5000, 1), (2000, 1500)])
    assert not cpu_attention.kernel_serves_extend([(0, 1025)])
    assert not cpu_attention.kernel_serves_extend([(1000, 1500), (3, 1)])
