"""Distil DSpark drafters (and their DFlash twins) from a cached target (dspark-algorithm.md 4).

Losses (DeepSpec): 0.1 CE on the Markov-corrected draft logits + 0.9 L1 between the draft and
target next-token distributions + 1.0 confidence BCE against the soft label 1 - TV, each a
position-weighted mean with w_k = exp(-k/4) over the contiguous valid prefix of each block.
Many random anchors per sequence run in one pass (``DSparkDrafter.forward_train``). Embedding
and lm_head are the target's, frozen.

Target hidden states are **cached, not computed on the fly** (``target_cache.py``): on this CPU
the target forward costs more than a drafter step, every sequence is seen several times, and
several drafters train on the same data, so paying the target once is the cheapest option. The
target distribution comes from the cache as its top-k probabilities (no full-vocabulary head in
the training step).

Reduced draft vocabulary: the ``draft_vocab_size`` most frequent target tokens of the training
responses (plus the end-of-turn token), with ``d2t`` mapping draft ids to target ids. Target
mass outside it cannot be proposed, so it counts as rejected in the L1 and confidence label.

Several drafters can train in one process on exactly the same batches (``train_drafters``):
that is how the DSpark drafter and its DFlash twin get "the same data for the same steps".
Checkpoints hold fp32 weights, optimizer, schedule position and RNG state, so a later run
resumes where the last stopped (``--steps`` may grow between runs).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from sglang_dspark.model import DSparkConfig, DSparkDrafter, TargetWeights, save_drafter
from sglang_dspark.training.target_cache import TargetCache

CHECKPOINT_DIR = "checkpoint"


@dataclass
class DrafterSpec:
    """One drafter to train: its output folder and its architecture knobs."""

    out: str
    markov_rank: int = 64
    markov_head_type: str = "vanilla"
    confidence_head: bool = True
    # a trained drafter folder to start from (a fresh run only): its weights, more layers allowed
    init_from: str | None = None


@dataclass
class TrainSettings:
    """Everything shared by the drafters of one training run (recorded in the checkpoint)."""

    layers: int = 2
    block_size: int = 7
    draft_vocab_size: int = 8192
    mask_token_id: int = 16
    anchors_per_seq: int = 64
    seqs_per_step: int = 4
    steps: int = 1000
    lr: float = 1e-3
    warmup_frac: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    ce_alpha: float = 0.1
    l1_alpha: float = 0.9
    conf_alpha: float = 1.0
    # soft cross-entropy to the target's (top-k) distribution, i.e. forward KL up to a constant:
    # 0 in DeepSpec's recipe. The L1 (total variation) gives bounded, sign-like gradients that
    # move a drafter trained from scratch slowly; the KL term pulls every target token's logit.
    kl_alpha: float = 0.0
    decay_gamma: float = 4.0
    seed: int = 0
    checkpoint_every: int = 200
    eval_every: int = 100
    holdout_fraction: float = 0.08
    # with init_from: choose the draft vocabulary afresh from the cache (draft_vocab_size tokens)
    # instead of keeping the source drafter's, which was chosen on older data
    reselect_vocab: bool = False
    # bf16 autocast made a CPU step 2.7x slower without native bf16 math (weight casts dominate
    # at these sizes) and 1.5x faster with AMX (`dspark-ctl train --autocast auto` picks)
    bf16_autocast: bool = False
    extra: dict = field(default_factory=dict)


# --------------------------------------------------------------------------------- vocabulary


def draft_vocabulary(cache: TargetCache, size: int, always: list[int]) -> torch.Tensor:
    """The ``size`` most frequent target tokens of the responses (sorted ids, int64) + ``always``."""
    vocab = int(cache.topk_ids.max()) + 1 if cache.topk_ids.numel() else 0
    vocab = max(vocab, int(cache.input_ids.max()) + 1, max(always) + 1)
    counts = torch.bincount(cache.input_ids[cache.loss_mask].long(), minlength=vocab).float()
    # Break ties (unseen tokens) by the target's own top-1 predictions, which are also likely drafts.
    counts += 1e-3 * torch.bincount(cache.topk_ids[:, 0].long(), minlength=vocab).float()
    counts[always] = float("inf")
    size = min(size, vocab)
    return counts.topk(size).indices.sort().values.cpu()


def target_to_draft(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Inverse map: target id -> draft id, -1 where the target token is not in the draft vocab."""
    t2d = torch.full((vocab_size,), -1, dtype=torch.long)
    t2d[d2t] = torch.arange(len(d2t))
    return t2d


