"""`dspark-ctl bench serve` reports where DSPARK_LIVE's step time went, from the worker's step log."""

import json
import time

import pytest

from dspark_ctl.bench_serve import step_summary, verify_cost_summary


def _step(drafted: bool, draft: float, verify: float, measured: float, predicted: float | None) -> dict:
    return {"drafted": drafted, "draft_seconds": draft, "verify_seconds": verify, "measured_seconds": measured,
            "predicted_seconds": predicted, "batch_size": 4}


def test_step_summary_reads_only_the_cells_own_steps(tmp_path):
    log = tmp_path / "steps.jsonl"
    earlier = [_step(True, 9.0, 9.0, 9.0, None)] * 3  # another concurrency level's steps
    cell = [_step(True, 0.02, 0.10, 0.12, 0.06), _step(False, 0.001, 0.08, 0.08, 0.04),
            _step(False, 0.001, 0.09, 0.09, 0.045)]
    log.write_text("".join(json.dumps(s) + "\n" for s in earlier + cell))
    summary = step_summary(log, skip=len(earlier))
    assert summary["decode_steps"] == 3
    assert summary["drafted_share"] == pytest.approx(1 / 3)
    assert summary["draft_seconds_median"] == pytest.approx(0.02)
    assert summary["verify_seconds_median"] == pytest.approx(0.09)
    assert summary["predicted_over_measured_median"] == pytest.approx(0.5)
    assert summary["draft_parts_median"]["block"] == pytest.approx(0.0), "records without the parts read as 0"


def test_step_summary_splits_a_drafted_steps_time_into_its_parts(tmp_path):
    log = tmp_path / "steps.jsonl"
    parts = {"decide_seconds": 0.001, "catch_up_seconds": 0.002, "block_seconds": 0.004, "walk_seconds": 0.003,
             "plan_seconds": 0.0005}
    log.write_text(json.dumps(_step(True, 0.0105, 0.05, 0.07, None) | parts) + "\n"
                   + json.dumps(_step(False, 0.001, 0.04, 0.045, None)) + "\n")
    assert step_summary(log)["draft_parts_median"] == pytest.approx(
        {"decide": 0.001, "catch_up": 0.002, "block": 0.004, "walk": 0.003, "plan": 0.0005})


def test_step_summary_of_an_empty_cell(tmp_path):
    log = tmp_path / "steps.jsonl"
    log.write_text(json.dumps(_step(True, 1, 1, 1, 1)) + "\n")
    assert step_summary(log, skip=1) == {"decode_steps": 0}


def test_step_summary_reports_lookup_rounds_acceptance_per_position_and_temperature_class(tmp_path):
    def request(temperature: float, verify_len: int, accepted: int, lookup: int) -> dict:
        return {"temperature": temperature, "verify_len": verify_len, "accepted": accepted, "lookup_drafts": lookup}

    step = _step(True, 0.01, 0.05, 0.06, None) | {"requests": [
        request(0.0, 3, 3, 7), request(0.0, 3, 1, 7), request(0.0, 2, 0, 7),  # greedy lookup rounds
        request(1.0, 2, 2, 7),                                                 # a sampled one
        request(0.0, 3, 0, 0),                                                 # the drafter's round
    ]}
    lookup_only = _step(False, 0.001, 0.05, 0.05, None) | {"requests": [  # the drafter skipped
        request(1.0, 1, 0, 7), request(1.0, 0, 0, 0)]}
    plain = _step(False, 0.001, 0.04, 0.04, None) | {"requests": [request(0.0, 0, 0, 0)]}
    log = tmp_path / "steps.jsonl"
    log.write_text("".join(json.dumps(s) + "\n" for s in (step, lookup_only, plain)))
    summary = step_summary(log)
    assert summary["lookup_round_share"] == pytest.approx(5 / 7), "rounds of steps that verified drafts"
    # greedy: position 1 verified by all 3 rounds, accepted by 2; position 2 reached by those 2,
    # accepted by 1; position 3 reached by that one, accepted
    assert summary["lookup_conditional_acceptance"] == {"greedy": [0.667, 0.5, 1.0], "sampled": [0.5, 1.0]}


