"""The plugin's pure-torch `sgl_kernel` stand-in and DSPARK_LIVE registration."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from sglang_dspark.kernels_cpu import build
from sglang_dspark.kernels_cpu.build import vector_isa_supported
from sglang_dspark.kernels_cpu.ops import assign_req_to_token_pool_cpu, copy_all_layer_kv_cache_cpu


def test_assign_req_to_token_pool_writes_each_requests_slots_at_its_offsets():
    req_to_token = torch.zeros((4, 10), dtype=torch.int32)
    out_cache_loc = torch.tensor([11, 12, 13, 21, 31, 32], dtype=torch.int64)
    assign_req_to_token_pool_cpu(torch.tensor([2, 0, 3]), req_to_token, torch.tensor([4, 0, 7]),
                                 torch.tensor([7, 1, 9]), out_cache_loc, 10)
    assert req_to_token[2, 4:7].tolist() == [11, 12, 13]
    assert req_to_token[0, 0:1].tolist() == [21]
    assert req_to_token[3, 7:9].tolist() == [31, 32]
    assert int(req_to_token.count_nonzero()) == 6


def test_copy_all_layer_kv_cache_moves_rows_in_every_buffer_even_when_they_overlap():
    layers = [torch.arange(40, dtype=torch.float32).reshape(10, 4) + 100 * i for i in range(2)]
    before = [layer.clone() for layer in layers]
    data_ptrs = torch.tensor([layer.data_ptr() for layer in layers], dtype=torch.uint64)
    strides = torch.tensor([layer.stride(0) * layer.element_size() for layer in layers], dtype=torch.int64)
    # 1->2 and 2->3 overlap: row 3 must receive the *old* row 2
    copy_all_layer_kv_cache_cpu(data_ptrs, strides, torch.tensor([2, 3, 7]), torch.tensor([1, 2, 0]))
    for layer, old in zip(layers, before):
        torch.testing.assert_close(layer[2], old[1])
        torch.testing.assert_close(layer[3], old[2])
        torch.testing.assert_close(layer[7], old[0])
        torch.testing.assert_close(layer[[0, 1, 4, 5, 6, 8, 9]], old[[0, 1, 4, 5, 6, 8, 9]])


def test_plugin_installs_the_standin_and_registers_dspark_live_in_a_fresh_process():
    """What SGLang's plugin loader does in each process, without a server."""
    script = textwrap.dedent("""
        import sys
        from sglang_dspark.plugin import register
        register()
        import sgl_kernel
        from sgl_kernel.kvcacheio import copy_all_layer_kv_cache_cpu
        from sgl_kernel import assign_req_to_token_pool_cpu, verify_tree_greedy_cpu
        assert sgl_kernel.IS_DSPARK_STANDIN
        assert copy_all_layer_kv_cache_cpu.__module__ == "sglang_dspark.kernels_cpu.ops"
        try:
            verify_tree_greedy_cpu()
        except NotImplementedError as error:
            assert "stand-in does not implement" in str(error)
        else:
            raise AssertionError("a missing kernel did not raise")
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        algo = SpeculativeAlgorithm.from_string("DSPARK_LIVE")
        assert algo.supports_overlap and not algo.need_topk() and not algo.carries_draft_hidden_states()
        register()  # idempotent, as SGLang may call it again
        print("OK", sys.path[0].endswith("shadow"))
    """)
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "DSPARK_CPU_KERNELS": "auto"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("OK True")


class UnquantizedLinearMethod:  # the name the re-layout keys on (SGLang's class is not imported here)
    calls = 0

    def apply(self, layer, x, bias=None):
        self.calls += 1
        return F.linear(x, layer.weight, bias)

    def embedding(self, layer, ids):
        return F.embedding(ids, layer.weight)


def _linear(out_features: int, in_features: int, dtype=torch.float32) -> torch.nn.Module:
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.randn(out_features, in_features, dtype=dtype), requires_grad=False)
    module.quant_method = UnquantizedLinearMethod()
    return module


