"""Distil both shipped drafters further on a lent GPU, in one unattended run.

On the 2-core CPU the target answers ~200 tokens/s and caching its taps takes ~25 minutes per
500k tokens, so data, not steps, bounded the drafters (drafters/README.md). On a GPU the same
pipeline runs in minutes, end to end:

1. dequantise the wheel's GGUF into a bf16 model folder (``prepare._convert``, as ``dspark-ctl
   prepare`` does; the GGUF is the only copy of the target a device machine can receive);
2. the target answers the prompts of the shipped answer files afresh, at the two samplings those
   files used (T=1.0, and T=0.5 with top-p 0.9), until ``--generate-seconds`` are spent;
3. old and new answers go through the target once more, their taps and top-64 probabilities kept
   in GPU memory (``cache_in_memory``);
4. the DSpark drafter and its DFlash twin train from their shipped weights on the same batches
   (``train_drafters``), with a cosine schedule that anneals by ``--train-seconds``.

It writes to ``--out``: each drafter folder as a tar (its shipped bf16 weights, config, recipe and
held-out log), the new answers as ``.jsonl.gz`` in the format of ``drafters/data/``, and
``summary.json``. Pure torch and transformers: no SGLang on the device machine.

    python scripts/gpu_distill.py --gguf G.gguf --answers drafters/data/*.jsonl.gz \\
        --init-dspark drafters/smollm2-135m-dspark --init-dflash drafters/smollm2-135m-dflash \\
        --work /tmp/distill --out $OUT --device cuda
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import shutil
import sys
import tarfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_dspark.training.data import _generate_batch, read_responses  # noqa: E402
from sglang_dspark.training.prepare import _convert  # noqa: E402
from sglang_dspark.training.target_cache import cache_in_memory  # noqa: E402
from sglang_dspark.training.trainer import DrafterSpec, TrainSettings, train_drafters  # noqa: E402

SAMPLINGS = {"t1": (1.0, 1.0), "t05-p09": (0.5, 0.9)}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def unique_prompts(records: list[dict], seed: int) -> list[dict]:
    """One entry per distinct prompt, shuffled (seeded) so a time budget samples every domain."""
    seen: dict[tuple, dict] = {}
    for record in records:
        seen.setdefault(tuple(record["prompt_ids"]), record)
    prompts = list(seen.values())
    random.Random(seed).shuffle(prompts)
    return prompts


def answer_afresh(model, prompts: list[dict], eos: int, args) -> dict[str, list[dict]]:
    """New target answers to ``prompts``, alternating the two samplings batch by batch."""
    answers: dict[str, list[dict]] = {name: [] for name in SAMPLINGS}
    started = time.perf_counter()
    names = list(SAMPLINGS)
    starts = list(range(0, len(prompts), args.generate_batch))
    for number in range(args.passes * len(starts)):
        if time.perf_counter() - started > args.generate_seconds:
            break
        rank, index = divmod(number, len(starts))  # the rank-th answer to these prompts
        name = names[(index + rank) % len(names)]  # a prompt's next answer at the other sampling
        temperature, top_p = SAMPLINGS[name]
        start = starts[index]
        batch = sorted(prompts[start : start + args.generate_batch], key=lambda r: len(r["prompt_ids"]))
        torch.manual_seed(args.seed * 100_000 + number)
        responses = _generate_batch(model, [r["prompt_ids"] for r in batch], eos,
                                    args.max_new_tokens, temperature, top_p)
        for record, response in zip(batch, responses):
            answers[name].append({"id": f"{record['id']}-{args.tag}{rank}-{name}", "domain": record["domain"],
                                  "prompt_ids": record["prompt_ids"], "response_ids": response})
        tokens = sum(len(a["response_ids"]) for group in answers.values() for a in group)
        log(f"generate batch {number} ({name}, {len(batch)} prompts): {tokens} answer tokens, "
            f"{time.perf_counter() - started:.0f} s")
    return answers


def write_answers(answers: dict[str, list[dict]], out: Path, tag: str) -> dict[str, int]:
    counts = {}
    for name, records in answers.items():
        with gzip.open(out / f"answers-{tag}-{name}.jsonl.gz", "wt") as handle:
            for record in records:
                handle.write(json.dumps(record) + "\n")
        counts[name] = sum(len(r["response_ids"]) for r in records)
    return counts


def tar_drafter(folder: Path, out: Path) -> None:
    with tarfile.open(out / f"{folder.name}.tar", "w") as tar:
        for path in sorted(folder.iterdir()):
            if path.is_file():
                tar.add(path, arcname=f"{folder.name}/{path.name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--answers", type=Path, nargs="+", required=True)
    parser.add_argument("--init-dspark", type=Path, required=True)
    parser.add_argument("--init-dflash", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tag", default="gpu", help="names the new answers and their record ids")
    parser.add_argument("--generate-seconds", type=float, default=150)
    parser.add_argument("--generate-batch", type=int, default=512)
    parser.add_argument("--passes", type=int, default=2, help="answers per prompt at most (time allowing)")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--train-seconds", type=float, default=240)
    parser.add_argument("--steps", type=int, default=6000, help="the schedule's length if time allows it")
    parser.add_argument("--seqs-per-step", type=int, default=64)
    parser.add_argument("--anchors", type=int, default=48)
    parser.add_argument("--lr", type=float, default=1e-3, help="what session 36's H200 run used")
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--max-len", type=int, default=448)
    parser.add_argument("--tokens-per-batch", type=int, default=32768)
    parser.add_argument("--limit-records", type=int, default=None, help="a dry run on fewer answers")
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.work / "target"
    if not (target / "model.safetensors").exists():
        shutil.rmtree(target, ignore_errors=True)
        _convert(args.gguf, target)
    log(f"target ready at {target}")
    dtype = torch.bfloat16 if args.device != "cpu" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(args.device).eval()
    eos = json.loads((target / "config.json").read_text())["eos_token_id"]
    eos = int(eos[0] if isinstance(eos, list) else eos)

    records = [r for path in args.answers for r in read_responses(path) if r["response_ids"]]
    records = records[: args.limit_records]
    log(f"{len(records)} shipped answers, {sum(len(r['response_ids']) for r in records)} answer tokens")
    answers = answer_afresh(model, unique_prompts(records, args.seed), eos, args)
    new_tokens = write_answers(answers, args.out, args.tag)
    log(f"new answer tokens: {new_tokens}")

    layer_ids = json.loads((args.init_dspark / "config.json").read_text())["target_layer_ids"]
    everything = records + [r for group in answers.values() for r in group]
    cache = cache_in_memory(model, everything, layer_ids, top_k=64, max_len=args.max_len,
                            tokens_per_batch=args.tokens_per_batch)
    del model
    log(f"cache: {cache.num_sequences} sequences, {cache.meta['tokens']} tokens on {cache.input_ids.device}")

    settings = TrainSettings(layers=1, block_size=7, draft_vocab_size=8192, anchors_per_seq=args.anchors,
                             seqs_per_step=args.seqs_per_step, steps=args.steps, warmup_frac=0.01,
                             lr=args.lr, seed=args.seed,
                             checkpoint_every=10**6, eval_every=args.eval_every, kl_alpha=1.0,
                             bf16_autocast=args.device != "cpu")
    specs = [DrafterSpec(out=str(args.work / "dspark"), markov_rank=32, markov_head_type="vanilla",
                         init_from=str(args.init_dspark)),
             DrafterSpec(out=str(args.work / "dflash"), markov_rank=0, confidence_head=False,
                         init_from=str(args.init_dflash))]
    for spec in specs:
        shutil.rmtree(spec.out, ignore_errors=True)
    command = "python " + " ".join(sys.argv)
    summary = train_drafters(cache, target, specs, settings, command=command, progress=False,
                             device=args.device, schedule_seconds=args.train_seconds)
    log(f"trained: {summary}")
    for spec in specs:
        tar_drafter(Path(spec.out), args.out)
    summary.update(new_answer_tokens=new_tokens, old_answers=len(records),
                   wall_seconds=round(time.perf_counter() - started, 1),
                   device=torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log("done")


if __name__ == "__main__":
    main()
