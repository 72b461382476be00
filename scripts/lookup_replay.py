"""Replay the target's greedy answers to measure lookup drafts and draft trees against the drafter's blocks.

    .venv/bin/python scripts/lookup_replay.py --per-domain 60 --out lookup-replay.json

Generates greedy answers (128 new tokens at most, stopped at the end of turn) to the eval split's
prompts through a plain SGLang server, then walks each answer as DSPARK_LIVE would at batch 1
with every draft verified: at each round the drafter's greedy block (its context the target's taps
of the committed tokens) and the lookup proposal (`engine.lookup`) from the same committed text,
each scored by how many of its drafts the answer confirms. Reports tokens per round for the
drafter alone, the lookup wherever it fills the block, and the per-position survival of each.
Session 28 (180 prompts): tokens per round 2.005 macro with the drafter, 2.536 with lookups;
a lookup fills the block at 45 % of the answers' positions (26 % of the rounds that use them).

It also scores the tree a lone greedy request verifies instead of the chain (`--tree-nodes`
drafts, `KernelWalk.tree` over the same block, as the server grows it). Session 50 scored a
runner-up branch of 3 beside a chain of 5 this way (120 prompts): 1.977 -> 2.158 tokens a drafter
round, 2.531 -> 2.673 with lookups where they exist (+5.6 %); session 53 replaced that branch
with trees.
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dspark_ctl.bench_serve import chat_texts
from dspark_ctl.serve import ServerLaunch, drafter_or_shipped, prepared_target_path, running
from sglang_dspark.engine.lookup import SequenceLookup
from sglang_dspark.kernels_cpu.draft_walk import KernelWalk
from sglang_dspark.model import load_drafter, target_weights_of, taps_from_hidden_states
from sglang_dspark.training.data import split_prompts

DOMAINS = ("math", "code", "chat")


def greedy_answers(target: str, per_domain: int, port: int, log_dir: Path) -> list[dict]:
    tokenizer = AutoTokenizer.from_pretrained(target)
    items = []
    for domain in DOMAINS:
        prompts = [record["prompt"] for record in split_prompts("eval", domain)][:per_domain]
        items += [(domain, text) for text in chat_texts(target, prompts)]
    launch = ServerLaunch(model_path=target, port=port, device="cpu", dtype="bfloat16", overlap=True, extra_env={})

    def ask(item: tuple[str, str]) -> dict:
        domain, text = item
        reply = httpx.post(f"{launch.url}/generate", timeout=1800, json={
            "text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 128}})
        reply.raise_for_status()
        return {"domain": domain, "prompt_ids": tokenizer(text, add_special_tokens=False)["input_ids"],
                "output_ids": reply.json()["output_ids"]}

    with running({"plain": launch}, log_dir), ThreadPoolExecutor(16) as pool:
        return list(pool.map(ask, items))


def accepted(proposal: list[int], answer: list[int], start: int) -> int:
    """How many leading drafts the answer confirms from position `start` on."""
    count = 0
    for offset, token in enumerate(proposal):
        if start + offset >= len(answer) or answer[start + offset] != token:
            break
        count += 1
    return count


def replay(answer: dict, target, drafter, kernel_walk: KernelWalk, gamma: int,
           tree_nodes: int) -> list[tuple[int, int, int]]:
    """Per round start t: (drafter's accepted drafts, lookup's accepted drafts or -1 without a
    lookup, the tree's accepted drafts)."""
    prompt, output = answer["prompt_ids"], answer["output_ids"]
    hidden = target(torch.tensor([prompt + output]), output_hidden_states=True).hidden_states
    taps = taps_from_hidden_states(hidden, list(drafter.target_layer_ids))[0]
    cache, slot = drafter.new_cache(num_slots=1, capacity=len(prompt) + len(output) + 16), torch.tensor([0])
    drafter.append_context(cache, slot, taps[: len(prompt)], torch.tensor([len(prompt)]))
    lookup = SequenceLookup(prompt)
    rounds = []
    for t in range(len(output) - 1):
        bonus = torch.tensor([output[t]])
        # the chain and the tree as the server walks and grows them (`KernelWalk`)
        hidden = drafter.forward_block(cache, slot, bonus)
        base = kernel_walk.base_logits(hidden)
        block = kernel_walk.greedy(hidden, bonus, base)
        tree = kernel_walk.tree(base[0], output[t], tree_nodes)
        proposal = lookup.propose(output[t], gamma)
        rounds.append((accepted(block.tokens[0].tolist(), output, t + 1),
                       accepted(proposal, output, t + 1) if proposal else -1,
                       len(tree.follow(output[t + 1: t + 1 + gamma]))))
        drafter.append_context(cache, slot, taps[len(prompt) + t: len(prompt) + t + 1], torch.tensor([1]))
        lookup.extend([output[t]])
    return rounds


def walk(rounds: list[tuple[int, int, int]], use_lookup: bool, use_tree: bool = False) -> tuple[int, int]:
    """(rounds, committed tokens) of decoding the answer with or without lookups, drafter rounds
    verifying the chain or the tree."""
    t = steps = committed = 0
    while t < len(rounds):
        drafter_accepted, lookup_accepted, tree_drafts_accepted = rounds[t]
        if use_tree:
            drafter_accepted = tree_drafts_accepted
        step = (lookup_accepted if use_lookup and lookup_accepted >= 0 else drafter_accepted) + 1
        steps, committed, t = steps + 1, committed + step, t + step
    return steps, committed


def survival(counts: list[int], gamma: int) -> list[float]:
    return [round(sum(c >= k for c in counts) / max(len(counts), 1), 3) for k in range(1, gamma + 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-domain", type=int, default=60)
    parser.add_argument("--drafter", default=None)
    parser.add_argument("--port", type=int, default=31500)
    parser.add_argument("--tree-nodes", type=int, default=15, help="drafts of the tree scored beside the chain")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(2)
    target_path = prepared_target_path()
    answers = greedy_answers(target_path, args.per_domain, args.port, args.out.with_suffix(".logs"))
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    drafter = load_drafter(drafter_or_shipped(args.drafter), target=target_weights_of(target)).float().eval()
    gamma = drafter.gamma
    kernel_walk = KernelWalk(drafter)
    if args.tree_nodes < 1:
        parser.error(f"--tree-nodes {args.tree_nodes}: expected at least 1")
    report: dict = {"prompts_per_domain": args.per_domain, "gamma": gamma, "tree_nodes": args.tree_nodes,
                    "domains": {}}
    policies = {"drafter": (False, False), "with_lookup": (True, False),
                "drafter_tree": (False, True), "with_lookup_and_tree": (True, True)}
    with torch.no_grad():
        for domain in DOMAINS:
            rounds = [replay(a, target, drafter, kernel_walk, gamma, args.tree_nodes)
                      for a in answers if a["domain"] == domain]
            flat = [r for answer in rounds for r in answer]
            tau = {}
            for name, policy in policies.items():
                steps, committed = (sum(x) for x in zip(*(walk(r, *policy) for r in rounds)))
                tau[name] = committed / steps
            report["domains"][domain] = {
                **{f"tau_{name}": round(value, 3) for name, value in tau.items()},
                "lookup_round_share": round(sum(lookup >= 0 for _, lookup, _ in flat) / len(flat), 3),
                "drafter_survival": survival([d for d, _, _ in flat], gamma),
                "lookup_survival": survival([lookup for _, lookup, _ in flat if lookup >= 0], gamma),
                "tree_survival": survival([b for _, _, b in flat], gamma),
            }
    for name in (f"tau_{policy}" for policy in policies):
        report[f"macro_{name}"] = round(sum(d[name] for d in report["domains"].values()) / len(DOMAINS), 3)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
