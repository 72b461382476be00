"""`dspark-ctl data generate --server`: training answers from a running SGLang server of the target."""

from __future__ import annotations

import gzip
import json

import httpx
import pytest
from typer.testing import CliRunner

from dspark_ctl.cli import app
from sglang_dspark.training.data import chat_ids, generate_responses_via_server, read_responses

PROMPTS = ["def parse(text):", "What is 7 times 6?", "Tell me about your weekend.", "import os\nos.path"]


def _write_prompts(path, prompts: list[str]) -> None:
    with open(path, "w") as handle:
        for index, prompt in enumerate(prompts):
            domain = ("code", "math", "chat")[index % 3]
            handle.write(json.dumps({"id": f"train-{domain}-{index}", "domain": domain, "prompt": prompt}) + "\n")


@pytest.mark.server
def test_server_answers_are_the_targets_and_a_rerun_only_answers_new_prompts(baseline_server, tiny_serving_models,
                                                                            tmp_path):
    from transformers import AutoTokenizer

    target, _ = tiny_serving_models
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "answers.jsonl"
    _write_prompts(prompts, PROMPTS[:3])
    summary = generate_responses_via_server(baseline_server.url, str(target), prompts, out, max_new_tokens=12,
                                            concurrency=2, temperature=0.0)
    assert summary["responses"] == 3 and not summary["stopped_by_budget"]

    _write_prompts(prompts, PROMPTS)
    assert generate_responses_via_server(baseline_server.url, str(target), prompts, out, max_new_tokens=12,
                                         concurrency=2, temperature=0.0)["responses"] == 1
    records = {record["id"]: record for record in read_responses(out)}
    assert len(records) == len(PROMPTS)
    for index, prompt in enumerate(PROMPTS):
        record = records[f"train-{('code', 'math', 'chat')[index % 3]}-{index}"]
        assert record["prompt_ids"] == chat_ids(tokenizer, prompt)
        greedy = httpx.post(f"{baseline_server.url}/generate", timeout=300, json={
            "input_ids": record["prompt_ids"], "sampling_params": {"max_new_tokens": 12, "temperature": 0.0}})
        assert record["response_ids"] == greedy.json()["output_ids"]
        assert 0 < len(record["response_ids"]) <= 12

    packed = tmp_path / "answers.jsonl.gz"
    packed.write_bytes(gzip.compress(out.read_bytes()))
    assert read_responses(packed) == read_responses(out)  # how drafters/data/ keeps them

    # a new split names the same prompts by other ids: the answered ones are matched by token ids
    # (and a conversation ending on an answered prompt is a new prompt: the target reads its turns)
    renamed, fresh = tmp_path / "renamed.jsonl", tmp_path / "fresh.jsonl"
    context = ["Tell me about your weekend.", "I went hiking."]
    with open(renamed, "w") as handle:
        for index, prompt in enumerate([*PROMPTS, "Name three rivers."]):
            handle.write(json.dumps({"id": f"train-chat-{100 + index}", "domain": "chat", "prompt": prompt}) + "\n")
        handle.write(json.dumps({"id": "train-chat-200", "domain": "chat", "prompt": PROMPTS[0], "context": context}) + "\n")
    summary = generate_responses_via_server(baseline_server.url, str(target), renamed, fresh, max_new_tokens=12,
                                            concurrency=2, temperature=0.0, skip_answered=[packed])
    assert summary["responses"] == 2
    assert sorted(record["prompt_ids"] for record in read_responses(fresh)) == sorted(
        [chat_ids(tokenizer, "Name three rivers."), chat_ids(tokenizer, PROMPTS[0], context)])


def test_generate_names_the_url_when_no_server_answers(tiny_serving_models, tmp_path):
    target, _ = tiny_serving_models
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "answers.jsonl"
    _write_prompts(prompts, PROMPTS)
    result = CliRunner().invoke(app, ["data", "generate", "--server", "http://127.0.0.1:9", "--target", str(target),
                                      "--prompts", str(prompts), "--out", str(out)])
    assert result.exit_code == 2
    assert "no SGLang server answers at http://127.0.0.1:9" in result.output
    assert not out.exists()


def test_generate_names_a_missing_skip_answered_file(tiny_serving_models, tmp_path):
    target, _ = tiny_serving_models
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "answers.jsonl"
    _write_prompts(prompts, PROMPTS)
    result = CliRunner().invoke(app, ["data", "generate", "--server", "http://127.0.0.1:9", "--target", str(target),
                                      "--prompts", str(prompts), "--out", str(out),
                                      "--skip-answered", str(tmp_path / "gone.jsonl.gz")])
    assert result.exit_code == 2
    assert f"no answer file at {tmp_path / 'gone.jsonl.gz'}" in result.output
    assert not out.exists()