def test_gemm_relayout_keeps_every_linear_output_and_skips_what_it_must():
    """Column-major storage changes only the memory layout: same shapes, same F.linear results;
    bf16 weights and an untied input embedding are left alone, a tied lm_head is done once."""
    from sglang_dspark.kernels_cpu.gemm_layout import relayout_weights

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.qkv, model.down, model.bf16 = _linear(24, 8), _linear(8, 16), _linear(8, 8, torch.bfloat16)
    model.embed = torch.nn.Embedding(32, 8)
    model.lm_head = model.embed  # tied
    model.other_embed = torch.nn.Embedding(32, 8)
    x8, x16 = torch.randn(5, 8), torch.randn(5, 16)
    before = [F.linear(x8, model.qkv.weight), F.linear(x16, model.down.weight), F.linear(x8, model.lm_head.weight)]
    assert relayout_weights(model) == 3
    after = [F.linear(x8, model.qkv.weight), F.linear(x16, model.down.weight), F.linear(x8, model.lm_head.weight)]
    for old, new in zip(before, after):
        torch.testing.assert_close(new, old)
    assert model.qkv.weight.shape == (24, 8) and model.qkv.weight.stride() == (1, 24)
    assert model.bf16.weight.is_contiguous() and model.other_embed.weight.is_contiguous()
    assert relayout_weights(model) == 0, "a second pass finds nothing left to do"


def test_a_bad_gemm_layout_knob_is_refused(monkeypatch):
    from sglang_dspark.kernels_cpu.gemm_layout import gemm_layout_mode

    monkeypatch.setenv("DSPARK_CPU_GEMM_LAYOUT", "packed")
    with pytest.raises(ValueError, match="expected one of auto, column, off"):
        gemm_layout_mode()


def _tiny_drafter_and_block():
    """A tiny 2-layer drafter and a function drafting one block from 10 tokens of its context."""
    from tests.tiny import make_tiny_drafter, make_tiny_target, tiny_taps

    target = make_tiny_target(seed=0)
    drafter = make_tiny_drafter(target, num_layers=2, gamma=4)
    ids = torch.randint(3, 400, (1, 12), generator=torch.Generator().manual_seed(0))
    taps = tiny_taps(target, ids)[0]

    def block() -> torch.Tensor:
        cache = drafter.new_cache(num_slots=1, capacity=16)
        drafter.append_context(cache, [0], taps[:10], [10])
        return drafter.forward_block(cache, [0], ids[0, 10:11])

    return drafter, block


def test_a_column_major_drafter_drafts_the_same_blocks():
    """The worker re-lays out the drafter's linears on CPU: only strides change, not its blocks."""
    from sglang_dspark.kernels_cpu.gemm_layout import relayout_linears

    drafter, block = _tiny_drafter_and_block()
    before = block()
    linears = [m for m in drafter.modules() if isinstance(m, torch.nn.Linear)]
    row_major = sum(1 for m in linears if not m.weight.t().is_contiguous())
    assert row_major > 0 and relayout_linears(drafter) == row_major
    assert all(m.weight.t().is_contiguous() for m in linears) and relayout_linears(drafter) == 0
    torch.testing.assert_close(block(), before)


def test_a_drafter_with_panel_linears_drafts_the_same_blocks_and_keeps_its_parameters():
    """The worker gives the drafter's linears weight panels for small inputs: same parameters and
    state_dict, blocks equal up to summation order, and inputs outside the row range still take
    the BLAS."""
    from sglang_dspark.kernels_cpu.gemm_layout import PanelLinear, add_linear_panels

    drafter, block = _tiny_drafter_and_block()
    before, keys = block(), set(drafter.state_dict())
    linears = [m for m in drafter.modules() if type(m) is torch.nn.Linear]
    assert add_linear_panels(drafter, rows=range(1, 11)) == len(linears) > 0
    assert not any(type(m) is torch.nn.Linear for m in drafter.modules()), "a second pass finds none left"
    assert set(drafter.state_dict()) == keys
    panel = next(m for m in drafter.modules() if isinstance(m, PanelLinear))
    calls = []
    panel.panels = _CountingPanels(panel.panels, calls)
    torch.testing.assert_close(block(), before, rtol=1e-4, atol=1e-4)  # 10 context rows, 4 block rows: panels
    assert calls, "inputs of 1-10 rows went through the panels"
    calls.clear()
    wide = torch.randn(12, panel.in_features)
    torch.testing.assert_close(panel(wide), F.linear(wide, panel.weight, panel.bias))
    assert not calls, "12 rows are outside the range: the BLAS serves them"


