"""Training prompts: code's method prompts and chat's later turns (as conversations) extend the train split without moving a prompt."""

from __future__ import annotations

import ast
import json
import random

import pytest

from sglang_dspark.training.data import (
    CONVERSATION_TURNS,
    _chitchat_turns,
    chat_conversation_prompts,
    chat_ids,
    chat_prompts,
    domain_prompts,
    frozen_held_out,
    human_eval_prompts,
    read_jsonl,
    record_prompt_ids,
    reference_records,
    stdlib_function_prompts,
)


@pytest.fixture(scope="module")
def code_domain() -> tuple[list[str], dict]:
    return domain_prompts("code", seed=0)  # parses the standard library twice, so once per module


@pytest.fixture(scope="module")
def code_prompts(code_domain) -> list[str]:
    return code_domain[0]


def test_code_held_out_splits_are_still_the_first_code_prompts(code_prompts):
    """The frozen eval and calibration code prompts were the first 64 + 64 of the seeded list
    before method prompts existed; they must still be, or eval prompts could leak into train."""
    held = frozen_held_out()
    assert code_prompts[:64] == held["eval"]["code"]
    assert code_prompts[64:128] == held["calibration"]["code"]


def test_method_prompts_come_after_the_earlier_prompts_in_their_old_order(code_prompts):
    """Shipped answer files were generated for `train-code-N` ids: every earlier prompt keeps its index."""
    earlier = list(dict.fromkeys([*human_eval_prompts(), *(p for p, _ in stdlib_function_prompts(limit=6000))]))
    random.Random("0-code").shuffle(earlier)
    assert code_prompts[: len(earlier)] == earlier
    later = code_prompts[len(earlier):]
    assert len(later) > 1000  # the point: several times more code prompts than the ~1,400 before
    assert all(prompt.startswith("Write the method `") for prompt in later)


def test_method_prompts_ask_for_a_documented_method_and_carry_its_source(code_domain):
    prompts, notes = code_domain
    methods = [(prompt, notes["references"][prompt]) for prompt in prompts if prompt.startswith("Write the method")]
    assert len(methods) > 1000
    for prompt, reference in methods:
        qualified = prompt.split("`")[1]
        owner, name = qualified.split(".")
        stub = prompt.split("```python\n")[1].rsplit("```", 1)[0]
        cls = ast.parse(stub).body[0]  # the stub is valid Python: a class holding the method's signature
        assert isinstance(cls, ast.ClassDef) and cls.name == owner
        assert cls.body[0].name == name and ast.get_docstring(cls.body[0])
        source = reference.removeprefix("```python\n").removesuffix("\n```")
        assert ast.parse(source).body[0].name == name  # the method on its own, dedented


def test_chat_later_turns_come_after_the_opening_turns_in_their_old_order():
    """Shipped answer files were generated for `train-chat-N` ids of opening turns; the later
    turns only add prompts after them, never one of the frozen held-out ones."""
    prompts, notes = domain_prompts("chat", seed=0)
    openers = list(dict.fromkeys(prompt for prompt, _ in chat_prompts()))
    random.Random("0-chat").shuffle(openers)
    assert prompts[: len(openers)] == openers
    held = frozen_held_out()
    assert prompts[:64] == held["eval"]["chat"] and prompts[64:128] == held["calibration"]["chat"]
    later = prompts[len(openers):]
    assert len(later) > 10 * len(openers) and not set(later) & set(openers)
    assert sum(bool(notes["references"].get(prompt)) for prompt in later) > 0.9 * len(later)  # the reply turn


def test_chat_later_turns_carry_their_conversation_from_a_turn_of_the_same_sender():
    """A later turn is answered as a multi-turn chat: the conversation up to it, an odd number
    of turns so that they alternate user / assistant from a user's turn to the one answered."""
    conversations = [prompt for prompt, _ in chat_conversation_prompts()]
    assert all(isinstance(turns, tuple) and 3 <= len(turns) <= CONVERSATION_TURNS and len(turns) % 2 == 1
               for turns in conversations)
    first = next(turns for turns in _chitchat_turns() if len(turns) >= 9 and all(len(t) >= 8 for t in turns[2:9]))
    ours = [turns for turns in conversations if turns[-1] in first[2:9]][:7]
    assert ours == [first[0:3], first[1:4], first[0:5], first[1:6], first[0:7], first[1:8], first[2:9]]  # the last 7


def test_a_conversation_alternates_roles_back_from_the_prompt_and_sheds_its_oldest_exchanges_to_fit(
        tiny_serving_models):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_serving_models[0])
    context = ["Hi, how are you today?", "Fine, and you?", "Great. Any plans?", "A walk by the river."]
    text = tokenizer.decode(chat_ids(tokenizer, "Sounds nice.", context))
    assert text.index("<|im_start|>user\nHi, how") < text.index("<|im_start|>assistant\nFine") \
        < text.index("<|im_start|>user\nGreat") < text.index("<|im_start|>assistant\nA walk") \
        < text.index("<|im_start|>user\nSounds nice.") and text.endswith("<|im_start|>assistant\n")
    record = {"prompt": "Sounds nice.", "context": context}
    whole = chat_ids(tokenizer, "Sounds nice.", context)
    assert record_prompt_ids(tokenizer, record, len(whole)) == whole
    assert record_prompt_ids(tokenizer, record, len(whole) - 1) == chat_ids(tokenizer, "Sounds nice.", context[2:])
    alone = chat_ids(tokenizer, "Sounds nice.")
    assert record_prompt_ids(tokenizer, record, len(alone)) == alone
    assert record_prompt_ids(tokenizer, record, 3) == alone[-3:]  # too long alone: its last ids, as before


def test_a_prompt_file_with_a_malformed_context_is_refused_by_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "ok", "context": ["a", "b"]}) + "\n"
                    + json.dumps({"prompt": "next", "context": "a single string"}) + "\n")
    with pytest.raises(ValueError, match=r"prompts.jsonl:2: 'context' must be a list of strings"):
        read_jsonl(path)


def test_reference_answers_of_a_conversation_are_templated_with_it(tiny_serving_models, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_serving_models[0])
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"id": "train-chat-9", "domain": "chat", "prompt": "And you?",
                                 "context": ["Hello!", "Hi, I am well."], "reference": "Good, thanks."}) + "\n")
    (record,) = reference_records(tokenizer, train)
    assert record["prompt_ids"] == chat_ids(tokenizer, "And you?", ["Hello!", "Hi, I am well."])
