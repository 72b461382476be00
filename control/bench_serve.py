"""`dspark-ctl bench serve`: plain serving vs DSPARK_LIVE on the same SGLang build and prompts.

Each arm (no speculation; DSPARK_LIVE without drafts; DSPARK_LIVE) gets its own server, all up
at once. For each concurrency c, a wave of c x `requests_per_client` chat-templated prompts (math,
code and chat, held-out eval split) goes to each arm in turn, `repeats` times, through c clients
that each send their next request as soon as their last one finished (the closed-loop load of
SGLang's and vLLM's serving benchmarks). `--requests-per-client 1` sends c requests at once and
waits for the slowest: a batch that drains to one request, where speculation's variable tokens
per step make the last request of a wave finish later than it does without speculation.
Reported per cell (medians over waves): aggregate output tokens/s, per-user tokens/s, tau
(committed tokens per verify step, bonus included) and verify tokens per request-step.
`--verify-cost` also measures the DSPARK_LIVE verify step at two context lengths from the
worker's step log. Requests are greedy unless `--temperature` (and `--top-p`) say otherwise.
Prints JSON; `--plot` writes a PNG of throughput against concurrency.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import typer

from dspark_ctl.serve import (DEVICE_OPTION, DRAFTER_OPTION, TARGET_OPTION, ServerLaunch, drafter_or_shipped,
                             prepared_target_path, running)

DOMAINS = ("math", "code", "chat")


def eval_prompts(per_domain: int) -> dict[str, list[str]]:
    """Held-out prompts (the shipped eval split the drafter never trained on)."""
    from sglang_dspark.training.data import split_prompts

    return {domain: [r["prompt"] for r in split_prompts("eval", domain)][:per_domain] for domain in DOMAINS}


def chat_texts(model_path: str, prompts: list[str]) -> list[str]:
    """Apply the target's chat template on the client, so /generate returns spec metadata."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                          add_generation_prompt=True) for p in prompts]


GREEDY = {"temperature": 0.0}


def http_client(connections: int = 1):
    """A client whose connections stay open across requests, as a serving client's do.

    A new connection per request (`httpx.post`) cost ~21 ms of client CPU on this project's 2-core
    machine (a fresh client and TLS context each time), against 0.8 ms on an open one: per
    request, on the cores the server under test runs on, it lengthened every request alike and
    so compressed every ratio between arms."""
    import httpx

    return httpx.Client(timeout=1800, limits=httpx.Limits(max_connections=connections,
                                                           max_keepalive_connections=connections))


