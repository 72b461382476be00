"""The target cache: what the trainer needs from the frozen target, computed once per sequence.

Per token of every training sequence (chat-templated prompt + the target's own response):
- ``input_ids`` (int32) and ``loss_mask`` (uint8, 1 on response tokens incl. ``<|im_end|>``);
- ``taps``: the raw outputs of the tapped target layers, concatenated ``[m*d]`` (bf16): the
  drafter's context features;
- ``topk_probs`` / ``topk_ids``: the target's next-token distribution at temperature 1, its k most
  likely tokens (fp16 / int32). The L1 loss and the confidence label need p_t; storing the top-k
  instead of the final hidden state saves the full-vocabulary head (28 M multiply-adds a token)
  in every training step, at the cost of ignoring the target's tail mass beyond k.

Why cached and not on the fly: on this 2-core CPU the 135M target's forward costs more than the
drafter's training step, and the trainer makes several passes over the data for *two* drafters
(DSpark and its DFlash twin), so computing the target once saves most of the training time. The
cost is memory (~5 KB a token with 4 taps, k=64), fine for the ~10^5-10^6 tokens we can afford.
The taps (90 % of it) stay memory-mapped in their shard files (``TapShards``): a million tokens'
4.6 GB are read through the page cache, which the DSpark drafter's and its twin's trainers,
running side by side, share instead of each holding a copy.

Shards are ``shard-XXXXX.pt`` files written as sequences are processed; ``index.json`` lists the
record ids already cached, so building is resumable and can grow as more responses arrive.
"""

from __future__ import annotations

import bisect
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from sglang_dspark.training.data import read_responses

CACHE_VERSION = 1


class TapShards:
    """The taps of several shards as one ``[N, m*d]`` table without concatenating them.

    Sequences never straddle shards, so a row slice ``[start:end]`` of one sequence is a view into
    a single shard's (memory-mapped) tensor.
    """

    def __init__(self, parts: list[torch.Tensor]) -> None:
        if not parts:
            raise ValueError("TapShards needs at least one shard")
        self.parts = parts
        self.starts = [0]
        for part in parts:
            self.starts.append(self.starts[-1] + part.shape[0])

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.starts[-1], *self.parts[0].shape[1:]))

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    def __getitem__(self, rows: slice) -> torch.Tensor:
        start, stop, _ = rows.indices(self.starts[-1])
        shard = bisect.bisect_right(self.starts, start) - 1
        base = self.starts[shard]
        if stop > self.starts[shard + 1]:
            raise IndexError(f"rows {start}:{stop} straddle shards {shard} and {shard + 1}")
        return self.parts[shard][start - base:stop - base]

    @staticmethod
    def join(tables: list[TapShards]) -> TapShards:
        return TapShards([part for table in tables for part in table.parts])


