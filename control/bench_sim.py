"""`dspark-ctl bench sim | planner | sps-cpu | gemm | attention`: the serving simulator, the planner's speed,
the CPU cost-model measurement, the CPU linears (BLAS against weight panels) and attention (SDPA
against the paged kernel).

The torch work lives in `sglang_dspark.scheduling`, imported inside each command body, so
`import dspark_ctl` stays light and control/ never imports torch itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

PROFILES_DIR = Path(__file__).resolve().parents[1] / "profiles"
DEFAULT_TARGET_SPS = PROFILES_DIR / "cpu-smollm2-135m-target-context.json"
DEFAULT_DRAFTER_SPS = PROFILES_DIR / "cpu-smollm2-135m-drafter-context.json"
POLICY_STYLE = {
    "no_spec": ("tab:gray", "o"),
    "static_1": ("tab:blue", "s"),
    "static_7": ("tab:orange", "^"),
    "algorithm1": ("tab:purple", "v"),
    "scheduled": ("tab:green", "D"),
    "early_stop": ("tab:red", "P"),
}


def _parse_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise typer.BadParameter(f"{what} must be comma-separated integers, got {text!r}") from error
    if not values or any(v < 1 for v in values):
        raise typer.BadParameter(f"{what} must list integers >= 1, got {text!r}")
    return values


def _load_model(path: Path, what: str) -> Any:
    from sglang_dspark.scheduling.cost_model import CostModelError, load_cost_model

    try:
        return load_cost_model(path)
    except CostModelError as error:
        raise typer.BadParameter(f"{what}: {error}") from error


def _plot(results: list[Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7.5, 5.5))
    for policy, (color, marker) in POLICY_STYLE.items():
        points = sorted((r for r in results if r.policy == policy), key=lambda r: r.concurrency)
        if not points:
            continue
        axes.plot([p.per_user_tps for p in points], [p.aggregate_tps for p in points],
                  color=color, marker=marker, label=policy)
        for p in points:
            axes.annotate(str(p.concurrency), (p.per_user_tps, p.aggregate_tps), fontsize=7,
                          xytext=(3, 3), textcoords="offset points", color=color)
    axes.set_xscale("log")
    axes.set_xlabel("per-user tokens/s (log)")
    axes.set_ylabel("aggregate tokens/s")
    axes.set_title(title, fontsize=9)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _checks(results: list[Any], matched: list[dict[str, float]]) -> dict[str, Any]:
    by = {(r.policy, r.concurrency): r for r in results}
    levels = sorted({r.concurrency for r in results})
    per_level = []
    for c in levels:
        if not all((p, c) in by for p in ("scheduled", "no_spec", "static_7")):
            continue
        best = max(by[("no_spec", c)].aggregate_tps, by[("static_7", c)].aggregate_tps)
        per_level.append({"concurrency": c, "scheduled_over_best_of_no_spec_static_7":
                          round(by[("scheduled", c)].aggregate_tps / best, 4)})
    return {
        "scheduled_vs_best_baseline": per_level,
        "scheduled_ge_best_baseline_everywhere": all(
            row["scheduled_over_best_of_no_spec_static_7"] >= 1.0 for row in per_level
        ),
        "matched_throughput_min_ratio_vs_static_1": min((m["ratio"] for m in matched), default=None),
    }


def sim(
    concurrency: str = typer.Option("1,2,4,8,16,32,64", help="Comma-separated concurrency levels."),
    sps: Path = typer.Option(DEFAULT_TARGET_SPS, help="Target cost model (JSON)."),
    draft_sps: Optional[str] = typer.Option(
        str(DEFAULT_DRAFTER_SPS), help="Drafter cost model (JSON), or 'none' to treat drafting as free."
    ),
    traces: Optional[Path] = typer.Option(None, help="JSONL rounds from the offline evaluator; default: synthetic paper-shaped traces."),
    sts: Optional[Path] = typer.Option(None, help="STS calibration JSON applied to the confidence logits the planners see."),
    policies: str = typer.Option(",".join(POLICY_STYLE), help="Comma-separated policies."),
    seed: int = typer.Option(0, help="Seed for traces and requests."),
    requests_per_slot: float = typer.Option(3.0, help="Finished requests per slot before stopping."),
    min_requests: int = typer.Option(48, help="Finished requests before stopping, at least."),
    json_output: bool = typer.Option(False, "--json", help="Print the JSON report."),
    plot: Optional[Path] = typer.Option(None, help="Write the Pareto plot (PNG) here."),
    out: Optional[Path] = typer.Option(None, help="Also write the JSON report to this file."),
    planner_bench: bool = typer.Option(True, help="Include the planner speed benchmark (batch 64, gamma 7)."),
) -> None:
    """Simulate decode serving per policy and concurrency: aggregate and per-user tokens/s."""
    from sglang_dspark.runtime import set_torch_threads
    from sglang_dspark.scheduling.bench import plan_speed
    from sglang_dspark.scheduling.simulator import (
        POLICIES,
        SimSettings,
        matched_throughput,
        same_concurrency_crossings,
        simulate,
    )
    from sglang_dspark.scheduling.traces import FileTraces, SyntheticTraces, TraceError

    set_torch_threads(1)
    levels = _parse_ints(concurrency, "--concurrency")
    chosen = [p.strip() for p in policies.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in POLICIES]
    if unknown:
        raise typer.BadParameter(f"unknown policies {unknown}; expected some of {list(POLICIES)}")
    target = _load_model(sps, "--sps")
    drafter = None if draft_sps in (None, "none") else _load_model(Path(draft_sps), "--draft-sps")

    def source() -> Any:
        if traces is None:
            return SyntheticTraces(seed=seed)
        try:
            return FileTraces(traces, seed=seed)
        except (OSError, TraceError) as error:
            raise typer.BadParameter(f"--traces: {error}") from error

    gamma = source().gamma
    settings = SimSettings(gamma=gamma, seed=seed, requests_per_slot=requests_per_slot,
                           min_requests=min_requests)
    temperatures = biases = None
    if sts is not None:
        from sglang_dspark.calibration.metrics import CalibrationDataError
        from sglang_dspark.calibration.sts import StsCalibration

        try:
            calibration = StsCalibration.load(sts)
        except (OSError, ValueError, KeyError, CalibrationDataError) as error:
            raise typer.BadParameter(f"--sts: cannot use {sts}: {error}") from error
        if calibration.gamma != gamma:
            raise typer.BadParameter(f"--sts is for gamma {calibration.gamma}, traces have {gamma}")
        temperatures = list(calibration.temperatures)
        biases = list(calibration.biases or [0.0] * gamma)
    results = [simulate(p, c, target, drafter, source(), settings, temperatures, biases)
               for c in levels for p in chosen]
    matched = matched_throughput(results)
    report: dict[str, Any] = {
        "results": [r.to_json() for r in results],
        "config": {
            "concurrency": levels, "policies": chosen, "seed": seed, "gamma": gamma,
            "sts": str(sts) if sts else None,
            "traces": str(traces) if traces else "synthetic (sglang_dspark.scheduling.traces)",
            "settings": {k: getattr(settings, k) for k in settings.__dataclass_fields__},
        },
        "target_cost_model": {"path": str(sps), "kind": target.kind, "metadata": target.metadata},
        "drafter_cost_model": None if drafter is None else {
            "path": draft_sps, "kind": drafter.kind, "metadata": drafter.metadata},
        "matched_throughput_vs_static_1": matched,
        "same_concurrency_crossings_vs_static_1": same_concurrency_crossings(results),
        "checks": _checks(results, matched),
    }
    if planner_bench:
        report["planner_benchmark"] = plan_speed(DEFAULT_TARGET_SPS, 64, gamma, 300)
    if plot is not None:
        model = target.metadata.get("model")
        name = model.get("name", "target") if isinstance(model, dict) else str(model)
        _plot(results, plot, f"{name} on {sps.name}: aggregate vs per-user tokens/s")
        report["plot"] = str(plot)
    text = json.dumps(report, indent=1)
    if out is not None:
        out.write_text(text + "\n")
    if json_output:
        typer.echo(text)
    else:
        for r in results:
            typer.echo(f"{r.policy:>10} c={r.concurrency:<3} aggregate {r.aggregate_tps:8.2f} tok/s  "
                       f"per-user {r.per_user_tps:7.2f} tok/s  tau {r.tau:.2f}")


def planner(
    batch: int = typer.Option(64, help="Requests in the batch."),
    gamma: int = typer.Option(7, help="Block size."),
    iterations: int = typer.Option(500, help="Timed calls per planner."),
    threads: int = typer.Option(1, help="torch threads (the planner's tensors are tiny)."),
    json_output: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Time the planners at (batch, gamma) on this CPU; medians in microseconds."""
    from sglang_dspark.runtime import set_torch_threads
    from sglang_dspark.scheduling.bench import plan_speed

    set_torch_threads(threads)
    report = plan_speed(DEFAULT_TARGET_SPS, batch, gamma, iterations)
    typer.echo(json.dumps(report, indent=1) if json_output else
               f"algorithm1 {report['algorithm1_median_us']} us, scheduled step "
               f"{report['scheduled_step_median_us']} us (median, batch {batch}, gamma {gamma})")


