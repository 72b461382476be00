"""The serving simulator and `dspark-ctl bench sim`: deterministic, paper-shaped traces, the
trace file schema with clear errors, the stable JSON schema and the Pareto plot."""

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from sglang_dspark.scheduling.cost_model import AdditiveCostModel
from sglang_dspark.scheduling.simulator import SimSettings, simulate
from sglang_dspark.scheduling.traces import DOMAIN_SHAPES, FileTraces, SyntheticTraces, TraceError, expected_tau

META = {"hardware": "test", "model": "test"}
PROFILES = Path(__file__).resolve().parents[1] / "profiles"


def cpu_like() -> AdditiveCostModel:
    return AdditiveCostModel(0.06, [1, 64], [0.0, 0.01], [1, 8, 512], [0.0, 0.05, 6.0], metadata=META)


def drafter_like() -> AdditiveCostModel:
    return AdditiveCostModel(0.01, [1, 64], [0.0, 0.0], [1, 448], [0.0, 1.2], metadata=META)


@pytest.mark.parametrize("domain", list(DOMAIN_SHAPES))
def test_synthetic_traces_reproduce_the_paper_domain_tau(domain):
    tau = expected_tau(SyntheticTraces(seed=5), domain, rounds=20000)
    assert tau == pytest.approx(DOMAIN_SHAPES[domain].paper_tau, abs=0.1)


def test_synthetic_traces_are_deterministic_by_seed_and_confidence_is_informative():
    a, b, c = SyntheticTraces(seed=1), SyntheticTraces(seed=1), SyntheticTraces(seed=2)
    ids, offsets = torch.tensor([0, 1, 2] * 400), torch.zeros(1200)
    la, na = a.draw(ids, offsets)
    lb, nb = b.draw(ids, offsets)
    lc, _ = c.draw(ids, offsets)
    assert torch.equal(la, lb) and torch.equal(na, nb) and not torch.equal(la, lc)
    first_confident = torch.sigmoid(la[:, 0]) > 0.9
    accepted_first = (na > 0).float()
    assert accepted_first[first_confident].mean() > accepted_first[~first_confident].mean() + 0.1


def test_simulator_is_deterministic_and_policies_behave_as_defined():
    settings = SimSettings(requests_per_slot=2, min_requests=6, output_tokens=(32, 64))
    run = lambda policy: simulate(policy, 3, cpu_like(), drafter_like(), SyntheticTraces(seed=0), settings)  # noqa: E731
    first, second = run("scheduled"), run("scheduled")
    assert first.to_json() == second.to_json()
    no_spec = run("no_spec")
    assert no_spec.tau == 1.0 and no_spec.mean_verified_drafts == 0.0
    static = run("static_7")
    assert static.mean_verified_drafts > 5.0 and static.tau > 2.0


def test_the_production_early_stop_planner_is_simulated_and_beats_both_baselines():
    settings = SimSettings(requests_per_slot=2, min_requests=6, output_tokens=(32, 64))
    for concurrency in (1, 3):
        run = lambda policy: simulate(policy, concurrency, cpu_like(), drafter_like(),  # noqa: E731
                                      SyntheticTraces(seed=0), settings)
        early = run("early_stop")
        assert early.to_json() == run("early_stop").to_json()
        assert early.aggregate_tps > max(run("no_spec").aggregate_tps, run("static_7").aggregate_tps)
        assert 0 < early.mean_verified_drafts < 7


