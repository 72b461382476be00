"""`dspark-ctl ship`: replace a shipped drafter folder's weights by a finished training run's.

Every run since session 6 started from the shipped folder (`dspark-ctl train --init-from`) and was
shipped back by hand: copy the weights, keep the folder's history of runs, put the run's held-out
log after the earlier ones. This does it in one checked step, so that a run made on a lent
machine can be shipped within minutes of coming back.

Checks, each with a clear error and the shipped folder left as it was:
- the run is finished (`model.safetensors`, `config.json`, `training.json`, `train_log.jsonl`);
- it started from the weights it replaces (`init_weights_sha256` in its `training.json`, which
  `dspark-ctl train --init-from` records; `--force` for runs made before that);
- a drafter with a confidence head brings its own calibrations (`sts.json`, `sts-greedy.json`,
  fitted by `dspark-ctl eval --calibrate` on the run folder): calibrations of the old weights
  would mislead the planner.

What it writes: the run's weights, config and calibrations; the folder's `training.json` moved to
`training_run<N>.json` and the run's put in its place; the run's log lines appended to the
folder's with steps and seconds offset by its last line, each tagged with `--note`. Files that do
not depend on the weights (`sps*.json`, the engine's cost model) stay.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import typer

RUN_FILES = ("model.safetensors", "config.json", "training.json", "train_log.jsonl")
CALIBRATION_FILES = ("sts.json", "sts-greedy.json")


class ShipError(ValueError):
    """A run that cannot replace the shipped drafter; nothing was changed."""


def weights_sha256(folder: Path) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def check_run(run: Path, into: Path, force: bool) -> dict:
    """The run's training record, after every check that shipping it depends on."""
    missing = [name for name in RUN_FILES if not (run / name).is_file()]
    if missing:
        raise ShipError(f"{run} is not a finished training run: no {', '.join(missing)} "
                        "(dspark-ctl train writes them when a run ends)")
    if not (into / "model.safetensors").is_file() or not (into / "training.json").is_file():
        raise ShipError(f"{into} is not a shipped drafter folder: it needs model.safetensors and training.json")
    record = json.loads((run / "training.json").read_text())
    started_from = record.get("init_weights_sha256")
    if started_from is None and not force:
        raise ShipError(f"{run}/training.json does not record the weights the run started from (a run "
                        "without --init-from, or one made before dspark-ctl train recorded them); "
                        "pass --force if it did start from the weights in " + str(into))
    shipped_sha256 = weights_sha256(into)
    if started_from is not None and started_from != shipped_sha256:
        raise ShipError(f"{run} did not start from the weights in {into} (sha256 {started_from[:12]}... "
                        f"against {shipped_sha256[:12]}...): shipping it would misstate its history")
    config = json.loads((run / "config.json").read_text())
    if config.get("enable_confidence_head"):
        absent = [name for name in CALIBRATION_FILES if not (run / name).is_file()]
        if absent:
            raise ShipError(f"{run} has a confidence head but no {', '.join(absent)}: fit them on the run first, "
                            f"dspark-ctl eval --draft {run} --calibrate --calibration-limit 64 (and again with --temperature 0)")
    return record


def next_run_number(into: Path) -> int:
    numbers = [int(m.group(1)) for path in into.glob("training_run*.json")
               if (m := re.fullmatch(r"training_run(\d+)\.json", path.name))]
    return max(numbers, default=0) + 1


def merged_log(into: Path, run: Path, note: str) -> str:
    """The shipped log, then the run's lines with steps and seconds continuing from its last line."""
    shipped = (into / "train_log.jsonl").read_text() if (into / "train_log.jsonl").exists() else ""
    rows = [json.loads(line) for line in shipped.splitlines() if line.strip()]
    step0 = rows[-1]["step"] if rows else 0
    seconds0 = rows[-1]["train_seconds"] if rows else 0.0
    lines = []
    for line in (run / "train_log.jsonl").read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            row["step"] += step0
            row["train_seconds"] = round(row["train_seconds"] + seconds0, 1)
            lines.append(json.dumps({**row, "run": note}))
    return shipped + "".join(line + "\n" for line in lines)


def ship(run: Path, into: Path, note: str, force: bool = False) -> dict:
    """Build the new folder beside ``into`` and swap it in; a failed check changes nothing."""
    record = check_run(run, into, force)
    staging = into.with_name(into.name + ".shipping")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(into, staging)
    number = next_run_number(into)
    (staging / "training.json").rename(staging / f"training_run{number}.json")
    for name in CALIBRATION_FILES:
        (staging / name).unlink(missing_ok=True)
    for name in ("model.safetensors", "config.json", "training.json", *CALIBRATION_FILES):
        if (run / name).is_file():
            shutil.copy2(run / name, staging / name)
    (staging / "train_log.jsonl").write_text(merged_log(into, run, note))
    previous = into.with_name(into.name + ".previous")
    shutil.rmtree(previous, ignore_errors=True)
    into.rename(previous)
    try:
        staging.rename(into)
    except OSError:
        previous.rename(into)
        raise
    shutil.rmtree(previous)
    return {"into": str(into), "run": str(run), "previous_record": f"training_run{number}.json",
            "steps": record.get("steps_done"), "train_wall_seconds": record.get("train_wall_seconds")}


def ship_command(
    run: Path = typer.Option(..., "--run", help="Finished run folder (dspark-ctl train --out, evaluated with --calibrate)."),
    into: Path = typer.Option(..., "--into", help="Shipped drafter folder the run started from (its --init-from)."),
    note: str = typer.Option(..., "--note", help="What this run was, kept on each of its log lines (e.g. 'session 40: fresh answers')."),
    force: bool = typer.Option(False, "--force", help="Ship a run that does not record the weights it started from."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Ship a training run over the drafter folder it grew from, keeping the folder's history."""
    try:
        result = ship(run, into, note, force)
    except ShipError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(code=2) from error
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        typer.echo(f"shipped {run} into {into} ({result['steps']} steps); the previous record is "
                   f"{result['previous_record']}. Next: dspark-ctl train-curves, and the drafters README.")