def test_sps_serve_fits_a_loadable_cost_model_from_a_step_log(tmp_path):
    from typer.testing import CliRunner

    from dspark_ctl.cli import app
    from sglang_dspark.scheduling.cost_model import StepShape, load_cost_model
    from tests.test_scheduling_live_probes import _engine_seconds, _records

    log = tmp_path / "steps.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    out = tmp_path / "sps.json"
    result = CliRunner().invoke(app, ["bench", "sps-serve", "--from-log", str(log), "--out", str(out),
                                      "--model-path", "tiny-target", "--plot", str(tmp_path / "sps.png")])
    assert result.exit_code == 0, result.output
    model = load_cost_model(out)
    assert model.kind == "context"
    assert model.predict(StepShape(4, 12, 2000)) == pytest.approx(_engine_seconds(4, 12, 2000), rel=0.1)
    assert (tmp_path / "sps.png").stat().st_size > 1000


def test_sps_serve_refuses_a_log_it_cannot_fit(tmp_path):
    from typer.testing import CliRunner

    from dspark_ctl.cli import app

    log = tmp_path / "steps.jsonl"
    log.write_text(json.dumps(_step(True, 0.01, 0.1, 0.1, None) | {"verify_tokens": 4, "requests": [
        {"context_len": 10}] * 4}) + "\n")
    result = CliRunner().invoke(app, ["bench", "sps-serve", "--from-log", str(log), "--out", str(tmp_path / "x.json"),
                                      "--model-path", "tiny-target"])
    assert result.exit_code == 1 and "cannot fit a cost model" in result.output
    assert not (tmp_path / "x.json").exists()


def test_speedups_separate_the_verify_path_from_the_speculation():
    from dspark_ctl.bench_serve import speedups

    arms = {"plain": {"1": {"aggregate_tok_s": 10.0}}, "nodraft": {"1": {"aggregate_tok_s": 12.0}},
            "dspark": {"1": {"aggregate_tok_s": 18.0}}}
    ratios = speedups(arms)
    assert ratios["speedup"]["1"] == pytest.approx(1.8)
    assert ratios["nodraft_speedup"]["1"] == pytest.approx(1.2)
    assert ratios["speculation_speedup"]["1"] == pytest.approx(1.5)
    assert speedups({"plain": arms["plain"]}) == {}


def test_paired_speedups_cancel_a_drift_that_the_ratio_of_medians_does_not():
    """The machine slows down 2x halfway; dspark is 10 % faster than plain in every repeat."""
    from dspark_ctl.bench_serve import speedups, waves_per_cell

    plain_waves = [20.0, 20.0, 10.0, 10.0, 10.0]
    dspark_waves = [22.0, 22.0, 11.0, 11.0, 11.0]
    arms = {name: {"1": {"aggregate_tok_s": sorted(waves)[2], "waves_tok_s": waves}}
            for name, waves in (("plain", plain_waves), ("dspark", dspark_waves))}
    arms["plain"]["1"]["aggregate_tok_s"] = 20.0  # a median that happened to fall before the drift
    ratios = speedups(arms)
    assert ratios["speedup_paired"]["1"] == pytest.approx(1.1)
    assert ratios["speedup"]["1"] == pytest.approx(0.55)
    assert [waves_per_cell(c, 3, 12) for c in (1, 4, 16)] == [12, 3, 3]


