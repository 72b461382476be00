"""`dspark-ctl train` (distil drafters) and `dspark-ctl data` (prompts, responses, target cache)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import List, Optional

import typer

data_app = typer.Typer(no_args_is_help=True, help="Training data: splits, target responses, target cache.")

DEFAULT_LAYER_IDS = "1,10,19,27"


def _target_or_default(target: Optional[str]) -> str:
    if target:
        return target
    from sglang_dspark.training.prepare import default_target_path

    try:
        return str(default_target_path())
    except FileNotFoundError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(code=2) from error


def train_command(
    out: str = typer.Option(..., "--out", help="Folder of the drafter (checkpoint, shipped weights, logs)."),
    cache: List[str] = typer.Option(..., "--cache", help="Target cache folder (dspark-ctl data cache); repeat to join several."),
    target: Optional[str] = typer.Option(None, "--target", help="Target model folder [default: prepared SmolLM2]."),
    markov_rank: int = typer.Option(64, "--markov-rank", help="Markov head rank; 0 = no head (DFlash)."),
    markov_head: str = typer.Option("vanilla", "--markov-head", help="vanilla | gated | rnn."),
    no_confidence_head: bool = typer.Option(False, "--no-confidence-head"),
    layers: int = typer.Option(1, "--layers", help="Drafter transformer layers."),
    block_size: int = typer.Option(7, "--block-size", help="gamma: drafts per block."),
    twin_out: Optional[str] = typer.Option(None, "--twin-out", help="Also train the DFlash twin (rank 0, no confidence head) here, on the same batches."),
    init_from: Optional[str] = typer.Option(None, "--init-from", help="Start a fresh run from this trained drafter folder (its weights and vocabulary; --layers may add identity-initialised layers, and a larger --markov-rank widens a vanilla Markov head with columns that add nothing at first)."),
    reselect_vocab: bool = typer.Option(False, "--reselect-vocab", help="With --init-from: choose the draft vocabulary afresh from --cache (--draft-vocab tokens) instead of keeping the source's; the tokens both share keep their trained Markov rows."),
    twin_init_from: Optional[str] = typer.Option(None, "--twin-init-from", help="The same for the twin."),
    steps: int = typer.Option(1000, "--steps", help="Total optimizer steps (a resumed run continues towards it)."),
    lr: float = typer.Option(1e-3, "--lr"),
    draft_vocab: int = typer.Option(8192, "--draft-vocab", help="Reduced draft vocabulary size."),
    anchors: int = typer.Option(64, "--anchors", help="Anchors per sequence."),
    seqs_per_step: int = typer.Option(4, "--seqs-per-step"),
    kl_alpha: float = typer.Option(0.0, "--kl-alpha", help="Weight of a soft cross-entropy to the target's distribution on top of DeepSpec's losses (0: DeepSpec's recipe)."),
    seed: int = typer.Option(0, "--seed"),
    checkpoint_every: int = typer.Option(100, "--checkpoint-every"),
    eval_every: int = typer.Option(50, "--eval-every"),
    time_budget_min: Optional[float] = typer.Option(None, "--time-budget-min", help="Stop (and checkpoint) after this many minutes."),
    stop_at: Optional[int] = typer.Option(None, "--stop-at", help="Stop (and checkpoint) at this step, keeping the --steps schedule: brings drafters trained side by side to the same step."),
    schedule_min: Optional[float] = typer.Option(None, "--schedule-min", help="End the run after this many minutes with the learning rate annealed to 0 by then (or at --steps, whichever comes first): for a fixed wall budget on a machine whose step time is not known beforehand."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch threads (1 is best on a busy 2-core CPU)."),
    autocast: str = typer.Option("auto", "--autocast", help="bf16 (mixed precision: fp32 weights and optimizer, bf16 matmuls), off (fp32), or auto: bf16 on a CPU with native bf16 math (AVX512-BF16/AMX), where a step ran 1.5x faster; off elsewhere (2.7x slower without it)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Distil a DSpark drafter (and optionally its DFlash twin) from a cached target."""
    from sglang_dspark.runtime import cpu_has_native_bf16, keep_freed_memory, set_torch_threads
    from sglang_dspark.training.target_cache import load_target_caches
    from sglang_dspark.training.trainer import DrafterSpec, TrainSettings, train_drafters

    keep_freed_memory()  # a step's big tensors reuse the last step's pages: the kernel's share of
    # a trainer's CPU time fell from 15-25 % to 1-2 % (session 17)

    if markov_head not in ("vanilla", "gated", "rnn"):
        raise typer.BadParameter(f"--markov-head must be vanilla, gated or rnn, got {markov_head!r}")
    if autocast not in ("auto", "bf16", "off"):
        raise typer.BadParameter(f"--autocast must be auto, bf16 or off, got {autocast!r}")
    if threads:
        set_torch_threads(threads)
    if reselect_vocab and not (init_from or twin_init_from):
        raise typer.BadParameter("--reselect-vocab re-chooses the vocabulary of an --init-from drafter; "
                                 "a run without --init-from chooses a fresh one anyway")
    if schedule_min is not None and (schedule_min <= 0 or time_budget_min is not None):
        raise typer.BadParameter("--schedule-min takes minutes > 0 and ends the run, annealed; --time-budget-min "
                                 "pauses one on its step schedule instead: give one of them")
    target_dir = Path(_target_or_default(target))
    specs = [DrafterSpec(out=out, markov_rank=markov_rank, markov_head_type=markov_head,
                         confidence_head=not no_confidence_head, init_from=init_from)]
    if twin_out:
        specs.append(DrafterSpec(out=twin_out, markov_rank=0, confidence_head=False, init_from=twin_init_from))
    settings = TrainSettings(layers=layers, block_size=block_size, draft_vocab_size=draft_vocab,
                             anchors_per_seq=anchors, seqs_per_step=seqs_per_step, steps=steps, lr=lr,
                             kl_alpha=kl_alpha, reselect_vocab=reselect_vocab, seed=seed, checkpoint_every=checkpoint_every, eval_every=eval_every,
                             bf16_autocast=autocast == "bf16" or (autocast == "auto" and cpu_has_native_bf16()))
    command = "dspark-ctl " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    summary = train_drafters(load_target_caches([Path(c) for c in cache]), target_dir, specs, settings, command=command,
                             time_budget_s=None if time_budget_min is None else time_budget_min * 60,
                             stop_at=stop_at, progress=not as_json,
                             schedule_seconds=None if schedule_min is None else schedule_min * 60)
    typer.echo(json.dumps(summary, indent=None if as_json else 2))


