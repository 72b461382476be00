"""Offline evaluation of drafters against their target (dspark-algorithm.md section 6).

Every round of real speculative decoding (``decoding.generate``: drafter proposes gamma tokens,
the target verifies, rejection sampling or greedy matching) becomes one record. All metrics are
computed from these records, so they can be recomputed from the JSONL traces we write:

- tau: mean over rounds of accepted drafts + 1 (the correction/bonus token);
- prefix survival at k: share of rounds with >= k accepted, among rounds that verified >= k drafts;
- conditional acceptance at k: survival(k) / survival(k-1) (the paper's Figure 2);
- confidence ECE (20 equal-width bins on the cumulative survival prod sigmoid(z_i / T_i)) with
  the raw head (T = 1) and with the STS temperatures fitted on the calibration split;
- draft time share: the drafter's share of the decoding wall time (the drafter is wrapped by a
  timer), plus a batch-1 microbenchmark of one drafter block against one target decode step.

Trace lines follow the simulator's schema (docs/interfaces.md): ``domain``,
``confidence_logits`` [gamma] (drafters with a confidence head), ``accepted_length``,
``verified_length``, ``request_id`` (the prompt) and ``step`` (the round); plus ``drafter``.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from sglang_dspark.calibration.metrics import ece_sampling_floor, position_report, prefix_labels
from sglang_dspark.calibration.sts import CalibrationData, StsCalibration, calibrate, fit_method
from sglang_dspark.decoding.sampling import GREEDY_TEMPERATURE

STS_FILE = "sts.json"
STS_GREEDY_FILE = "sts-greedy.json"
"""Greedy decoding gets its own calibration: its acceptance event (argmax match) is not the
sampled one (min(1, p/q)), and a T=1 calibration was off by 7 points at position 1 there."""


def sts_files(temperature: float) -> list[str]:
    """Calibration files for decoding at `temperature`, the one `--calibrate` writes first."""
    return [STS_GREEDY_FILE, STS_FILE] if temperature < GREEDY_TEMPERATURE else [STS_FILE]


@dataclass
class RoundRecord:
    """One speculative round of one prompt."""

    drafter: str
    domain: str
    prompt_id: str
    round: int
    verified_length: int
    accepted_length: int
    confidence_logits: list[float] | None

    def to_json(self) -> dict:
        line = {"drafter": self.drafter, "domain": self.domain, "request_id": self.prompt_id,
                "step": self.round, "accepted_length": self.accepted_length,
                "verified_length": self.verified_length}
        if self.confidence_logits is not None:
            line["confidence_logits"] = self.confidence_logits
        return line


class TimedDrafter:
    """Forwards every attribute to the drafter and times its method calls from the decoder.

    Only calls made *through* this proxy are timed (the decoder's and the draft walk's), so a
    drafter method calling another is not counted twice.
    """

    def __init__(self, drafter: torch.nn.Module):
        object.__setattr__(self, "_drafter", drafter)
        object.__setattr__(self, "seconds", 0.0)

    def __getattr__(self, name: str):
        value = getattr(self._drafter, name)
        if not callable(value) or isinstance(value, torch.nn.Module) or isinstance(value, torch.Tensor):
            return value

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return value(*args, **kwargs)
            finally:
                object.__setattr__(self, "seconds", self.seconds + time.perf_counter() - started)

        return timed


# ------------------------------------------------------------------------------------ metrics


def _share(count: int, total: int) -> float:
    return count / total if total else float("nan")


def tau(records: list[RoundRecord]) -> float:
    """Mean accepted length including the bonus token."""
    if not records:
        return float("nan")
    return sum(r.accepted_length + 1 for r in records) / len(records)


def tau_standard_error(records: list[RoundRecord]) -> float:
    """Standard error of ``tau`` with the rounds clustered by prompt.

    A prompt's rounds are not independent draws (an easy prompt is easy all the way), so the
    error is that of the ratio estimator over prompts, sum(a_i) / sum(n_i) with a_i the tokens
    and n_i the rounds of prompt i: the honest yardstick for two drafters' taus on 16 prompts a
    domain. NaN with fewer than two prompts."""
    per_prompt: dict[str, list[int]] = {}
    for r in records:
        tokens_rounds = per_prompt.setdefault(r.prompt_id, [0, 0])
        tokens_rounds[0] += r.accepted_length + 1
        tokens_rounds[1] += 1
    count = len(per_prompt)
    if count < 2:
        return float("nan")
    mean = sum(tokens for tokens, _ in per_prompt.values()) / len(records)
    squares = sum((tokens - mean * rounds) ** 2 for tokens, rounds in per_prompt.values())
    return math.sqrt(count / (count - 1) * squares) / len(records)


def position_stats(records: list[RoundRecord], gamma: int) -> dict:
    """Prefix survival and conditional acceptance per position 1..gamma.

    Both count only the rounds that verified position k (a round cut short by the token budget
    says nothing about the positions it never verified). Conditional acceptance at k is the share
    of those rounds that accepted k-1 drafts which also accepted the k-th: a probability, unlike
    the ratio of two survivals measured on different rounds."""
    survival, conditional, verified = [], [], []
    for k in range(1, gamma + 1):
        eligible = [r for r in records if r.verified_length >= k]
        reached = sum(r.accepted_length >= k - 1 for r in eligible)
        accepted = sum(r.accepted_length >= k for r in eligible)  # all of them among `reached`
        survival.append(_share(accepted, len(eligible)))
        conditional.append(_share(accepted, reached))
        verified.append(len(eligible))
    return {"prefix_survival": survival, "conditional_acceptance": conditional, "rounds_per_position": verified}


def calibration_data(records: list[RoundRecord]) -> CalibrationData | None:
    """Rounds with confidence logits as STS input (None when the drafter has no head)."""
    rows = [r for r in records if r.confidence_logits is not None]
    if not rows:
        return None
    return CalibrationData.from_rounds(
        torch.tensor([r.confidence_logits for r in rows], dtype=torch.float64),
        torch.tensor([r.accepted_length for r in rows]),
        torch.tensor([r.verified_length for r in rows]),
    )


def ece_report(records: list[RoundRecord], calibration: StsCalibration | None) -> dict | None:
    """Per-position ECE of the cumulative survival, raw (T=1) and with ``calibration``."""
    data = calibration_data(records)
    if data is None:
        return None
    gamma = data.logits.shape[1]
    raw = position_report(StsCalibration.identity(gamma).apply(data.logits), data.labels, data.valid)
    report = {"ece_raw": raw.ece, "mean_ece_raw": raw.mean_ece,
              "mean_predicted_survival_raw": raw.mean_prediction, "observed_survival": raw.mean_label}
    if calibration is not None:
        calibrated = calibration.apply(data.logits)
        after = position_report(calibrated, data.labels, data.valid)
        report.update(ece_sts=after.ece, mean_ece_sts=after.mean_ece,
                      mean_predicted_survival_sts=after.mean_prediction,
                      ece_floor_sts=_ece_floors(calibrated, data.valid))
    return report


def _ece_floors(survivals: torch.Tensor, valid: torch.Tensor) -> list[float]:
    """Per position, the ECE perfect calibration would show on these rounds (sampling noise)."""
    return [ece_sampling_floor(survivals[:, k], valid[:, k].to(torch.float64)) if bool(valid[:, k].any())
            else float("nan") for k in range(survivals.shape[1])]


def fit_sts(records: list[RoundRecord]) -> StsCalibration:
    """Confidence calibration from calibration-split rounds: STS (one temperature per position,
    left to right) unless a variant (a bias per position too, one global temperature, identity)
    is clearly better on held-out rounds (`calibration.sts.calibrate`). The choice and its
    held-out ECEs are in the result's metadata."""
    data = calibration_data(records)
    if data is None:
        raise ValueError("STS needs a drafter with a confidence head; these rounds carry no logits")
    if data.logits.shape[0] < 40:  # too few rounds to hold some out: plain STS on all of them
        return fit_method("sts", data)
    return calibrate(data).calibration