def vocab_coverage(cache: TargetCache, t2d: torch.Tensor) -> float:
    """Share of the target's (top-k) next-token mass on response positions inside the draft vocab."""
    mask = cache.loss_mask
    probs = cache.topk_probs[mask].float()
    inside = t2d.to(mask.device)[cache.topk_ids[mask].long()] >= 0
    return float((probs * inside).sum() / probs.sum().clamp_min(1e-9))


# ------------------------------------------------------------------------------------ batches


@dataclass
class Batch:
    """Padded sequences plus sampled anchors, labels and target distributions per block slot."""

    taps: torch.Tensor  # [S, T, m*d]
    input_ids: torch.Tensor  # [S, T] long
    anchors: torch.Tensor  # [S, N]
    prev: torch.Tensor  # [S, N, G] target ids fed to the Markov head (teacher forcing)
    labels: torch.Tensor  # [S, N, G] target ids
    valid: torch.Tensor  # [S, N, G] bool, contiguous prefix per block
    topk_probs: torch.Tensor  # [S, N, G, K] fp32 target distribution for each slot
    topk_ids: torch.Tensor  # [S, N, G, K] long


def make_batch(cache: TargetCache, indices: list[int], anchors_per_seq: int, gamma: int,
               generator: torch.Generator) -> Batch:
    """Pad ``indices``' sequences and draw up to ``anchors_per_seq`` anchors in each.

    Anchor candidates are positions t with loss_mask[t] and loss_mask[t+1] (the anchor and its
    first label are response tokens); missing anchors are dummies (position 0, all slots invalid).
    The batch lives where the cache does (a cache built on a GPU stays there); ``generator`` is a
    CPU generator either way, so a batch's anchors do not depend on the device.
    """
    seqs = [cache.sequence(i) for i in indices]
    width = max(len(s["input_ids"]) for s in seqs)
    num, k = len(seqs), cache.topk_ids.shape[1]
    device = cache.input_ids.device
    taps = torch.zeros((num, width, cache.taps.shape[1]), dtype=cache.taps.dtype, device=device)
    ids = torch.zeros((num, width), dtype=torch.long, device=device)
    mask = torch.zeros((num, width), dtype=torch.bool, device=device)
    tk_p = torch.zeros((num, width, k), dtype=torch.float32, device=device)
    tk_i = torch.zeros((num, width, k), dtype=torch.long, device=device)
    anchors = torch.zeros((num, anchors_per_seq), dtype=torch.long, device=device)
    keep = torch.zeros((num, anchors_per_seq), dtype=torch.bool, device=device)
    for row, seq in enumerate(seqs):
        n = len(seq["input_ids"])
        taps[row, :n] = seq["taps"]
        ids[row, :n] = seq["input_ids"].long()
        mask[row, :n] = seq["loss_mask"]
        tk_p[row, :n] = seq["topk_probs"].float()
        tk_i[row, :n] = seq["topk_ids"].long()
        candidates = torch.nonzero(mask[row, : n - 1] & mask[row, 1:n]).flatten()
        if len(candidates) > anchors_per_seq:
            pick = torch.randperm(len(candidates), generator=generator)[:anchors_per_seq]
            candidates = candidates[pick.to(device)].sort().values
        anchors[row, : len(candidates)] = candidates
        keep[row, : len(candidates)] = True
    offsets = torch.arange(gamma, device=device)
    label_pos = anchors[..., None] + offsets + 1  # slot k predicts the token at anchor + k + 1
    in_range = label_pos < width
    label_pos = label_pos.clamp(max=width - 1)
    gather = lambda t: torch.gather(t, 1, label_pos.reshape(num, -1)).reshape(label_pos.shape)
    labels = gather(ids)
    valid = (in_range & gather(mask) & keep[..., None]).long().cumprod(-1).bool()
    anchor_tokens = torch.gather(ids, 1, anchors)
    prev = torch.cat((anchor_tokens[..., None], labels[..., :-1]), dim=-1)
    dist_pos = (label_pos - 1).reshape(num, -1)  # p_t for slot k lives at position anchor + k
    index = dist_pos[..., None].expand(-1, -1, k)
    probs = torch.gather(tk_p, 1, index).reshape(label_pos.shape + (k,))
    top_ids = torch.gather(tk_i, 1, index).reshape(label_pos.shape + (k,))
    return Batch(taps, ids, anchors, prev, labels, valid, probs, top_ids)


