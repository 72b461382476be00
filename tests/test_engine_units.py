"""Fast unit tests of the engine pieces that do not need a server (verify attention, knobs, records)."""

from __future__ import annotations

import json

import pytest
import torch
from kv_fakes import FakeKVPool

from sglang_dspark import runtime
from sglang_dspark.engine import settings as settings_module
from sglang_dspark.engine.records import RequestStep, StepRecord, StepRecorder
from sglang_dspark.engine.requests import StopBan, min_new_tokens_bans
from sglang_dspark.engine.settings import SettingsError, load_settings
from sglang_dspark.engine.verify_attention import VerifyLayout, verify_attention
from sglang_dspark.engine.worker import _ban_stop_tokens


def _reference_attention(q, k, v, prefix_len, scale):
    """Full causal attention over the whole sequence, keeping the window rows (the O(L^2) way)."""
    total = k.shape[0]
    full_q = torch.zeros(total, *q.shape[1:])
    full_q[prefix_len:] = q
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", full_q, k) * scale
    scores = scores.masked_fill(torch.triu(torch.ones(total, total, dtype=torch.bool), 1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)[prefix_len:]


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 3), (6, 1)])
def test_verify_attention_equals_causal_attention_over_the_whole_sequence(heads, kv_heads):
    torch.manual_seed(0)
    dim, pool = 16, 64
    k_cache, v_cache = torch.randn(pool, kv_heads, dim), torch.randn(pool, kv_heads, dim)
    req_to_token = torch.randperm(pool - 1).add(1).reshape(3, 21)
    spans = [(7, 3), (0, 5), (15, 1)]
    q = torch.randn(sum(w for _, w in spans), heads, dim)
    layout = VerifyLayout.build(req_to_token, [2, 0, 1], spans, group=heads // kv_heads, dtype=q.dtype)
    out = verify_attention(q, k_cache, v_cache, layout, dim**-0.5)
    start = 0
    for row, (prefix, window) in zip([2, 0, 1], spans):
        slots = req_to_token[row, : prefix + window]
        want = _reference_attention(q[start : start + window], k_cache[slots], v_cache[slots], prefix, dim**-0.5)
        torch.testing.assert_close(out[start : start + window], want, rtol=1e-5, atol=1e-5)
        start += window


def test_each_verify_forward_builds_its_own_layout_and_its_layers_share_it():
    """The layout is built once per forward; a new forward (layer ids start again) must never
    reuse the last one's slots and masks, even when the ForwardBatch object is the same."""
    from types import SimpleNamespace

    from sglang_dspark.engine import verify_attention as va

    torch.manual_seed(0)
    heads, kv_heads, dim, pool = 4, 2, 8, 64
    k_cache, v_cache = torch.randn(pool, kv_heads, dim), torch.randn(pool, kv_heads, dim)
    req_to_token = torch.randperm(pool - 1).add(1).reshape(3, 21)
    backend = SimpleNamespace(token_to_kv_pool=FakeKVPool(k_cache, v_cache),
                              req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
                              forward_extend=lambda *args, **kwargs: pytest.fail("not a verify forward"))
    va.install(backend)
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_target_verify=lambda: True))
    layers = [SimpleNamespace(layer_id=i, tp_q_head_num=heads, tp_k_head_num=kv_heads, qk_head_dim=dim,
                              v_head_dim=dim, is_cross_attention=False, sliding_window_size=None,
                              scaling=dim**-0.5) for i in range(2)]
    builds = []
    real_build = va.VerifyLayout.build
    va.VerifyLayout.build = classmethod(lambda cls, *a, **kw: builds.append(a[2]) or real_build(*a, **kw))
    try:
        for pools, spans in (([2, 0], [(7, 3), (0, 5)]), ([1, 0], [(15, 1), (5, 2)])):
            batch.req_pool_indices = torch.tensor(pools)
            batch.extend_prefix_lens_cpu = [p for p, _ in spans]
            batch.extend_seq_lens_cpu = [w for _, w in spans]
            batch.out_cache_loc = torch.cat([req_to_token[r, p : p + w] for r, (p, w) in zip(pools, spans)])
            q = torch.randn(sum(w for _, w in spans), heads * dim)
            k, v = torch.randn(len(q), kv_heads, dim), torch.randn(len(q), kv_heads, dim)
            outs = [backend.forward_extend(q, k, v, layer, batch) for layer in layers]
            want = verify_attention(q.view(-1, heads, dim), k_cache, v_cache,
                                    real_build(req_to_token, pools, spans, group=2, dtype=q.dtype), dim**-0.5)
            for out in outs:
                torch.testing.assert_close(out, want.reshape(len(q), heads * dim))
    finally:
        va.VerifyLayout.build = real_build
    assert builds == [[(7, 3), (0, 5)], [(15, 1), (5, 2)]], "one build per forward"


def _draft_folder(tmp_path, block_size=4, confidence_head=True):
    config = {"block_size": block_size, "enable_confidence_head": confidence_head}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_settings_default_to_checkpoint_block_size_and_verify_all(tmp_path, monkeypatch):
    for name in ("DSPARK_GAMMA", "DSPARK_PLANNER", "DSPARK_SPS_PATH", "DSPARK_STS_PATH", "DSPARK_LOOKUP",
                 "DSPARK_GRAMMAR_STEERING", "DSPARK_TREE_NODES"):
        monkeypatch.delenv(name, raising=False)
    settings = load_settings(_draft_folder(tmp_path))
    assert (settings.gamma, settings.planner) == (4, "all")
    assert settings.lookup == "on", "every request may draft from its own text unless told otherwise"
    assert settings.grammar_steering, "constrained requests steer the drafter unless told otherwise"
    assert settings.tree_nodes == 9, "a lone greedy request verifies a tree of 2 x gamma + 1 drafts unless told otherwise"
    assert settings.verify_window == 10, "the verify window holds the bonus and the tree"
    monkeypatch.setenv("DSPARK_TREE_NODES", "0")
    assert load_settings(_draft_folder(tmp_path)).verify_window == 5, "without trees: the bonus and gamma drafts"
    monkeypatch.setenv("DSPARK_TREE_NODES", "2")
    assert load_settings(_draft_folder(tmp_path)).verify_window == 5, "a small tree fits the chain's window"
    monkeypatch.delenv("DSPARK_TREE_NODES")
    monkeypatch.setenv("DSPARK_GAMMA", "3")
    assert load_settings(_draft_folder(tmp_path)).tree_nodes == 0, "a block of 3 slots drafts a chain"
    monkeypatch.setenv("DSPARK_TREE_NODES", "64")
    with pytest.raises(SettingsError, match="DSPARK_TREE_NODES=64: expected an integer between 0 and 63"):
        load_settings(_draft_folder(tmp_path))
    monkeypatch.delenv("DSPARK_GAMMA")
    monkeypatch.delenv("DSPARK_TREE_NODES")
    monkeypatch.setenv("DSPARK_GRAMMAR_STEERING", "off")
    assert not load_settings(_draft_folder(tmp_path)).grammar_steering


def test_the_cost_model_for_the_served_dtype_wins_over_the_generic_one(tmp_path, monkeypatch):
    """A drafter folder may ship one SPS table per dtype (bf16 and fp32 steps differ in shape on a
    CPU without native bf16 math); the server picks the one for its --dtype, else sps.json, and an
    explicit DSPARK_SPS_PATH beats both."""
    for name in ("DSPARK_PLANNER", "DSPARK_SPS_PATH"):
        monkeypatch.delenv(name, raising=False)
    folder = _draft_folder(tmp_path)
    (folder / "sps.json").write_text("{}")
    (folder / "sps-bfloat16.json").write_text("{}")
    assert load_settings(folder, "bfloat16").sps_path == folder / "sps-bfloat16.json"
    assert load_settings(folder, "float32").sps_path == folder / "sps.json"
    assert load_settings(folder).sps_path == folder / "sps.json"
    assert load_settings(folder, "bfloat16").planner == "production"
    other = tmp_path / "other.json"
    other.write_text("{}")
    monkeypatch.setenv("DSPARK_SPS_PATH", str(other))
    assert load_settings(folder, "bfloat16").sps_path == other


