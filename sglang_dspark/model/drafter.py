"""`DSparkDrafter`: the DSpark parallel block drafter (dspark-algorithm.md sections 1-3).

One block is `[anchor, MASK x (gamma-1)]` at positions `start..start+gamma-1`, where `start` is the
slot's committed context length; all gamma slots predict (slot k -> token at start+k+1). The
target's tapped hidden states are projected once per committed position (`fc` + `hidden_norm`)
and injected into every layer's K/V; `DraftContextCache` keeps those K/V, so a step only projects
newly committed positions. The frozen embedding and lm_head are the target's tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sglang_dspark.model.cache import BlockContext, DraftContextCache, packed_rows
from sglang_dspark.model.config import DSparkConfig, default_target_layer_ids
from sglang_dspark.model.errors import CheckpointError
from sglang_dspark.model.heads import ConfidenceHead, MarkovHead
from sglang_dspark.model.layers import DrafterLayer, RMSNorm, Rotary


@dataclass(frozen=True)
class TargetWeights:
    """The target's input embedding `[vocab, d]` and output head `[vocab, d]` as plain tensors."""

    embed_tokens: torch.Tensor
    lm_head: torch.Tensor


def target_weights_of(target: object) -> TargetWeights:
    """Accept `TargetWeights` or a transformers causal LM; return its (shared) token tensors."""
    if isinstance(target, TargetWeights):
        return target
    if hasattr(target, "get_input_embeddings") and hasattr(target, "get_output_embeddings"):
        head = target.get_output_embeddings()
        if head is None:
            raise TypeError(f"{type(target).__name__} has no output embeddings (lm_head)")
        return TargetWeights(
            embed_tokens=target.get_input_embeddings().weight.detach(),
            lm_head=head.weight.detach(),
        )
    raise TypeError(
        f"target must be a transformers causal LM or TargetWeights, got {type(target).__name__}"
    )