# -------------------------------------------------------------------------------------- losses


def drafter_losses(drafter: DSparkDrafter, batch: Batch, t2d: torch.Tensor,
                   settings: TrainSettings) -> tuple[torch.Tensor, dict]:
    """DeepSpec's weighted CE + L1 + confidence BCE for one batch; returns (loss, metrics)."""
    gamma = drafter.gamma
    with torch.autocast(drafter.device.type, dtype=torch.bfloat16, enabled=settings.bf16_autocast):
        hidden = drafter.forward_train(batch.taps, batch.input_ids, batch.anchors)
        logits = drafter.base_logits(hidden) + drafter.markov_bias_block(batch.prev, hidden)
        valid = batch.valid
        h_valid, prev_valid = hidden[valid], batch.prev[valid]
        conf_logits = (drafter.confidence_logits(h_valid, prev_valid).float()
                       if drafter.has_confidence_head else None)
    logits = logits[valid].float()
    slot = torch.arange(gamma, device=valid.device).expand_as(valid)[valid]
    weights = torch.exp(-slot.float() / settings.decay_gamma)
    log_pd = torch.log_softmax(logits, dim=-1)
    p_d = log_pd.exp()

    label_draft = t2d[batch.labels[valid]]
    ce_weight = weights * (label_draft >= 0)
    ce = -log_pd.gather(1, label_draft.clamp_min(0)[:, None]).squeeze(1)
    ce_loss = (ce * ce_weight).sum() / ce_weight.sum().clamp_min(1e-9)

    tp = batch.topk_probs[valid]
    tdraft = t2d[batch.topk_ids[valid]]
    inside = tdraft >= 0
    pd_at = p_d.gather(1, tdraft.clamp_min(0)) * inside
    # sum_v |p_d - p_t| over the draft vocab (p_t = 0 beyond its top-k) + target mass it cannot draft
    l1 = 1.0 + ((pd_at - tp).abs() - pd_at).mul(inside).sum(-1) + (tp * ~inside).sum(-1)
    l1_loss = (l1 * weights).sum() / weights.sum().clamp_min(1e-9)
    accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()

    loss = settings.ce_alpha * ce_loss + settings.l1_alpha * l1_loss
    metrics = {"ce": float(ce_loss.detach()), "l1": float(l1_loss.detach())}
    if settings.kl_alpha > 0:
        soft_ce = -(log_pd.gather(1, tdraft.clamp_min(0)) * tp * inside).sum(-1)
        kl_loss = (soft_ce * weights).sum() / weights.sum().clamp_min(1e-9)
        loss = loss + settings.kl_alpha * kl_loss
        metrics["soft_ce"] = float(kl_loss.detach())
    if conf_logits is not None:
        bce = F.binary_cross_entropy_with_logits(conf_logits, accept, reduction="none")
        conf_loss = (bce * weights).sum() / weights.sum().clamp_min(1e-9)
        loss = loss + settings.conf_alpha * conf_loss
        metrics["conf_bce"] = float(conf_loss.detach())
        metrics["conf_abs_err"] = float((torch.sigmoid(conf_logits.detach()) - accept).abs().mean())
    metrics.update(expected_tau(valid, accept, p_d, tdraft, batch, label_draft))
    metrics["loss"] = float(loss.detach())
    return loss, metrics


