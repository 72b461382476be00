"""The reference speculative decoder: DSpark over a transformers causal LM, in pure torch.

It is the executable definition of a DSpark round (dspark-algorithm.md sections 1.6 and 6) for
evaluation, data generation and tests; the SGLang worker does the same with SGLang's batching.

Batching: the target runs all live prompts in one forward per round over a shared
``DynamicCache``. Prompts accept different numbers of drafts, so the cache is a padded store:
row b's rejected drafts stay behind as holes that a key mask (``attention_mask``) hides, every
token gets its true position through ``position_ids``, and the columns no row still needs are
cropped after each round. Attention over a masked store equals attention over the row alone, so
the result is the same as decoding each prompt by itself.

One round, per live prompt: the drafter proposes a block from its context cache and the anchor
(the last committed token); ``verify_lengths`` caps how many drafts the target checks; the
target scores ``[anchor, drafts...]``; :func:`verify` accepts a prefix and samples the
correction/bonus token; the anchor and accepted drafts become committed context (their target
taps go into the drafter cache) and the correction/bonus token is the next anchor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from sglang_dspark.decoding.drafting import sample_block
from sglang_dspark.decoding.sampling import SamplingParams, logits_to_probs, sample_from_probs
from sglang_dspark.decoding.verification import verify
from sglang_dspark.model import taps_from_hidden_states

VerifyLengths = (
    int
    | Sequence[int | Sequence[int]]
    | Callable[[int, torch.Tensor | None], Sequence[int] | torch.Tensor]
    | None
)


@dataclass
class RoundStats:
    """One speculative round. Lists are aligned with ``prompts`` (the prompts still decoding).

    drafted: drafts the target verified per prompt (the capped verify length).
    accepted: drafts accepted per prompt (before any truncation at EOS / max_new_tokens).
    committed: tokens appended to the output this round (accepted + 1, or fewer at a stop).
    confidence_logits: ``[len(prompts), gamma]`` raw confidence logits of the block, or None.
    """

    prompts: list[int]
    drafted: list[int]
    accepted: list[int]
    committed: list[int]
    confidence_logits: torch.Tensor | None


@dataclass
class GenerateOutput:
    """tokens: the generated ids per prompt (the prompt excluded); rounds: per-round stats."""

    tokens: list[list[int]]
    rounds: list[RoundStats] = field(default_factory=list)

    def mean_accepted_length(self) -> float:
        """tau: mean tokens committed per prompt-round from the verify outcome (accepted + 1)."""
        outcomes = [a + 1 for r in self.rounds for a in r.accepted]
        return sum(outcomes) / len(outcomes) if outcomes else float("nan")


@torch.no_grad()
def generate(
    target: torch.nn.Module,
    drafter: torch.nn.Module,
    input_ids: Sequence[Sequence[int]] | Sequence[torch.Tensor] | torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    verify_lengths: VerifyLengths = None,
    eos_token_id: int | Sequence[int] | None = None,
) -> GenerateOutput:
    """Speculatively decode ``input_ids`` (prompts of any lengths) with ``drafter`` over ``target``.

    The output distribution is the target's own under (temperature, top_p, top_k); temperature
    0 is greedy and then equals the target's greedy decode token for token.

    verify_lengths caps the drafts verified per round: ``None`` = gamma; an int for every round;
    a list with one entry per round (an int, or one int per prompt); or a callable
    ``(round_index, confidence_logits [num_prompts, gamma] with NaN rows for finished prompts,
    or None) -> lengths [num_prompts]``. To keep decoding lossless a callable may use a slot's
    confidence only to decide about later slots (non-anticipation; see the paper's Algorithm 1).
    Each prompt stops after exactly ``max_new_tokens`` tokens or after an ``eos_token_id``.
    """
    prompts = _as_prompt_list(input_ids)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    _check_target(target, drafter)
    device = next(target.parameters()).device
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    stop_ids = _as_id_set(eos_token_id)
    state = _Decoding(target, drafter, prompts, device)
    params_all = SamplingParams.uniform(len(prompts), temperature, top_p, top_k, device=device)

    first_logits = state.prefill()
    first = _sample(first_logits, params_all, generator)
    outputs: list[list[int]] = [[] for _ in prompts]
    live = _commit(outputs, torch.arange(len(prompts)), first.unsqueeze(1).cpu(), [1] * len(prompts),
                   max_new_tokens, stop_ids)
    state.anchors = first
    state.keep_rows(live)

    rounds: list[RoundStats] = []
    while state.rows.numel():
        params = params_all.select(state.rows.to(device))
        hidden = drafter.forward_block(state.drafter_cache, state.rows.to(drafter.device), state.anchors)
        block = sample_block(drafter, hidden, state.anchors, params, generator)
        lens = _verify_lens(verify_lengths, len(rounds), block.confidence_logits, state.rows,
                            len(prompts), drafter.gamma)
        remaining = torch.tensor([max_new_tokens - len(outputs[int(p)]) for p in state.rows])
        lens = torch.minimum(lens, remaining - 1).to(device)
        target_logits, taps = state.score(block.tokens, lens)
        result = verify(block, target_logits, lens, params, generator)
        counts = (result.num_accepted + 1).tolist()
        prompt_ids = state.rows.tolist()
        lengths_before = [len(outputs[p]) for p in prompt_ids]
        live = _commit(outputs, state.rows, result.tokens.cpu(), counts, max_new_tokens, stop_ids)
        rounds.append(RoundStats(
            prompts=prompt_ids, drafted=lens.tolist(), accepted=result.num_accepted.tolist(),
            committed=[len(outputs[p]) - before for p, before in zip(prompt_ids, lengths_before)],
            confidence_logits=None if block.confidence_logits is None else block.confidence_logits.cpu(),
        ))
        state.advance(result.num_accepted, taps)
        state.anchors = result.tokens[torch.arange(len(counts), device=device), result.num_accepted]
        state.keep_rows(live)
    return GenerateOutput(tokens=outputs, rounds=rounds)


class _Decoding:
    """Target KV store, key mask, positions and drafter cache of the prompts still decoding."""

    def __init__(self, target: torch.nn.Module, drafter: torch.nn.Module, prompts: list[list[int]],
                 device: torch.device) -> None:
        self.target, self.drafter, self.prompts, self.device = target, drafter, prompts, device
        from transformers import DynamicCache  # only the reference decoder needs transformers

        self.rows = torch.arange(len(prompts))  # prompt index of each live batch row
        self.cache = DynamicCache(config=target.config)
        self.key_mask = torch.zeros(len(prompts), 0, dtype=torch.long, device=device)
        self.next_position = torch.tensor([len(p) for p in prompts], device=device)
        self.drafter_cache = drafter.new_cache(len(prompts), capacity=max(map(len, prompts)) + 64)
        self.anchors = torch.empty(0, dtype=torch.long, device=device)

    def prefill(self) -> torch.Tensor:
        """Run the right-padded prompts; fill both caches; return each prompt's last logits."""
        lengths = self.next_position
        width = int(lengths.max())
        ids = torch.zeros(len(self.prompts), width, dtype=torch.long, device=self.device)
        for row, prompt in enumerate(self.prompts):
            ids[row, : len(prompt)] = torch.tensor(prompt, device=self.device)
        valid = (torch.arange(width, device=self.device) < lengths.unsqueeze(1)).long()
        positions = torch.arange(width, device=self.device).expand_as(ids)
        logits, taps = self._forward(ids, valid, positions)
        self.key_mask = valid
        self.drafter.append_context(self.drafter_cache, self.rows.to(self.drafter.device),
                                    taps[valid.bool()], lengths)
        return logits[torch.arange(len(self.prompts), device=self.device), lengths - 1]

    def score(self, drafts: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target logits ``[rows, S, V]`` and taps over ``[anchor, drafts[:lens]]`` (S = max + 1)."""
        slots = int(lens.max()) + 1
        chunk = torch.cat([self.anchors.unsqueeze(1), drafts[:, : slots - 1].to(self.device)], dim=1)
        chunk_valid = (torch.arange(slots, device=self.device) <= lens.unsqueeze(1)).long()
        positions = self.next_position.unsqueeze(1) + torch.arange(slots, device=self.device)
        logits, taps = self._forward(chunk, torch.cat([self.key_mask, chunk_valid], dim=1), positions)
        self.key_mask = torch.cat([self.key_mask, chunk_valid], dim=1)
        return logits, taps

    def advance(self, num_accepted: torch.Tensor, taps: torch.Tensor) -> None:
        """Commit anchor + accepted drafts: keep their keys, feed their taps to the drafter."""
        slots = taps.shape[1]
        committed = torch.arange(slots, device=self.device) <= num_accepted.unsqueeze(1)
        self.key_mask[:, -slots:] = committed.long()
        self.drafter.append_context(self.drafter_cache, self.rows.to(self.drafter.device),
                                    taps[committed], num_accepted + 1)
        self.next_position = self.next_position + num_accepted + 1
        self._crop_unused_tail()

    def keep_rows(self, live: torch.Tensor) -> None:
        """Drop finished prompts from the batch (``live`` is a bool mask over current rows)."""
        if bool(live.all()):
            return
        keep = live.nonzero().squeeze(1)
        self.rows = self.rows[keep]
        keep = keep.to(self.device)
        self.cache.batch_select_indices(keep)
        self.key_mask = self.key_mask[keep]
        self.next_position = self.next_position[keep]
        self.anchors = self.anchors[keep]
        self._crop_unused_tail()

    def _crop_unused_tail(self) -> None:
        if self.key_mask.shape[0] == 0:
            return
        used = self.key_mask.any(0).nonzero()
        width = int(used.max()) + 1 if used.numel() else 0
        surplus = self.key_mask.shape[1] - width
        if surplus > 0:
            self.cache.crop(-surplus)
            self.key_mask = self.key_mask[:, :width]

    def _forward(self, ids: torch.Tensor, key_mask: torch.Tensor, positions: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.target(input_ids=ids, attention_mask=key_mask, position_ids=positions,
                          past_key_values=self.cache, use_cache=True, output_hidden_states=True)
        return out.logits, taps_from_hidden_states(out.hidden_states, self.drafter.target_layer_ids)


def _sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    if bool(params.greedy.all()):
        return logits.argmax(-1)
    return sample_from_probs(logits_to_probs(logits, params), generator)


def _commit(outputs: list[list[int]], rows: torch.Tensor, tokens: torch.Tensor, counts: list[int],
            max_new_tokens: int, stop_ids: set[int]) -> torch.Tensor:
    """Append each row's first ``counts`` tokens, stopping at the budget or a stop id.

    Returns the bool mask of rows that continue."""
    live = torch.ones(len(counts), dtype=torch.bool)
    for index, (prompt, count) in enumerate(zip(rows.tolist(), counts)):
        out = outputs[prompt]
        for token in tokens[index, :count].tolist():
            out.append(token)
            if token in stop_ids or len(out) >= max_new_tokens:
                live[index] = False
                break
    return live


def _verify_lens(policy: VerifyLengths, round_index: int, confidences: torch.Tensor | None,
                 rows: torch.Tensor, num_prompts: int, gamma: int) -> torch.Tensor:
    """The verify length of each live row this round, validated to lie in 0..gamma."""
    if policy is None:
        lens = torch.full((num_prompts,), gamma)
    elif isinstance(policy, int):
        lens = torch.full((num_prompts,), policy)
    elif callable(policy):
        full = None
        if confidences is not None:
            full = torch.full((num_prompts, gamma), float("nan"))
            full[rows] = confidences.cpu()
        lens = torch.as_tensor(policy(round_index, full), dtype=torch.long).reshape(-1)
    else:
        if round_index >= len(policy):
            raise ValueError(
                f"verify_lengths lists {len(policy)} rounds but round {round_index} is needed; "
                "give more entries or a callable"
            )
        entry = policy[round_index]
        lens = torch.full((num_prompts,), entry) if isinstance(entry, int) else torch.as_tensor(entry)
    lens = lens.long().reshape(-1)
    if lens.shape != (num_prompts,):
        raise ValueError(f"verify lengths {lens.tolist()}: expected one per prompt ({num_prompts})")
    chosen = lens[rows]
    if bool(((chosen < 0) | (chosen > gamma)).any()):
        raise ValueError(f"verify lengths must lie in 0..gamma=0..{gamma}, got {chosen.tolist()}")
    return chosen


def _as_prompt_list(input_ids: object) -> list[list[int]]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids tensor must be [B, T], got shape {tuple(input_ids.shape)}")
        prompts = input_ids.tolist()
    else:
        prompts = [p.tolist() if isinstance(p, torch.Tensor) else list(p) for p in input_ids]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("input_ids must hold at least one prompt and every prompt at least one token")
    return [[int(t) for t in p] for p in prompts]


def _as_id_set(eos_token_id: int | Sequence[int] | None) -> set[int]:
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(t) for t in eos_token_id}


def _check_target(target: torch.nn.Module, drafter: torch.nn.Module) -> None:
    """The padded-store batching needs full attention in every target layer."""
    config = target.config
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        raise ValueError(
            f"target layer_types {sorted(set(layer_types))}: the reference decoder needs "
            "'full_attention' in every layer (sliding windows would count masked holes)"
        )
    if config.vocab_size != drafter.config.vocab_size:
        raise ValueError(
            f"target vocab_size {config.vocab_size} != drafter vocab_size {drafter.config.vocab_size}"
        )
