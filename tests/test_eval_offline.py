"""The offline evaluator: tau and curves are exactly what its own per-round records say."""

import json
import math

import pytest
import torch

from sglang_dspark.calibration.sts import StsCalibration
from sglang_dspark.scheduling.traces import FileTraces
from sglang_dspark.training.evaluate import (
    RoundRecord, position_stats, read_traces, run_rounds, summarize, tau, tau_standard_error, write_outputs,
)
from tests.tiny import make_tiny_drafter, make_tiny_target


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _prompts():
    generator = torch.Generator().manual_seed(3)
    return [{"id": f"p{i}", "domain": ("math", "chat")[i % 2],
             "prompt_ids": torch.randint(3, 500, (6 + i,), generator=generator).tolist()} for i in range(4)]


def test_tau_equals_the_records_and_survives_the_trace_file(tmp_path):
    target = make_tiny_target(seed=0)
    drafter = make_tiny_drafter(target, seed=1, gamma=4)
    records, timing = run_rounds(target, drafter, None, _prompts(), "dspark", temperature=1.0,
                                 max_new_tokens=24, batch_size=2, verify_length=None, seed=0)
    # every generated token is one accepted draft or one bonus/correction token of some round,
    # except the first token (sampled at prefill) and drafts cut at max_new_tokens
    assert timing["generated_tokens"] == 4 * 24
    assert sum(r.accepted_length + 1 for r in records) >= 4 * 24 - 4
    summary = summarize(records, 4, StsCalibration.identity(4))
    by_hand = sum(r.accepted_length + 1 for r in records) / len(records)
    assert summary["tau_all_rounds"] == pytest.approx(by_hand)
    for domain in ("math", "chat"):
        subset = [r for r in records if r.domain == domain]
        assert summary["domains"][domain]["tau"] == pytest.approx(
            sum(r.accepted_length + 1 for r in subset) / len(subset))
    report = {"temperature": 1.0, "drafters": {"dspark": summary}}
    write_outputs(tmp_path, report, records)
    again = read_traces(tmp_path / "rounds-dspark.jsonl")
    assert tau(again) == pytest.approx(summary["tau_all_rounds"])
    assert position_stats(again, 4) == position_stats(records, 4)
    assert (tmp_path / "conditional_acceptance.png").stat().st_size > 1000
    FileTraces(tmp_path / "rounds-dspark.jsonl")  # the simulator accepts our traces
    assert 0.0 < timing["draft_time_share"] < 1.0


def test_tau_error_counts_prompts_not_rounds():
    """Rounds of one prompt move together: the error is the ratio estimator's over prompts."""
    def prompt(name, accepted):
        return [RoundRecord("d", "math", name, i, 4, a, None) for i, a in enumerate(accepted)]

    easy, hard = prompt("easy", [3, 3, 3, 3]), prompt("hard", [0, 0])
    records = easy + hard
    mean = tau(records)  # (16 + 2) / 6 = 3
    by_hand = math.sqrt(2 / 1 * ((16 - mean * 4) ** 2 + (2 - mean * 2) ** 2)) / 6
    assert tau_standard_error(records) == pytest.approx(by_hand)
    # twice the rounds of the same two prompts: no more certain, since there are still two prompts
    assert tau_standard_error(records + records) == pytest.approx(by_hand)
    # the same rounds spread over many prompts that all look alike: far more certain
    spread = [RoundRecord("d", "math", f"p{i}", 0, 4, r.accepted_length, None) for i, r in enumerate(records)]
    assert tau_standard_error(spread) < by_hand / 2
    assert math.isnan(tau_standard_error(easy))  # one prompt: no spread to measure
    summary = summarize(records + [RoundRecord("d", "chat", "c", 0, 4, 1, None)] * 2
                        + [RoundRecord("d", "chat", "c2", 0, 4, 2, None)], 4, None)
    chat_se = summary["domains"]["chat"]["tau_se"]
    assert summary["macro_tau_se"] == pytest.approx(math.sqrt(by_hand ** 2 + chat_se ** 2) / 2)