@torch.no_grad()
def expected_tau(valid: torch.Tensor, accept: torch.Tensor, p_d: torch.Tensor,
                 tdraft: torch.Tensor, batch: Batch, label_draft: torch.Tensor) -> dict:
    """Teacher-forced tau estimates over the batch's kept blocks (training-curve proxies).

    ``tau_t1`` = mean of 1 + sum_k prod_{i<=k} c*_i (expected accepted length at T=1, the DeepSpec
    ``tau_probabilistic``); ``tau_greedy`` chains argmax(p_d) == argmax(p_t).
    """
    per_slot = torch.zeros(valid.shape, device=valid.device)
    per_slot[valid] = accept
    greedy_slot = torch.zeros(valid.shape, device=valid.device)
    target_top = tdraft[:, 0]
    greedy_slot[valid] = (p_d.argmax(-1) == target_top).float() * (target_top >= 0)
    kept = valid[..., 0]
    tau_t1 = 1 + per_slot.cumprod(-1).sum(-1)
    tau_greedy = 1 + greedy_slot.cumprod(-1).sum(-1)
    return {"tau_t1": float(tau_t1[kept].mean()), "tau_greedy": float(tau_greedy[kept].mean()),
            "accept_1": float(per_slot[..., 0][kept].mean())}


# ------------------------------------------------------------------------------------- training


def build_drafter(target_dir: Path, spec: DrafterSpec, settings: TrainSettings,
                  layer_ids: list[int], d2t: torch.Tensor, weights: TargetWeights,
                  device: str = "cpu") -> DSparkDrafter:
    """A fresh drafter shaped like the target, sharing its frozen embedding and lm_head."""
    target_config = json.loads((target_dir / "config.json").read_text())
    config = DSparkConfig.from_target_config(
        target_config,
        num_draft_layers=settings.layers,
        block_size=settings.block_size,
        mask_token_id=settings.mask_token_id,
        target_layer_ids=layer_ids,
        markov_rank=spec.markov_rank,
        markov_head_type=spec.markov_head_type if spec.markov_rank > 0 else None,
        enable_confidence_head=spec.confidence_head,
        confidence_head_with_markov=spec.confidence_head and spec.markov_rank > 0,
        draft_vocab_size=len(d2t) if len(d2t) < target_config["vocab_size"] else None,
    )
    d2t_arg = d2t if config.has_reduced_vocab else None
    return DSparkDrafter(config, target=weights, d2t=d2t_arg, dtype=torch.float32, device=device)