def sps_cpu(
    out_dir: Path = typer.Option(PROFILES_DIR, help="Where the probes and fitted models go."),
    repeats: int = typer.Option(3, help="Repeats per shape (medians are fitted)."),
    target_path: Optional[Path] = typer.Option(None, "--target", help="Local HF checkpoint of the target; default: random weights of the SmolLM2-135M shape (timing-equivalent)."),
    threads: int = typer.Option(1, help="torch threads for the measured forwards."),
    quick: bool = typer.Option(False, help="A tiny grid (smoke test), not a usable profile."),
) -> None:
    """Measure target and drafter-proxy step times on this CPU and fit all cost models."""
    import sys

    from sglang_dspark.runtime import set_torch_threads
    from sglang_dspark.scheduling.fit import fit_all
    from sglang_dspark.scheduling.measure import (
        SMOLLM2_135M_SHAPE,
        build_llama,
        load_local_llama,
        measure_llama_probes,
        probe_grid,
    )
    from sglang_dspark.scheduling.probes import ProbeError

    set_torch_threads(threads)
    command = "dspark-ctl bench sps-cpu " + " ".join(sys.argv[3:])
    if quick:
        target_shapes = probe_grid([1, 2], [1, 2], [16]) + probe_grid([1, 2], [1, 2], [32])
        draft_shapes = probe_grid([1, 2], [1, 7], [16, 32])
    else:
        target_shapes = probe_grid([1, 2, 4, 8, 16, 32, 64], [1, 2, 3, 4, 6, 8], [256]) + probe_grid(
            [1, 4, 16, 64], [1, 4, 8], [1024])
        draft_shapes = probe_grid([1, 4, 16, 64], [1, 2, 4, 7], [256, 1024])
    weights = "random init (timing-equivalent)" if target_path is None else str(target_path)
    target = build_llama(SMOLLM2_135M_SHAPE) if target_path is None else load_local_llama(str(target_path))
    say = lambda message: typer.echo(message, err=True)  # noqa: E731
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, model, shapes, meta in (
        ("target", target, target_shapes, {"name": "SmolLM2-135M-Instruct", "weights": weights}),
        ("drafter", build_llama(SMOLLM2_135M_SHAPE, num_layers=2), draft_shapes,
         {"name": "DSpark drafter proxy: 2 Llama layers at SmolLM2-135M width, full 49152 vocab",
          "weights": "random init"}),
    ):
        say(f"measuring {name}: {len(shapes)} shapes x {repeats} repeats")
        probes = measure_llama_probes(model, shapes, repeats,
                                      {**meta, "dtype": "bfloat16", **SMOLLM2_135M_SHAPE,
                                       "num_hidden_layers": model.config.num_hidden_layers},
                                      progress=say)
        probes.metadata["command"] = command
        probes_path = out_dir / f"cpu-smollm2-135m-{name}.probes.json"
        probes.save(probes_path)
        try:
            fitted_models = fit_all(probes)
        except ProbeError as error:
            typer.echo(f"error: cannot fit cost models to {probes_path} (kept): {error}", err=True)
            raise typer.Exit(code=1) from None
        for kind, fitted in fitted_models.items():
            fitted.save(out_dir / f"cpu-smollm2-135m-{name}-{kind}.json")
            say(f"  {kind}: {fitted.metadata.get('fit')}")