def summarize(records: list[RoundRecord], gamma: int, calibration: StsCalibration | None) -> dict:
    """Per-domain and macro metrics of one drafter's records."""
    domains = sorted({r.domain for r in records})
    per_domain = {}
    for domain in domains:
        subset = [r for r in records if r.domain == domain]
        per_domain[domain] = {"tau": tau(subset), "tau_se": tau_standard_error(subset), "rounds": len(subset),
                              **position_stats(subset, gamma)}
        ece = ece_report(subset, calibration)
        if ece is not None:
            per_domain[domain].update(ece)
    summary = {"domains": per_domain, "macro_tau": statistics.fmean(d["tau"] for d in per_domain.values()),
               # the domains' prompts are disjoint, so their errors add in quadrature
               "macro_tau_se": math.sqrt(sum(d["tau_se"] ** 2 for d in per_domain.values())) / len(per_domain),
               "tau_all_rounds": tau(records), **position_stats(records, gamma)}
    ece = ece_report(records, calibration)
    if ece is not None:
        summary.update(ece)
    return summary


# ------------------------------------------------------------------------------------ running


def run_rounds(target, drafter, tokenizer, prompts: list[dict], name: str, temperature: float,
               max_new_tokens: int, batch_size: int, verify_length: int | None, seed: int,
               eos_token_id: int | None = None) -> tuple[list[RoundRecord], dict]:
    """Decode ``prompts`` and record every round.

    A prompt record has ``prompt`` (chat-templated with ``tokenizer``, after a conversation's
    earlier turns in ``context`` where it has them) or ready ``prompt_ids``, and optionally
    ``domain`` and ``id``.
    """
    from sglang_dspark.decoding import generate
    from sglang_dspark.training.data import chat_ids

    if eos_token_id is None and tokenizer is not None:
        eos_token_id = tokenizer.eos_token_id

    timed = TimedDrafter(drafter)
    records: list[RoundRecord] = []
    started = time.perf_counter()
    generated = 0
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        ids = [p["prompt_ids"] if "prompt_ids" in p else chat_ids(tokenizer, p["prompt"], p.get("context", ()))
               for p in batch]
        output = generate(target, timed, ids, max_new_tokens, temperature=temperature,
                          seed=seed + start, verify_lengths=verify_length, eos_token_id=eos_token_id)
        generated += sum(len(t) for t in output.tokens)
        for index, round_stats in enumerate(output.rounds):
            for row, prompt_index in enumerate(round_stats.prompts):
                logits = None
                if round_stats.confidence_logits is not None:
                    logits = [float(x) for x in round_stats.confidence_logits[row]]
                record = batch[prompt_index]
                records.append(RoundRecord(
                    drafter=name, domain=record.get("domain", "unknown"),
                    prompt_id=str(record.get("id", start + prompt_index)), round=index,
                    verified_length=int(round_stats.drafted[row]),
                    accepted_length=int(round_stats.accepted[row]), confidence_logits=logits))
    wall = time.perf_counter() - started
    return records, {"wall_seconds": round(wall, 2), "draft_seconds": round(timed.seconds, 2),
                     "draft_time_share": timed.seconds / wall if wall > 0 else float("nan"),
                     "generated_tokens": generated, "tokens_per_s": generated / wall if wall > 0 else 0.0}