@pytest.mark.parametrize("flags,tag", [("fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile", "amx"),
                                       ("avx2 avx512f avx512_bf16", "avx512bf16"), ("avx2 avx512f avx512bw", "avx512"),
                                       ("sse4_2 avx2 fma", "avx2"), ("sse4_2", None)])
def test_a_cpu_server_picks_the_cost_model_measured_on_its_instruction_set(tmp_path, monkeypatch, flags, tag):
    """Extra verify tokens cost differently on AVX2, AVX-512, AVX512-BF16 and AMX CPUs, so a folder may ship a
    table per instruction set; a CPU server takes its own, else the dtype's table; a CUDA server
    never takes a CPU one."""
    monkeypatch.delenv("DSPARK_SPS_PATH", raising=False)
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert runtime.cpu_profile_tag(cpuinfo) == tag
    monkeypatch.setattr(settings_module, "cpu_profile_tag", lambda: runtime.cpu_profile_tag(cpuinfo))
    folder = _draft_folder(tmp_path)
    for name in ("sps.json", "sps-bfloat16.json", "sps-bfloat16-avx2.json", "sps-bfloat16-amx.json",
                 "sps-bfloat16-avx512bf16.json"):
        (folder / name).write_text("{}")
    expected = {"amx": "sps-bfloat16-amx.json", "avx2": "sps-bfloat16-avx2.json",
                "avx512bf16": "sps-bfloat16-avx512bf16.json"}.get(tag, "sps-bfloat16.json")
    assert load_settings(folder, "bfloat16", "cpu").sps_path == folder / expected
    assert load_settings(folder, "bfloat16", "cuda").sps_path == folder / "sps-bfloat16.json"
    assert load_settings(folder, "float32", "cpu").sps_path == folder / "sps.json"


@pytest.mark.parametrize("name,value,message", [
    ("DSPARK_GAMMA", "9", "between 1 and 4"),
    ("DSPARK_GAMMA", "two", "expected an integer"),
    ("DSPARK_PLANNER", "greedy", "expected all, production, fixed:N or sweep"),
    ("DSPARK_PLANNER", "fixed:7", "0 <= N <= gamma=4"),
    ("DSPARK_PLANNER", "production", "needs a cost model"),
    ("DSPARK_VERIFY_ATTENTION", "flash", "expected linear or native"),
    ("DSPARK_DRAFT_DTYPE", "int8", "expected one of auto, float32, bfloat16, float16"),
    ("DSPARK_RECALIBRATE_EVERY", "10", "0 \\(never\\) or at least 64 rounds"),
    ("DSPARK_RECALIBRATE_EVERY", "-1", "expected an integer >= 0"),
    ("DSPARK_LOOKUP", "sampled", "expected one of on, greedy, off"),
    ("DSPARK_GRAMMAR_STEERING", "yes", "expected on or off"),
])
def test_bad_knobs_fail_with_what_was_expected(tmp_path, monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError, match=message):
        load_settings(_draft_folder(tmp_path))