class _CountingPanels(torch.Tensor):
    """The same panels, noting each time the kernel reads them (`data_ptr`)."""

    @staticmethod
    def __new__(cls, panels: torch.Tensor, calls: list):
        view = panels.as_subclass(cls)
        view.calls = calls
        return view

    def data_ptr(self) -> int:
        self.calls.append(1)
        return super().data_ptr()


def test_the_drafter_takes_the_panels_where_they_are_faster_on_this_cpu():
    from sglang_dspark.kernels_cpu.gemm_layout import fastest_panel_rows

    assert fastest_panel_rows(torch.bfloat16, {"avx512f", "avx512_bf16"})[-1] > 10**6
    assert fastest_panel_rows(torch.bfloat16, {"avx512f", "amx_bf16"}, tiles=False) == range(1, 16), \
        "oneDNN on the tiles beats panels without them from 16 rows"
    assert fastest_panel_rows(torch.bfloat16, {"avx512f", "amx_bf16"}, tiles=True)[-1] > 10**6, "panels on the tiles win"
    assert fastest_panel_rows(torch.float32, {"avx512f", "amx_bf16"}, tiles=True) == range(2, 33), \
        "AMX does not multiply float32"


@pytest.fixture(params=["avx512", "amx", "dpbf16"])
def panel_layout(request, monkeypatch):
    """Each bfloat16 panel kernel this CPU can run: widening in AVX-512 (or AVX2) registers, the
    AMX tiles, or VDPBF16PS (the last two on pairs of inputs per column)."""
    from sglang_dspark.kernels_cpu import panel_gemm

    monkeypatch.setenv("DSPARK_CPU_AMX", "auto" if request.param == "amx" else "off")
    monkeypatch.setenv("DSPARK_CPU_DPBF16", "auto" if request.param == "dpbf16" else "off")
    panel_gemm.amx_panels.cache_clear()
    panel_gemm.dpbf16_panels.cache_clear()
    if request.param == "amx" and not panel_gemm.amx_panels():
        pytest.skip("no AMX tiles on this CPU")
    if request.param == "dpbf16" and not panel_gemm.dpbf16_panels():
        pytest.skip("no AVX512-BF16 on this CPU")
    yield request.param
    panel_gemm.amx_panels.cache_clear()
    panel_gemm.dpbf16_panels.cache_clear()