def test_trace_file_round_trip_and_errors(tmp_path):
    path = tmp_path / "traces.jsonl"
    rows = [
        {"domain": "math", "confidence_logits": [3.0, 2.0, 1.0], "accepted_length": 3},
        {"domain": "chat", "confidence_logits": [0.0, -1.0, -2.0], "accepted_length": 1, "verified_length": 2},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    source = FileTraces(path, seed=0)
    assert source.gamma == 3 and source.domains == ("chat", "math")
    logits, natural = source.draw(torch.tensor([0, 1, 1]), torch.zeros(3))
    assert natural.tolist() == [1, 3, 3] and logits[1].tolist() == [3.0, 2.0, 1.0]
    bad = tmp_path / "bad.jsonl"
    for line, message in [
        ('{"domain": "math", "confidence_logits": [1.0], "accepted_length": 2}', "accepted_length"),
        ('{"confidence_logits": [1.0], "accepted_length": 0}', "'domain'"),
        ("not json", "not JSON"),
    ]:
        bad.write_text(line + "\n")
        with pytest.raises(TraceError, match=message):
            FileTraces(bad)
    bad.write_text(json.dumps(rows[0]) + "\n" + json.dumps({**rows[0], "confidence_logits": [1.0, 1.0], "accepted_length": 0}) + "\n")
    with pytest.raises(TraceError, match=r"bad.jsonl:2: .*same gamma"):
        FileTraces(bad)


def test_cli_prints_the_stable_schema_and_writes_the_plot(tmp_path):
    from dspark_ctl.cli import app

    plot = tmp_path / "pareto.png"
    result = CliRunner().invoke(app, [
        "bench", "sim", "--concurrency", "1,4", "--policies", "no_spec,static_1,scheduled",
        "--requests-per-slot", "1", "--min-requests", "4", "--no-planner-bench",
        "--json", "--plot", str(plot),
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert len(report["results"]) == 6
    for row in report["results"]:
        assert {"policy", "concurrency", "aggregate_tps", "per_user_tps", "tau"} <= set(row)
        assert row["aggregate_tps"] > 0 and row["per_user_tps"] > 0
    assert report["target_cost_model"]["kind"] == "context"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_applies_an_sts_calibration(tmp_path):
    from dspark_ctl.cli import app
    from sglang_dspark.calibration.sts import StsCalibration

    path = tmp_path / "sts.json"
    StsCalibration([50.0] * 7).save(path)  # squashes every confidence to ~0.5: short verification
    args = ["bench", "sim", "--concurrency", "2", "--policies", "algorithm1", "--requests-per-slot", "1",
            "--min-requests", "4", "--no-planner-bench", "--json"]
    plain = json.loads(CliRunner().invoke(app, args).output)["results"][0]
    squashed = json.loads(CliRunner().invoke(app, args + ["--sts", str(path)]).output)["results"][0]
    assert squashed["mean_verified_drafts"] < plain["mean_verified_drafts"]


def test_cli_refuses_a_bad_cost_model_with_the_reason(tmp_path):
    from dspark_ctl.cli import app

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "sglang-dspark/cost-model", "version": 1, "kind": "step",
                               "metadata": {}, "batch_tokens": [1], "steps_per_second": [1.0]}))
    result = CliRunner().invoke(app, ["bench", "sim", "--sps", str(bad), "--json"])
    assert result.exit_code != 0 and "metadata lacks" in result.output


@pytest.mark.slow
def test_scheduler_moves_the_pareto_frontier_on_the_measured_cpu_profile():
    """Issue 3's acceptance claims, re-run on the shipped CPU profiles (about 2-4 minutes)."""
    from sglang_dspark.scheduling.cost_model import load_cost_model
    from sglang_dspark.scheduling.simulator import POLICIES, matched_throughput

    target = load_cost_model(PROFILES / "cpu-smollm2-135m-target-context.json")
    drafter = load_cost_model(PROFILES / "cpu-smollm2-135m-drafter-context.json")
    results = [
        simulate(policy, c, target, drafter, SyntheticTraces(seed=0), SimSettings(seed=0))
        for c in (1, 2, 4, 8, 16, 32, 64)
        for policy in POLICIES
    ]
    by = {(r.policy, r.concurrency): r for r in results}
    for c in (1, 2, 4, 8, 16, 32, 64):
        best = max(by[("no_spec", c)].aggregate_tps, by[("static_7", c)].aggregate_tps)
        assert by[("scheduled", c)].aggregate_tps >= best, f"concurrency {c}"
    matched = matched_throughput(results)
    assert matched and min(m["ratio"] for m in matched) >= 1.3