def _generate(client, url: str, text: str, max_new_tokens: int, ignore_eos: bool = True,
              sampling: dict | None = None) -> dict:
    started = time.perf_counter()
    response = client.post(f"{url}/generate", json={
        "text": text, "sampling_params": (sampling or GREEDY) | {"max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos}})
    response.raise_for_status()
    meta = response.json()["meta_info"]
    return {"tokens": meta["completion_tokens"], "seconds": time.perf_counter() - started,
            "verify_steps": meta.get("spec_verify_ct"), "cap_length": meta.get("spec_cap_length")}


def run_wave(url: str, texts: list[str], max_new_tokens: int, ignore_eos: bool = True,
             concurrency: int | None = None, sampling: dict | None = None) -> dict:
    """`texts` through `concurrency` clients (all at once when None), each sending its next text
    when its last request finished; aggregate and per-user throughput, tau and verify width.
    `sampling`: SGLang sampling parameters of every request (default greedy)."""
    clients = concurrency or len(texts)
    with http_client(clients) as client:
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=clients) as pool:
            results = list(pool.map(lambda t: _generate(client, url, t, max_new_tokens, ignore_eos, sampling), texts))
        wall = time.perf_counter() - started
    tokens = sum(r["tokens"] for r in results)
    wave = {"aggregate_tok_s": tokens / wall, "per_user_tok_s": statistics.mean(r["tokens"] / r["seconds"] for r in results),
            "tokens": tokens, "seconds": wall}
    steps = sum(r["verify_steps"] or 0 for r in results)
    if steps:
        wave["tau"] = tokens / steps
        wave["verify_tokens_per_step"] = sum((r["cap_length"] or 0) * (r["verify_steps"] or 0) for r in results) / steps
    return wave


POOLED = ("tokens", "seconds")  # a wave's totals: summed over a cell's waves, not medians


def _median_cells(waves: list[dict]) -> dict:
    """Each measure's median over the cell's waves, the waves' own rates, and `pooled_tok_s`: all
    the waves' tokens over all their seconds. At concurrency 1 a wave's rate swings with its 4
    prompts (53-92 tok/s for DSPARK_LIVE, session 46), so the median of 4 such waves moves by
    ~10 % from run to run where the pooled rate (each wave weighed by its time) moves less."""
    cell = ({key: statistics.median(w[key] for w in waves) for key in waves[0] if key not in POOLED}
            | {"repeats": len(waves), "waves_tok_s": [w["aggregate_tok_s"] for w in waves]})
    if all(key in w for w in waves for key in POOLED):
        cell["pooled_tok_s"] = sum(w["tokens"] for w in waves) / sum(w["seconds"] for w in waves)
    return cell


def waves_per_cell(wave_requests: int, repeats: int, min_requests: int) -> int:
    """At least `repeats` waves and `min_requests` requests per cell: a cell of concurrency 1 with
    3 one-request waves rests on 3 requests, too few for a 10 % effect on a machine that drifts 30 %."""
    return max(repeats, -(-min_requests // wave_requests))


ARMS = {
    "plain": "SGLang without speculation",
    "nodraft": "DSPARK_LIVE with DSPARK_PLANNER=fixed:0: the worker's forward path without drafts",
    "dspark": "DSPARK_LIVE as shipped (the drafter's planner, SPS table and calibration)",
}
"""The `nodraft` arm separates what the worker's own verify path gains or loses against plain
SGLang from what the drafts gain: `dspark / nodraft` is the speculation's own share."""


ARM_ENV_OPTION = typer.Option([], "--arm-env", metavar="ARM:KEY=VALUE",
                              help="ARM:KEY=VALUE, an environment variable for one arm's server (repeatable), "
                                   "e.g. dspark.column:DSPARK_CPU_GEMM_LAYOUT=column or plain.sdpa:DSPARK_CPU_ATTENTION=sdpa.")
"""`--arm-env` of every benchmark that runs arms side by side (`bench serve`, `bench prefix`)."""


def arm_base(arm: str) -> str:
    """`dspark.column` is a variant of `dspark` (its own server, its own `--arm-env`)."""
    return arm.split(".", 1)[0]


def parse_arms(arms: str) -> list[str]:
    wanted = [a.strip() for a in arms.split(",") if a.strip()]
    if any(arm_base(a) not in ARMS or a.endswith(".") for a in wanted) or len(set(wanted)) != len(wanted):
        raise typer.BadParameter(f"--arms {arms!r}: expected distinct names from {', '.join(ARMS)}, "
                                 "each optionally with a variant label (e.g. dspark.column)")
    return wanted


def parse_arm_env(pairs: list[str], arms: list[str]) -> dict[str, dict[str, str]]:
    """`ARM:KEY=VALUE` options into each arm's extra environment."""
    env: dict[str, dict[str, str]] = {arm: {} for arm in arms}
    for pair in pairs:
        arm, sep, assignment = pair.partition(":")
        key, equals, value = assignment.partition("=")
        if not sep or not equals or not key or arm not in env:
            raise typer.BadParameter(f"--arm-env {pair!r}: expected ARM:KEY=VALUE with ARM one of {', '.join(arms)}")
        env[arm][key] = value
    return env


def arm_launch(arm: str, target: str, drafter_path: str | None, port: int, device: str, dtype: str,
               log_dir: Path, extra_env: dict[str, str] | None = None, overlap: bool = True) -> ServerLaunch:
    """The server of one arm; the DSPARK_LIVE arms log every step to `<log_dir>/<arm>-steps.jsonl`."""
    if arm_base(arm) == "plain":
        return ServerLaunch(model_path=target, port=port, device=device, dtype=dtype, overlap=overlap,
                            extra_env=dict(extra_env or {}))
    env = {"DSPARK_STEP_LOG": str(log_dir / f"{arm}-steps.jsonl")}
    if arm_base(arm) == "nodraft":
        env["DSPARK_PLANNER"] = "fixed:0"
    env.update(extra_env or {})
    return ServerLaunch(model_path=target, port=port, device=device, dtype=dtype, drafter_path=drafter_path,
                        overlap=overlap, extra_env=env)


def bench_arms(launches: dict[str, ServerLaunch], prompts: list[str], concurrency: list[int], repeats: int,
               max_new_tokens: int, log_dir: Path, min_requests: int = 1, ignore_eos: bool = True,
               warmup_waves: int = 0, requests_per_client: int = 1, sampling: dict | None = None) -> dict:
    """All arms' servers up at once; for each concurrency and repeat, one wave per arm in turn
    (c clients, `requests_per_client` requests each, see the module doc).

    Interleaving the arms' waves puts them minutes apart instead of a whole arm apart, so slow
    drifts of a shared machine's speed fall on every arm alike (an idle server sleeps).
    `warmup_waves` unmeasured waves per arm come first at each concurrency: a fresh DSPARK_LIVE
    server learns what drafting costs at a new batch size from its first steps there, and a
    measured first wave would weigh that one-off lesson as if every wave paid it."""
    with running(launches, log_dir):
        for launch in launches.values():
            run_wave(launch.url, prompts[:1], 8)
        cells: dict[str, dict] = {arm: {} for arm in launches}
        for c in concurrency:
            for _ in range(warmup_waves):
                for launch in launches.values():
                    run_wave(launch.url, prompts[:c], max_new_tokens, ignore_eos, sampling=sampling)
            seen = {arm: _line_count(_step_log(launch)) for arm, launch in launches.items()}
            waves: dict[str, list[dict]] = {arm: [] for arm in launches}
            size = c * requests_per_client
            for r in range(waves_per_cell(size, repeats, min_requests)):
                texts = [prompts[(r * size + i) % len(prompts)] for i in range(size)]
                for arm, launch in launches.items():
                    waves[arm].append(run_wave(launch.url, texts, max_new_tokens, ignore_eos, concurrency=c,
                                               sampling=sampling))
            for arm, launch in launches.items():
                cells[arm][str(c)] = _median_cells(waves[arm])
                if _step_log(launch) is not None:
                    cells[arm][str(c)]["steps"] = step_summary(_step_log(launch), skip=seen[arm])
        return cells


def _step_log(launch: ServerLaunch) -> Path | None:
    path = launch.extra_env.get("DSPARK_STEP_LOG")
    return Path(path) if path else None


def _line_count(path: Path | None) -> int:
    return len(path.read_text().splitlines()) if path is not None and path.exists() else 0


DRAFT_PARTS = ("decide", "catch_up", "block", "walk", "plan")
"""A drafted step's seconds before the verify forward, as its step record splits them."""


def step_summary(step_log: Path, skip: int = 0) -> dict:
    """Where a DSPARK_LIVE step's time went, from its step records (after the first `skip`)."""
    steps = [json.loads(line) for line in step_log.read_text().splitlines()[skip:]]
    if not steps:
        return {"decode_steps": 0}
    drafted = [s for s in steps if s["drafted"]]
    predicted = [s["predicted_seconds"] / s["measured_seconds"] for s in steps if s["predicted_seconds"]]
    return {
        "decode_steps": len(steps),
        "drafted_share": len(drafted) / len(steps),
        "vetoed_share": sum(bool(s.get("vetoed")) for s in steps) / len(steps),
        "lookup_round_share": _lookup_round_share(_verifying(steps)),
        "lookup_conditional_acceptance": _lookup_conditional_acceptance(steps),
        "draft_seconds_median": statistics.median(s["draft_seconds"] for s in drafted) if drafted else None,
        "draft_parts_median": {part: statistics.median(s.get(f"{part}_seconds", 0.0) for s in drafted)
                               for part in DRAFT_PARTS} if drafted else None,
        "verify_seconds_median": statistics.median(s["verify_seconds"] for s in steps),
        # the target forward alone, and SGLang's scheduler between two decode steps (older logs: None)
        "forward_seconds_median": _median_of(s.get("forward_seconds") or None for s in steps),
        "between_steps_seconds_median": _median_of(s.get("between_steps_seconds") for s in steps),
        # the planner's intake after each step: its longest is a live recalibration's stall (older logs: None)
        "observe_seconds_median": _median_of(s.get("observe_seconds") for s in steps),
        "observe_seconds_max": max((s["observe_seconds"] for s in steps if "observe_seconds" in s), default=None),
        "step_seconds_median": statistics.median(s["measured_seconds"] for s in steps),
        "predicted_over_measured_median": statistics.median(predicted) if predicted else None,
        "by_kind": _by_kind(steps),
        "drafter_rounds": _drafter_rounds(steps),
    }


def _median_of(values) -> float | None:
    """The median of the values that are not None, or None when there are none."""
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


STEP_KINDS = ("drafter", "lookup", "plain")
"""What a step verified: the drafter ran (its rows, and any lookup rows beside them); only lookup
drafts (the drafter skipped, or drafted no row: every request had a lookup); nothing but the
bonus tokens (a one-token step)."""


def _kind(step: dict) -> str:
    if step["drafted"] and step.get("block_seconds", 1.0) > 0:  # (older logs have no parts)
        return "drafter"
    return "lookup" if any(r.get("lookup_drafts", 0) > 0 for r in step.get("requests", ())) else "plain"


def _by_kind(steps: list[dict]) -> dict[str, dict]:
    """Per step kind: its share of the steps, tokens committed per step, median step seconds and
    the worker's tokens/s over those steps (committed tokens over the steps' own seconds, the
    scheduler's time between steps left out): which kind of step the speed-up comes from, and
    which costs it. Steps without `committed_tokens` (older logs) give no rate."""
    result = {}
    for kind in STEP_KINDS:
        ours = [s for s in steps if _kind(s) == kind]
        if not ours:
            continue
        counted = [s for s in ours if "committed_tokens" in s]
        committed = sum(s["committed_tokens"] for s in counted)
        seconds = sum(s["measured_seconds"] for s in counted)
        result[kind] = {
            "share": len(ours) / len(steps),
            "committed_per_step": committed / len(counted) if counted else None,
            "step_seconds_median": statistics.median(s["measured_seconds"] for s in ours),
            "worker_tok_s": committed / seconds if counted and seconds > 0 else None,
        }
    return result


def _drafter_rounds(steps: list[dict]) -> dict | None:
    """The drafter's request rounds (not lookup rounds) of the drafting steps: drafts verified and
    accepted (committed) per round, the share that accepted none, and per draft position the
    survival the planner predicted (calibrated confidence) against the share of rounds that
    verified the position and whose chain accepted it (None: never verified there). A round that
    verified a tree commits its tree's drafts, but its survivals are its chain's: the chain's own
    outcome is what the tree's gain leaves (`trees`: those rounds, their nodes, committed drafts
    and gain over the chain)."""
    rounds = [r for s in steps if s["drafted"] for r in s.get("requests", ())
              if r.get("lookup_drafts", 0) == 0 and r["verify_len"] > 0]
    if not rounds:
        return None
    width = max(r["verify_len"] for r in rounds)
    predicted, measured = [], []
    for k in range(width):
        verified = [r for r in rounds if r["verify_len"] > k and len(r.get("survivals") or ()) > k]
        predicted.append(round(statistics.mean(r["survivals"][k] for r in verified), 3) if verified else None)
        measured.append(round(sum(r["accepted"] - r.get("tree_gain", 0) > k for r in verified) / len(verified), 3)
                        if verified else None)
    trees = [r for r in rounds if r.get("tree_drafts", 0) > 0]
    return {
        "rounds": len(rounds),
        "verified_mean": statistics.mean(r["verify_len"] for r in rounds),
        "accepted_mean": statistics.mean(r["accepted"] for r in rounds),
        "none_accepted_share": sum(r["accepted"] == 0 for r in rounds) / len(rounds),
        "survival_predicted": predicted,
        "survival_measured": measured,
        "trees": {
            "share": len(trees) / len(rounds),
            "drafts_mean": statistics.mean(r["tree_drafts"] for r in trees),
            "accepted_mean": statistics.mean(r["accepted"] for r in trees),
            "gain_mean": statistics.mean(r["tree_gain"] for r in trees),
        } if trees else None,
    }


def _verifying(steps: list[dict]) -> list[dict]:
    """Steps that verified drafts: the drafter's, or only lookup drafts on a step that skipped it."""
    return [s for s in steps if s["drafted"] or any(r.get("lookup_drafts", 0) > 0 for r in s.get("requests", ()))]


def _lookup_round_share(verifying_steps: list[dict]) -> float | None:
    """Of the verifying steps' request rounds, the share that verified lookup drafts (`engine.lookup`)."""
    rounds = [request for step in verifying_steps for request in step.get("requests", ())]
    return sum(request.get("lookup_drafts", 0) > 0 for request in rounds) / len(rounds) if rounds else None


def _lookup_conditional_acceptance(steps: list[dict]) -> dict[str, list[float | None]]:
    """Per temperature class, lookup rounds' acceptance at each draft position given the drafts
    before it were accepted (what `engine.lookup.LookupSurvival` learns; None: never verified)."""
    rounds = [request for step in steps for request in step.get("requests", ())
              if request.get("lookup_drafts", 0) > 0]
    result = {}
    for kind in ("greedy", "sampled"):
        ours = [r for r in rounds if (r["temperature"] == 0) == (kind == "greedy")]
        width = max((r["verify_len"] for r in ours), default=0)
        tested = [sum(r["verify_len"] >= k and r["accepted"] >= k - 1 for r in ours) for k in range(1, width + 1)]
        accepted = [sum(r["accepted"] >= k for r in ours) for k in range(1, width + 1)]
        result[kind] = [round(a / n, 3) if n else None for a, n in zip(accepted, tested)]
    return result


def verify_cost(launch: ServerLaunch, model_path: str, contexts: list[int], log_dir: Path) -> dict:
    """Median verify-forward seconds of DSPARK_LIVE at each context length (batch 1)."""
    from transformers import AutoTokenizer

    step_log = log_dir / "steps.jsonl"
    launch.extra_env["DSPARK_STEP_LOG"] = str(step_log)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    filler = " ".join(f"item {i} is {i * 7 % 13}." for i in range(4000))
    filler_ids = tokenizer(filler)["input_ids"]
    with running({"verify-cost": launch}, log_dir), http_client() as client:
        steps_by_context = {}
        for context in contexts:
            seen = _line_count(step_log)  # the server holds the log open: read past, never unlink
            text = tokenizer.decode(filler_ids[:context])
            _generate(client, launch.url, text, 64)
            steps = [json.loads(line) for line in step_log.read_text().splitlines()[seen:]]
            steps_by_context[context] = [s for s in steps if s["batch_size"] == 1][5:]
    return verify_cost_summary(steps_by_context)


def verify_cost_summary(steps_by_context: dict[int, list[dict]], min_steps: int = 3) -> dict:
    """Per context: the median verify seconds of its steps and, per verify width (tokens a step),
    the median and count; `ratio_long_to_short` compares the longest context's median with the
    shortest's. The planner picks the widths, so the two contexts may verify different numbers
    of tokens: `ratio_at_same_width` compares them at the width both verified most often (at
    least `min_steps` steps each), the cost of context alone."""
    result: dict = {}
    for context, steps in steps_by_context.items():
        widths: dict[int, list[float]] = {}
        for step in steps:
            widths.setdefault(int(step["verify_tokens"]), []).append(step["verify_seconds"])
        result[str(context)] = {
            "verify_seconds_median": statistics.median(s["verify_seconds"] for s in steps), "steps": len(steps),
            "verify_tokens_median": statistics.median(s["verify_tokens"] for s in steps),
            "by_verify_tokens": {str(width): {"verify_seconds_median": statistics.median(seconds),
                                              "steps": len(seconds)} for width, seconds in sorted(widths.items())},
        }
    low, high = str(min(steps_by_context)), str(max(steps_by_context))
    result["ratio_long_to_short"] = result[high]["verify_seconds_median"] / result[low]["verify_seconds_median"]
    short, long = result[low]["by_verify_tokens"], result[high]["by_verify_tokens"]
    shared = [(min(short[w]["steps"], long[w]["steps"]), int(w)) for w in short.keys() & long.keys()]
    shared = [(count, width) for count, width in shared if count >= min_steps]
    result["ratio_at_same_width"] = None
    if shared:  # the most steps at both; a tie goes to the wider window
        width = str(max(shared)[1])
        result["ratio_at_same_width"] = {"verify_tokens": int(width), "ratio": (
            long[width]["verify_seconds_median"] / short[width]["verify_seconds_median"])}
    return result


def speedups(arms: dict) -> dict:
    """Aggregate tokens/s ratios per concurrency: `speedup` (dspark / plain), `nodraft_speedup`
    (nodraft / plain) and `speculation_speedup` (dspark / nodraft), for the arms that ran, as
    ratios of the cells' medians; and each as `<name>_paired`, the median of the ratios of the
    two arms' waves of the same repeat (seconds apart, so the machine's drift cancels), and
    `<name>_pooled`, the ratio of the cells' pooled rates (with the same greedy tokens in both arms:
    the ratio of their total seconds). A variant arm (`dspark.column`) gets `<variant>_vs_<base>`
    against its base arm."""
    pairs = {"speedup": ("dspark", "plain"), "nodraft_speedup": ("nodraft", "plain"),
             "speculation_speedup": ("dspark", "nodraft")}
    pairs.update({f"{arm}_vs_{arm_base(arm)}": (arm, arm_base(arm)) for arm in arms if arm != arm_base(arm)})
    report = {}
    for name, (top, bottom) in pairs.items():
        if top not in arms or bottom not in arms:
            continue
        report[name] = {c: arms[top][c]["aggregate_tok_s"] / arms[bottom][c]["aggregate_tok_s"] for c in arms[bottom]}
        report[f"{name}_paired"] = {
            c: statistics.median(a / b for a, b in zip(arms[top][c]["waves_tok_s"], arms[bottom][c]["waves_tok_s"]))
            for c in arms[bottom] if "waves_tok_s" in arms[bottom][c]}
        pooled = {c: arms[top][c]["pooled_tok_s"] / arms[bottom][c]["pooled_tok_s"]
                  for c in arms[bottom] if "pooled_tok_s" in arms[bottom][c] and "pooled_tok_s" in arms[top].get(c, {})}
        if pooled:
            report[f"{name}_pooled"] = pooled
    return report


def _number(value, digits: int = 1, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def report_tables(report: dict) -> list:
    """The report for a terminal (`--no-json`): one row per arm and concurrency (throughput, tau,
    verify tokens a step, and the arm's ratio to its base, plain or the arm a variant varies:
    median, paired, pooled); for the DSPARK_LIVE cells, which kind of step delivered the tokens
    (`step_summary`'s `by_kind` and `drafter_rounds`); and the verify cost against context when
    `--verify-cost` ran."""
    tables: list = []
    if report["arms"]:
        tables += _arm_tables(report)
    if "verify_cost" in report:
        tables.append(_verify_cost_table(report["verify_cost"]))
    return tables


def _verify_cost_table(cost: dict):
    """Median verify seconds per context (`verify_cost_summary`), or the error that stopped it."""
    from rich.table import Table

    if "error" in cost:
        return f"verify cost: not measured ({cost['error']})"
    table = Table(title="verify step against context (batch 1)")
    for column in ("context tokens", "verify ms (median)", "verify tokens (median)", "steps"):
        table.add_column(column, justify="right")
    for context, cell in cost.items():
        if context.isdigit():
            table.add_row(context, f"{1000 * cell['verify_seconds_median']:.1f}", _number(cell["verify_tokens_median"]),
                          str(cell["steps"]))
    same = cost.get("ratio_at_same_width")
    table.caption = f"longest / shortest context: {cost['ratio_long_to_short']:.2f}x" + (
        "" if same is None else f"; at {same['verify_tokens']} tokens a step both: {same['ratio']:.2f}x")
    return table


def _arm_tables(report: dict) -> list:
    from rich.table import Table

    throughput = Table(title="bench serve: output tokens/s (medians over waves)")
    for column in ("arm", "concurrency", "tok/s", "pooled tok/s", "per user", "tau", "verify tok/step", "base",
                   "ratio (paired, pooled)"):
        throughput.add_column(column, justify="left" if column == "arm" else "right")
    steps = Table(title="DSPARK_LIVE steps by kind: share, tokens a step, median ms, worker tok/s")
    for column in ("arm", "concurrency", "drafter", "lookup only", "one-token", "drafter rounds"):
        steps.add_column(column, justify="left" if column == "arm" else "right")
    for arm, cells in report["arms"].items():
        ratio, base = _ratio_of(arm)
        for level, cell in cells.items():
            versus = "-" if ratio is None or level not in report.get(ratio, {}) else (
                f"{report[ratio][level]:.2f}x ({_number(report.get(ratio + '_paired', {}).get(level), 2, 'x')}, "
                f"{_number(report.get(ratio + '_pooled', {}).get(level), 2, 'x')})")
            throughput.add_row(arm, level, _number(cell.get("aggregate_tok_s")), _number(cell.get("pooled_tok_s")),
                               _number(cell.get("per_user_tok_s")), _number(cell.get("tau"), 2),
                               _number(cell.get("verify_tokens_per_step"), 2), base, versus)
            summary = cell.get("steps") or {}
            if summary.get("decode_steps"):
                kinds = summary.get("by_kind", {})
                rounds = summary.get("drafter_rounds")
                steps.add_row(arm, level, *(_kind_cell(kinds.get(kind)) for kind in STEP_KINDS), _rounds_cell(rounds))
    return [throughput, steps] if steps.row_count else [throughput]


def _rounds_cell(rounds: dict | None) -> str:
    """Drafts accepted of those verified a round, rounds accepting none, and the trees' share and gain."""
    if rounds is None:
        return "-"
    cell = (f"{rounds['accepted_mean']:.2f} of {rounds['verified_mean']:.2f} accepted, "
            f"{100 * rounds['none_accepted_share']:.0f} % none")
    trees = rounds.get("trees")
    return cell if trees is None else (f"{cell}; trees {100 * trees['share']:.0f} % "
                                       f"({trees['drafts_mean']:.1f} nodes, +{trees['gain_mean']:.2f})")


def _ratio_of(arm: str) -> tuple[str | None, str]:
    """The `speedups` entry that compares `arm` with its base, and the base (None, "-" for plain)."""
    if arm == "plain":
        return None, "-"
    if arm in ("dspark", "nodraft"):
        return ("speedup" if arm == "dspark" else "nodraft_speedup"), "plain"
    return f"{arm}_vs_{arm_base(arm)}", arm_base(arm)


def _kind_cell(kind: dict | None) -> str:
    if kind is None:
        return "-"
    return (f"{100 * kind['share']:.0f} %, {_number(kind['committed_per_step'], 2)}, "
            f"{1000 * kind['step_seconds_median']:.1f} ms, {_number(kind['worker_tok_s'], 0)}")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, cells in report["arms"].items():
        xs = [int(c) for c in cells]
        ax.plot(xs, [cells[c]["aggregate_tok_s"] for c in cells], marker="o", label=arm)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s (aggregate)")
    ax.set_xscale("log", base=2)
    ax.set_title(f"SGLang on {report['config']['device']}, {report['config']['dtype']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def bench_serve_command(
    model_path: str = TARGET_OPTION,
    drafter: str = DRAFTER_OPTION,
    concurrency: str = typer.Option("1,4,16", help="Comma-separated concurrency levels."),
    repeats: int = typer.Option(3, min=1, help="Waves per cell (the median is reported)."),
    warmup_waves: int = typer.Option(1, min=0, help="Unmeasured waves per arm before each concurrency's "
                                                    "measured ones (a fresh server's planner learns there)."),
    min_requests: int = typer.Option(12, min=1, help="More waves where a cell would hold fewer requests than this."),
    requests_per_client: int = typer.Option(4, min=1, help="Requests each of the c clients sends in a wave, one "
                                                           "after the other (1: c at once, the wave waits for "
                                                           "the slowest)."),
    max_new_tokens: int = typer.Option(128, min=1, help="Output tokens per request."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos/--stop-at-eos",
                                    help="Stop at the end of turn like real traffic (default; greedy output is "
                                         "lossless, so every arm still produces the same tokens), or generate exactly "
                                         "--max-new-tokens past it. Fixed lengths favour plain serving: its requests "
                                         "finish in lock step and are prefilled together, where speculative ones "
                                         "finish at different steps and are prefilled one by one; and the drafter "
                                         "never trained on text past the end of turn."),
    prompts_per_domain: int = typer.Option(22, min=1, help="Eval prompts taken from each domain (66 in all: a "
                                                             "wave of 16 clients x 4 requests repeats none)."),
    temperature: float = typer.Option(0.0, min=0.0, help="Sampling temperature of every request (0: greedy)."),
    top_p: float = typer.Option(1.0, min=0.0, max=1.0, help="Nucleus sampling of every request (1: off)."),
    sampling_json: str = typer.Option("", "--sampling-params",
                                      help="More SGLang sampling parameters of every request, as a JSON object, e.g. "
                                           "'{\"json_schema\": \"...\"}' or '{\"frequency_penalty\": 0.5}'."),
    dtype: str = typer.Option("bfloat16", help="Same dtype for both arms."),
    device: str = DEVICE_OPTION,
    overlap: bool = typer.Option(True, "--overlap/--no-overlap",
                                 help="SGLang's overlap scheduler in every arm's server (--no-overlap passes "
                                      "--disable-overlap-schedule to all of them)."),
    port: int = typer.Option(30100, help="Port of the server under test."),
    arms: str = typer.Option("plain,nodraft,dspark",
                             help="Arms to run side by side (plain, nodraft, dspark, or a variant such as "
                                  "dspark.column; empty: only --verify-cost)."),
    arm_env: list[str] = ARM_ENV_OPTION,
    verify_cost_contexts: str = typer.Option("", "--verify-cost", help="e.g. 200,2000: also time the verify step."),
    as_json: bool = typer.Option(True, "--json/--no-json", help="Print the report as JSON (--no-json: tables)."),
    plot_path: Path = typer.Option(None, "--plot", help="Write a PNG of throughput vs concurrency."),
    out: Path = typer.Option(None, "--out", help="Also write the JSON report to this file (its folder is "
                                                 "made first, so a long run cannot end on a bad path)."),
) -> None:
    """Plain serving vs DSPARK_LIVE: tokens/s, per-user tokens/s, tau, verify tokens per step.

    Arms: plain (no speculation), nodraft (DSPARK_LIVE's verify path with no drafts), dspark.
    Their servers run side by side (ports --port, --port+1, ...) and take turns wave by wave."""
    target = model_path or prepared_target_path()
    drafter_path = drafter_or_shipped(drafter)
    wanted = parse_arms(arms)
    envs = parse_arm_env(arm_env, wanted)
    if ({arm_base(a) for a in wanted} - {"plain"} or verify_cost_contexts) and drafter_path is None:
        typer.echo("error: no drafter given and none shipped; pass --drafter PATH or --arms plain", err=True)
        raise typer.Exit(code=2)
    levels = [int(c) for c in concurrency.split(",")]
    if top_p <= 0.0:
        typer.echo(f"error: --top-p {top_p}: expected a value in (0, 1]", err=True)
        raise typer.Exit(code=2)
    sampling = {"temperature": temperature, "top_p": top_p} | extra_sampling(sampling_json)
    for path in (out, plot_path):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
    texts: list[str] = []
    if wanted:
        by_domain = eval_prompts(prompts_per_domain)
        texts = chat_texts(target, [p for group in zip(*by_domain.values()) for p in group])
    log_dir = Path(tempfile.mkdtemp(prefix="dspark-bench-serve-"))
    report = {"config": {"model_path": target, "drafter": drafter_path, "dtype": dtype, "device": device, "overlap": overlap,
                         "max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos, "repeats": repeats, "min_requests": min_requests,
                         "warmup_waves": warmup_waves, "requests_per_client": requests_per_client, "sampling": sampling,
                         "prompts": len(texts),
                         "logs": str(log_dir), "arms": {arm: ARMS[arm_base(arm)] for arm in wanted},
                         "arm_env": {arm: env for arm, env in envs.items() if env}}, "arms": {}}
    if wanted:
        launches = {arm: arm_launch(arm, target, drafter_path, port + i, device, dtype, log_dir, envs[arm], overlap)
                    for i, arm in enumerate(wanted)}
        report["arms"] = bench_arms(launches, texts, levels, repeats, max_new_tokens, log_dir, min_requests,
                                    ignore_eos, warmup_waves, requests_per_client, sampling)
    report.update(speedups(report["arms"]))
    failed = False
    if verify_cost_contexts:
        launch = ServerLaunch(model_path=target, port=port, device=device, dtype=dtype, drafter_path=drafter_path)
        try:
            report["verify_cost"] = verify_cost(launch, target, [int(c) for c in verify_cost_contexts.split(",")],
                                                log_dir)
        except (RuntimeError, TimeoutError, OSError, ValueError) as error:  # keep the arms' results
            report["verify_cost"] = {"error": f"{type(error).__name__}: {error}"}
            failed = True
    if plot_path is not None and report["arms"]:
        plot(report, plot_path)
        report["plot"] = str(plot_path)
    text = json.dumps(report, indent=2)
    if out is not None:
        out.write_text(text + "\n")
    if as_json:
        typer.echo(text)
    else:
        from rich.console import Console

        Console().print(*report_tables(report))
    if failed:
        typer.echo(f"error: the verify-cost measurement failed: {report['verify_cost']['error']}", err=True)
        raise typer.Exit(code=1)


OWN_OPTIONS = {"temperature": "--temperature", "top_p": "--top-p", "max_new_tokens": "--max-new-tokens",
               "ignore_eos": "--ignore-eos/--stop-at-eos"}


def extra_sampling(text: str) -> dict:
    """`--sampling-params`: a JSON object of SGLang sampling parameters, none of those that have their own option."""
    if not text:
        return {}
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as error:
        typer.echo(f"error: --sampling-params is not JSON ({error}); expected an object such as "
                   "'{\"frequency_penalty\": 0.5}'", err=True)
        raise typer.Exit(code=2) from None
    if not isinstance(extra, dict):
        typer.echo(f"error: --sampling-params must be a JSON object of SGLang sampling parameters, got {text!r}", err=True)
        raise typer.Exit(code=2)
    if clash := sorted(OWN_OPTIONS.keys() & extra.keys()):
        typer.echo(f"error: --sampling-params sets {', '.join(clash)}; use "
                   f"{', '.join(OWN_OPTIONS[key] for key in clash)} instead", err=True)
        raise typer.Exit(code=2)
    return extra


def sweep_texts(model_path: str, per_domain: int, long_tokens: int) -> list[str]:
    """Short eval prompts and long ones (~`long_tokens` of filler), alternating: the sweep then
    sees short and long contexts at every batch size."""
    from transformers import AutoTokenizer

    short = chat_texts(model_path, [p for group in zip(*eval_prompts(per_domain).values()) for p in group])
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    filler_ids = tokenizer(" ".join(f"item {i} is {i * 7 % 13}." for i in range(long_tokens)))["input_ids"]
    long = [tokenizer.decode(filler_ids[i * 31 : i * 31 + long_tokens]) + "\nSummarise the items above."
            for i in range(len(short))]
    return [text for pair in zip(short, long) for text in pair]


def plot_sps(probes: list, model, path: Path) -> None:
    """Measured steps/s against batch tokens per batch size, with the fitted model's curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sglang_dspark.scheduling.cost_model import StepShape

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for batch in sorted({p.num_requests for p in probes}):
        mine = sorted((p for p in probes if p.num_requests == batch), key=lambda p: p.batch_tokens)
        line = ax.plot([p.batch_tokens for p in mine], [1 / p.median_seconds for p in mine], "o", ms=3,
                       label=f"batch {batch}")[0]
        context = statistics.median(p.context_tokens for p in mine)
        xs = sorted({p.batch_tokens for p in mine})
        ax.plot(xs, [1 / model.predict(StepShape(batch, x, int(context))) for x in xs], "-", color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch tokens (requests x verify window)")
    ax.set_ylabel("target steps/s")
    ax.set_title("live SPS: measured (dots) and fitted (lines)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def sps_serve_command(
    out: Path = typer.Option(..., "--out", help="Cost model JSON to write (DSPARK_SPS_PATH / <draft>/sps.json)."),
    model_path: str = TARGET_OPTION,
    drafter: str = DRAFTER_OPTION,
    concurrency: str = typer.Option("1,2,4,8,16", help="Batch sizes to sweep (concurrent requests)."),
    max_new_tokens: int = typer.Option(64, min=8, help="Output tokens per request (steps per wave)."),
    long_tokens: int = typer.Option(1200, min=16, help="Context of the long prompts."),
    dtype: str = typer.Option("bfloat16", help="The dtype the server will serve in."),
    device: str = DEVICE_OPTION,
    port: int = typer.Option(30100, help="Port of the profiled server."),
    from_log: Path = typer.Option(None, "--from-log", help="Fit from this DSPARK_STEP_LOG file instead of running a sweep."),
    plot_path: Path = typer.Option(None, "--plot", help="Write a PNG of the measured and fitted SPS curves."),
) -> None:
    """Profile the SPS curve on a live DSPARK_LIVE server and fit the planner's cost model.

    The server runs the `sweep` planner (every verify width in turn) under waves of concurrent
    requests; each step's target-side time (step minus drafter) becomes a probe, and the
    context-aware model is fitted to all of them (`--from-log` refits a saved step log)."""
    import sys

    from sglang_dspark.scheduling.fit import fit_context
    from sglang_dspark.scheduling.live_probes import probes_from_step_records
    from sglang_dspark.scheduling.measure import machine_metadata
    from sglang_dspark.scheduling.probes import ProbeError, ProbeSet

    target = model_path or prepared_target_path()
    if from_log is None:
        step_log, warm_up = _sweep(target, drafter, concurrency, max_new_tokens, long_tokens, dtype, device, port)
    else:
        step_log, warm_up = from_log, 0
    records = [json.loads(line) for line in step_log.read_text().splitlines()]
    probes = probes_from_step_records(records, skip_first=warm_up)
    metadata = {"hardware": {**machine_metadata(), "device": device,
                             "timer": "wall seconds of the worker's decode step minus its drafter"},
                "model": target, "dtype": dtype, "step_log": str(step_log),
                "command": "dspark-ctl bench sps-serve " + " ".join(sys.argv[3:])}
    try:
        model = fit_context(probes, metadata)
    except ProbeError as error:
        typer.echo(f"error: cannot fit a cost model from {step_log}: {error}", err=True)
        raise typer.Exit(code=1) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    model.save(out)
    ProbeSet(probes, metadata).save(out.with_suffix(".probes.json"))
    summary = {"out": str(out), "kind": model.kind, "steps": len(records) - warm_up, "probes": len(probes),
               "fit": model.metadata.get("fit"), "step_log": str(step_log)}
    if plot_path is not None:
        plot_sps(probes, model, plot_path)
        summary["plot"] = str(plot_path)
    typer.echo(json.dumps(summary, indent=2))


def _sweep(target: str, drafter: str | None, concurrency: str, max_new_tokens: int, long_tokens: int,
           dtype: str, device: str, port: int) -> tuple[Path, int]:
    """Run the sweep server under waves of 1..N requests; (its step log, warm-up steps)."""
    drafter_path = drafter_or_shipped(drafter)
    if drafter_path is None:
        typer.echo("error: no drafter given and none shipped; pass --drafter PATH", err=True)
        raise typer.Exit(code=2)
    levels = [int(c) for c in concurrency.split(",")]
    texts = sweep_texts(target, max(1, (max(levels) + 5) // 6), long_tokens)
    log_dir = Path(tempfile.mkdtemp(prefix="dspark-sps-serve-"))
    step_log = log_dir / "steps.jsonl"
    launch = ServerLaunch(model_path=target, port=port, device=device, dtype=dtype, drafter_path=drafter_path,
                          extra_env={"DSPARK_PLANNER": "sweep", "DSPARK_STEP_LOG": str(step_log)})
    with running({"server": launch}, log_dir):
        run_wave(launch.url, texts[:2], 16)
        warm_up = _line_count(step_log)
        for c in levels:
            run_wave(launch.url, [texts[i % len(texts)] for i in range(c)], max_new_tokens)
    return step_log, warm_up