@torch.no_grad()
def block_cost(target, drafter, context: int = 256, repeats: int = 15, temperature: float = 1.0) -> dict:
    """Batch-1 medians: one target decode step (q_len 1) vs one drafter block (backbone + walk)."""
    from transformers import DynamicCache

    from sglang_dspark.decoding import SamplingParams, sample_block

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 1000, (1, context), generator=generator)
    cache = DynamicCache()
    out = target(input_ids=ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
    taps = torch.cat([out.hidden_states[i + 1] for i in drafter.target_layer_ids], dim=-1)[0]
    step_times = []
    for _ in range(repeats + 2):
        started = time.perf_counter()
        target(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
        step_times.append(time.perf_counter() - started)
        cache.crop(context)
    draft_cache = drafter.new_cache(1, capacity=context + 16)
    slots = torch.zeros(1, dtype=torch.long)
    drafter.append_context(draft_cache, slots, taps.to(drafter.dtype), torch.tensor([context]))
    params = SamplingParams.uniform(1, temperature, 1.0, 0)
    block_times = []
    anchor = ids[0, -1:]
    for _ in range(repeats + 2):
        started = time.perf_counter()
        hidden = drafter.forward_block(draft_cache, slots, anchor)
        sample_block(drafter, hidden, anchor, params, generator)
        block_times.append(time.perf_counter() - started)
    target_ms = statistics.median(step_times[2:]) * 1e3
    block_ms = statistics.median(block_times[2:]) * 1e3
    return {"context": context, "target_decode_ms": round(target_ms, 2), "draft_block_ms": round(block_ms, 2),
            "block_over_decode": round(block_ms / target_ms, 3), "threads": torch.get_num_threads()}


def plot_conditional_acceptance(results: dict, path: Path, title: str) -> None:
    """Per-position conditional acceptance, one panel per domain, one line per drafter (Fig. 2)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = sorted({d for r in results.values() for d in r["domains"]})
    fig, axes = plt.subplots(1, len(domains), figsize=(4.2 * len(domains), 3.6), squeeze=False)
    for axis, domain in zip(axes[0], domains):
        for name, result in results.items():
            stats = result["domains"].get(domain)
            if stats is None:
                continue
            values = stats["conditional_acceptance"]
            axis.plot(range(1, len(values) + 1), values, marker="o",
                      label=f"{name} (tau {stats['tau']:.2f})")
        axis.set_title(domain)
        axis.set_xlabel("draft position k")
        axis.set_ylim(0, 1)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    axes[0][0].set_ylabel("P(accept k | 1..k-1 accepted)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def evaluate(target_path: str, drafter_paths: list[str], prompts: list[dict], temperature: float,
             max_new_tokens: int, batch_size: int = 8, verify_length: int | None = None,
             seed: int = 0, calibration_prompts: list[dict] | None = None, out_dir: Path | None = None,
             measure_block_cost: bool = True, threads: int | None = None,
             dtype: torch.dtype = torch.float32) -> dict:
    """Evaluate each drafter on ``prompts``; fit STS first on ``calibration_prompts`` if given.

    Writes ``<out_dir>/eval.json``, ``rounds-<drafter>.jsonl`` (simulator traces) and
    ``conditional_acceptance.png`` when ``out_dir`` is set. Returns the JSON report.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_dspark.model import load_drafter

    if threads:
        torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    # fp32 compute on the bf16 weights: on this CPU bf16 matmuls of these shapes were ~3x slower
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype).eval()
    report: dict = {"target": target_path, "dtype": str(dtype).removeprefix("torch."),
                    "temperature": temperature, "max_new_tokens": max_new_tokens,
                    "verify_length": verify_length, "prompts": len(prompts), "seed": seed, "drafters": {}}
    all_records: list[RoundRecord] = []
    for path in drafter_paths:
        name = Path(path).name
        drafter = load_drafter(path, target=target, dtype=dtype)
        gamma = drafter.gamma
        calibration = _calibration_for(path, drafter, target, tokenizer, calibration_prompts, name,
                                       temperature, max_new_tokens, batch_size, seed)
        records, timing = run_rounds(target, drafter, tokenizer, prompts, name, temperature,
                                     max_new_tokens, batch_size, verify_length, seed)
        all_records += records
        result = summarize(records, gamma, calibration)
        result.update(timing, gamma=gamma, sts=None if calibration is None else calibration.to_json())
        if measure_block_cost:
            result["block_cost_batch1"] = block_cost(target, drafter, temperature=temperature)
        report["drafters"][name] = result
    names = list(report["drafters"])
    if len(names) == 2:
        first, second = (report["drafters"][n]["macro_tau"] for n in names)
        report["macro_tau_ratio"] = {f"{names[0]}/{names[1]}": first / second}
    if out_dir is not None:
        write_outputs(out_dir, report, all_records)
    return report


def write_outputs(out_dir: Path, report: dict, records: list[RoundRecord]) -> None:
    """``eval.json``, per-drafter round traces ``rounds-<drafter>.jsonl`` (the simulator's
    schema, docs/interfaces.md) and ``conditional_acceptance.png``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in dict.fromkeys(r.drafter for r in records):
        with open(out_dir / f"rounds-{name}.jsonl", "w") as handle:
            for record in records:
                if record.drafter == name:
                    handle.write(json.dumps(record.to_json()) + "\n")
    plot_conditional_acceptance(report["drafters"], out_dir / "conditional_acceptance.png",
                                f"conditional acceptance, T={report['temperature']}")
    (out_dir / "eval.json").write_text(json.dumps(report, indent=2) + "\n")


def read_traces(path: Path) -> list[RoundRecord]:
    """Round records back from a ``rounds-<drafter>.jsonl`` trace."""
    records = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            raw = json.loads(line)
            records.append(RoundRecord(drafter=raw["drafter"], domain=raw["domain"], prompt_id=raw["request_id"],
                                       round=raw["step"], verified_length=raw["verified_length"],
                                       accepted_length=raw["accepted_length"],
                                       confidence_logits=raw.get("confidence_logits")))
    return records


def _calibration_for(path: str, drafter, target, tokenizer, calibration_prompts, name, temperature,
                     max_new_tokens, batch_size, seed) -> StsCalibration | None:
    """Fit STS on the calibration prompts (saved as ``<drafter>/sts.json``, or ``sts-greedy.json``
    for greedy decoding) or load a saved one (greedy falls back to ``sts.json``)."""
    if not drafter.has_confidence_head:
        return None
    candidates = [Path(path) / file_name for file_name in sts_files(temperature)]
    if calibration_prompts:
        records, _ = run_rounds(target, drafter, tokenizer, calibration_prompts, name, temperature,
                                max_new_tokens, batch_size, None, seed + 100_000)
        calibration = fit_sts(records)
        calibration.save(candidates[0])
        return calibration
    for sts_path in candidates:
        if sts_path.exists():
            return StsCalibration.load(sts_path)
    return None


def plot_training_curves(logs: dict[str, Path], path: Path) -> None:
    """Held-out teacher-forced tau (T=1 expected and greedy chain) against training seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for name, log in logs.items():
        rows = [json.loads(line) for line in Path(log).read_text().splitlines() if line.strip()]
        minutes = [row["train_seconds"] / 60 for row in rows]
        axes[0].plot(minutes, [row["holdout_tau_t1"] for row in rows], marker=".", label=name)
        axes[1].plot(minutes, [row["holdout_tau_greedy"] for row in rows], marker=".", label=name)
    for axis, title in zip(axes, ("expected tau at T=1 (held-out)", "greedy tau (held-out)")):
        axis.set_title(title)
        axis.set_xlabel("training wall minutes (this CPU, shared)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def merge_reports(reports: list[dict]) -> dict:
    """One report from evaluations run as separate processes on the same prompts and settings."""
    merged = {key: value for key, value in reports[0].items() if key != "drafters"}
    merged["drafters"] = {}
    for report in reports:
        for key in ("temperature", "max_new_tokens", "prompts", "seed", "verify_length"):
            if report.get(key) != merged.get(key):
                raise ValueError(f"cannot merge reports that differ in {key}: {report.get(key)} vs {merged.get(key)}")
        merged["drafters"].update(report["drafters"])
    names = list(merged["drafters"])
    if len(names) == 2:
        first, second = (merged["drafters"][n]["macro_tau"] for n in names)
        merged["macro_tau_ratio"] = {f"{names[0]}/{names[1]}": first / second}
    return merged