def test_the_pooled_rate_weighs_each_wave_by_its_time_where_a_median_of_few_waves_jumps():
    """Four waves of different prompts, one of them slow for DSPARK_LIVE (its drafts rarely
    survive): the median of the four rates lands between two waves, the pooled rate is the
    cell's total tokens over its total seconds."""
    from dspark_ctl.bench_serve import _median_cells, speedups

    def wave(tokens: int, seconds: float) -> dict:
        return {"aggregate_tok_s": tokens / seconds, "per_user_tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds}

    plain = [wave(400, 10.0), wave(400, 10.0), wave(400, 10.0), wave(400, 10.0)]
    dspark = [wave(400, 5.0), wave(400, 8.0), wave(400, 4.0), wave(400, 5.5)]
    arms = {"plain": {"1": _median_cells(plain)}, "dspark": {"1": _median_cells(dspark)}}
    assert arms["dspark"]["1"]["pooled_tok_s"] == pytest.approx(1600 / 22.5)
    assert "tokens" not in arms["dspark"]["1"] and arms["dspark"]["1"]["repeats"] == 4
    ratios = speedups(arms)
    assert ratios["speedup_pooled"]["1"] == pytest.approx(40.0 / 22.5)  # the ratio of total seconds
    assert ratios["speedup"]["1"] == pytest.approx((80.0 + 400 / 5.5) / 2 / 40.0)  # the median's pick
    assert "speedup_pooled" not in speedups({arm: {"1": {k: v for k, v in cells["1"].items() if k != "pooled_tok_s"}}
                                             for arm, cells in arms.items()})


def test_the_nodraft_arm_is_the_worker_without_drafts(tmp_path):
    from dspark_ctl.bench_serve import arm_launch

    nodraft = arm_launch("nodraft", "/t", "/d", 30101, "cpu", "float32", tmp_path)
    plain = arm_launch("plain", "/t", "/d", 30100, "cpu", "float32", tmp_path)
    assert nodraft.extra_env["DSPARK_PLANNER"] == "fixed:0" and "DSPARK_LIVE" in nodraft.command()
    assert "DSPARK_LIVE" not in plain.command() and not plain.extra_env
    assert "--disable-overlap-schedule" not in plain.command() + nodraft.command()


def test_no_overlap_turns_the_overlap_scheduler_off_in_every_arm(tmp_path):
    from dspark_ctl.bench_serve import arm_launch

    for arm in ("plain", "nodraft", "dspark"):
        launch = arm_launch(arm, "/t", "/d", 30100, "cpu", "float32", tmp_path, overlap=False)
        assert "--disable-overlap-schedule" in launch.command(), arm


def test_bench_serve_refuses_an_unknown_arm():
    from typer.testing import CliRunner

    from dspark_ctl.cli import app

    result = CliRunner().invoke(app, ["bench", "serve", "--arms", "plain,eagle", "--model-path", "/nonexistent"],
                               env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "plain, nodraft, dspark" in result.output


def test_bench_serve_writes_its_report_to_out_making_the_folder(tmp_path):
    from typer.testing import CliRunner

    from dspark_ctl.cli import app

    out = tmp_path / "results" / "run.json"
    result = CliRunner().invoke(app, ["bench", "serve", "--arms", "", "--model-path", "/t", "--drafter", "/d",
                                      "--concurrency", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["config"]["drafter"] == "/d" and report["arms"] == {}
    assert json.loads(result.output) == report


def test_extra_sampling_params_reach_every_request_and_bad_ones_are_refused(tmp_path):
    from typer.testing import CliRunner

    from dspark_ctl.cli import app

    def bench(params: str):
        return CliRunner().invoke(app, ["bench", "serve", "--arms", "", "--model-path", "/t", "--drafter", "/d",
                                        "--concurrency", "1", "--temperature", "0.5", "--sampling-params", params],
                                  env={"COLUMNS": "200"})

    result = bench('{"regex": "[a-z]+", "frequency_penalty": 0.5}')
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["config"]["sampling"] == {"temperature": 0.5, "top_p": 1.0, "regex": "[a-z]+",
                                                               "frequency_penalty": 0.5}
    for params, message in (("{regex", "is not JSON"), ('["regex"]', "must be a JSON object"),
                            ('{"temperature": 1.0, "max_new_tokens": 9}', "use --max-new-tokens, --temperature")):
        result = bench(params)
        assert result.exit_code == 2 and message in result.output, result.output


def test_a_variant_arm_runs_its_base_with_its_own_environment_and_is_compared_to_it(tmp_path):
    from dspark_ctl.bench_serve import arm_launch, parse_arm_env, parse_arms, speedups

    arms = parse_arms("plain,dspark,dspark.column")
    envs = parse_arm_env(["dspark.column:DSPARK_CPU_GEMM_LAYOUT=column"], arms)
    variant = arm_launch("dspark.column", "/t", "/d", 30102, "cpu", "float32", tmp_path, envs["dspark.column"])
    assert "DSPARK_LIVE" in variant.command() and variant.extra_env["DSPARK_CPU_GEMM_LAYOUT"] == "column"
    assert variant.extra_env["DSPARK_STEP_LOG"].endswith("dspark.column-steps.jsonl") and not envs["dspark"]
    cells = {arm: {"1": {"aggregate_tok_s": tok_s, "waves_tok_s": [tok_s]}}
             for arm, tok_s in (("plain", 10.0), ("dspark", 12.0), ("dspark.column", 11.0))}
    ratios = speedups(cells)
    assert ratios["dspark.column_vs_dspark_paired"]["1"] == pytest.approx(11 / 12)
    assert ratios["speedup"]["1"] == pytest.approx(1.2)


@pytest.mark.parametrize("arms, arm_env", [("plain,plain", []), ("dspark.", []), ("eagle.x", []),
                                           ("plain", ["dspark:A=1"]), ("plain", ["plain:A"])])
def test_bad_arms_and_arm_environments_are_refused(arms, arm_env):
    import typer

    from dspark_ctl.bench_serve import parse_arm_env, parse_arms

    with pytest.raises(typer.BadParameter):
        parse_arm_env(arm_env, parse_arms(arms))


def _record_sampling_params(monkeypatch) -> list[dict]:
    """Answer every /generate with 10 tokens in 5 verify steps; return the sampling_params sent."""
    import httpx

    sent = []

    def fake_post(client, url, json):
        sent.append(json["sampling_params"])
        meta = {"completion_tokens": 10, "spec_verify_ct": 5, "spec_cap_length": 3.0}
        return httpx.Response(200, json={"meta_info": meta}, request=httpx.Request("POST", url))

    monkeypatch.setattr(httpx.Client, "post", fake_post)
    return sent


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_waves_stop_at_the_end_of_turn_only_when_asked(monkeypatch, ignore_eos):
    from dspark_ctl.bench_serve import run_wave

    sent = _record_sampling_params(monkeypatch)
    wave = run_wave("http://server", ["a", "b"], 16, ignore_eos=ignore_eos)
    assert [p["ignore_eos"] for p in sent] == [ignore_eos] * 2 and sent[0]["max_new_tokens"] == 16
    assert wave["tau"] == pytest.approx(2.0)


def test_waves_sample_at_the_temperature_asked_and_greedy_by_default(monkeypatch):
    from dspark_ctl.bench_serve import run_wave

    sent = _record_sampling_params(monkeypatch)
    run_wave("http://server", ["a"], 16)
    run_wave("http://server", ["a"], 16, sampling={"temperature": 0.7, "top_p": 0.9})
    assert sent[0]["temperature"] == 0.0
    assert sent[1] == {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 16, "ignore_eos": True}


def test_warmup_waves_run_at_each_concurrency_before_the_measured_ones_and_stay_out_of_them(tmp_path, monkeypatch):
    """A fresh DSPARK_LIVE server learns what drafting costs at a new batch size in its first steps
    there; the warm-up wave takes that lesson at the cell's own concurrency, unmeasured."""
    import contextlib

    from dspark_ctl import bench_serve
    from dspark_ctl.serve import ServerLaunch

    sent = []

    def fake_wave(url, texts, max_new_tokens, ignore_eos=True, concurrency=None, sampling=None):
        sent.append((url, len(texts), max_new_tokens))
        return {"aggregate_tok_s": 1000.0 if len(sent) <= 6 else float(len(sent)), "per_user_tok_s": 1.0}

    monkeypatch.setattr(bench_serve, "run_wave", fake_wave)
    monkeypatch.setattr(bench_serve, "running", lambda launches, log_dir: contextlib.nullcontext())
    launches = {arm: ServerLaunch(model_path="t", port=port) for arm, port in (("plain", 1), ("dspark", 2))}
    cells = bench_serve.bench_arms(launches, [f"p{i}" for i in range(8)], [4], repeats=2, max_new_tokens=16,
                                   log_dir=tmp_path, min_requests=1, warmup_waves=2)
    urls = [launch.url for launch in launches.values()]
    assert sent[:2] == [(url, 1, 8) for url in urls], "the server warm-up: one short request each"
    assert sent[2:6] == [(url, 4, 16) for url in urls] * 2, "two warm-up waves at concurrency 4, arms in turn"
    assert len(sent) == 10 and cells["plain"]["4"]["waves_tok_s"] == [7.0, 9.0]


def test_a_wave_keeps_c_clients_busy_each_sending_its_next_request_when_the_last_one_ends(tmp_path, monkeypatch):
    """The closed-loop load of SGLang's and vLLM's serving benchmarks: c requests in flight until
    the wave's prompts run out, not c at once and a wait for the slowest."""
    import contextlib
    import threading

    import httpx

    from dspark_ctl import bench_serve
    from dspark_ctl.serve import ServerLaunch

    lock, in_flight, most, texts_sent = threading.Lock(), [0], [0], []

    clients = set()

    def fake_post(client, url, json):
        with lock:
            clients.add(client)
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
            texts_sent.append(json["text"])
        time.sleep(0.02)
        with lock:
            in_flight[0] -= 1
        meta = {"completion_tokens": 10, "spec_verify_ct": 5, "spec_cap_length": 3.0}
        return httpx.Response(200, json={"meta_info": meta}, request=httpx.Request("POST", url))

    monkeypatch.setattr(httpx.Client, "post", fake_post)
    monkeypatch.setattr(bench_serve, "running", lambda launches, log_dir: contextlib.nullcontext())
    launches = {"plain": ServerLaunch(model_path="t", port=1)}
    prompts = [f"p{i}" for i in range(20)]
    cells = bench_serve.bench_arms(launches, prompts, [3], repeats=2, max_new_tokens=16, log_dir=tmp_path,
                                   requests_per_client=4)
    measured = texts_sent[1:]  # after the server warm-up request
    assert len(measured) == 2 * 3 * 4 and most[0] == 3, "two waves of 3 clients x 4 requests, 3 in flight at most"
    assert sorted(measured[:12]) == sorted(prompts[:12]), "the first wave: the first 12 prompts"
    assert sorted(measured[12:]) == sorted(prompts[12:] + prompts[:4]), "the next wave goes on from there"
    assert cells["plain"]["3"]["repeats"] == 2
    # a wave's clients keep their connections open, as serving clients do (a new one per request cost ~21 ms of
    # client CPU here, beside the server): one pooled client per wave, the warm-up's included
    assert len(clients) == 3


def test_verify_cost_compares_the_contexts_overall_and_at_the_width_both_verified_most():
    """The planner chose 8-token windows at the short context and mostly 3-token ones at the long
    one: the overall ratio mixes widths, the same-width one is the cost of context alone."""
    def steps(pairs):
        return [{"verify_tokens": tokens, "verify_seconds": seconds} for tokens, seconds in pairs]

    short = steps([(8, 0.030)] * 5 + [(3, 0.025)] * 3 + [(5, 0.028)] * 2)
    long = steps([(3, 0.040)] * 6 + [(8, 0.050)] * 4 + [(5, 0.045)] * 2)
    report = verify_cost_summary({200: short, 2000: long})
    assert report["200"]["by_verify_tokens"]["8"] == {"verify_seconds_median": 0.030, "steps": 5}
    assert report["ratio_long_to_short"] == pytest.approx(0.0425 / 0.029)  # medians over all widths
    assert report["ratio_at_same_width"] == {"verify_tokens": 8, "ratio": pytest.approx(0.050 / 0.030)}
    assert verify_cost_summary({200: short, 2000: long[:6] + long[-2:]})["ratio_at_same_width"]["verify_tokens"] == 3
    assert verify_cost_summary({200: short[:5], 2000: long[:6]})["ratio_at_same_width"] is None


def test_step_summary_says_which_kind_of_step_delivers_the_tokens(tmp_path):
    """Drafter steps, lookup-only steps and one-token steps apart: their share, tokens a step and
    the worker's tokens/s, and the drafter's rounds with the survival predicted against measured
    (a tree's round measured by its chain: the drafts the tree committed less its gain)."""
    def request(verify_len: int, accepted: int, lookup: int = 0, survivals=(), tree=(0, 0)) -> dict:
        return {"temperature": 0.0, "verify_len": verify_len, "accepted": accepted, "lookup_drafts": lookup,
                "survivals": list(survivals), "tree_drafts": tree[0], "tree_gain": tree[1]}

    def step(drafted: bool, measured: float, requests: list[dict], block: float = 0.0) -> dict:
        committed = sum(r["accepted"] for r in requests) + len(requests)
        return _step(drafted, 0.003, measured - 0.004, measured, None) | {
            "requests": requests, "committed_tokens": committed, "block_seconds": block}

    drafter = [step(True, 0.030, [request(2, 0, survivals=(0.6, 0.3))], block=0.001),
               step(True, 0.026, [request(2, 2, survivals=(0.8, 0.5))], block=0.001),
               step(True, 0.028, [request(1, 1, survivals=(0.7,))], block=0.001),
               step(True, 0.027, [request(2, 3, survivals=(0.9, 0.2), tree=(5, 2))], block=0.001)]
    # the step chose to draft, but its only request had a lookup: the drafter ran no row
    lookup = [step(True, 0.025, [request(7, 3, lookup=7)])]
    plain = [step(False, 0.020, [request(0, 0)])] * 4
    log = tmp_path / "steps.jsonl"
    log.write_text("".join(json.dumps(s) + "\n" for s in drafter + lookup + plain))
    summary = step_summary(log)

    kinds = summary["by_kind"]
    assert kinds["drafter"]["share"] == pytest.approx(4 / 9)
    assert kinds["drafter"]["committed_per_step"] == pytest.approx((1 + 3 + 2 + 4) / 4)
    assert kinds["drafter"]["worker_tok_s"] == pytest.approx(10 / 0.111)
    assert kinds["lookup"] == pytest.approx({"share": 1 / 9, "committed_per_step": 4, "step_seconds_median": 0.025,
                                             "worker_tok_s": 4 / 0.025})
    assert kinds["plain"]["worker_tok_s"] == pytest.approx(1 / 0.020)

    rounds = summary["drafter_rounds"]
    assert rounds["rounds"] == 4 and rounds["none_accepted_share"] == pytest.approx(1 / 4)
    assert rounds["verified_mean"] == pytest.approx(7 / 4) and rounds["accepted_mean"] == pytest.approx(1.5)
    assert rounds["survival_predicted"] == pytest.approx([0.75, 1 / 3], abs=1e-3)
    # position 2: verified three times, accepted once (the tree's chain accepted one draft of two)
    assert rounds["survival_measured"] == pytest.approx([3 / 4, 1 / 3], abs=1e-3)
    assert rounds["trees"] == pytest.approx({"share": 1 / 4, "drafts_mean": 5, "accepted_mean": 3, "gain_mean": 2})


def test_step_summary_of_a_log_without_rounds_or_committed_tokens(tmp_path):
    """Older step logs (no committed tokens, no request rounds) still summarise: no rates, no rounds."""
    log = tmp_path / "steps.jsonl"
    log.write_text(json.dumps(_step(False, 0.001, 0.04, 0.045, None)) + "\n")
    summary = step_summary(log)
    assert summary["by_kind"] == {"plain": {"share": 1.0, "committed_per_step": None, "step_seconds_median": 0.045,
                                            "worker_tok_s": None}}
    assert summary["drafter_rounds"] is None


def test_report_tables_show_throughput_ratios_and_step_kinds_for_a_terminal():
    """`bench serve --no-json` prints tables: each arm's rate and its ratio to its base, and where
    DSPARK_LIVE's tokens came from; a variant arm is compared with the arm it varies."""
    from rich.console import Console

    from dspark_ctl.bench_serve import report_tables

    kind = {"share": 0.7, "committed_per_step": 2.02, "step_seconds_median": 0.0255, "worker_tok_s": 79.2}
    steps = {"decode_steps": 10, "by_kind": {"drafter": kind},
             "drafter_rounds": {"accepted_mean": 1.02, "verified_mean": 3.26, "none_accepted_share": 0.48,
                                "trees": {"share": 0.45, "drafts_mean": 9.3, "accepted_mean": 1.5, "gain_mean": 0.51}}}
    report = {
        "arms": {"plain": {"1": {"aggregate_tok_s": 48.2, "pooled_tok_s": 48.0, "per_user_tok_s": 46.8}},
                 "dspark": {"1": {"aggregate_tok_s": 85.0, "pooled_tok_s": 81.6, "per_user_tok_s": 88.5, "tau": 2.52,
                                  "verify_tokens_per_step": 5.43, "steps": steps}},
                 "dspark.x": {"1": {"aggregate_tok_s": 80.0, "per_user_tok_s": 80.0, "steps": {"decode_steps": 0}}}},
        "speedup": {"1": 1.7635}, "speedup_paired": {"1": 1.759}, "speedup_pooled": {"1": 1.7},
        "dspark.x_vs_dspark": {"1": 0.9412},
    }
    console = Console(record=True, width=220)
    console.print(*report_tables(report))
    text = console.export_text()
    assert "1.76x (1.76x, 1.70x)" in text
    dspark_x = next(line for line in text.splitlines() if "dspark.x" in line)
    assert "dspark" in dspark_x.split("dspark.x", 1)[1] and "0.94x (-, -)" in dspark_x, "a variant against its base"
    assert "70 %, 2.02, 25.5 ms, 79" in text and "1.02 of 3.26 accepted, 48 % none" in text
    assert "trees 45 % (9.3 nodes, +0.51)" in text
    assert text.count("dspark.x") == 1, "a cell without steps gets no step row"


def test_report_tables_show_the_verify_cost_or_why_it_is_missing():
    from rich.console import Console

    from dspark_ctl.bench_serve import report_tables, verify_cost_summary

    def steps(seconds: float, tokens: int) -> list[dict]:
        return [{"verify_tokens": tokens, "verify_seconds": seconds}] * 4

    report = {"arms": {}, "verify_cost": verify_cost_summary({200: steps(0.020, 6), 2000: steps(0.025, 6)})}
    console = Console(record=True, width=200)
    console.print(*report_tables(report))
    text = console.export_text()
    assert "2000" in text and "25.0" in text and "20.0" in text
    assert "longest / shortest context: 1.25x; at 6 tokens a step both: 1.25x" in text
    assert "tok/s" not in text, "no arms ran: no throughput table"

    failed = {"arms": {}, "verify_cost": {"error": "TimeoutError: the server did not start"}}
    console = Console(record=True, width=200)
    console.print(*report_tables(failed))
    assert "verify cost: not measured (TimeoutError: the server did not start)" in console.export_text()


def test_step_summary_separates_the_target_forward_and_the_schedulers_time_between_steps(tmp_path):
    log = tmp_path / "steps.jsonl"
    timed = [_step(True, 0.003, 0.030, 0.033, None) | {"forward_seconds": f, "between_steps_seconds": b,
                                                       "observe_seconds": o}
             for f, b, o in ((0.024, None, 0.0002), (0.026, 0.0015, 0.16), (0.025, 0.0011, 0.0003))]
    log.write_text("".join(json.dumps(s) + "\n" for s in timed))  # the first came after a prefill
    summary = step_summary(log)
    assert summary["forward_seconds_median"] == pytest.approx(0.025)
    assert summary["between_steps_seconds_median"] == pytest.approx(0.0013), "steps after a prefill say nothing"
    assert summary["observe_seconds_median"] == pytest.approx(0.0003)
    assert summary["observe_seconds_max"] == pytest.approx(0.16), "a refit's stall shows in the longest intake"
    log.write_text(json.dumps(_step(True, 0.003, 0.030, 0.033, None)) + "\n")  # a log from before the fields
    older = step_summary(log)
    assert older["forward_seconds_median"] is None and older["between_steps_seconds_median"] is None
    assert older["observe_seconds_median"] is None and older["observe_seconds_max"] is None