def test_the_panel_row_range_comes_from_the_knob_with_a_default_per_dtype(monkeypatch):
    from sglang_dspark.kernels_cpu.gemm_layout import panel_rows_setting

    assert panel_rows_setting(torch.float32) == range(2, 33)
    assert panel_rows_setting(torch.bfloat16)[0] == 1 and 10**6 in panel_rows_setting(torch.bfloat16), (
        "the target takes panels at every bf16 row count, AMX or not: only they are batch-invariant")
    monkeypatch.setenv("DSPARK_CPU_PANEL_ROWS", " 1-8 ")
    assert panel_rows_setting(torch.float32) == range(1, 9)
    monkeypatch.setenv("DSPARK_CPU_PANEL_ROWS", "4-")
    assert 4 in panel_rows_setting(torch.float32) and 3 not in panel_rows_setting(torch.float32)
    monkeypatch.setenv("DSPARK_CPU_PANEL_ROWS", "")
    assert not panel_rows_setting(torch.float32)
    for bad in ("two", "0-8", "8-2", "2,3", "4", "-4"):
        monkeypatch.setenv("DSPARK_CPU_PANEL_ROWS", bad)
        with pytest.raises(ValueError, match="expected a row range LO-HI"):
            panel_rows_setting(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panels_multiply_like_the_blas_and_each_row_alone_gives_the_same_bits(dtype, panel_layout):
    """The kernel equals F.linear (up to summation order) for odd sizes and any row count, and a
    row's result does not depend on the rows beside it: a verify window's linears reproduce the
    one-token decode's bit for bit. On the AMX tiles (16 rows a pass) and by VDPBF16PS (8) too,
    bf16 weights only."""
    from sglang_dspark.kernels_cpu.panel_gemm import pack_panels, panel_linear

    pairs = panel_layout in ("amx", "dpbf16")
    if dtype == torch.float32 and pairs:
        pytest.skip("pair panels multiply bfloat16 only")
    torch.manual_seed(0)
    # 77 outputs: not a multiple of the 32-column panel; inputs: 45, or for pair panels, which the
    # tiles step over 32 inputs at a time, 64 (a bf16 weight of 45 inputs keeps the widening panels)
    in_features = 64 if pairs else 45
    weight = torch.randn(77, in_features).to(dtype)
    panels = pack_panels(weight)
    expected = (3, 32, 32, 2) if pairs else (3, 45, 32)  # pairs of inputs per column
    assert panels.shape == expected and panels.dtype == dtype
    assert pack_panels(torch.randn(77, 45).to(dtype)).shape == (3, 45, 32)
    # 18 rows: three passes of 8 (AVX-512, VDPBF16PS), two of 16 (AMX), or with AVX2 three of 6 over each half
    # panel; 9 rows (below) take AVX2's whole-panel passes of 4
    x = torch.randn(2, 9, in_features).to(dtype)
    out = panel_linear(x, panels, 77)
    assert out.shape == (2, 9, 77) and out.dtype == dtype
    reference = F.linear(x.float(), weight.float())
    tolerance = 1e-4 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(out.float(), reference, rtol=tolerance, atol=tolerance)
    assert torch.equal(panel_linear(x[1], panels, 77), out[1])
    alone = torch.stack([torch.stack([panel_linear(x[i, j:j + 1], panels, 77)[0] for j in range(9)]) for i in range(2)])
    assert torch.equal(alone, out)
    with pytest.raises(ValueError, match="do not fit panels"):
        panel_linear(torch.randn(3, in_features - 1).to(dtype), panels, 77)
    if pairs:
        with pytest.raises(ValueError, match="do not fit panels"):
            panel_linear(x.float(), panels, 77)


def test_bfloat16_panels_round_to_nearest_even_and_keep_nan():
    from sglang_dspark.kernels_cpu.panel_gemm import pack_panels, panel_linear

    weight = torch.ones(3, 1, dtype=torch.bfloat16)
    # 1 + 2^-8 lies halfway between two bf16 values: ties go to the even one (1.0); just above rounds up
    x = torch.tensor([[1 + 2**-8], [1 + 2**-8 + 2**-12], [float("nan")]], dtype=torch.float32)
    out = panel_linear(x.bfloat16(), pack_panels(weight), 3)  # x itself rounds when cast to bf16
    torch.testing.assert_close(out, F.linear(x.bfloat16(), weight), equal_nan=True)
    float_out = panel_linear(x, pack_panels(weight.float()), 3).to(torch.bfloat16)
    assert float_out[0, 0].item() == 1.0 and float_out[1, 0].item() > 1.0 and float_out[2].isnan().all()


def _hybrid_model() -> torch.nn.Module:
    from sglang_dspark.kernels_cpu.gemm_layout import relayout_weights

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.qkv, model.down, model.lm_head = _linear(24, 8), _linear(8, 16), _linear(32, 8)  # lm_head also embeds
    relayout_weights(model)
    return model


def test_panels_serve_the_rows_in_range_with_the_same_values():
    """Rows in range run on the panels, others on the column-major weight as before; the outputs
    equal the plain product, and a tied lm_head still embeds through its own method."""
    from sglang_dspark.kernels_cpu.gemm_layout import PanelLayouts, add_panels

    model = _hybrid_model()
    assert add_panels(model, range(2, 4), available_bytes=2**30) == 3
    for module in (model.qkv, model.down, model.lm_head):
        method = module.quant_method
        assert isinstance(method, PanelLayouts) and method.rows == range(2, 4)
        assert module.weight.t().is_contiguous(), "the BLAS keeps its column-major weight"
        for rows in (1, 2, 3, 4, 7):
            x = torch.randn(rows, module.weight.shape[1])
            before = method.inner.calls
            torch.testing.assert_close(method.apply(module, x), F.linear(x, module.weight))
            assert method.inner.calls == before + (rows not in (2, 3))
    bias = torch.randn(24)
    x = torch.randn(2, 8)
    torch.testing.assert_close(model.qkv.quant_method.apply(model.qkv, x, bias), F.linear(x, model.qkv.weight, bias))
    ids = torch.tensor([1, 5])
    torch.testing.assert_close(model.lm_head.quant_method.embedding(model.lm_head, ids), model.lm_head.weight[ids])
    assert add_panels(model, range(2, 4), available_bytes=2**30) == 0, "done once"


def test_no_panels_when_they_would_not_fit_or_no_rows_are_asked_for():
    from sglang_dspark.kernels_cpu.gemm_layout import add_panels

    model = _hybrid_model()
    weights = sum(m.weight.numel() * 4 for m in (model.qkv, model.down, model.lm_head))
    assert add_panels(model, range(2, 4), available_bytes=4 * weights - 4) == 0
    assert add_panels(model, range(0), available_bytes=2**30) == 0
    assert all(type(m.quant_method).__name__ == "UnquantizedLinearMethod" for m in (model.qkv, model.down, model.lm_head))


def test_a_machine_that_cannot_build_the_kernel_keeps_the_blas_layout_and_says_why(monkeypatch, caplog):
    from sglang_dspark.kernels_cpu import gemm_layout
    from sglang_dspark.kernels_cpu.panel_gemm import PanelKernelUnavailable

    def no_kernel():
        raise PanelKernelUnavailable("no C++ compiler found (install g++ or set CXX)")

    monkeypatch.setattr(gemm_layout, "load_kernel", no_kernel)
    model = _hybrid_model()
    runner = type("Runner", (), {"device": "cpu", "model": model})()
    with caplog.at_level("WARNING", logger=gemm_layout.__name__):
        gemm_layout.after_load_model(None, runner)
    assert "no weight panels, small batches use the BLAS (slower): no C++ compiler found" in caplog.text
    assert all(type(m.quant_method).__name__ == "UnquantizedLinearMethod" for m in (model.qkv, model.down, model.lm_head))
    x = torch.randn(3, 8)
    torch.testing.assert_close(model.qkv.quant_method.apply(model.qkv, x), x @ model.qkv.weight.t())


def test_pack_panels_refuses_what_the_kernel_cannot_read():
    from sglang_dspark.kernels_cpu.panel_gemm import pack_panels

    for bad in (torch.randn(4), torch.randn(4, 4, dtype=torch.float64), torch.randn(2, 2, 2)):
        with pytest.raises(ValueError, match="needs a 2-D float32 or bfloat16 CPU weight"):
            pack_panels(bad)


@pytest.mark.skipif(not vector_isa_supported(), reason="the kernel needs AVX-512F or AVX2 + FMA, which this CPU lacks")
def test_a_fresh_cache_builds_the_kernel_once_and_reuses_it(tmp_path):
    """What a new machine does on the first server start: compile into $DSPARK_CACHE/kernels/,
    then load the same library in the next process without compiling again."""
    script = textwrap.dedent("""
        import time, torch
        from sglang_dspark.kernels_cpu.panel_gemm import pack_panels, panel_linear
        weight, x = torch.randn(40, 24), torch.randn(3, 24)
        torch.testing.assert_close(panel_linear(x, pack_panels(weight), 40), x @ weight.t())
        print("OK")
    """)
    env = {**os.environ, "DSPARK_CACHE": str(tmp_path)}

    def run_and_find_library():
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip() == "OK"
        libraries = list((tmp_path / "kernels").glob("panel_gemm-*.so"))
        assert len(libraries) == 1, libraries
        return libraries[0], libraries[0].stat().st_mtime_ns

    first = run_and_find_library()
    assert run_and_find_library() == first, "the second process rebuilt the kernel"
    assert not [p for p in (tmp_path / "kernels").iterdir() if p.is_dir()], "a scratch build folder was left behind"


def test_the_gemm_benchmark_times_both_paths_for_every_row_count():
    from sglang_dspark.kernels_cpu.gemm_bench import time_linears

    timings = time_linears([1, 3], "bfloat16", layer_shapes=((16, 40), (40, 16)), layers=2, head=(16, 70),
                           repeats=2)
    assert [t.rows for t in timings] == [1, 3]
    assert all(t.blas_ms > 0 and t.panels_ms > 0 for t in timings)
    assert timings[0].to_json()["speedup"] == round(timings[0].blas_ms / timings[0].panels_ms, 3)


def test_dspark_ctl_bench_gemm_refuses_an_unknown_dtype_or_row_count():
    from typer.testing import CliRunner

    from dspark_ctl.cli import app

    for arguments, message in ((["--dtype", "float16"], "dtype must be float32 or bfloat16"),
                               (["--rows", "1,zero"], "must be comma-separated integers")):
        result = CliRunner().invoke(app, ["bench", "gemm", *arguments])
        assert result.exit_code == 2, result.output
        assert message in result.output


def test_the_kernels_need_avx512f_or_avx2_with_fma():
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the kernels are x86-64 only")
    assert vector_isa_supported({"avx512f"}) and vector_isa_supported({"avx2", "fma", "sse4_2"})
    assert not vector_isa_supported({"avx2"}), "AVX2 without FMA cannot run the kernels' fused multiply-adds"
    assert not vector_isa_supported({"avx", "sse4_2"})
    assert build.vector_isa({"avx512f", "avx2", "fma"}) == "avx512" and build.vector_isa({"avx2", "fma"}) == "avx2"


@pytest.mark.parametrize("march", ["haswell", "skylake-avx512"])
def test_every_kernel_source_compiles_for_both_vector_isas(march):
    """`simd16.h` gives each kernel an AVX-512 and an AVX2 build, and a machine only builds the one
    it runs: the other must still compile, wherever the suite runs."""
    compiler = os.environ.get("CXX") or shutil.which("g++")
    if compiler is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs g++ on x86-64")
    sources = sorted((Path(build.__file__).parent).glob("*.cpp"))
    assert len(sources) >= 5
    for source in sources:
        result = subprocess.run([compiler, "-fsyntax-only", f"-march={march}", "-fopenmp", str(source)],
                                capture_output=True, text=True)
        assert result.returncode == 0, f"{source.name} for {march}: {result.stderr[:2000]}"


def _smaps_fields(start: int, end: int) -> dict[str, int]:
    """AnonHugePages (kB, summed) and THPeligible (the least) of this process's mappings that
    overlap [start, end)."""
    fields, overlaps = {"AnonHugePages:": 0, "THPeligible:": 1}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            overlaps = low < end and start < high
        elif overlaps and head == "AnonHugePages:":
            fields[head] += int(line.split()[1])
        elif overlaps and head == "THPeligible:":
            fields[head] = min(fields[head], int(line.split()[1]))
    return {key.rstrip(":"): value for key, value in fields.items()}


def _thp_fault_fallbacks() -> int:
    """Page faults in madvised memory that the kernel served with 4 KB pages (none free in 2 MB)."""
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("thp_fault_fallback "):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(not vector_isa_supported(), reason="the kernel needs AVX-512F or AVX2 + FMA, which this CPU lacks")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_panels_in_one_block_hold_what_each_packed_alone_holds(dtype):
    """`pack_all_panels` (how the plugin packs a model) gives every weight the panels
    `pack_panels` gives it alone, each one its own contiguous tensor, aligned, none overlapping."""
    from sglang_dspark.kernels_cpu.panel_gemm import PANEL_ALIGN_BYTES, pack_all_panels, pack_panels, panel_linear

    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=generator).to(dtype) for n, k in ((77, 64), (32, 96), (1000, 64))]
    packed = pack_all_panels(weights)
    for weight, panels in zip(weights, packed):
        assert torch.equal(panels, pack_panels(weight)) and panels.is_contiguous()
        assert panels.data_ptr() % PANEL_ALIGN_BYTES == 0
        x = torch.randn(3, weight.shape[1], generator=generator).to(dtype)
        assert torch.equal(panel_linear(x, panels, weight.shape[0]), panel_linear(x, pack_panels(weight), weight.shape[0]))
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in packed)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    with pytest.raises(ValueError, match="must be contiguous"):
        pack_panels(weights[0], out=torch.empty(packed[1].shape, dtype=dtype))