def test_position_stats_follow_the_definitions():
    def rec(accepted, verified=3):
        return RoundRecord("d", "chat", "p", 0, verified, accepted, None)

    stats = position_stats([rec(0), rec(1), rec(3), rec(3), rec(2, verified=2)], 3)
    assert stats["prefix_survival"] == pytest.approx([4 / 5, 3 / 5, 2 / 4])
    # position 3: of the 2 rounds that verified it after accepting 2 drafts, both accepted it (the
    # round cut at 2 verified drafts does not count); a ratio of survivals would read (2/4)/(3/5)
    assert stats["conditional_acceptance"] == pytest.approx([4 / 5, 3 / 4, 2 / 2])
    cut_short = [rec(0, verified=1)] * 20 + [rec(2, verified=2)] * 2  # survivals 2/22, then 2/2
    assert position_stats(cut_short, 2)["conditional_acceptance"] == pytest.approx([2 / 22, 1.0])
    assert tau([rec(0), rec(3)]) == 2.5


def _eval_folder(folder, name: str, temperature: float = 1.0):
    """What `dspark-ctl eval --out folder` writes for one tiny drafter."""
    target = make_tiny_target(seed=0)
    drafter = make_tiny_drafter(target, seed=1, gamma=4)
    records, _ = run_rounds(target, drafter, None, _prompts(), name, temperature=temperature,
                            max_new_tokens=12, batch_size=2, verify_length=None, seed=0)
    report = {"temperature": temperature, "max_new_tokens": 12, "prompts": 4, "seed": 0, "verify_length": None,
              "drafters": {name: summarize(records, 4, None)}}
    write_outputs(folder, report, records)
    return report


def test_eval_merge_joins_per_drafter_runs_and_refuses_mismatched_ones(tmp_path):
    from typer.testing import CliRunner

    from dspark_ctl.cli import app

    first = _eval_folder(tmp_path / "a", "dspark")
    _eval_folder(tmp_path / "b", "twin")
    result = CliRunner().invoke(app, ["eval-merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    merged = json.loads((tmp_path / "m" / "eval.json").read_text())
    assert list(merged["drafters"]) == ["dspark", "twin"]
    assert merged["macro_tau_ratio"]["dspark/twin"] == pytest.approx(1.0)  # the same drafter twice
    assert merged["drafters"]["dspark"]["macro_tau"] == first["drafters"]["dspark"]["macro_tau"]
    assert (tmp_path / "m" / "rounds-twin.jsonl").is_file()

    _eval_folder(tmp_path / "c", "greedy", temperature=0.0)
    refused = CliRunner().invoke(app, ["eval-merge", str(tmp_path / "a"), str(tmp_path / "c"), "--out", str(tmp_path / "x")])
    assert refused.exit_code == 2 and "differ in temperature" in refused.output
    assert not (tmp_path / "x").exists()


def test_greedy_calibration_goes_to_its_own_file(tmp_path):
    """`--calibrate` at temperature 0 writes sts-greedy.json (what the server reads for greedy
    requests) and leaves the sampled calibration alone."""
    from sglang_dspark.training.evaluate import _calibration_for

    target = make_tiny_target(seed=0)
    drafter = make_tiny_drafter(target, seed=1, gamma=4)
    fitted = _calibration_for(str(tmp_path), drafter, target, None, _prompts(), "dspark", 0.0,
                              max_new_tokens=24, batch_size=2, seed=0)
    assert (tmp_path / "sts-greedy.json").is_file() and not (tmp_path / "sts.json").exists()
    loaded = _calibration_for(str(tmp_path), drafter, target, None, None, "dspark", 0.0, 24, 2, 0)
    assert loaded.temperatures == pytest.approx(fitted.temperatures)
    assert _calibration_for(str(tmp_path), drafter, target, None, None, "dspark", 1.0, 24, 2, 0) is None