@dataclass
class TargetCache:
    """All cached sequences, flat: sequence ``s`` is ``offsets[s]:offsets[s+1]`` of every field."""

    input_ids: torch.Tensor  # int32 [N]
    loss_mask: torch.Tensor  # bool [N]
    taps: TapShards  # bf16 [N, m*d]
    topk_probs: torch.Tensor  # fp16 [N, k]
    topk_ids: torch.Tensor  # int32 [N, k]
    offsets: torch.Tensor  # int64 [S+1]
    domains: list[str]
    meta: dict
    ids: list[str] | None = None  # record ids, stable across cache growth (holdout membership)

    @property
    def num_sequences(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def sequence(self, index: int) -> dict[str, torch.Tensor]:
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return {
            "input_ids": self.input_ids[start:end],
            "loss_mask": self.loss_mask[start:end],
            "taps": self.taps[start:end],
            "topk_probs": self.topk_probs[start:end],
            "topk_ids": self.topk_ids[start:end],
        }


def build_target_cache(
    model_path: str,
    responses_file: Path,
    cache_dir: Path,
    layer_ids: list[int],
    top_k: int = 64,
    max_len: int = 512,
    tokens_per_batch: int = 4096,
    shard_tokens: int = 16384,
    threads: int | None = None,
    time_budget_s: float | None = None,
) -> dict:
    """Run the target over every not-yet-cached response and append shards; returns a summary.

    With ``time_budget_s`` it stops after the batch that crosses the budget and flushes what it has.
    """
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    cache_dir.mkdir(parents=True, exist_ok=True)
    index = _read_index(cache_dir, layer_ids, top_k, model_path)
    done = set(index["record_ids"])
    records = [r for r in read_responses(responses_file) if r["id"] not in done and r["response_ids"]]
    # fp32 compute on the bf16 weights: on this CPU a bf16 prefill was 3x slower than fp32
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    started = time.perf_counter()
    pending: list[dict] = []
    new_tokens = 0
    # sort by length within windows only: little padding, and a build stopped early stays a
    # random sample of the records rather than only the shortest ones
    window = 64
    records = [r for start in range(0, len(records), window)
               for r in sorted(records[start : start + window],
                               key=lambda r: len(r["prompt_ids"]) + len(r["response_ids"]))]
    for batch in _token_batches(records, tokens_per_batch, max_len):
        if time_budget_s is not None and time.perf_counter() - started > time_budget_s:
            break
        pending.extend(_run_target(model, batch, layer_ids, top_k, max_len))
        if sum(len(p["input_ids"]) for p in pending) >= shard_tokens:
            new_tokens += _write_shard(cache_dir, index, pending)
            pending = []
    if pending:
        new_tokens += _write_shard(cache_dir, index, pending)
    seconds = time.perf_counter() - started
    return {
        "sequences": len(index["record_ids"]),
        "tokens": index["tokens"],
        "new_tokens": new_tokens,
        "seconds": round(seconds, 1),
        "tokens_per_s": round(new_tokens / max(seconds, 1e-9), 1),
    }


def _read_index(cache_dir: Path, layer_ids: list[int], top_k: int, model_path: str) -> dict:
    path = cache_dir / "index.json"
    if not path.exists():
        return {"version": CACHE_VERSION, "layer_ids": list(layer_ids), "top_k": top_k,
                "target": str(model_path), "shards": [], "record_ids": [], "tokens": 0}
    index = json.loads(path.read_text())
    if index["layer_ids"] != list(layer_ids) or index["top_k"] != top_k:
        raise ValueError(
            f"{cache_dir} holds layer_ids={index['layer_ids']} top_k={index['top_k']}, but "
            f"layer_ids={list(layer_ids)} top_k={top_k} were asked: use another cache folder"
        )
    return index


def _token_batches(records: list[dict], tokens_per_batch: int, max_len: int):
    batch: list[dict] = []
    for record in records:
        length = min(len(record["prompt_ids"]) + len(record["response_ids"]), max_len)
        if batch and length * (len(batch) + 1) > tokens_per_batch:
            yield batch
            batch = []
        batch.append(record)
    if batch:
        yield batch


@torch.inference_mode()
def _run_target(model, batch: list[dict], layer_ids: list[int], top_k: int, max_len: int) -> list[dict]:
    sequences = [(r["prompt_ids"] + r["response_ids"])[:max_len] for r in batch]
    width = max(len(s) for s in sequences)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    for row, seq in enumerate(sequences):  # right padding: positions stay 0..len-1
        ids[row, : len(seq)] = torch.tensor(seq)
        attention[row, : len(seq)] = 1
    out = model(input_ids=ids.to(model.device), attention_mask=attention.to(model.device),
                output_hidden_states=True)
    taps = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1).to(torch.bfloat16)
    logits = out.logits.float()
    top_logits, top_i = logits.topk(top_k, dim=-1)  # softmax is monotone: same ids, one pass less
    top_p = torch.exp(top_logits - torch.logsumexp(logits, dim=-1, keepdim=True))
    results = []
    for row, (record, seq) in enumerate(zip(batch, sequences)):
        n = len(seq)
        mask = torch.zeros(n, dtype=torch.uint8, device=taps.device)
        mask[min(len(record["prompt_ids"]), n) :] = 1
        results.append({
            "id": record["id"],
            "domain": record["domain"],
            "input_ids": torch.tensor(seq, dtype=torch.int32, device=taps.device),
            "loss_mask": mask,
            "taps": taps[row, :n].clone(),
            "topk_probs": top_p[row, :n].to(torch.float16),
            "topk_ids": top_i[row, :n].to(torch.int32),
        })
    return results


def cache_in_memory(model, records: list[dict], layer_ids: list[int], top_k: int,
                    max_len: int = 512, tokens_per_batch: int | None = None) -> TargetCache:
    """Build a :class:`TargetCache` without touching disk (tests, small experiments, and a lent
    GPU, where the cache stays in the model's device memory so that training batches never cross
    to the host). ``tokens_per_batch`` bounds one target forward (all records at once without)."""
    batches = _token_batches(records, tokens_per_batch, max_len) if tokens_per_batch else [records]
    sequences = [seq for batch in batches for seq in _run_target(model, batch, layer_ids, top_k, max_len)]
    lengths = torch.tensor([len(s["input_ids"]) for s in sequences])
    return TargetCache(
        input_ids=torch.cat([s["input_ids"] for s in sequences]),
        loss_mask=torch.cat([s["loss_mask"] for s in sequences]).bool(),
        taps=TapShards([torch.cat([s["taps"] for s in sequences])]),
        topk_probs=torch.cat([s["topk_probs"] for s in sequences]),
        topk_ids=torch.cat([s["topk_ids"] for s in sequences]),
        offsets=torch.cat((torch.zeros(1, dtype=torch.long), lengths.cumsum(0))),
        domains=[s["domain"] for s in sequences],
        meta={"layer_ids": list(layer_ids), "top_k": top_k, "target": "in-memory",
              "tokens": int(lengths.sum())},
        ids=[s["id"] for s in sequences],
    )