def test_a_drafter_without_confidence_head_cannot_use_the_production_planner(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_PLANNER", "production")
    with pytest.raises(SettingsError, match="needs a drafter with a confidence head"):
        load_settings(_draft_folder(tmp_path, confidence_head=False))


@pytest.mark.parametrize("planner,drafts", [("all", 4), ("fixed:2", 2)])
def test_a_drafter_without_confidence_head_plans_without_survivals(tmp_path, monkeypatch, planner, drafts):
    """A DFlash drafter drafts no confidence logits; the step must still plan (it once crashed the server)."""
    from sglang_dspark.engine.planning import VerifyPlanner

    for name in ("DSPARK_GAMMA", "DSPARK_SPS_PATH", "DSPARK_STS_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DSPARK_PLANNER", planner)
    planner = VerifyPlanner(load_settings(_draft_folder(tmp_path, confidence_head=False)))
    plan = planner.plan(["a", "b"], None, torch.tensor([10, 20]))
    assert plan.verify_lens.tolist() == [drafts, drafts] and plan.survivals is None


def test_a_folder_without_config_is_not_a_drafter(tmp_path):
    with pytest.raises(SettingsError, match="no config.json"):
        load_settings(tmp_path)


def _record(step: int, batch: int, accepted: int) -> StepRecord:
    request = RequestStep(rid="r", slot=0, context_len=10, verify_len=4, accepted=accepted, temperature=0.0,
                          confidence_logits=[0.0] * 4, survivals=[0.5] * 4)
    return StepRecord(step=step, wall_time=0.0, batch_size=batch, capacity=None, verify_tokens=5 * batch,
                      accepted_tokens=accepted * batch, committed_tokens=(accepted + 1) * batch,
                      predicted_seconds=None, measured_seconds=0.01, draft_seconds=0.001, verify_seconds=0.005,
                      overlap=True, requests=[request] * batch)


def test_recorder_keeps_a_bounded_ring_but_totals_everything(tmp_path):
    log = tmp_path / "steps.jsonl"
    recorder = StepRecorder(max_records=3, log_path=log)
    for step in range(10):
        recorder.add(_record(step, batch=2, accepted=1))
    assert [r.step for r in recorder.last()] == [7, 8, 9]
    summary = recorder.summary()
    assert summary["decode_steps"] == 10 and summary["tau"] == 2.0
    lines = log.read_text().splitlines()
    assert len(lines) == 10
    logged = json.loads(lines[-1])  # every field, requests included, as the benchmarks read them
    assert logged["step"] == 9 and logged["committed_tokens"] == 4 and logged["measured_seconds"] == 0.01
    assert logged["requests"] == [{"rid": "r", "slot": 0, "context_len": 10, "verify_len": 4, "accepted": 1,
                                   "temperature": 0.0, "confidence_logits": [0.0] * 4, "survivals": [0.5] * 4,
                                   "lookup_drafts": 0, "lookup_match": 0, "tree_drafts": 0,
                                   "tree_gain": 0}] * 2


def test_verify_spans_come_from_the_extend_fields_of_a_verify_forward_only():
    from types import SimpleNamespace

    from sglang_dspark.engine.verify_attention import verify_spans

    class Mode:
        def __init__(self, verify):
            self.verify = verify

        def is_target_verify(self):
            return self.verify

    batch = SimpleNamespace(forward_mode=Mode(True), extend_prefix_lens_cpu=[7, 0], extend_seq_lens_cpu=[3, 5])
    assert verify_spans(batch) == [(7, 3), (0, 5)]
    batch.forward_mode = Mode(False)
    assert verify_spans(batch) is None


def test_production_planner_verifies_the_drafts_whose_survival_pays_for_them(tmp_path, monkeypatch):
    planner = _production_planner(tmp_path, monkeypatch)
    rids = ["a", "b", "c"]
    logits = torch.tensor([[6.0] * 7, [-6.0] * 7, [0.0] * 7])  # sure, hopeless, a coin flip each
    context = torch.tensor([100, 200, 300])
    first = planner.plan(rids, logits, context)
    assert first.capacity == 21, "before any history the whole block is drafted"
    for plan in [first] + [planner.plan(rids, logits, context) for _ in range(3)]:
        lens = plan.verify_lens.tolist()
        assert lens[0] == 7 and lens[1] == 0 and 0 < lens[2] < 7, lens
        assert plan.predicted_seconds > 0 and int(plan.verify_lens.sum()) <= plan.capacity


def test_draft_cost_tracker_learns_a_line_over_batch_size():
    from sglang_dspark.engine.planning import DraftCostTracker

    tracker = DraftCostTracker()
    assert tracker.estimate(8) == 0.0, "optimistic before any measurement, so the planner drafts"
    tracker.add(4, 0.010)
    assert tracker.estimate(2) == pytest.approx(0.010), "flat below the smallest measured size"
    tracker.add(8, 0.018)
    assert tracker.estimate(6) == pytest.approx(0.014)
    tracker.add(16, 0.034)
    assert tracker.estimate(12) == pytest.approx(0.026)


def test_draft_cost_tracker_grows_in_proportion_beyond_the_largest_measured_batch():
    """Measured at batch 1 only (10 ms), a flat estimate charged a first batch of 16 the same 10
    ms where it cost 50, and the planner drafted ~20 steps at 1.8x a skipped step's time."""
    from sglang_dspark.engine.planning import DraftCostTracker

    tracker = DraftCostTracker()
    tracker.add(1, 0.010)
    assert tracker.estimate(16) == pytest.approx(0.160)
    tracker.add(4, 0.016)  # line: 0.008 + 0.002 * size
    assert tracker.estimate(16) == pytest.approx(0.064), "the line's value at 4, times 16 / 4"
    tracker.add(16, 0.040)
    assert tracker.estimate(16) < 0.064, "a measurement there replaces the extrapolation"


def test_a_first_slow_walk_does_not_make_drafting_look_dear():
    """A server's first walks paid one-off costs (86-115 ms against 8 ms warm): a mean of the
    few samples so far would have charged drafting 3x its cost and turned it off."""
    from sglang_dspark.engine.planning import DraftCostTracker

    tracker = DraftCostTracker()
    for seconds in (0.110, 0.008, 0.009, 0.008):
        tracker.add(1, seconds)
    assert tracker.estimate(1) == pytest.approx(0.0085)
    tracker.add(16, 0.030)
    assert tracker.estimate(16) == pytest.approx(0.030, rel=0.05), "the line still follows the batch size"


def test_draft_cost_tracker_refits_each_young_size_at_once_and_a_full_window_every_8_samples(monkeypatch):
    """The fit runs on every decode step's estimate: redone after every sample it cost ~0.2 ms a
    drafted step (two trackers) for medians that a single sample barely moves."""
    from sglang_dspark.engine.planning import DraftCostTracker

    tracker = DraftCostTracker()
    fits = []
    line = tracker._line
    monkeypatch.setattr(tracker, "_line", lambda: fits.append(1) or line())
    for _ in range(40):
        tracker.add(4, 0.012)
        tracker.estimate(4)
    assert len(fits) == 8 + 4, "each of a size's first 8 samples, then every 8th"
    tracker.add(16, 0.050)
    assert tracker.estimate(16) == pytest.approx(0.050, rel=0.05), "a new batch size is fitted at once"
    for _ in range(7):
        tracker.add(4, 0.012)
        tracker.estimate(4)
    assert len(fits) == 8 + 4 + 1


def test_a_one_off_slow_draft_at_a_rarely_seen_batch_size_is_capped_by_larger_ones():
    """Under concurrency 4 the server's first draft (275 ms, one-off) was batch 1's only sample;
    the line through it and batch 4's 12 ms charged a wave's last request 245 ms per draft, so it
    never drafted. A smaller batch never costs more than a larger one."""
    from sglang_dspark.engine.planning import DraftCostTracker

    tracker = DraftCostTracker()
    tracker.add(1, 0.275)
    for _ in range(40):
        tracker.add(4, 0.012)
    assert tracker.estimate(1) <= 0.012
    assert tracker.estimate(4) == pytest.approx(0.012)


def test_draft_costs_charge_the_block_once_and_the_walk_per_slot():
    from sglang_dspark.engine.planning import DraftCosts

    costs = DraftCosts()
    costs.add(4, 7, block_seconds=0.004, walk_seconds=0.007)
    costs.add(4, 2, block_seconds=0.004, walk_seconds=0.002)
    assert costs.per_width(4, 3) == pytest.approx([0.0, 0.005, 0.006, 0.007])


def test_a_catch_up_after_skipped_steps_is_charged_per_token_not_per_drafting_step():
    """After 100 skipped steps a drafting step projected 400 rows of taps at once (40 ms): what
    drafting every step would cost is 4 rows' worth per step, not 40 ms."""
    from sglang_dspark.engine.planning import DraftCosts

    costs = DraftCosts()
    assert costs.catch_up_seconds(4) == 0.0, "nothing measured yet"
    costs.add(4, 7, block_seconds=0.004, walk_seconds=0.007)
    costs.add_catch_up(rows=400, seconds=0.040)
    assert costs.catch_up_seconds(4) == pytest.approx(0.0004)
    assert costs.per_width(4, 1) == pytest.approx([0.0, 0.004 + 0.0004 + 0.001])


def test_a_short_draft_width_walks_fewer_slots_and_verifies_within_them(tmp_path, monkeypatch):
    """A step that decided on 2 slots gets 2 columns of confidences; the plan keeps to them."""
    planner = _production_planner(tmp_path, monkeypatch)
    rids, context = ["a", "b"], torch.tensor([100, 100])
    from sglang_dspark.engine.planning import StepDecision

    plan = planner.plan(rids, torch.full((2, 2), 8.0), context, StepDecision(draft_width=2, capacity=6))
    assert plan.verify_lens.tolist() == [2, 2]
    assert plan.confidence_logits.shape == (2, 2) and plan.survivals.shape == (2, 2)


def _production_planner(tmp_path, monkeypatch):
    from pathlib import Path

    from sglang_dspark.engine.planning import VerifyPlanner

    profile = Path(__file__).resolve().parent.parent / "profiles" / "cpu-smollm2-135m-target-context.json"
    monkeypatch.setenv("DSPARK_SPS_PATH", str(profile))
    monkeypatch.setenv("DSPARK_PLANNER", "production")
    return VerifyPlanner(load_settings(_draft_folder(tmp_path, block_size=7)))


def test_production_planner_skips_a_drafter_that_costs_more_than_it_returns(tmp_path, monkeypatch):
    from sglang_dspark.engine.planning import EXPLORE_EVERY, StepDecision

    planner = _production_planner(tmp_path, monkeypatch)
    rids, context = ["a", "b"], torch.tensor([100, 100])
    hopeless = torch.full((2, 7), -8.0)
    for _ in range(3):
        planner.plan(rids, hopeless, context, StepDecision(draft_width=7, capacity=14))
    planner.draft_costs.add(2, 7, 1.0, 0.0)  # a drafter far slower than the target step
    decisions = [planner.decide(rids, context) for _ in range(2 * EXPLORE_EVERY)]
    skipped = [not d.draft for d in decisions]
    assert sum(skipped) >= 2 * EXPLORE_EVERY - 2, "drafts that cannot pay are not drafted"
    assert not all(skipped), "a probe draft still runs now and then"
    plan = planner.skipped(rids, context)
    assert plan.verify_lens.tolist() == [0, 0] and plan.predicted_seconds > 0


def test_production_planner_drafts_when_drafts_pay(tmp_path, monkeypatch):
    planner = _production_planner(tmp_path, monkeypatch)
    rids, context = ["a", "b"], torch.tensor([100, 100])
    sure = torch.full((2, 7), 8.0)
    for _ in range(3):
        planner.plan(rids, sure, context)
    planner.draft_costs.add(2, 7, 0.0005, 0.0005)
    decision = planner.decide(rids, context)
    assert decision.draft and decision.capacity > 0
    assert int(planner.plan(rids, sure, context, decision).verify_lens.sum()) == decision.capacity


def test_native_bf16_is_read_from_the_cpu_flags(tmp_path):
    from sglang_dspark.runtime import cpu_has_native_bf16

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw\n")
    assert not cpu_has_native_bf16(cpuinfo)
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_tile\n")
    assert cpu_has_native_bf16(cpuinfo)
    assert not cpu_has_native_bf16(tmp_path / "missing")


def test_sweep_planner_cycles_every_verify_width(tmp_path, monkeypatch):
    from sglang_dspark.engine.planning import VerifyPlanner

    monkeypatch.setenv("DSPARK_PLANNER", "sweep")
    planner = VerifyPlanner(load_settings(_draft_folder(tmp_path, block_size=3)))
    widths = [planner.plan(["a", "b"], torch.zeros(2, 3), torch.tensor([5, 9])).verify_lens.tolist()
              for _ in range(5)]
    assert widths == [[0, 0], [1, 1], [2, 2], [3, 3], [0, 0]]


def test_sweep_steps_of_width_zero_skip_the_drafter_like_production_does(tmp_path, monkeypatch):
    """The one-token steps of the measured SPS table must be undrafted steps, as in production."""
    from sglang_dspark.engine.planning import VerifyPlanner

    monkeypatch.setenv("DSPARK_PLANNER", "sweep")
    planner = VerifyPlanner(load_settings(_draft_folder(tmp_path, block_size=3)))
    widths = []
    for _ in range(6):
        decision = planner.decide(["a"], torch.tensor([5]))
        plan = (planner.plan(["a"], torch.zeros(1, 3), torch.tensor([5]), decision) if decision.draft
                else planner.skipped(["a"], torch.tensor([5])))
        widths.append((decision.draft, int(plan.verify_lens[0])))
    assert widths == [(False, 0), (True, 1), (True, 2), (True, 3), (False, 0), (True, 1)]


def test_fixed_zero_skips_the_drafter_and_verifies_only_the_bonus(tmp_path, monkeypatch):
    """`DSPARK_PLANNER=fixed:0` is plain decoding through the worker: nothing to verify, so no draft."""
    from sglang_dspark.engine.planning import VerifyPlanner

    for name in ("DSPARK_GAMMA", "DSPARK_SPS_PATH", "DSPARK_STS_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DSPARK_PLANNER", "fixed:0")
    planner = VerifyPlanner(load_settings(_draft_folder(tmp_path)))
    decision = planner.decide(["a", "b"], torch.tensor([5, 9]))
    plan = planner.skipped(["a", "b"], torch.tensor([5, 9]))
    assert not decision.draft
    monkeypatch.setenv("DSPARK_PLANNER", "fixed:3")
    assert VerifyPlanner(load_settings(_draft_folder(tmp_path))).decide(["a"], torch.tensor([5])).draft_width == 3
    assert plan.verify_lens.tolist() == [0, 0] and plan.predicted_seconds is None


def test_greedy_requests_use_their_own_calibration(tmp_path, monkeypatch):
    """A greedy draft survives by argmax match, a sampled one by min(1, p/q): with sts-greedy.json
    the greedy rows of a mixed batch are calibrated by it and the sampled rows by sts.json."""
    from sglang_dspark.calibration.sts import StsCalibration
    from sglang_dspark.engine.planning import VerifyPlanner

    for name in ("DSPARK_GAMMA", "DSPARK_SPS_PATH", "DSPARK_STS_PATH", "DSPARK_STS_GREEDY_PATH"):
        monkeypatch.delenv(name, raising=False)
    folder = _draft_folder(tmp_path, block_size=2)
    StsCalibration(temperatures=[1.0, 1.0]).save(folder / "sts.json")
    StsCalibration(temperatures=[1.0, 1.0], biases=[2.0, 2.0]).save(folder / "sts-greedy.json")
    planner = VerifyPlanner(load_settings(folder))
    logits = torch.zeros(3, 2)
    survivals = planner.plan(["a", "b", "c"], logits, torch.tensor([5, 5, 5]),
                             greedy=torch.tensor([True, False, True])).survivals
    sampled, greedy = torch.sigmoid(torch.tensor(0.0)), torch.sigmoid(torch.tensor(2.0))
    torch.testing.assert_close(survivals[1], torch.stack([sampled, sampled * sampled]))
    torch.testing.assert_close(survivals[0], torch.stack([greedy, greedy * greedy]))
    torch.testing.assert_close(survivals[2], survivals[0])


def test_the_planner_rescales_its_table_to_the_steps_it_measures(tmp_path, monkeypatch):
    """A table profiled on a slower day overstates the target's seconds; once the steps show the
    machine runs 4x faster, a drafter that cost little against the table no longer pays."""
    from sglang_dspark.engine.planning import EXPLORE_EVERY

    planner = _production_planner(tmp_path, monkeypatch)
    rids, context = ["a", "b"], torch.tensor([100, 100])
    fair = torch.full((2, 7), 0.0)
    for _ in range(3):
        planner.plan(rids, fair, context)
    step = planner.skipped(rids, context).predicted_seconds
    planner.draft_costs.add(2, 7, 0.25 * step, 0.0)
    assert planner.decide(rids, context).draft, "against the table the drafter pays"
    drafted = []
    for _ in range(200):
        drafted.append(planner.decide(rids, context).draft)
        plan = planner.skipped(rids, context)
        planner.observe(plan, rids, plan.predicted_seconds / 4, step_seconds=plan.predicted_seconds / 4,
                        committed_tokens=2, drafted=False)
    assert planner.skipped(rids, context).predicted_seconds == pytest.approx(step / 4, rel=0.05)
    assert sum(drafted[-100:]) <= 100 // EXPLORE_EVERY + 1, "against the measured steps it does not"


def test_the_table_scales_ignore_steps_without_a_shape_and_stay_bounded():
    from sglang_dspark.scheduling.cost_model import StepShape, uninitialised_cost_model
    from sglang_dspark.scheduling.planner import TwoStepCapacityPlanner

    planner = TwoStepCapacityPlanner(uninitialised_cost_model(), gamma=3)
    planner.observe(None, 1.0)
    planner.observe(StepShape(1, 1, 10), 0.0)
    assert (planner.step_scale, planner.token_scale) == (1.0, 1.0)
    for _ in range(1000):
        planner.observe(StepShape(1, 1, 10), 100.0)  # the flat table predicts 1 s
    assert planner.step_scale == pytest.approx(4.0) and planner.token_scale == pytest.approx(4.0)


def test_slow_first_steps_with_drafts_do_not_turn_drafting_off():
    """Replays what happened at concurrency 1: the server's first steps (all verifying 2 drafts)
    took 0.88 s and 0.17 s against 0.09 s warm. Least squares blamed the drafts (token scale
    16), so the planner verified none and drafting stayed off for ~700 steps. The fit now skips
    the first steps and clips outliers, so the warm steps decide."""
    from sglang_dspark.scheduling.cost_model import StepShape
    from sglang_dspark.scheduling.planner import WARMUP_STEPS, EarlyStopPlanner
    from tests.test_scheduling_planner import affine

    table = affine(0.06, 0.01)
    planner = EarlyStopPlanner(table, gamma=7, explore_every=16)
    ids = ["a"]
    survivals = torch.full((1, 7), 0.7).cumprod(dim=1)
    slow = {0: 10.0, 3: 2.0, WARMUP_STEPS + 2: 10.0}  # step -> measured / table
    verified = []
    for step in range(120):
        width = planner.decide(ids, context_tokens=100.0, draft_seconds=[0.0] + [0.005] * 7).draft_width
        lens = planner.verify_lens(survivals, width, 100.0) if width else torch.zeros(1, dtype=torch.long)
        if width:
            planner.publish(ids, survivals, width)
        shape = StepShape(1, 1 + int(lens.sum()), 100)
        planner.observe(shape, table.predict(shape) * slow.get(step, 1.0))
        verified.append(int(lens.sum()))
    assert planner.token_scale < 2.0 and 0.5 < planner.step_scale < 2.0
    assert sum(v > 0 for v in verified[-100:]) >= 95, verified


def test_the_token_scale_may_learn_a_slope_far_steeper_than_the_table():
    """At batch 16 four one-draft requests cost ~10x what the table said: the planner must see it
    (a step scale that large would be a stall; a token slope that large is the engine)."""
    from sglang_dspark.scheduling.cost_model import StepShape
    from sglang_dspark.scheduling.planner import MAX_TOKEN_SCALE, TwoStepCapacityPlanner
    from tests.test_scheduling_planner import affine

    table = affine(0.17, 0.001)
    planner = TwoStepCapacityPlanner(table, gamma=7)
    one = table.predict(StepShape(16, 16, 4800))
    for step in range(400):
        shape = StepShape(16, 16 + step % 8, 4800)
        planner.observe(shape, one + 10.0 * (table.predict(shape) - one))
    assert planner.step_scale == pytest.approx(1.0, rel=0.02)
    assert planner.token_scale == pytest.approx(10.0, rel=0.02) and MAX_TOKEN_SCALE > 10
    for step in range(400):
        shape = StepShape(16, 16 + step % 8, 4800)
        planner.observe(shape, one + 100.0 * (table.predict(shape) - one))
    assert planner.token_scale == pytest.approx(MAX_TOKEN_SCALE)


def test_the_planner_learns_what_a_verify_token_costs_apart_from_the_step():
    """Steps at the table's one-token speed whose drafts cost twice what the table says."""
    from sglang_dspark.scheduling.cost_model import StepShape
    from sglang_dspark.scheduling.planner import TwoStepCapacityPlanner
    from tests.test_scheduling_planner import affine

    table = affine(0.05, 0.002)
    planner = TwoStepCapacityPlanner(table, gamma=7)
    for step in range(400):
        shape = StepShape(2, 2 + step % 8, 100)
        one = table.predict(StepShape(2, 2, 100))
        planner.observe(shape, one + 2.0 * (table.predict(shape) - one))
    assert planner.step_scale == pytest.approx(1.0, rel=0.02)
    assert planner.token_scale == pytest.approx(2.0, rel=0.02)
    seven, one = StepShape(2, 9, 100), table.predict(StepShape(2, 2, 100))
    assert planner.cost_model.predict(seven) == pytest.approx(one + 2 * (table.predict(seven) - one), rel=0.02)


def test_verify_logits_are_padded_per_request_and_equal_windows_are_not_copied():
    from sglang_dspark.engine.worker import _pad_rows

    packed = torch.arange(12.0).reshape(6, 2)
    ragged = _pad_rows(packed, torch.tensor([1, 3, 2]))
    assert ragged.tolist() == [[[0, 1], [0, 0], [0, 0]], [[2, 3], [4, 5], [6, 7]], [[8, 9], [10, 11], [0, 0]]]
    equal = _pad_rows(packed, torch.tensor([3, 3]))
    assert equal.shape == (2, 3, 2) and equal.data_ptr() == packed.data_ptr()


def test_packed_argmax_ids_are_padded_per_request_and_equal_windows_are_not_copied():
    from sglang_dspark.engine.worker import _pad_rows

    packed = torch.arange(6)
    assert _pad_rows(packed, torch.tensor([1, 3, 2])).tolist() == [[0, 0, 0], [1, 2, 3], [4, 5, 0]]
    equal = _pad_rows(packed, torch.tensor([3, 3]))
    assert equal.tolist() == [[0, 1, 2], [3, 4, 5]] and equal.data_ptr() == packed.data_ptr()


def test_packed_window_rows_know_their_request_and_offset_and_which_are_committed():
    from sglang_dspark.engine.worker import _committed_rows
    from sglang_dspark.model.cache import packed_rows

    request, offset = packed_rows(torch.tensor([1, 3, 0, 2]))
    assert request.tolist() == [0, 1, 1, 1, 3, 3] and offset.tolist() == [0, 0, 1, 2, 0, 1]
    committed = _committed_rows(torch.tensor([1, 3, 2]), accept_lens=torch.tensor([1, 2, 1]))
    assert committed.tolist() == [True, True, True, False, True, False]


@pytest.mark.parametrize("native_bf16, panels, layout, target, want", [
    (False, True, "auto", torch.bfloat16, torch.bfloat16),  # AVX2: the panels stream bf16 weights
    (False, False, "auto", torch.bfloat16, torch.float32),  # no panel kernel: torch's bf16 GEMM is slow
    (False, True, "off", torch.bfloat16, torch.float32),  # panels switched off
    (False, True, "auto", torch.float16, torch.float32),  # the panels take fp32 and bf16 only
    (True, False, "auto", torch.bfloat16, torch.bfloat16),  # native bf16 math
    (False, True, "auto", torch.float32, torch.float32),
])
def test_the_drafter_dtype_follows_the_target_where_this_cpu_serves_it_fast(monkeypatch, native_bf16, panels,
                                                                         layout, target, want):
    from types import SimpleNamespace

    from sglang_dspark.engine import worker as worker_module

    monkeypatch.setattr(worker_module, "cpu_has_native_bf16", lambda: native_bf16)
    monkeypatch.setattr(worker_module, "vector_isa_supported", lambda: panels)
    monkeypatch.setattr(worker_module, "gemm_layout_mode", lambda: layout)
    worker = object.__new__(worker_module.DSparkLiveWorker)
    worker.settings = SimpleNamespace(draft_dtype="auto")
    worker.model_runner = SimpleNamespace(dtype=target)
    worker.device = "cpu"
    assert worker._draft_dtype() == want
    worker.settings = SimpleNamespace(draft_dtype="float32")  # an explicit choice always wins
    assert worker._draft_dtype() == torch.float32


class _Tokenizer:
    eos_token_id = 2
    additional_stop_token_ids = {7}


class _Req:
    def __init__(self, prompt_len: int, min_new_tokens: int, stop_token_ids=None, eos_token_ids=None):
        self.origin_input_ids = list(range(prompt_len))
        self.sampling_params = type("Params", (), {"min_new_tokens": min_new_tokens,
                                                   "stop_token_ids": stop_token_ids})()
        self.eos_token_ids = eos_token_ids
        self.tokenizer = _Tokenizer()


def test_min_new_tokens_bans_the_stop_tokens_sglangs_penalizer_bans_until_the_same_length():
    reqs = [_Req(5, 0), _Req(4, 3, stop_token_ids={9}, eos_token_ids={2, 11})]
    assert min_new_tokens_bans(reqs) == [StopBan(batch_index=1, until_position=6, token_ids=(2, 7, 9, 11))]


def test_stop_bans_cover_only_the_verify_rows_below_their_position():
    # three requests with windows of 3, 1 and 4 rows at committed lengths 10, 4 and 20
    logits = torch.zeros(8, 12)
    seq_lens, window_lens = torch.tensor([10, 4, 20]), torch.tensor([3, 1, 4])
    bans = [StopBan(0, 12, (2, 7)), StopBan(1, 4, (3,)), StopBan(2, 30, (5, 99))]
    _ban_stop_tokens(logits, bans, seq_lens, window_lens)
    banned = {(row, col) for row, col in (logits == float("-inf")).nonzero().tolist()}
    # request 0: positions 10, 11 banned, 12 free; request 1: position 4 is not below 4;
    # request 2: all four rows (20..23), and id 99 lies outside the vocabulary
    assert banned == {(0, 2), (0, 7), (1, 2), (1, 7), (4, 5), (5, 5), (6, 5), (7, 5)}


def _penalised_req(rid: str, output_ids: list[int], frequency: float = 1.0):
    from types import SimpleNamespace

    params = SimpleNamespace(frequency_penalty=frequency, presence_penalty=0.0, repetition_penalty=1.0)
    return SimpleNamespace(rid=rid, sampling_params=params, origin_input_ids=[1, 2, 3], output_ids=output_ids)


def _penalise(histories, logits, reqs, bonus, seq_lens, drafts, window_lens) -> None:
    from sglang_dspark.engine.penalties import penalise_rows, penalties_of

    penalties = [penalties_of(req.sampling_params) for req in reqs]
    outputs = histories.refresh(reqs, bonus, seq_lens, [p.active for p in penalties])
    penalise_rows(logits, reqs, penalties, outputs, drafts, window_lens)


def test_penalties_follow_the_outputs_the_worker_commits_while_sglangs_lag_a_step():
    from sglang_dspark.engine.penalties import OutputHistories

    histories = OutputHistories()
    reqs = [_penalised_req("a", []), _penalised_req("b", [], frequency=0.0)]  # overlap: the prefill's token not yet seen
    logits = torch.zeros(5, 12)
    _penalise(histories, logits, reqs, bonus=torch.tensor([9, 4]), seq_lens=torch.tensor([3, 3]),
              drafts=torch.tensor([[9, 5], [0, 0]]), window_lens=torch.tensor([3, 2]))
    assert logits[:3, 9].tolist() == [-1.0, -2.0, -2.0] and logits[2, 5] == -1.0
    assert int((logits != 0).sum()) == 4, "only request a's rows, on tokens it output, are penalised"
    histories.commit(reqs, torch.tensor([[9, 6, 0], [4, 0, 0]]), accept_lens=torch.tensor([2, 1]))

    reqs[0].output_ids = [9]  # SGLang has processed the prefill only
    logits = torch.zeros(1, 12)
    _penalise(histories, logits, reqs[:1], bonus=torch.tensor([6]), seq_lens=torch.tensor([5]),
              drafts=torch.zeros(1, 0, dtype=torch.long), window_lens=torch.tensor([1]))
    assert logits[0, 9] == -2.0 and logits[0, 6] == -1.0


def test_a_request_prefilled_again_takes_sglangs_outputs_and_unknown_outputs_are_an_error():
    from sglang_dspark.engine.penalties import OutputHistories

    histories = OutputHistories()
    logits = torch.zeros(1, 12)
    retracted = _penalised_req("a", [7, 7, 8])  # its three outputs are prefilled again, the bonus is new
    _penalise(histories, logits, [retracted], bonus=torch.tensor([2]), seq_lens=torch.tensor([6]),
              drafts=torch.zeros(1, 0, dtype=torch.long), window_lens=torch.tensor([1]))
    assert logits[0, [7, 8, 2]].tolist() == [-2.0, -1.0, -1.0]
    with pytest.raises(RuntimeError, match="only 1 are known"):
        _penalise(histories, logits, [_penalised_req("c", [5])], bonus=torch.tensor([2]), seq_lens=torch.tensor([8]),
                  drafts=torch.zeros(1, 0, dtype=torch.long), window_lens=torch.tensor([1]))


class BanLastOutput:
    """A custom logit processor that reads its request: bans the request's last output token."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, logits: torch.Tensor, params: list) -> torch.Tensor:
        self.calls += 1
        for row, param in enumerate(params):
            logits[row, param["__req__"].output_ids[-1]] = float("-inf")
        return logits


def test_each_verify_row_of_a_custom_logit_processor_sees_the_request_as_it_stands_at_that_row():
    from types import SimpleNamespace

    from sglang_dspark.engine.logit_processors import apply_custom_logit_processors, reads_request
    from sglang_dspark.engine.penalties import OutputHistories

    processor = BanLastOutput()
    request = SimpleNamespace(rid="a", origin_input_ids=[1, 2, 3], output_ids=[], custom_logit_processor="serialized",
                              sampling_params=SimpleNamespace(custom_params={"__req__": None}))
    request.sampling_params.custom_params["__req__"] = request
    plain = SimpleNamespace(rid="b", origin_input_ids=[1], output_ids=[], custom_logit_processor=None,
                            sampling_params=SimpleNamespace(custom_params=None))
    reqs = [plain, request]  # request a's outputs so far: [4] (SGLang, a step behind, knows none)
    assert [reads_request(req) for req in reqs] == [False, True]
    outputs = OutputHistories().refresh(reqs, bonus=torch.tensor([6, 4]), seq_lens=torch.tensor([1, 3]),
                                        wanted=[False, True])
    info = SimpleNamespace(has_custom_logit_processor=True, custom_params=[None, request.sampling_params.custom_params],
                           custom_logit_processor={0: SimpleNamespace(processor=processor, rows=[1])})
    logits = torch.zeros(2 + 3, 10)
    apply_custom_logit_processors(logits, info, reqs, outputs, drafts=torch.tensor([[0, 0], [8, 5]]),
                                  window_lens=torch.tensor([2, 3]))
    banned = [row.isinf().nonzero().flatten().tolist() for row in logits]
    assert banned == [[], [], [4], [8], [5]], "rows after the bonus 4 and the drafts 8, 5; request b untouched"
    assert processor.calls == 1, "one call for all the processor's rows"
    assert request.output_ids == [], "the request itself is not changed"


def test_a_custom_logit_processor_that_fails_for_one_request_aborts_that_request_alone():
    """A processor that raises, or returns logits of another shape, for one request's params is
    run again request by request: the others' rows are processed, the failing request is aborted
    with the error and its rows are left as they were."""
    from types import SimpleNamespace

    from sglang_dspark.engine.logit_processors import apply_custom_logit_processors

    def ban_listed(logits, params):
        for row, param in enumerate(params):
            logits[row, param["token_ids"]] = float("-inf")
        return logits

    def first_row_only(logits, params):
        return logits[:1]

    reqs = [SimpleNamespace(rid=rid, to_finish=None) for rid in "abc"]
    info = SimpleNamespace(has_custom_logit_processor=True, custom_params=[{"token_ids": [1]}, {}, None],
                           custom_logit_processor={0: SimpleNamespace(processor=ban_listed, rows=[0, 1]),
                                                   1: SimpleNamespace(processor=first_row_only, rows=[2])})
    logits = torch.zeros(2 + 2 + 3, 5)
    apply_custom_logit_processors(logits, info, reqs, [None] * 3, torch.tensor([[4, 0], [4, 0], [1, 2]]),
                                  torch.tensor([2, 2, 3]))
    assert logits[:2, 1].isinf().all() and int(logits.isinf().sum()) == 2, "request a's rows alone processed"
    assert reqs[0].to_finish is None
    assert "ban_listed failed: KeyError" in reqs[1].to_finish.message
    assert "must return logits of the shape it was given" in reqs[2].to_finish.message


@pytest.mark.parametrize("server_mode", ["FULL", "LAST"])
def test_a_prefill_hands_sglang_the_hidden_states_in_the_layout_its_result_processor_reads(monkeypatch, server_mode):
    """Every extend token's final hidden state when SGLang's result processor reads the FULL mode
    (the server's `--enable-return-hidden-states`), each request's last one when LAST; none when
    no request of the batch asks."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    from sglang_dspark.engine import worker

    monkeypatch.setattr(worker, "get_server_return_hidden_states_mode", lambda: getattr(CaptureHiddenMode, server_mode))
    final = torch.arange(7.0)[:, None].expand(7, 3)
    output = SimpleNamespace(last_hidden_states=final)
    batch = SimpleNamespace(return_hidden_states=True, return_hidden_states_mode=CaptureHiddenMode.LAST, spec_info=None)
    hidden = worker._prefill_hidden_states(batch, output, torch.tensor([3, 4]))
    assert hidden[:, 0].tolist() == ([0, 1, 2, 3, 4, 5, 6] if server_mode == "FULL" else [2, 6])
    assert worker._prefill_hidden_states(SimpleNamespace(return_hidden_states=False), output, torch.tensor([3, 4])) is None
    with pytest.raises(RuntimeError, match="final hidden states for 9 rows"):
        worker._prefill_hidden_states(batch, output, torch.tensor([3, 6]))


class ScriptedGrammar:
    """A grammar that allows `script[i]` (a set of token ids) as its i-th token, then terminates;
    SGLang's grammar-object interface (bitmask of 32 tokens per int32 word)."""

    def __init__(self, script: list[set[int]]) -> None:
        self.script, self.state = script, 0

    def allocate_vocab_mask(self, vocab_size: int, batch_size: int, device) -> torch.Tensor:
        return torch.full((batch_size, (vocab_size + 31) // 32), -1, dtype=torch.int32)

    def fill_vocab_mask(self, mask: torch.Tensor, index: int) -> None:
        bits = [0] * mask.shape[1]
        for token in self.script[self.state]:
            bits[token // 32] |= 1 << (token % 32)
        mask[index] = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32)

    def accept_token(self, token: int) -> None:
        assert token in self.script[self.state], (token, self.state)
        self.state += 1

    def rollback(self, count: int) -> None:
        self.state -= count

    def is_terminated(self) -> bool:
        return self.state >= len(self.script)


def _constrained_req(grammar):
    from types import SimpleNamespace

    return SimpleNamespace(grammar=grammar, finished=lambda: False)


def test_grammar_forces_single_tokens_and_stops_verifying_at_the_first_refused_draft():
    from sglang_dspark.decoding import DraftBlock
    from sglang_dspark.engine.grammar import FORCED_CONFIDENCE_LOGIT, guide_drafts

    forcing = ScriptedGrammar([{5}, {1, 2, 3}, {63}, {9}])  # then terminated
    refusing = ScriptedGrammar([{1, 2}, {3, 4}, {40}, {0}, {0}])
    sampled = ScriptedGrammar([{6}, {50}, {1}, {1}, {1}])  # 50: outside the 40-token draft vocabulary
    reqs = [_constrained_req(forcing), _constrained_req(refusing), _constrained_req(sampled),
            _constrained_req(None)]
    tokens = torch.tensor([[5, 2, 4, 9, 0], [2, 5, 40, 0, 0], [8, 7, 1, 1, 1], [3, 3, 3, 3, 3]])
    probs = torch.rand(4, 5, 40)
    confidences = torch.zeros(4, 5)
    block = DraftBlock(tokens=tokens.clone(), probs=probs.clone(), confidence_logits=confidences.clone(),
                       probs_vocab=None)
    columns = lambda ids: torch.tensor([t if t < 40 else -1 for t in ids])  # noqa: E731
    limits = guide_drafts(block, reqs, torch.tensor([True, True, False, True]), 64, columns)

    assert limits.tolist() == [4, 1, 1, 5], "terminated after 4, 5 refused, 50 not representable for a sampled row"
    assert block.tokens[0].tolist() == [5, 2, 63, 9, 0], "the grammar's only token replaces the draft"
    assert block.tokens[2, 0] == 6 and torch.equal(block.probs[2, 0], torch.nn.functional.one_hot(torch.tensor(6), 40).float())
    assert block.confidence_logits[0, 2] == FORCED_CONFIDENCE_LOGIT and block.confidence_logits[2, 0] == FORCED_CONFIDENCE_LOGIT
    assert block.confidence_logits[0, 0] == FORCED_CONFIDENCE_LOGIT, "a dictated token drafted already is certain too"
    assert block.confidence_logits[0, 1] == 0.0, "a token among several allowed keeps the drafter's confidence"
    assert torch.equal(block.tokens[1], tokens[1]) and torch.equal(block.tokens[3], tokens[3])
    assert torch.equal(block.probs[[0, 1, 3]], probs[[0, 1, 3]]), "greedy rows' distributions are never read"
    assert (forcing.state, refusing.state, sampled.state) == (0, 0, 0), "every grammar is rolled back"
    assert guide_drafts(block, [_constrained_req(None)] * 4, torch.ones(4, dtype=torch.bool), 64, columns) is None


class _PreferringDrafter:
    """A drafter over 40 columns (target ids 0..39) whose logits rank token `favourite` first,
    then lower ids above higher ones."""

    d2t = None
    has_confidence_head = False

    def __init__(self, favourite: int) -> None:
        self.favourite = favourite

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = -torch.arange(40, dtype=torch.float32).expand(*hidden.shape[:2], 40).clone()
        logits[..., self.favourite] = 10.0
        return logits

    def markov_bias(self, prev_tokens, hidden, state):
        return torch.zeros(hidden.shape[0], 40), state


def test_grammar_steering_drafts_the_drafters_best_allowed_token_and_rolls_every_grammar_back():
    from sglang_dspark.decoding import SamplingParams, sample_block
    from sglang_dspark.engine.grammar import GrammarSteering

    steered = ScriptedGrammar([{3, 5}, {20}, {1, 2}])  # then terminated: the drafter's own drafts follow
    beyond = ScriptedGrammar([{2}, {50}, {1}, {1}])  # 50: outside the 40-token draft vocabulary
    sampled = ScriptedGrammar([{8, 9, 30}] * 4)
    reqs = [_constrained_req(steered), _constrained_req(beyond), _constrained_req(None), _constrained_req(sampled)]
    steering = GrammarSteering(reqs, 64, torch.arange(40))
    params = SamplingParams(temperature=torch.tensor([0.0, 0.0, 0.0, 1.0]), top_p=torch.ones(4),
                            top_k=torch.zeros(4, dtype=torch.long))
    block = sample_block(_PreferringDrafter(favourite=7), torch.zeros(4, 4, 2), torch.tensor([0, 0, 0, 0]), params,
                         torch.Generator().manual_seed(0), steering=steering)
    steering.close()

    assert block.tokens[0].tolist() == [3, 20, 1, 7], "the best allowed token, the only one, then the drafter's own"
    assert block.tokens[1].tolist() == [2, 7, 7, 7], "no allowed token in the draft vocabulary: unsteered from there"
    assert block.tokens[2].tolist() == [7, 7, 7, 7], "a request without a grammar drafts as before"
    assert set(block.tokens[3].tolist()) <= {8, 9, 30}
    allowed = torch.zeros(40, dtype=torch.bool)
    allowed[[8, 9, 30]] = True
    assert float(block.probs[3][:, ~allowed].abs().sum()) == 0.0, "a sampled row's p_d is the masked distribution"
    assert torch.allclose(block.probs[3].sum(-1), torch.ones(4))
    assert (steered.state, beyond.state, sampled.state) == (0, 0, 0), "every grammar is rolled back"


def test_a_walked_block_is_drawn_again_steered_only_from_the_first_draft_its_grammar_refuses():
    from sglang_dspark.decoding import DraftBlock, SamplingParams
    from sglang_dspark.engine.grammar import steer_walked_block

    allowing = ScriptedGrammar([{4, 5}, {6}, {7, 8}, {9}])  # every draft below allowed
    refusing = ScriptedGrammar([{4}, {6}, {20, 21}, {3}])  # refuses the draft at slot 2
    sampled = ScriptedGrammar([{1, 2, 3}, {2, 3}, {3}, {3}])
    reqs = [_constrained_req(allowing), _constrained_req(refusing), _constrained_req(None), _constrained_req(sampled)]
    tokens = torch.tensor([[5, 6, 8, 9], [4, 6, 7, 9], [30, 31, 32, 33], [2, 3, 3, 3]])
    probs = torch.rand(4, 4, 40)
    block = DraftBlock(tokens=tokens.clone(), probs=probs.clone(), confidence_logits=torch.zeros(4, 4), probs_vocab=None)
    params = SamplingParams(temperature=torch.tensor([0.0, 0.0, 0.0, 1.0]), top_p=torch.ones(4),
                            top_k=torch.zeros(4, dtype=torch.long))
    drafter, calls = _PreferringDrafter(favourite=30), []

    def slot_logits(rows, slot, prev):
        calls.append((rows.tolist(), slot, prev.tolist()))
        return drafter.base_logits(torch.zeros(len(rows), 1, 2))[:, 0], torch.full((len(rows),), 5.0)

    steer_walked_block(block, reqs, params, torch.tensor([1, 2, 3, 4]), 64, torch.arange(40), slot_logits,
                       torch.Generator().manual_seed(0))

    assert calls == [([1], 2, [6]), ([1], 3, [20])], "only the refusing row is drawn again, from the refused slot on"
    assert block.tokens[1].tolist() == [4, 6, 20, 3], "the best allowed token, then what the grammar allows"
    assert block.confidence_logits[1].tolist() == [0.0, 0.0, 5.0, 5.0], "drawn again, scored again"
    assert torch.equal(block.tokens[[0, 2, 3]], tokens[[0, 2, 3]]), "allowed drafts stand"
    kept = torch.zeros(4, 40)
    kept[0, [1, 2, 3]] = probs[3, 0, [1, 2, 3]] / probs[3, 0, [1, 2, 3]].sum()
    kept[1, [2, 3]] = probs[3, 1, [2, 3]] / probs[3, 1, [2, 3]].sum()
    kept[2:, 3] = 1.0
    assert torch.allclose(block.probs[3], kept), "a kept sampled draft's p_d is the drafter's masked to the grammar"
    assert torch.equal(block.probs[[0, 1, 2]][:, :2], probs[[0, 1, 2]][:, :2])
    assert (allowing.state, refusing.state, sampled.state) == (0, 0, 0), "every grammar is rolled back"


def test_a_sampled_draft_its_grammar_refuses_is_drawn_again_from_the_drafters_masked_distribution():
    from sglang_dspark.decoding import DraftBlock, SamplingParams
    from sglang_dspark.engine.grammar import steer_walked_block

    grammar = ScriptedGrammar([{2}, {11, 12}, {13}])
    block = DraftBlock(tokens=torch.tensor([[2, 30, 30]]), probs=torch.rand(1, 3, 40), confidence_logits=None,
                       probs_vocab=None)
    drafter = _PreferringDrafter(favourite=30)
    params = SamplingParams(temperature=torch.ones(1), top_p=torch.ones(1), top_k=torch.zeros(1, dtype=torch.long))

    steer_walked_block(block, [_constrained_req(grammar)], params, torch.tensor([0]), 64, torch.arange(40),
                       lambda rows, slot, prev: (drafter.base_logits(torch.zeros(len(rows), 1, 2))[:, 0], None),
                       torch.Generator().manual_seed(0))

    expected = torch.zeros(40)
    expected[[11, 12]] = torch.softmax(torch.tensor([-11.0, -12.0]), -1)
    assert block.tokens[0, 1].item() in (11, 12) and block.tokens[0, 2].item() == 13
    assert torch.allclose(block.probs[0, 1], expected), "p_d is the drafter's distribution masked to the grammar"
    assert grammar.state == 0


def test_a_tree_is_verified_only_where_the_rows_are_the_targets_own_logits():
    """A tree's rows are read as they come out of the target, so any request whose rows
    SGLang's sampler would change keeps the chain alone: a custom logit processor counts whether
    or not it reads the request."""
    from types import SimpleNamespace

    from sglang_dspark.engine.worker import _plain_rows

    def batch(info=None, **request_params):
        params = SimpleNamespace(**({"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                                     "min_new_tokens": 0, "stop_token_ids": [0]} | request_params))
        req = SimpleNamespace(sampling_params=params, output_ids=[], origin_input_ids=[1, 2],
                              custom_logit_processor=None)
        info = info or SimpleNamespace(logit_bias=None, has_custom_logit_processor=False)
        return SimpleNamespace(has_grammar=False, return_logprob=False, return_hidden_states=False,
                               sampling_info=info, reqs=[req])

    assert _plain_rows(batch())
    assert not _plain_rows(batch(SimpleNamespace(logit_bias=None, has_custom_logit_processor=True)))
    assert not _plain_rows(batch(SimpleNamespace(logit_bias=torch.zeros(1, 8),
                                                 has_custom_logit_processor=False)))
    assert not _plain_rows(batch(frequency_penalty=0.5))
    assert not _plain_rows(batch(min_new_tokens=4))


@pytest.mark.parametrize(("tree_nodes", "planned"), [(15, 3), (15, 7), (3, 5)])
def test_a_sampled_requests_tree_holds_its_chain_and_the_best_nodes_that_fit(tree_nodes, planned):
    """A sampled chain's drafts are tested on their own rows, so the tree holds the planned k of
    them as a path, fills the rest of its 2k + 1 nodes (at most `DSPARK_TREE_NODES`) with the
    best-first nodes in their order, and never exceeds that budget (the KV positions reserved a
    step); a greedy request's tree is the best-first tree, its chain cut to the part it holds."""
    from types import SimpleNamespace

    from sglang_dspark.decoding.tree import DraftTree
    from sglang_dspark.engine.worker import DSparkLiveWorker

    # best first: 10, 11, 12 after the bonus; 20 after 10, 30 after 20, ...
    best = DraftTree(tokens=[10, 11, 20, 12, 30, 13, 40, 14, 50, 15, 60, 16, 70, 17, 18],
                     parents=[0, 0, 1, 0, 3, 0, 5, 0, 7, 0, 9, 0, 11, 0, 0],
                     depths=[1, 1, 2, 1, 3, 1, 4, 1, 5, 1, 6, 1, 7, 1, 1])
    worker = SimpleNamespace(settings=SimpleNamespace(tree_nodes=tree_nodes),
                             kernel_walk=SimpleNamespace(tree=lambda base, bonus, nodes: best.first(nodes)))
    chain = [10, 21, 31, 41, 51, 61, 71]  # leaves the best-first tree after its first draft
    budget = min(tree_nodes, 2 * planned + 1)
    for greedy in (False, True):
        plan = SimpleNamespace(verify_lens=torch.tensor([planned]), step_shape=None)
        tree, plan = DSparkLiveWorker._tree_plan(worker, torch.zeros(7, 4), 5, plan, chain, greedy)
        assert tree.rows - 1 <= budget
        if greedy:
            assert tree == best.first(budget) and int(plan.verify_lens[0]) == 1
            continue
        held = min(planned, budget)
        assert int(plan.verify_lens[0]) == held and tree.chain_depth(chain) == held
        kept = tree.rows - 1 - (held - 1)  # the chain's first draft is a best node
        assert tree.tokens[:kept] == best.tokens[:kept] and tree.rows - 1 == budget