@data_app.command("splits")
def splits_command(
    out: str = typer.Option(..., "--out", help="Folder for eval/calibration/train JSONL files."),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Write the prompt splits (eval/calibration are the frozen shipped ones; train is the rest)."""
    from sglang_dspark.training.data import write_splits

    typer.echo(json.dumps(write_splits(Path(out), seed=seed)["sizes"]))


@data_app.command("generate")
def generate_command(
    prompts: str = typer.Option(..., "--prompts", help="JSONL with id, domain, prompt."),
    out: str = typer.Option(..., "--out", help="JSONL of responses (appended; resumable)."),
    target: Optional[str] = typer.Option(None, "--target"),
    max_new_tokens: int = typer.Option(192, "--max-new-tokens"),
    batch_size: int = typer.Option(16, "--batch-size"),
    temperature: float = typer.Option(0.7, "--temperature"),
    top_p: float = typer.Option(0.9, "--top-p"),
    seed: int = typer.Option(0, "--seed"),
    time_budget_min: Optional[float] = typer.Option(None, "--time-budget-min"),
    threads: Optional[int] = typer.Option(None, "--threads"),
    server: Optional[str] = typer.Option(None, "--server", help="Generate through this running SGLang server of the target (e.g. http://127.0.0.1:30000; `dspark-ctl serve --no-speculation`): continuous batching, ~5x the tokens/s of the in-process path on this CPU. --target then only names the tokenizer; --seed, --batch-size and --threads do not apply."),
    concurrency: int = typer.Option(32, "--concurrency", help="Requests in flight with --server (at most the server's --max-running-requests is useful)."),
    skip_answered: List[str] = typer.Option([], "--skip-answered", help="Answer files (.jsonl or .jsonl.gz, repeatable) whose prompts are not sent again, matched by their token ids (with --server)."),
) -> None:
    """Answer training prompts with the target itself: in process (batched fp32 sampling on the
    bf16 weights) or through a running SGLang server (--server)."""
    budget = None if time_budget_min is None else time_budget_min * 60
    if server:
        from sglang_dspark.training.data import generate_responses_via_server

        try:
            summary = generate_responses_via_server(server, _target_or_default(target), Path(prompts), Path(out),
                                                    max_new_tokens=max_new_tokens, concurrency=concurrency,
                                                    temperature=temperature, top_p=top_p, time_budget_s=budget,
                                                    skip_answered=[Path(path) for path in skip_answered])
        except (OSError, RuntimeError) as error:  # no server, a missing --skip-answered file, a refused prompt
            typer.echo(f"error: {error}", err=True)
            raise typer.Exit(code=2) from error
    else:
        if skip_answered:
            typer.echo("error: --skip-answered works with --server only", err=True)
            raise typer.Exit(code=2)
        from sglang_dspark.training.data import generate_responses

        summary = generate_responses(_target_or_default(target), Path(prompts), Path(out),
                                     max_new_tokens=max_new_tokens, batch_size=batch_size, temperature=temperature,
                                     top_p=top_p, seed=seed, time_budget_s=budget, threads=threads)
    typer.echo(json.dumps(summary))


@data_app.command("cache")
def cache_command(
    records: str = typer.Option(..., "--records", help="JSONL with id, domain, prompt_ids, response_ids."),
    out: str = typer.Option(..., "--out", help="Target cache folder (resumable)."),
    target: Optional[str] = typer.Option(None, "--target"),
    layer_ids: str = typer.Option(DEFAULT_LAYER_IDS, "--layer-ids", help="Tapped target layers, comma-separated."),
    top_k: int = typer.Option(64, "--top-k"),
    max_len: int = typer.Option(448, "--max-len"),
    threads: Optional[int] = typer.Option(None, "--threads"),
    time_budget_min: Optional[float] = typer.Option(None, "--time-budget-min"),
) -> None:
    """Run the target once over the records: taps + top-k next-token probabilities per token."""
    from sglang_dspark.training.target_cache import build_target_cache

    ids = [int(x) for x in layer_ids.split(",") if x.strip()]
    budget = None if time_budget_min is None else time_budget_min * 60
    typer.echo(json.dumps(build_target_cache(_target_or_default(target), Path(records), Path(out), ids,
                                             top_k=top_k, max_len=max_len, threads=threads,
                                             time_budget_s=budget)))
