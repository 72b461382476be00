"""`dspark-ctl bench prefix`: the latency of requests whose prompt is mostly cached."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from dspark_ctl.bench_prefix import prefix_texts, time_prefix
from dspark_ctl.cli import app


@pytest.mark.server
def test_requests_after_a_cached_prefix_are_timed_on_the_prefix_the_server_reused(baseline_server, tiny_serving_models):
    prefix = prefix_texts(str(tiny_serving_models[0]), [300])[300]
    cell = time_prefix(baseline_server.url, prefix, requests=3, max_new_tokens=1)
    # each request extends the cached prefix by its own line: the server reuses the prefix, not the whole prompt
    assert 290 <= cell["cached_tokens"] < cell["prompt_tokens"]
    assert 0 < cell["seconds_min"] <= cell["seconds_median"] <= cell["seconds_max"]


def test_the_prefix_is_cut_to_the_tokens_asked_and_a_length_past_the_source_is_refused(tiny_serving_models):
    from transformers import AutoTokenizer

    target = str(tiny_serving_models[0])
    texts = prefix_texts(target, [40, 120])
    tokenizer = AutoTokenizer.from_pretrained(target)
    for length, text in texts.items():
        assert abs(len(tokenizer(text, add_special_tokens=False)["input_ids"]) - length) <= 2
    with pytest.raises(ValueError, match="argparse.py has only"):
        prefix_texts(target, [100, 10**7])


@pytest.mark.parametrize("arguments, message", [(["--contexts", "2k"], "expected comma-separated token counts"),
                                                (["--contexts", "0,200"], "expected token counts >= 1"),
                                                (["--arms", "plain,eagle"], "plain, nodraft, dspark")])
def test_bench_prefix_refuses_bad_lengths_and_arms(arguments, message):
    result = CliRunner().invoke(app, ["bench", "prefix", "--model-path", "/nonexistent", *arguments],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 2 and message in result.output, result.output


def test_bench_prefix_says_which_length_the_source_cannot_give(tiny_serving_models):
    result = CliRunner().invoke(app, ["bench", "prefix", "--model-path", str(tiny_serving_models[0]), "--arms", "plain",
                                      "--contexts", "100,10000000"], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "a cached prefix of 10000000 tokens" in result.output, result.output
