"""The import layering of docs/architecture: an operator's client never drags in torch or sglang,
and the pure-torch core never imports sglang."""

import subprocess
import sys

import pytest


def _modules_after_import(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return {name.split(".")[0] for name in out.stdout.split()}


@pytest.mark.parametrize("module", ["dspark_ctl", "dspark_ctl.cli", "dspark_tui"])
def test_control_plane_imports_neither_torch_nor_sglang(module: str) -> None:
    loaded = _modules_after_import(module)
    assert "torch" not in loaded and "sglang" not in loaded


def test_cli_help_runs_without_torch() -> None:
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from dspark_ctl.cli import app\n"
        "result = CliRunner().invoke(app, ['--help'])\n"
        "assert result.exit_code == 0, result.output\n"
        "assert 'torch' not in sys.modules, 'dspark-ctl --help imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