class FrozenWeight(nn.Module):
    """Holds a frozen `weight` buffer (not in `state_dict`: it is the target's tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight", torch.empty(0), persistent=False)

    @property
    def loaded(self) -> bool:
        return self.weight.numel() > 0


class DSparkDrafter(nn.Module):
    """The drafter network; module names match DeepSpec's checkpoint keys (no `model.` prefix)."""

    def __init__(
        self,
        config: DSparkConfig,
        target: object | None = None,
        d2t: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.fc = nn.Linear(config.num_taps * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.rotary = Rotary(config.head_dim, config.rope_theta)
        self.markov_head = MarkovHead(config) if config.has_markov_head else None
        self.confidence_head = ConfidenceHead(config) if config.enable_confidence_head else None
        self.embed_tokens = FrozenWeight()
        self.lm_head = FrozenWeight()
        self.register_buffer("d2t", None, persistent=False)
        self._init_weights(config.initializer_range)
        self.to(device=device, dtype=dtype)
        if self.markov_head is not None:
            # Read once per slot of the serial walk: column-major makes that GEMM cheaper.
            w2 = self.markov_head.markov_w2.weight
            w2.data = column_major(w2.data)
        if config.has_reduced_vocab:
            if d2t is None:
                raise CheckpointError(
                    f"draft_vocab_size={config.draft_vocab_size} < vocab_size={config.vocab_size} "
                    "needs 'd2t' (draft id -> target id map); none was given"
                )
            self.d2t = check_d2t(d2t, config).to(self.fc.weight.device)
        elif d2t is not None:
            raise CheckpointError(
                "'d2t' was given but draft_vocab_size equals vocab_size: expected no d2t"
            )
        if target is not None:
            self.attach_target(target)

    @classmethod
    def for_target(
        cls,
        target: object,
        *,
        num_draft_layers: int,
        block_size: int,
        mask_token_id: int,
        target_layer_ids: list[int] | None = None,
        markov_rank: int = 256,
        markov_head_type: str | None = "vanilla",
        enable_confidence_head: bool = True,
        confidence_head_with_markov: bool = True,
        d2t: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> "DSparkDrafter":
        """A freshly initialised drafter for a transformers `target` (DeepSpec defaults).

        The config copies the target's; `target_layer_ids` defaults to DFlash's evenly spaced
        rule; `d2t` (sorted target ids) selects a reduced draft vocabulary.
        """
        target_config = target.config
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(target_config.num_hidden_layers, num_draft_layers)
        config = DSparkConfig.from_target_config(
            target_config, num_draft_layers=num_draft_layers, block_size=block_size,
            mask_token_id=mask_token_id, target_layer_ids=target_layer_ids, markov_rank=markov_rank,
            markov_head_type=markov_head_type if markov_rank else None,
            enable_confidence_head=enable_confidence_head,
            confidence_head_with_markov=enable_confidence_head and confidence_head_with_markov,
            draft_vocab_size=None if d2t is None else len(d2t),
        )
        return cls(config, target=target, d2t=d2t, dtype=dtype, device=device)

    # ------------------------------------------------------------------ setup

    def _init_weights(self, std: float) -> None:
        """N(0, std) for projections and W1, zero biases, unit norms (HF `_init_weights`)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def attach_target(self, target: object) -> None:
        """Use the target's embedding and lm_head (shared when dtype/device match)."""
        weights = target_weights_of(target)
        self.set_token_weights(weights.embed_tokens, weights.lm_head, lm_head_is_full_vocab=True)

    def set_token_weights(
        self,
        embed_tokens: torch.Tensor,
        lm_head: torch.Tensor,
        lm_head_is_full_vocab: bool,
        share: bool = True,
    ) -> None:
        """Install frozen token tensors; a full-vocabulary lm_head is cut to the `d2t` rows.

        With `share`, tensors whose dtype/device already match are used in place (the target's
        memory); otherwise the drafter keeps its own copy."""
        cfg = self.config
        expected = (cfg.vocab_size, cfg.hidden_size)
        if tuple(embed_tokens.shape) != expected:
            raise CheckpointError(
                f"embed_tokens.weight has shape {tuple(embed_tokens.shape)}, expected {expected}"
            )
        head_rows = cfg.vocab_size if lm_head_is_full_vocab else cfg.draft_vocab_size
        if tuple(lm_head.shape) != (head_rows, cfg.hidden_size):
            raise CheckpointError(
                f"lm_head.weight has shape {tuple(lm_head.shape)}, "
                f"expected {(head_rows, cfg.hidden_size)}"
            )
        source = lm_head
        if lm_head_is_full_vocab and self.d2t is not None:
            lm_head = lm_head.index_select(0, self.d2t.to(lm_head.device))
        like = self.fc.weight
        self.embed_tokens.weight = embed_tokens.detach().to(device=like.device, dtype=like.dtype)
        head = lm_head.detach().to(device=like.device, dtype=like.dtype)
        shared = share and head.data_ptr() == source.data_ptr()
        # Our own copy (reduced vocabulary, converted dtype, loaded from disk) is stored
        # column-major: MKL runs the few-row draft GEMM ~2x faster on it. A shared one stays as is.
        self.lm_head.weight = head if shared else column_major(head)

    def new_cache(self, num_slots: int, capacity: int = 256) -> DraftContextCache:
        """An empty context cache shaped for this drafter (its dtype and device)."""
        cfg = self.config
        return DraftContextCache(
            num_layers=cfg.num_hidden_layers, num_slots=num_slots, kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim, capacity=capacity, dtype=self.dtype, device=self.device,
        )

    # ------------------------------------------------------------ properties

    @property
    def gamma(self) -> int:
        """Drafts per block (= `block_size`: all block slots predict)."""
        return self.config.block_size

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def has_markov_head(self) -> bool:
        return self.markov_head is not None

    @property
    def has_confidence_head(self) -> bool:
        return self.confidence_head is not None

    # ------------------------------------------------------------- backbone

    def project_context(self, taps: torch.Tensor) -> torch.Tensor:
        """H_ctx = hidden_norm(fc(taps)): `[..., m*d] -> [..., d]`."""
        expected = self.config.num_taps * self.config.hidden_size
        if taps.shape[-1] != expected:
            raise ValueError(
                f"taps have {taps.shape[-1]} features, expected m*d = {expected} "
                f"({self.config.num_taps} tapped layers x hidden {self.config.hidden_size})"
            )
        return self.hidden_norm(self.fc(taps.to(self.dtype)))

    @torch.no_grad()
    def append_context(
        self,
        cache: DraftContextCache,
        slots: torch.Tensor,
        taps: torch.Tensor,
        counts: torch.Tensor,
    ) -> None:
        """Project newly committed taps (packed `[sum(counts), m*d]`, slot order) into `cache`."""
        slots = cache.check_slots(slots)
        counts = torch.as_tensor(counts, dtype=torch.long, device=cache.device).reshape(-1)
        if counts.shape != slots.shape or bool((counts < 0).any()):
            raise ValueError(
                f"counts {counts.tolist()} must be one non-negative count per slot ({slots.numel()})"
            )
        total = int(counts.sum())
        if taps.dim() != 2 or taps.shape[0] != total:
            raise ValueError(f"taps shape {tuple(taps.shape)}: expected [{total}, m*d] (sum(counts) rows)")
        if total == 0:
            return
        owner, offset = packed_rows(counts)
        row_slot = slots[owner]
        positions = cache.lengths[row_slot] + offset
        cache.ensure_capacity(int((cache.lengths[slots] + counts).max()))
        hidden = self.project_context(taps.to(self.device))
        cos, sin = self.rotary.cos_sin(positions, self.dtype)
        for layer, keys, values in zip(self.layers, cache.keys, cache.values):
            k, v = layer.self_attn.key_value(hidden, cos, sin)
            keys[row_slot, positions] = k.to(keys.dtype)
            values[row_slot, positions] = v.to(values.dtype)
        cache.lengths[slots] += counts

    @torch.no_grad()
    def forward_block(
        self, cache: DraftContextCache, slots: torch.Tensor, anchors: torch.Tensor, width: int | None = None
    ) -> torch.Tensor:
        """Final-normed hidden states `[B, width, d]` (width: gamma unless given) of the first
        `width` slots of the blocks `[anchor, MASK x (gamma-1)]`.

        Slot b's block sits at positions `cache.lengths[slots[b]] + k` and attends to that slot's
        whole cached context plus its own block (bidirectionally). Slots with shorter contexts are
        padded and masked, so each row equals drafting that slot alone. Every layer reads all
        gamma block rows, but the last computes queries, attention output and MLP for the first
        `width` rows only: at concurrency 4-16 the planner drafts 1-2 slots, and the one-layer
        drafter's block cost the same at every width (11 ms at batch 16 on an AVX2 CPU, against a
        75 ms undrafted step).
        """
        width = self.gamma if width is None else width
        if not 1 <= width <= self.gamma:
            raise ValueError(f"block width {width}: expected 1..gamma={self.gamma}")
        slots = cache.check_slots(slots)
        anchors = torch.as_tensor(anchors, dtype=torch.long, device=self.device).reshape(-1)
        if anchors.shape != slots.shape:
            raise ValueError(f"{anchors.numel()} anchors for {slots.numel()} slots: expected one per slot")
        if slots.numel() == 0:
            return self.fc.weight.new_empty((0, width, self.config.hidden_size))
        starts = cache.lengths[slots]
        hidden, cos, sin = self._embed_blocks(anchors.unsqueeze(-1), starts.unsqueeze(-1))
        hidden, cos, sin = hidden.squeeze(1), cos.squeeze(1), sin.squeeze(1)
        context = BlockContext(cache, slots, starts, self.gamma)
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            hidden = layer.forward_cached(hidden, cos, sin, context, index, queries=width if index == last else None)
        return self.norm(hidden)

    def forward_train(
        self, taps: torch.Tensor, input_ids: torch.Tensor, anchor_positions: torch.Tensor
    ) -> torch.Tensor:
        """Training path: many anchors per sequence in one pass (with gradients).

        taps `[S, T, m*d]`, input_ids `[S, T]`, anchor_positions `[S, N]` (or the same without S)
        -> hidden `[S, N, gamma, d]`. Block n is `[input_ids[a_n], MASK...]` at positions
        `a_n + k`; it sees context positions `< a_n` and its own block (bidirectional), nothing of
        other blocks (section 1.5). Padding beyond a sequence's end is never seen as long as its
        anchors lie before it; a dummy anchor's output is simply to be ignored by the loss.
        """
        unbatched = taps.dim() == 2
        if unbatched:
            taps, input_ids, anchor_positions = taps[None], input_ids[None], anchor_positions[None]
        num_seqs, seq_len = input_ids.shape
        if taps.shape[:2] != (num_seqs, seq_len) or anchor_positions.shape[0] != num_seqs:
            raise ValueError(
                f"taps {tuple(taps.shape)}, input_ids {tuple(input_ids.shape)}, anchor_positions "
                f"{tuple(anchor_positions.shape)}: expected [S, T, m*d], [S, T], [S, N]"
            )
        anchors = anchor_positions.to(device=self.device, dtype=torch.long)
        if anchors.numel() and (int(anchors.min()) < 0 or int(anchors.max()) >= seq_len):
            raise ValueError(f"anchor positions must lie in [0, {seq_len - 1}]")
        context = self.project_context(taps.to(self.device))
        ctx_cos, ctx_sin = self.rotary.cos_sin(torch.arange(seq_len, device=self.device), self.dtype)
        anchor_tokens = input_ids.to(self.device).gather(1, anchors)
        # blocks side by side on one query axis: [S, N, gamma, ...] -> [S, N * gamma, ...]
        hidden, cos, sin = (t.flatten(1, 2) for t in self._embed_blocks(anchor_tokens, anchors))
        mask = self._train_mask(anchors, seq_len)
        for layer in self.layers:
            ctx_k, ctx_v = layer.self_attn.key_value(context, ctx_cos, ctx_sin)
            hidden = layer(hidden, cos, sin, ctx_k, ctx_v, mask)
        out = self.norm(hidden).reshape(num_seqs, anchors.shape[1], self.gamma, -1)
        return out[0] if unbatched else out

    def _embed_blocks(
        self, anchor_tokens: torch.Tensor, starts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Embeddings `[..., gamma, d]` and RoPE cos/sin of blocks `[anchor, MASK...]` at `starts`."""
        if not self.embed_tokens.loaded:
            raise RuntimeError(
                "the drafter has no embedding: pass a target (or TargetWeights) or load a "
                "checkpoint that holds embed_tokens"
            )
        tokens = anchor_tokens.new_full(anchor_tokens.shape + (self.gamma,), self.config.mask_token_id)
        tokens[..., 0] = anchor_tokens
        hidden = nn.functional.embedding(tokens, self.embed_tokens.weight).to(self.dtype)
        positions = starts.unsqueeze(-1) + torch.arange(self.gamma, device=starts.device)
        cos, sin = self.rotary.cos_sin(positions, self.dtype)
        return hidden, cos, sin

    def _train_mask(self, anchors: torch.Tensor, seq_len: int) -> torch.Tensor:
        """Bool `[S, 1, N*gamma, T + N*gamma]`: context before the anchor, plus the own block."""
        num_seqs, num_blocks = anchors.shape
        query_anchor = anchors.repeat_interleave(self.gamma, dim=1)
        context = torch.arange(seq_len, device=anchors.device) < query_anchor.unsqueeze(-1)
        block_id = torch.arange(num_blocks, device=anchors.device).repeat_interleave(self.gamma)
        own_block = (block_id[:, None] == block_id[None, :]).expand(num_seqs, -1, -1)
        return torch.cat((context, own_block), dim=-1).unsqueeze(1)

    # ----------------------------------------------------------------- heads

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """U_k = lm_head(h_k): `[..., d] -> [..., V_draft]` (draft-vocabulary ids).

        `hidden` is made contiguous first: a step that drafts w < gamma slots passes the block's
        first w columns, a strided view, and torch 2.14's CPU linear on a strided 3-D bf16 input
        took 50-57 ms for 16 x 2 rows against 0.3 ms contiguous (every drafted step of width
        2-6 at batch >= 2 paid it)."""
        if not self.lm_head.loaded:
            raise RuntimeError("the drafter has no lm_head: pass a target or load one with the checkpoint")
        return nn.functional.linear(hidden.contiguous(), self.lm_head.weight)

    def markov_bias(
        self, prev_tokens: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Bias for one slot of the walk: prev target ids `[B]`, h_k `[B, d]` ->
        (bias `[B, V_draft]`, state for the next slot). Zero bias when there is no Markov head."""
        if self.markov_head is None:
            return hidden.new_zeros(hidden.shape[:-1] + (self.config.draft_vocab_size,)), None
        return self.markov_head.step(prev_tokens, hidden, state)

    def markov_bias_block(self, prev_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced biases: prev `[..., gamma]`, h `[..., gamma, d]` -> `[..., gamma, V_draft]`."""
        if self.markov_head is None:
            return hidden.new_zeros(hidden.shape[:-1] + (self.config.draft_vocab_size,))
        return self.markov_head.block(prev_tokens, hidden)

    def confidence_logits(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        """Confidence logit z_k from `[h_k ; W1[x_{k-1}]]`: `[..., d]`, `[...]` -> `[...]`."""
        if self.confidence_head is None:
            raise RuntimeError(
                "this drafter has no confidence head (enable_confidence_head=false); "
                "check has_confidence_head first"
            )
        embedding = self.markov_head.embed(prev_tokens) if self.confidence_head.with_markov else None
        return self.confidence_head(hidden, embedding)


def column_major(matrix: torch.Tensor) -> torch.Tensor:
    """The same `[rows, cols]` matrix, stored transposed (strides `(1, rows)`)."""
    return matrix.t().contiguous().t()


def check_d2t(d2t: torch.Tensor, config: DSparkConfig) -> torch.Tensor:
    """Validate the draft->target id map: int64 `[draft_vocab_size]`, strictly increasing, in range."""
    d2t = torch.as_tensor(d2t)
    if d2t.dtype != torch.int64 or tuple(d2t.shape) != (config.draft_vocab_size,):
        raise CheckpointError(
            f"d2t has dtype {d2t.dtype} and shape {tuple(d2t.shape)}, "
            f"expected int64 [{config.draft_vocab_size}]"
        )
    if d2t.numel() and (int(d2t.min()) < 0 or int(d2t.max()) >= config.vocab_size):
        raise CheckpointError(f"d2t ids must lie in [0, {config.vocab_size - 1}]")
    if d2t.numel() > 1 and not bool((d2t[1:] > d2t[:-1]).all()):
        raise CheckpointError("d2t must be strictly increasing (sorted, distinct target ids)")
    return d2t