def test_huge_page_memory_is_2mb_aligned_and_backed_by_2mb_pages_where_linux_allows(monkeypatch):
    """Where the kernel's transparent huge pages are `always` or `madvise`, `huge_pages.empty`
    hands out memory that the kernel backs with 2 MB pages once written (the weight panels stream
    through it every step); `DSPARK_CPU_HUGE_PAGES=off` and a bad value behave as documented."""
    from sglang_dspark.kernels_cpu import huge_pages

    monkeypatch.setenv("DSPARK_CPU_HUGE_PAGES", "sometimes")
    huge_pages.unavailable_reason.cache_clear()
    with pytest.raises(ValueError, match="DSPARK_CPU_HUGE_PAGES='sometimes': expected one of auto, off"):
        huge_pages.empty(8 << 20)
    monkeypatch.setenv("DSPARK_CPU_HUGE_PAGES", "off")
    huge_pages.unavailable_reason.cache_clear()
    assert huge_pages.unavailable_reason() == "off" and huge_pages.empty(5).shape == (5,)
    monkeypatch.delenv("DSPARK_CPU_HUGE_PAGES")
    huge_pages.unavailable_reason.cache_clear()
    try:
        if huge_pages.transparent_huge_pages() not in ("always", "madvise"):
            pytest.skip(f"transparent huge pages are {huge_pages.transparent_huge_pages()} on this kernel")
        assert huge_pages.unavailable_reason() is None
        block = huge_pages.empty(8 << 20)
        assert block.shape == (8 << 20,) and block.dtype == torch.uint8
        assert block.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
        fallbacks = _thp_fault_fallbacks()
        block.fill_(1)  # first touch: the kernel backs it now
        start = block.data_ptr()
        smaps = _smaps_fields(start, start + block.numel())
        assert smaps["THPeligible"] == 1, "the block is not marked for 2 MB pages"
        # with memory too fragmented for a 2 MB page the kernel serves 4 KB pages and counts a
        # fallback (the full test suite hit that); otherwise the written block must be huge pages
        if _thp_fault_fallbacks() == fallbacks:
            assert smaps["AnonHugePages"] >= 2048, "the block was written but no 2 MB page backs it"
    finally:
        huge_pages.unavailable_reason.cache_clear()


def test_the_thp_mode_is_read_from_the_bracketed_word(tmp_path):
    from sglang_dspark.kernels_cpu.huge_pages import transparent_huge_pages

    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert transparent_huge_pages(setting) == "madvise"
    setting.write_text("always madvise [never]\n")
    assert transparent_huge_pages(setting) == "never"
    assert transparent_huge_pages(tmp_path / "missing") is None