def register(bench_app: typer.Typer) -> None:
    """Attach the commands to `dspark-ctl bench`."""
    bench_app.command("sim")(sim)
    bench_app.command("planner")(planner)
    bench_app.command("sps-cpu")(sps_cpu)
    bench_app.command("gemm")(gemm)
    bench_app.command("attention")(attention)


def gemm(
    dtype: str = typer.Option("bfloat16", help="float32 or bfloat16 weights and inputs."),
    rows: str = typer.Option("1,2,4,8,16,32", help="Comma-separated input row counts."),
    repeats: int = typer.Option(7, min=1, help="Forwards per row count and path (the median is reported)."),
    threads: int = typer.Option(2, min=1, help="torch intra-op threads (the kernel uses the same)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Time SmolLM2-135M's linears plus lm_head per forward: the BLAS against the weight panels.

    The plugin's CPU layouts: column-major float32 / bf16 as loaded for the BLAS, 32-column panels
    for the kernel (`sglang_dspark.kernels_cpu.panel_gemm`); random weights of the model's shapes,
    every layer streamed in turn as in serving, the two paths alternating."""
    row_counts = _parse_ints(rows, "--rows")
    from sglang_dspark.kernels_cpu.gemm_bench import time_linears
    from sglang_dspark.kernels_cpu.panel_gemm import PanelKernelUnavailable, panel_kernel_name
    from sglang_dspark.runtime import set_torch_threads

    set_torch_threads(threads)
    try:
        timings = time_linears(row_counts, dtype, repeats=repeats)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--dtype") from None
    except PanelKernelUnavailable as error:
        typer.echo(f"error: the panel kernel cannot run here: {error}", err=True)
        raise typer.Exit(code=1) from None
    isa = panel_kernel_name(dtype)
    _print_kernel_timings(
        {"dtype": dtype, "threads": threads, "repeats": repeats, "kernel_isa": isa}, timings, as_json,
        f"SmolLM2-135M linears + lm_head per forward, {dtype}, {threads} threads, {isa} panels (ms)",
        {"rows": lambda t: str(t.rows), "BLAS": lambda t: f"{t.blas_ms:.1f}", "panels": lambda t: f"{t.panels_ms:.1f}",
         "BLAS / panels": lambda t: f"{t.speedup:.2f}x"})


def _print_kernel_timings(settings: dict, timings: list, as_json: bool, title: str, columns: dict) -> None:
    """A kernel benchmark's report: JSON (`settings` and each timing's `to_json`), or a table of
    `columns` (header -> the cell text of one timing)."""
    if as_json:
        typer.echo(json.dumps(settings | {"timings": [t.to_json() for t in timings]}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right")
    for t in timings:
        table.add_row(*(cell(t) for cell in columns.values()))
    Console().print(table)


def attention(
    dtype: str = typer.Option("bfloat16", help="float32 or bfloat16 queries and KV cache."),
    contexts: str = typer.Option("200,2000", help="Comma-separated keys before the window."),
    windows: str = typer.Option("1,2,8", help="Comma-separated query rows (1: a decode step; w: a verify of w - 1 drafts)."),
    repeats: int = typer.Option(7, min=1, help="Forwards per cell and path (the median is reported)."),
    threads: int = typer.Option(2, min=1, help="torch intra-op threads (the kernel uses the same)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Time SmolLM2-135M's attention per forward (30 layers): the paged kernel against SDPA.

    One request's window over its context, each layer with its own KV cache
    (`sglang_dspark.kernels_cpu.attention_bench`); what a verify window costs against a decode
    step, and how it grows with context, on this CPU."""
    context_list, window_list = _parse_ints(contexts, "--contexts"), _parse_ints(windows, "--windows")
    from sglang_dspark.kernels_cpu.attention_bench import time_attention
    from sglang_dspark.kernels_cpu.build import KernelUnavailable, vector_isa
    from sglang_dspark.runtime import set_torch_threads

    set_torch_threads(threads)
    try:
        timings = time_attention(context_list, window_list, dtype, repeats=repeats)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    except KernelUnavailable as error:
        typer.echo(f"error: the attention kernel cannot run here: {error}", err=True)
        raise typer.Exit(code=1) from None
    isa = vector_isa()
    _print_kernel_timings(
        {"dtype": dtype, "threads": threads, "repeats": repeats, "kernel_isa": isa}, timings, as_json,
        f"SmolLM2-135M attention per forward, {dtype}, {threads} threads, {isa} kernel (ms)",
        {"context": lambda t: str(t.context), "window": lambda t: str(t.window), "SDPA": lambda t: f"{t.sdpa_ms:.2f}",
         "kernel": lambda t: f"{t.kernel_ms:.2f}", "SDPA / kernel": lambda t: f"{t.speedup:.2f}x"})
