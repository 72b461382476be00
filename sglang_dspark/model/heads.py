"""The Markov (sequential) head and the confidence head (dspark-algorithm.md sections 2-3).

The Markov head adds a low-rank bias B_k(x_{k-1}) to slot k's base logits, so that the block
distribution factorises causally and each step stays an exact softmax. The confidence head reads
`[h_k ; W1[x_{k-1}]]` and gives a logit for "draft k is accepted given drafts < k were".
"""

from __future__ import annotations

import torch
from torch import nn

from sglang_dspark.model.config import DSparkConfig


class MarkovHead(nn.Module):
    """`vanilla`, `gated` or `rnn` Markov head with DeepSpec's weight names.

    `markov_w1` is looked up by the previous token, which may be any target token (the anchor is
    the target's own sample), so it has `vocab_size` rows; `markov_w2` projects to the draft
    vocabulary.
    """

    def __init__(self, config: DSparkConfig):
        super().__init__()
        rank, d = config.markov_rank, config.hidden_size
        self.kind = config.markov_head_type
        self.rank = rank
        self.markov_w1 = nn.Embedding(config.vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, config.draft_vocab_size, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(d + rank, rank, bias=True)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + d, 3 * rank, bias=True)

    def embed(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """W1[x_{k-1}]: `[...] -> [..., rank]`."""
        return self.markov_w1(prev_tokens)

    def step(
        self, prev_tokens: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Bias for one slot of the walk: prev `[B]`, h_k `[B, d]` -> (`[B, V_draft]`, state).

        `state` is the RNN state s_{k-1} (None = s_0 = 0); other kinds return None.
        """
        e = self.embed(prev_tokens).to(hidden.dtype)
        if self.kind == "vanilla":
            return self.markov_w2(e), None
        if self.kind == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat((hidden, e), dim=-1)))
            return self.markov_w2(gate * e), None
        if state is None:
            state = hidden.new_zeros(hidden.shape[:-1] + (self.rank,))
        a, c, o = self.joint_proj(torch.cat((state, e, hidden), dim=-1)).chunk(3, dim=-1)
        keep = torch.sigmoid(a)
        new_state = keep * state + (1 - keep) * torch.tanh(c)
        return self.markov_w2(torch.tanh(o)), new_state

    def block(self, prev_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced biases for whole blocks: prev `[..., gamma]`, h `[..., gamma, d]`
        -> `[..., gamma, V_draft]`. The RNN is unrolled over the block from s_0 = 0."""
        if self.kind != "rnn":
            return self.step(prev_tokens, hidden, None)[0]
        state, biases = None, []
        for k in range(prev_tokens.shape[-1]):
            bias, state = self.step(prev_tokens[..., k], hidden[..., k, :], state)
            biases.append(bias)
        return torch.stack(biases, dim=-2)


class ConfidenceHead(nn.Module):
    """`proj: Linear(d (+ r) -> 1)`; its sigmoid is the conditional acceptance probability."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        extra = config.markov_rank if config.confidence_head_with_markov else 0
        self.with_markov = config.confidence_head_with_markov
        self.proj = nn.Linear(config.hidden_size + extra, 1, bias=True)

    def forward(self, hidden: torch.Tensor, markov_embedding: torch.Tensor | None) -> torch.Tensor:
        """`[..., d]` (and `[..., r]`) -> logits `[...]`."""
        features = hidden
        if self.with_markov:
            features = torch.cat((hidden, markov_embedding.to(hidden.dtype)), dim=-1)
        return self.proj(features).squeeze(-1)
