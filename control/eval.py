"""`dspark-ctl eval`: offline tau, acceptance curves, confidence ECE and draft cost of drafters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer


def eval_command(
    draft: List[str] = typer.Option(..., "--draft", help="Drafter folder; repeat to compare (e.g. DSpark and its DFlash twin)."),
    target: Optional[str] = typer.Option(None, "--target", help="Target model folder [default: prepared SmolLM2]."),
    domain: Optional[str] = typer.Option(None, "--domain", help="math | code | chat (default: all three)."),
    prompts: Optional[str] = typer.Option(None, "--prompts", help="JSONL with a 'prompt' field (chat-templated here), an optional 'domain' and an optional 'context' (a conversation's earlier turns, oldest first)."),
    temperature: float = typer.Option(1.0, "--temperature", help="0 = greedy."),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="Drafts verified per round (default gamma)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Prompts per domain."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    batch_size: int = typer.Option(8, "--batch-size"),
    seed: int = typer.Option(0, "--seed"),
    calibrate: bool = typer.Option(False, "--calibrate", help="Fit STS on the calibration split first and save <draft>/sts.json (greedy: sts-greedy.json)."),
    calibration_limit: Optional[int] = typer.Option(None, "--calibration-limit", help="Calibration prompts per domain (default: --limit)."),
    out: Optional[str] = typer.Option(None, "--out", help="Folder for eval.json, rounds-<drafter>.jsonl traces and the PNG."),
    threads: Optional[int] = typer.Option(None, "--threads"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Speculatively decode the eval split (or --prompts) and report tau and calibration."""
    from sglang_dspark.training.data import DOMAINS, read_jsonl, split_prompts
    from sglang_dspark.training.evaluate import evaluate

    from dspark_ctl.train import _target_or_default

    if domain is not None and domain not in DOMAINS:
        raise typer.BadParameter(f"--domain must be one of {', '.join(DOMAINS)}, got {domain!r}")
    if prompts:
        records = [r for r in read_jsonl(Path(prompts)) if domain is None or r.get("domain") == domain]
    else:
        records = split_prompts("eval", domain)
    records = _limit_per_domain(records, limit)
    calibration_count = limit if calibration_limit is None else calibration_limit
    calibration = _limit_per_domain(split_prompts("calibration", domain), calibration_count) if calibrate else None
    report = evaluate(_target_or_default(target), draft, records, temperature, max_new_tokens,
                      batch_size=batch_size, verify_length=block_size, seed=seed,
                      calibration_prompts=calibration, out_dir=Path(out) if out else None, threads=threads)
    if as_json:
        typer.echo(json.dumps(report))
        return
    for name, result in report["drafters"].items():
        taus = ", ".join(f"{d} {s['tau']:.2f} ± {s['tau_se']:.2f}" for d, s in result["domains"].items())
        typer.echo(f"{name}: macro tau {result['macro_tau']:.3f} ± {result['macro_tau_se']:.3f} ({taus}); "
                   f"draft share {result['draft_time_share']:.2f}")
        if "ece_sts" in result:
            ece = " ".join(f"{value:.3f}" for value in result["ece_sts"])
            floor = " ".join(f"{value:.3f}" for value in result["ece_floor_sts"])
            typer.echo(f"  ECE after STS per position: {ece}\n  (perfect calibration on these rounds: {floor})")


def _limit_per_domain(records: list[dict], limit: Optional[int]) -> list[dict]:
    if limit is None:
        return records
    seen: dict[str, int] = {}
    kept = []
    for record in records:
        key = record.get("domain", "unknown")
        if seen.get(key, 0) < limit:
            seen[key] = seen.get(key, 0) + 1
            kept.append(record)
    return kept


def eval_merge_command(
    folders: List[str] = typer.Argument(..., help="Output folders of `dspark-ctl eval --out` runs on the same prompts and settings."),
    out: str = typer.Option(..., "--out", help="Folder for the merged eval.json, the round traces and the PNG."),
) -> None:
    """Merge evaluations run as separate processes (one per drafter) into one report and plot."""
    from sglang_dspark.training.evaluate import merge_reports, read_traces, write_outputs

    reports, records = [], []
    for folder in map(Path, folders):
        report_file = folder / "eval.json"
        if not report_file.is_file():
            raise typer.BadParameter(f"{folder}: no eval.json there; expected a `dspark-ctl eval --out` folder")
        reports.append(json.loads(report_file.read_text()))
        for name in reports[-1]["drafters"]:
            records += read_traces(folder / f"rounds-{name}.jsonl")
    try:
        merged = merge_reports(reports)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    write_outputs(Path(out), merged, records)
    typer.echo(json.dumps({"out": out, "drafters": list(merged["drafters"]),
                           "macro_tau": {n: r["macro_tau"] for n, r in merged["drafters"].items()},
                           "macro_tau_ratio": merged.get("macro_tau_ratio")}))


def train_curves_command(
    logs: List[str] = typer.Argument(..., help="NAME=PATH of a drafter's train_log.jsonl; repeat to compare."),
    out: str = typer.Option(..., "--out", help="PNG to write."),
) -> None:
    """Plot held-out tau against training time for one or more drafters."""
    from sglang_dspark.training.evaluate import plot_training_curves

    named = {}
    for item in logs:
        name, sep, path = item.partition("=")
        if not sep or not Path(path).is_file():
            raise typer.BadParameter(f"{item!r}: expected NAME=PATH of an existing train_log.jsonl")
        named[name] = Path(path)
    plot_training_curves(named, Path(out))
    typer.echo(out)
