"""`dspark-ctl bench prefix`: how long a request waits when most of its prompt is already cached.

A chat's next turn, a shared system prompt, a document asked about twice: the server holds the
prefix's KV from an earlier request (SGLang's radix cache) and the new request only extends it by
a few tokens. For each cached length, one request caches a prefix (Python's own `argparse`
source, cut to that many of the target's tokens), then `--requests` requests each append their own
short line and ask for `--max-new-tokens` (1: the time to the first token). Reported per arm and
length: median, fastest and slowest seconds, and the prompt and cached tokens the server counted.
Arms as in `bench serve`, one server each, all up at once and taking turns;
`--arm-env plain.sdpa:DSPARK_CPU_ATTENTION=sdpa` adds SGLang's own prefill attention beside the
plugin's kernel.
"""

from __future__ import annotations

import json
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

import typer

from dspark_ctl.bench_serve import ARM_ENV_OPTION, arm_base, arm_launch, http_client, parse_arm_env, parse_arms
from dspark_ctl.serve import (DEVICE_OPTION, DRAFTER_OPTION, TARGET_OPTION, ServerLaunch, drafter_or_shipped,
                             prepared_target_path, running)


def prefix_texts(model_path: str, lengths: list[int]) -> dict[int, str]:
    """Per length, the first that many tokens (the target's tokenizer) of Python's `argparse`
    source, as text; the source is tokenized once for all lengths."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    source = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text()
    ids = tokenizer(source, add_special_tokens=False)["input_ids"]
    if max(lengths) > len(ids):
        raise ValueError(f"a cached prefix of {max(lengths)} tokens: argparse.py has only {len(ids)}")
    return {length: tokenizer.decode(ids[:length]) for length in lengths}


def time_prefix(url: str, prefix: str, requests: int, max_new_tokens: int) -> dict:
    """Cache `prefix` with one request, then time `requests` requests that each extend it by their own line."""
    with http_client() as client:
        def generate(text: str) -> tuple[float, dict]:
            started = time.perf_counter()
            reply = client.post(f"{url}/generate", json={
                "text": text, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens}})
            reply.raise_for_status()
            return time.perf_counter() - started, reply.json()["meta_info"]

        generate(prefix)
        timed = [generate(f"{prefix}\n# request {i}: what does this do?\n") for i in range(requests)]
    seconds = [s for s, _ in timed]
    return {"seconds_median": statistics.median(seconds), "seconds_min": min(seconds), "seconds_max": max(seconds),
            "prompt_tokens": statistics.median(meta["prompt_tokens"] for _, meta in timed),
            "cached_tokens": statistics.median(meta.get("cached_tokens") or 0 for _, meta in timed)}


def bench_prefix(launches: dict[str, ServerLaunch], prefixes: dict[int, str], requests: int, max_new_tokens: int,
                 log_dir: Path) -> dict:
    """Per arm, per cached length: `time_prefix`, the arms taking turns length by length."""
    cells: dict[str, dict] = {arm: {} for arm in launches}
    with running(launches, log_dir):
        for length, prefix in prefixes.items():
            for arm, launch in launches.items():
                cells[arm][str(length)] = time_prefix(launch.url, prefix, requests, max_new_tokens)
    return cells


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, cells in report["arms"].items():
        ax.plot([int(c) for c in cells], [1000 * cells[c]["seconds_median"] for c in cells], marker="o", label=arm)
    ax.set_xlabel("cached prefix (tokens)")
    ax.set_ylabel(f"request latency, ms (median; {report['config']['max_new_tokens']} new tokens)")
    ax.set_yscale("log")
    ax.set_title(f"A request after a cached prefix, {report['config']['device']}, {report['config']['dtype']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_lengths(text: str) -> list[int]:
    try:
        lengths = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(f"--contexts {text!r}: expected comma-separated token counts, e.g. 200,2000") from None
    if not lengths or min(lengths) < 1:
        raise typer.BadParameter(f"--contexts {text!r}: expected token counts >= 1")
    return lengths


def bench_prefix_command(
    model_path: str = TARGET_OPTION,
    drafter: str = DRAFTER_OPTION,
    contexts: str = typer.Option("200,1000,2000,3500", help="Cached prefix lengths in tokens, comma-separated."),
    requests: int = typer.Option(8, min=1, help="Timed requests per arm and length (the median is reported)."),
    max_new_tokens: int = typer.Option(1, min=1, help="Output tokens per request (1: time to the first token)."),
    arms: str = typer.Option("plain,dspark", help="Arms side by side (plain, nodraft, dspark, or variants)."),
    arm_env: list[str] = ARM_ENV_OPTION,
    dtype: str = typer.Option("bfloat16", help="Same dtype for every arm."),
    device: str = DEVICE_OPTION,
    port: int = typer.Option(30100, help="Port of the first arm's server (the others follow)."),
    plot_path: Path = typer.Option(None, "--plot", help="Write a PNG of latency against cached length."),
    out: Path = typer.Option(None, "--out", help="Also write the JSON report to this file."),
) -> None:
    """Latency of a request whose prompt is mostly cached (radix hit), per arm and cached length."""
    lengths = parse_lengths(contexts)
    wanted = parse_arms(arms)
    envs = parse_arm_env(arm_env, wanted)
    target = model_path or prepared_target_path()
    drafter_path = drafter_or_shipped(drafter)
    if {arm_base(a) for a in wanted} - {"plain"} and drafter_path is None:
        typer.echo("error: no drafter given and none shipped; pass --drafter PATH or --arms plain", err=True)
        raise typer.Exit(code=2)
    try:
        prefixes = prefix_texts(target, lengths)
    except ValueError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(code=2) from None
    for path in (out, plot_path):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="dspark-bench-prefix-"))
    launches = {arm: arm_launch(arm, target, drafter_path, port + i, device, dtype, log_dir, envs[arm])
                for i, arm in enumerate(wanted)}
    report = {"config": {"model_path": target, "drafter": drafter_path, "dtype": dtype, "device": device,
                         "requests": requests, "max_new_tokens": max_new_tokens, "logs": str(log_dir),
                         "arm_env": {arm: env for arm, env in envs.items() if env}},
              "arms": bench_prefix(launches, prefixes, requests, max_new_tokens, log_dir)}
    if plot_path is not None:
        plot(report, plot_path)
        report["plot"] = str(plot_path)
    text = json.dumps(report, indent=2)
    if out is not None:
        out.write_text(text + "\n")
    typer.echo(text)