def _write_shard(cache_dir: Path, index: dict, sequences: list[dict]) -> int:
    name = f"shard-{len(index['shards']):05d}.pt"
    lengths = torch.tensor([len(s["input_ids"]) for s in sequences])
    shard = {
        "ids": [s["id"] for s in sequences],
        "domains": [s["domain"] for s in sequences],
        "offsets": torch.cat((torch.zeros(1, dtype=torch.long), lengths.cumsum(0))),
    }
    for field in ("input_ids", "loss_mask", "taps", "topk_probs", "topk_ids"):
        shard[field] = torch.cat([s[field] for s in sequences])
    torch.save(shard, cache_dir / (name + ".tmp"))
    (cache_dir / (name + ".tmp")).rename(cache_dir / name)
    index["shards"].append(name)
    index["record_ids"].extend(shard["ids"])
    index["tokens"] += int(lengths.sum())
    (cache_dir / "index.json").write_text(json.dumps(index) + "\n")
    return int(lengths.sum())


def load_target_cache(cache_dir: Path) -> TargetCache:
    """Concatenate every shard listed in ``index.json`` into one :class:`TargetCache`."""
    index_path = Path(cache_dir) / "index.json"
    if not index_path.exists():
        raise FileNotFoundError(f"{cache_dir} has no index.json: build the target cache first")
    index = json.loads(index_path.read_text())
    if not index["shards"]:
        raise ValueError(f"{cache_dir} holds no shards yet")
    # mmap: the taps are read in place (see TapShards); the small fields are copied by cat below
    shards = [torch.load(Path(cache_dir) / name, weights_only=True, mmap=True) for name in index["shards"]]
    offsets, total = [torch.zeros(1, dtype=torch.long)], 0
    for shard in shards:
        offsets.append(shard["offsets"][1:] + total)
        total += int(shard["offsets"][-1])
    return TargetCache(
        input_ids=torch.cat([s["input_ids"] for s in shards]),
        loss_mask=torch.cat([s["loss_mask"] for s in shards]).bool(),
        taps=TapShards([s["taps"] for s in shards]),
        topk_probs=torch.cat([s["topk_probs"] for s in shards]),
        topk_ids=torch.cat([s["topk_ids"] for s in shards]),
        offsets=torch.cat(offsets),
        domains=[d for s in shards for d in s["domains"]],
        meta={k: index[k] for k in ("layer_ids", "top_k", "target", "tokens")},
        ids=[i for s in shards for i in s["ids"]],
    )


def load_target_caches(cache_dirs: list[Path]) -> TargetCache:
    """Several cache folders (e.g. built by parallel builders) as one; they must agree on taps/k."""
    caches = [load_target_cache(Path(d)) for d in cache_dirs]
    first = caches[0]
    for other, folder in zip(caches[1:], cache_dirs[1:]):
        if other.meta["layer_ids"] != first.meta["layer_ids"] or other.meta["top_k"] != first.meta["top_k"]:
            raise ValueError(
                f"{folder} has layer_ids={other.meta['layer_ids']} top_k={other.meta['top_k']}, "
                f"the first cache layer_ids={first.meta['layer_ids']} top_k={first.meta['top_k']}"
            )
    if len(caches) == 1:
        return first
    offsets, total = [torch.zeros(1, dtype=torch.long)], 0
    for cache in caches:
        offsets.append(cache.offsets[1:] + total)
        total += int(cache.offsets[-1])
    return TargetCache(
        input_ids=torch.cat([c.input_ids for c in caches]),
        loss_mask=torch.cat([c.loss_mask for c in caches]),
        taps=TapShards.join([c.taps for c in caches]),
        topk_probs=torch.cat([c.topk_probs for c in caches]),
        topk_ids=torch.cat([c.topk_ids for c in caches]),
        offsets=torch.cat(offsets),
        domains=[d for c in caches for d in c.domains],
        meta={**first.meta, "tokens": total, "folders": [str(d) for d in cache_dirs]},
        ids=[i for c in caches for i in (c.ids or [])],
    )
