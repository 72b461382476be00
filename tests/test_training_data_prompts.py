"""Training prompts: code's method prompts and chat's later turns extend the train split without moving a prompt."""

from __future__ import annotations

import ast
import random

import pytest

from sglang_dspark.training.data import (
    chat_prompts,
    domain_prompts,
    frozen_held_out,
    human_eval_prompts,
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
