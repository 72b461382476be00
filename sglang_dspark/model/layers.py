"""The drafter's building blocks: RMSNorm, RoPE and a Qwen3-style layer with KV injection.

KV injection (dspark-algorithm.md 1.4): each layer projects the shared context H_ctx and its own
(normalised) block input with the *same* W_K/W_V, applies k_norm and RoPE to both parts, and lets
the block's queries attend over `[context ; block]`. Queries never come from the context, so the
context K/V of a layer depend only on H_ctx and can be cached once per committed position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_dspark.model.cache import BlockContext
from sglang_dspark.model.config import DSparkConfig


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as transformers' Llama/Qwen3 norms do."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Rotary(nn.Module):
    """Plain RoPE (rotate-half convention of Llama/Qwen3) at arbitrary absolute positions."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        # A plain attribute, not a buffer: `module.to(bfloat16)` must not round the frequencies.
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.inv_freq = self.inv_freq.float()

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of shape `positions.shape + (1, head_dim)`, broadcastable over heads."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(-2)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [..., heads, head_dim]` by the angles in cos/sin `[..., 1, head_dim]`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class InjectedAttention(nn.Module):
    """Self-attention whose keys/values are `[context ; block]` and whose queries are the block."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = hd
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)

    def key_value(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K (k_norm + RoPE) and V of `x [..., n, d]`, each `[..., n, kv_heads, head_dim]`."""
        shape = x.shape[:-1] + (self.num_kv_heads, self.head_dim)
        k = self.norm_rope(self.k_norm, self.k_proj(x).view(shape), cos, sin)
        return k, self.v_proj(x).view(shape)

    def norm_rope(self, norm: RMSNorm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE of `norm(x)`, `x [..., heads, head_dim]` (the q and k paths; one method so that a
        served drafter can run it as one kernel call, `kernels_cpu.drafter_ops`)."""
        return apply_rotary(norm(x), cos, sin)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_k: torch.Tensor,
        context_v: torch.Tensor,
        mask: torch.Tensor | None,
        queries: int | None = None,
    ) -> torch.Tensor:
        """x: normalised block input `[B, L, d]`; context K/V `[B, C, kv_heads, head_dim]`;
        mask: bool `[B, 1, L or 1, C + L]` (True = may attend) or None for "everything".
        Outputs `[B, queries, d]` for the first `queries` rows (None: all L), each attending to
        every key as in the full forward."""
        batch, length, _ = x.shape
        rows = length if queries is None else queries
        q = self.q_proj(x[:, :rows]).view(batch, rows, self.num_heads, self.head_dim)
        q = self.norm_rope(self.q_norm, q, cos[:, :rows], sin[:, :rows])  # cos/sin [B, L, 1, head_dim]
        if mask is not None and mask.shape[2] != 1:
            mask = mask[:, :, :rows]
        block_k, block_v = self.key_value(x, cos, sin)
        k = torch.cat((context_k, block_k), dim=1)
        v = torch.cat((context_v, block_v), dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, rows, -1))


    def attend_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: BlockContext,
                      layer: int, queries: int | None = None) -> torch.Tensor:
        """`forward` for a served block step, over layer `layer`'s context cache rows (gathered);
        outputs for the first `queries` block rows only (None: all), which still attend to all."""
        context_k, context_v, mask = context.gathered(layer, x.dtype)
        return self.forward(x, cos, sin, context_k, context_v, mask, queries)


class SwiGLU(nn.Module):
    def __init__(self, config: DSparkConfig):
        super().__init__()
        d, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, inner, bias=False)
        self.up_proj = nn.Linear(d, inner, bias=False)
        self.down_proj = nn.Linear(inner, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer with KV injection (weight names as in DeepSpec)."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = InjectedAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_k: torch.Tensor,
        context_v: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, context_k, context_v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_cached(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: BlockContext,
                       layer: int, queries: int | None = None) -> torch.Tensor:
        """`forward` for a served block step, reading layer `layer`'s context from the cache; with
        `queries`, the first `queries` rows of its output only (the last layer, when the step
        drafts fewer slots than the block has)."""
        attended = self.self_attn.attend_cached(self.input_layernorm(h), cos, sin, context, layer, queries)
        h = h[:, : attended.shape[1]] + attended
        return h + self.mlp(self.post_attention_layernorm(h))