def load_target_weights(target_dir: Path) -> TargetWeights:
    """The target's embedding and lm_head (tied in SmolLM2) from its safetensors, fp32."""
    from safetensors import safe_open

    with safe_open(str(target_dir / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
        embed = handle.get_tensor("model.embed_tokens.weight").float()
        head = handle.get_tensor("lm_head.weight").float() if "lm_head.weight" in names else embed
    return TargetWeights(embed_tokens=embed, lm_head=head)


def lr_at(step: int, settings: TrainSettings, time_fraction: float = 0.0) -> float:
    """Linear warm-up to the peak, then cosine from the peak to 0 at ``settings.steps``, or
    earlier where ``time_fraction`` (the share of a run's time schedule spent) is further along:
    a run on a machine of unknown speed still anneals before its time is up."""
    warmup = max(1, int(settings.warmup_frac * settings.steps))
    if step < warmup:
        return settings.lr * (step + 1) / warmup
    progress = min(1.0, max((step - warmup) / max(1, settings.steps - warmup), time_fraction))
    return settings.lr * 0.5 * (1 + math.cos(math.pi * progress))


class SequenceSampler:
    """Seeded epochs over the training sequences, grouped by similar length to limit padding."""

    def __init__(self, indices: list[int], lengths: torch.Tensor, group: int, seed: int):
        self.indices, self.lengths, self.group = indices, lengths, group
        self.generator = torch.Generator().manual_seed(seed)
        self.queue: list[list[int]] = []

    def next(self) -> list[int]:
        if not self.queue:
            order = [self.indices[i] for i in torch.randperm(len(self.indices), generator=self.generator)]
            window = self.group * 16
            chunks = []
            for start in range(0, len(order), window):
                part = sorted(order[start : start + window], key=lambda i: int(self.lengths[i]))
                chunks += [part[j : j + self.group] for j in range(0, len(part), self.group)]
            self.queue = [chunks[i] for i in torch.randperm(len(chunks), generator=self.generator)]
        return self.queue.pop()

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "queue": self.queue}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.queue = state["queue"]


def split_holdout(cache: TargetCache, fraction: float) -> tuple[list[int], list[int]]:
    """(train, holdout) sequence indices; the holdout is for the tau-vs-time curve only.

    Membership hashes the record id, so it never changes when the cache grows between runs: a
    sequence trained on in one run can never be held out in the next.
    """
    if cache.ids is None:
        raise ValueError("the target cache has no record ids; rebuild it with this version")
    buckets = [zlib.crc32(i.encode()) % 10_000 for i in cache.ids]
    holdout = [n for n, b in enumerate(buckets) if b < fraction * 10_000]
    train = [n for n, b in enumerate(buckets) if b >= fraction * 10_000]
    return train, holdout


@torch.no_grad()
def holdout_metrics(drafter: DSparkDrafter, cache: TargetCache, holdout: list[int], t2d: torch.Tensor,
                    settings: TrainSettings) -> dict:
    """Teacher-forced tau proxies on held-out sequences, with fixed anchors (seeded)."""
    drafter.eval()
    generator = torch.Generator().manual_seed(12345)
    sums: dict[str, float] = {}
    groups = [holdout[i : i + settings.seqs_per_step] for i in range(0, len(holdout), settings.seqs_per_step)]
    for group in groups:
        batch = make_batch(cache, group, settings.anchors_per_seq, drafter.gamma, generator)
        _, metrics = drafter_losses(drafter, batch, t2d, settings)
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + value / len(groups)
    drafter.train()
    return sums


class DrafterRun:
    """One drafter's module, optimizer and bookkeeping inside a shared training loop."""

    def __init__(self, spec: DrafterSpec, drafter: DSparkDrafter, settings: TrainSettings):
        self.spec, self.drafter, self.settings = spec, drafter, settings
        self.out = Path(spec.out)
        params = [p for p in drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
        self.train_seconds = 0.0
        self.log = self.out / "train_log.jsonl"
        self.init_weights_sha256: str | None = None  # of the --init-from weights, when there are some

    def step(self, batch: Batch, t2d: torch.Tensor, lr: float) -> dict:
        started = time.perf_counter()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss, metrics = drafter_losses(self.drafter, batch, t2d, self.settings)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(
            [p for p in self.drafter.parameters() if p.requires_grad], self.settings.grad_clip))
        self.optimizer.step()
        self.train_seconds += time.perf_counter() - started
        return metrics

    def save_checkpoint(self, step: int, extra: dict) -> None:
        folder = self.out / CHECKPOINT_DIR
        staging = self.out / (CHECKPOINT_DIR + ".tmp")
        save_drafter(self.drafter, staging, include_token_weights=False)
        torch.save({"step": step, "optimizer": self.optimizer.state_dict(), "train_seconds": self.train_seconds,
                    "init_weights_sha256": self.init_weights_sha256, **extra}, staging / "training_state.pt")
        if folder.exists():
            old = self.out / (CHECKPOINT_DIR + ".old")
            folder.rename(old)
            staging.rename(folder)
            for child in old.iterdir():
                child.unlink()
            old.rmdir()
        else:
            staging.rename(folder)

    def ship(self, meta: dict) -> None:
        """The shipped artefact: bf16 weights without embed_tokens/lm_head, plus the recipe."""
        shipped = DSparkDrafter(self.drafter.config, d2t=self.drafter.d2t, dtype=torch.bfloat16)
        shipped.load_state_dict(self.drafter.state_dict())
        save_drafter(shipped, self.out, include_token_weights=False)
        (self.out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")


def train_drafters(cache: TargetCache, target_dir: Path, specs: list[DrafterSpec],
                   settings: TrainSettings, command: str = "", time_budget_s: float | None = None,
                   stop_at: int | None = None, progress: bool = True, device: str = "cpu",
                   schedule_seconds: float | None = None) -> dict:
    """Train every spec on the same batches; resume each from its checkpoint when present.

    ``time_budget_s`` pauses the run (resume later on the same schedule); ``schedule_seconds``
    instead ends it, with the learning rate annealed to 0 by then (``lr_at``'s time fraction):
    for a lent machine whose speed nobody measured beforehand. On ``device`` "cuda" the cache
    should live on the GPU too (``cache_in_memory`` of a target on the GPU), so batches never cross.
    """
    torch.manual_seed(settings.seed)
    layer_ids = list(cache.meta["layer_ids"])
    weights = load_target_weights(target_dir)
    eos = _eos_id(target_dir)
    # a resumed run keeps the vocabulary it started with, even if the cache has grown since
    d2t = _checkpoint_d2t(specs)
    if d2t is None and not settings.reselect_vocab:
        d2t = _init_d2t(specs)
    if d2t is None:
        d2t = draft_vocabulary(cache, settings.draft_vocab_size, always=[eos])
    t2d = target_to_draft(d2t, weights.embed_tokens.shape[0]).to(device)
    coverage = vocab_coverage(cache, t2d)
    train_idx, holdout = split_holdout(cache, settings.holdout_fraction)
    sampler = SequenceSampler(train_idx, cache.lengths(), settings.seqs_per_step, settings.seed)
    batch_generator = torch.Generator().manual_seed(settings.seed + 2)
    runs = []
    start_step = 0
    for spec in specs:
        run = DrafterRun(spec, build_drafter(target_dir, spec, settings, layer_ids, d2t, weights, device), settings)
        resumed = _resume(run, sampler, batch_generator, d2t, cache.num_sequences)
        if resumed == 0 and spec.init_from:
            grow_from(run.drafter, Path(spec.init_from))
            init_weights = (Path(spec.init_from) / "model.safetensors").read_bytes()
            run.init_weights_sha256 = hashlib.sha256(init_weights).hexdigest()
        start_step = resumed if not runs else _same_step(start_step, resumed, spec)
        runs.append(run)
    started = time.perf_counter()
    bar = _progress(settings.steps, start_step, progress)
    step = start_step
    for step in range(start_step, settings.steps):
        elapsed = time.perf_counter() - started
        if time_budget_s is not None and elapsed > time_budget_s:
            break
        if stop_at is not None and step >= stop_at:  # pause at a known step; the schedule is unchanged
            break
        time_fraction = elapsed / schedule_seconds if schedule_seconds else 0.0
        if time_fraction >= 1.0:
            break
        lr = lr_at(step, settings, time_fraction)
        batch = make_batch(cache, sampler.next(), settings.anchors_per_seq, settings.block_size, batch_generator)
        line = {}
        for run in runs:
            metrics = run.step(batch, t2d, lr)
            line[run.out.name] = f"L{metrics['loss']:.3f} tau{metrics['tau_t1']:.2f}"
        if bar is not None:
            bar.update(1)
            bar.set_postfix(line)
        done = step + 1
        if done % settings.eval_every == 0 or done == settings.steps:
            for run in runs:
                _log_eval(run, done, cache, holdout, t2d, settings)
        if done % settings.checkpoint_every == 0 or done == settings.steps:
            _checkpoint_all(runs, done, sampler, batch_generator, d2t, cache.num_sequences)
    else:
        step = settings.steps
    if bar is not None:
        bar.close()
    final_step = step if step < settings.steps else settings.steps
    if schedule_seconds and final_step % settings.eval_every:  # the schedule ended off the eval grid
        for run in runs:
            _log_eval(run, final_step, cache, holdout, t2d, settings)
    _checkpoint_all(runs, final_step, sampler, batch_generator, d2t, cache.num_sequences)
    summary = {"step": final_step, "draft_vocab_size": len(d2t), "vocab_coverage": round(coverage, 4),
               "cache_tokens": int(cache.meta["tokens"]), "train_sequences": len(train_idx)}
    for run in runs:
        meta = {"command": command, "seed": settings.seed, "steps_done": final_step,
                "train_wall_seconds": round(run.train_seconds, 1), "settings": asdict(settings),
                "spec": asdict(run.spec), **summary}
        if run.init_weights_sha256:  # lets `dspark-ctl ship` check the run grew from the weights it replaces
            meta["init_weights_sha256"] = run.init_weights_sha256
        run.ship(meta)
        summary[run.out.name] = {"train_wall_seconds": round(run.train_seconds, 1)}
    return summary


def _eos_id(target_dir: Path) -> int:
    config = json.loads((target_dir / "config.json").read_text())
    eos = config.get("eos_token_id", 2)
    return int(eos[0] if isinstance(eos, list) else eos)


def _log_eval(run: DrafterRun, step: int, cache: TargetCache, holdout: list[int], t2d: torch.Tensor,
              settings: TrainSettings) -> None:
    metrics = holdout_metrics(run.drafter, cache, holdout, t2d, settings)
    record = {"step": step, "train_seconds": round(run.train_seconds, 1),
              **{f"holdout_{k}": round(v, 4) for k, v in metrics.items()}}
    run.out.mkdir(parents=True, exist_ok=True)
    with open(run.log, "a") as handle:
        handle.write(json.dumps(record) + "\n")


def _checkpoint_all(runs: list[DrafterRun], step: int, sampler: SequenceSampler,
                    batch_generator: torch.Generator, d2t: torch.Tensor, num_sequences: int) -> None:
    extra = {"sampler": sampler.state_dict(), "batch_generator": batch_generator.get_state(),
             "torch_rng": torch.get_rng_state(), "d2t": d2t, "num_sequences": num_sequences}
    for run in runs:
        run.save_checkpoint(step, extra)


def _checkpoint_d2t(specs: list[DrafterSpec]) -> torch.Tensor | None:
    for spec in specs:
        state_path = Path(spec.out) / CHECKPOINT_DIR / "training_state.pt"
        if state_path.exists():
            return torch.load(state_path, weights_only=False)["d2t"]
    return None


def _init_d2t(specs: list[DrafterSpec]) -> torch.Tensor | None:
    """The draft vocabulary of the ``init_from`` drafters (they must agree), None without any."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for spec in specs:
        if spec.init_from:
            with safe_open(str(Path(spec.init_from) / "model.safetensors"), framework="pt") as handle:
                if "d2t" not in handle.keys():
                    raise ValueError(f"{spec.init_from}: no 'd2t' in model.safetensors; --init-from needs "
                                     "a drafter with a reduced draft vocabulary")
                found[spec.init_from] = handle.get_tensor("d2t").long()
    vocabularies = list(found.values())
    if any(not torch.equal(v, vocabularies[0]) for v in vocabularies[1:]):
        raise ValueError(f"the --init-from drafters {sorted(found)} have different draft vocabularies; "
                         "drafters trained together must share one")
    return vocabularies[0] if vocabularies else None


def grow_from(drafter: DSparkDrafter, source: Path) -> None:
    """Start ``drafter`` from a trained one with as many or fewer layers and, for a vanilla Markov
    head, as large or a smaller rank.

    Every tensor of the source is copied; each extra layer starts as the identity (its attention
    output and MLP down projections are zero, so the residual passes through), and extra Markov
    rank adds nothing at first (``_widen_markov_rank``), so the grown drafter drafts exactly like
    the source at step 0 and training only adds to it. A drafter with another draft vocabulary
    (``reselect_vocab``) takes the source's per-draft-token rows for the tokens both share
    (``_carry_vocab_rows``); its new tokens start with no Markov bias.
    """
    from safetensors.torch import load_file

    tensors = load_file(str(source / "model.safetensors"))
    source_d2t = tensors.pop("d2t", None)
    if drafter.d2t is not None and source_d2t is not None and not torch.equal(source_d2t, drafter.d2t.cpu()):
        _carry_vocab_rows(tensors, source_d2t.long(), drafter.d2t.cpu(), drafter.config.vocab_size)
    own = drafter.state_dict()
    _widen_markov_rank(tensors, own)
    unknown = sorted(set(tensors) - set(own))
    mismatched = sorted(k for k in tensors if k in own and tensors[k].shape != own[k].shape)
    if unknown or mismatched:
        raise ValueError(f"{source}: cannot start this drafter from it: tensors it lacks {unknown}, "
                         f"tensors of another shape {mismatched}; --init-from keeps the heads and "
                         "the taps of the source and may only add layers or widen a vanilla Markov head")
    missing = drafter.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False).missing_keys
    added = {k.split(".")[1] for k in missing if k.startswith("layers.")}
    if any(not k.startswith("layers.") for k in missing):
        raise ValueError(f"{source}: has no {[k for k in missing if not k.startswith('layers.')]}")
    with torch.no_grad():
        for index in added:
            layer = drafter.layers[int(index)]
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()


MARKOV_W1, MARKOV_W2 = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"
CONFIDENCE_PROJ = "confidence_head.proj.weight"


def _widen_markov_rank(tensors: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> None:
    """A vanilla Markov head of a larger rank than the source's: the source's columns first, then
    the drafter's own random W1 columns (so W2's new columns get gradients) beside zero W2 columns
    and zero Markov columns of the confidence head (so neither the bias nor the confidence moves
    at step 0). The paper's rank is 256; the shipped drafters' 32."""
    if MARKOV_W1 not in tensors or MARKOV_W1 not in own or any(k.startswith("markov_head.") and k not in
                                                                 (MARKOV_W1, MARKOV_W2) for k in tensors):
        return  # no head, or a gated / RNN one (their gate and joint projections read the rank too)
    source_rank, rank = tensors[MARKOV_W1].shape[1], own[MARKOV_W1].shape[1]
    if rank <= source_rank:
        return  # the same rank, or a narrower one (refused as a shape mismatch)
    extra = rank - source_rank
    tensors[MARKOV_W1] = torch.cat([tensors[MARKOV_W1].float(), own[MARKOV_W1][:, source_rank:].float()], dim=1)
    w2 = tensors[MARKOV_W2].float()
    tensors[MARKOV_W2] = torch.cat([w2, w2.new_zeros(w2.shape[0], extra)], dim=1)
    if CONFIDENCE_PROJ in tensors and CONFIDENCE_PROJ in own and tensors[CONFIDENCE_PROJ].shape[1] + extra == \
            own[CONFIDENCE_PROJ].shape[1]:  # the head reads [h ; W1[x]]: the new rank's columns come last
        proj = tensors[CONFIDENCE_PROJ].float()
        tensors[CONFIDENCE_PROJ] = torch.cat([proj, proj.new_zeros(proj.shape[0], extra)], dim=1)


# the tensors whose rows are draft-vocabulary ids (everything else is vocabulary-free or indexed
# by target ids: markov_w1 embeds the previous *target* token)
DRAFT_VOCAB_ROWS = ("markov_head.markov_w2.weight",)


def _carry_vocab_rows(tensors: dict[str, torch.Tensor], source_d2t: torch.Tensor,
                      new_d2t: torch.Tensor, vocab_size: int) -> None:
    """Re-index the source's draft-vocabulary rows to ``new_d2t``; tokens new to it get zero rows."""
    source_rows = target_to_draft(source_d2t, vocab_size)[new_d2t]  # -1: not in the source vocab
    shared = source_rows >= 0
    for name in DRAFT_VOCAB_ROWS:
        if name in tensors:
            old = tensors[name]
            rows = old.new_zeros((len(new_d2t), *old.shape[1:]))
            rows[shared] = old[source_rows[shared]]
            tensors[name] = rows


def _resume(run: DrafterRun, sampler: SequenceSampler, batch_generator: torch.Generator,
            d2t: torch.Tensor, num_sequences: int) -> int:
    folder = run.out / CHECKPOINT_DIR
    if not (folder / "training_state.pt").exists():
        return 0
    from safetensors.torch import load_file

    state = torch.load(folder / "training_state.pt", weights_only=False)
    if not torch.equal(state["d2t"], d2t):
        raise ValueError(
            f"{folder}: its draft vocabulary differs from the other drafters' of this run; drafters "
            "trained together must share one vocabulary (use separate --out folders)"
        )
    tensors = load_file(str(folder / "model.safetensors"))
    tensors.pop("d2t", None)
    run.drafter.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
    run.optimizer.load_state_dict(state["optimizer"])
    run.train_seconds = state["train_seconds"]
    run.init_weights_sha256 = state.get("init_weights_sha256")
    batch_generator.set_state(state["batch_generator"])
    torch.set_rng_state(state["torch_rng"])
    if state.get("num_sequences") == num_sequences:
        sampler.load_state_dict(state["sampler"])
    else:  # the cache grew: start a fresh (seeded) epoch over all of it
        sampler.generator.manual_seed(run.settings.seed + int(state["step"]))
    return int(state["step"])


def _same_step(expected: int, got: int, spec: DrafterSpec) -> int:
    if expected != got:
        raise ValueError(
            f"{spec.out} resumes at step {got} but the other drafters at step {expected}: drafters "
            "trained together must share their steps; use separate --out folders"
        )
    return got


def _progress(total: int, initial: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True)
