"""Launch-time checks of DSPARK_LIVE server arguments: clear errors for what does not fit."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from sglang_dspark.engine.algorithm import validate_server_args

TARGET = {"vocab_size": 1024, "hidden_size": 128, "num_hidden_layers": 4}


def _folders(tmp_path, **drafter_overrides):
    target, drafter = tmp_path / "target", tmp_path / "drafter"
    target.mkdir()
    drafter.mkdir()
    (target / "config.json").write_text(json.dumps(TARGET))
    config = {"block_size": 4, "target_layer_ids": [1, 2], "vocab_size": 1024, "hidden_size": 128,
              **drafter_overrides}
    (drafter / "config.json").write_text(json.dumps(config))
    return target, drafter


def _args(target, drafter, **overrides):
    fields = {"model_path": str(target), "speculative_draft_model_path": drafter and str(drafter),
              "speculative_num_draft_tokens": None, "page_size": 1}
    return SimpleNamespace(**{**fields, **overrides})


def test_matching_drafter_passes(tmp_path):
    validate_server_args(_args(*_folders(tmp_path)))


def test_missing_draft_path_says_which_flag(tmp_path):
    target, _ = _folders(tmp_path)
    with pytest.raises(ValueError, match="needs --speculative-draft-model-path"):
        validate_server_args(_args(target, None))


def test_num_draft_tokens_must_fit_the_verify_window(tmp_path):
    with pytest.raises(ValueError, match=r"expected max\(gamma, tree nodes\) \+ 1 = 10"):
        validate_server_args(_args(*_folders(tmp_path), speculative_num_draft_tokens=8))


@pytest.mark.parametrize("overrides,message", [
    ({"target_layer_ids": [1, 4]}, "include \\[4\\], but the target has 4 layers"),
    ({"vocab_size": 2048}, "vocab_size=2048 does not match the target's vocab_size=1024"),
    ({"hidden_size": 64}, "hidden_size=64 does not match"),
])
def test_drafter_that_does_not_fit_the_target_is_refused(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        validate_server_args(_args(*_folders(tmp_path, **overrides)))


def test_gamma_knob_above_block_size_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_GAMMA", "6")
    with pytest.raises(ValueError, match="DSPARK_GAMMA=6"):
        validate_server_args(_args(*_folders(tmp_path)))
