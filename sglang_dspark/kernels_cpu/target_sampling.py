"""The target's sampling distributions of a step's verify rows without materialising them
(`target_sampling.cpp`): a `decoding.verify_packed` sampler for sampled requests.

`TorchTargetRows` softmaxes every verify row of a sampled request over the 49,152-token
vocabulary, then gathers, copies and cumsums whole rows: ~9 ms of a batch-16 step at T=1 on this
project's CPU, for what needs one pass per row (its max and normaliser), a probability here and
there (acceptance) and one inverse CDF per request (the bonus or correction token). A row with
top-k or top-p also needs its kept set: the kernel sorts only the columns within a factor 1,000 of
the heaviest (widening when the set reaches past them) and keeps the set as a cut, so the readers
stay one pass. Torch's path softmaxes every such row and partially sorts 256-4,096 of its columns:
served, SmolLM2's distributions are peaked and it resolved in its first sort (session 30, T=0.7 /
top-p 0.9, batch 16: 9.5 ms a step after the verify forward with torch's path, 9.7 with this
kernel), but on flat rows it costs far more (80 rows of logits from random hidden states: 42 ms
against 4.1 ms here), and every sampled row now takes one path.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from sglang_dspark.decoding.sampling import SamplingParams
from sglang_dspark.decoding.verification import RESIDUAL_MASS_EPS, DraftBlock
from sglang_dspark.kernels_cpu.build import load_library

SOURCE = Path(__file__).with_name("target_sampling.cpp")


@functools.cache
def load_target_sampling() -> ctypes.CDLL:
    """The compiled kernels, built on first use; raises `KernelUnavailable` with the reason."""
    c = ctypes
    row_stats = [c.c_void_p, c.c_int64, c.c_int64] + [c.c_void_p] * 6  # as _common()
    return load_library(SOURCE, {
        "dspark_softmax_rows": [c.c_void_p, c.c_int64, c.c_int64, c.c_void_p, c.c_int64] + [c.c_void_p] * 8
                               + [c.c_int],
        "dspark_softmax_at": row_stats + [c.c_void_p, c.c_void_p, c.c_int64, c.c_void_p],
        "dspark_sample_softmax": row_stats + [c.c_void_p, c.c_void_p, c.c_int64, c.c_void_p],
        "dspark_sample_residual": row_stats + [c.c_void_p, c.c_void_p, c.c_int64, c.c_void_p, c.c_int64, c.c_void_p,
                                               c.c_int64, c.c_double, c.c_void_p],
    })


def kernel_sampler(logits: torch.Tensor, rows: torch.Tensor, params: SamplingParams) -> "KernelTargetRows | None":
    """A `decoding.TargetSampler`: `KernelTargetRows` for sampled rows (any temperature, top-k,
    top-p, min-p) of float32 CPU logits with unit column stride, else None (greedy rows never come here:
    they accept by argmax)."""
    if (logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1
            or bool(params.greedy.any())):
        return None
    return KernelTargetRows(logits, rows, params)


class KernelTargetRows:
    """`decoding.TargetRows` of `logits` rows `rows` under `params` (one row each)."""

    def __init__(self, logits: torch.Tensor, rows: torch.Tensor, params: SamplingParams) -> None:
        self.logits = logits
        self.rows = rows.to(torch.int64).contiguous()
        params = params.to("cpu")
        self.scale = (1.0 / params.temperature.to(torch.float32)).contiguous()
        top_k = params.top_k.to(torch.int64).contiguous()
        top_p = params.top_p.to(torch.float32).contiguous()
        min_p = params.min_p.to(torch.float32).contiguous()
        self.maxima = torch.empty(len(rows), dtype=torch.float32)
        self.cut_weights = torch.empty(len(rows), dtype=torch.float32)
        self.tie_columns = torch.empty(len(rows), dtype=torch.int64)
        self.totals = torch.empty(len(rows), dtype=torch.float64)
        load_target_sampling().dspark_softmax_rows(
            logits.data_ptr(), logits.stride(0), logits.shape[1], self.rows.data_ptr(), len(rows),
            self.scale.data_ptr(), top_k.data_ptr(), top_p.data_ptr(), min_p.data_ptr(), self.maxima.data_ptr(),
            self.cut_weights.data_ptr(), self.tie_columns.data_ptr(), self.totals.data_ptr(), torch.get_num_threads())

    def _common(self) -> list:
        return [self.logits.data_ptr(), self.logits.stride(0), self.logits.shape[1], self.rows.data_ptr(),
                self.scale.data_ptr(), self.maxima.data_ptr(), self.cut_weights.data_ptr(),
                self.tie_columns.data_ptr(), self.totals.data_ptr()]

    def probs_at(self, index: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        index, tokens = index.to(torch.int64).contiguous(), tokens.to(torch.int64).contiguous()
        out = torch.empty(len(index), dtype=torch.float32)
        load_target_sampling().dspark_softmax_at(*self._common(), index.data_ptr(), tokens.data_ptr(), len(index),
                                                 out.data_ptr())
        return out

    def sample(self, index: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        out = torch.empty(len(index), dtype=torch.int64)
        self._sample(index, torch.rand(len(index), dtype=torch.float64, generator=generator), out, slice(None))
        return out

    def sample_final(self, index: torch.Tensor, rejected: torch.Tensor, draft: DraftBlock, requests: torch.Tensor,
                     slots: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        uniforms = torch.rand(len(index), dtype=torch.float64, generator=generator)
        out = torch.empty(len(index), dtype=torch.int64)
        bonus, corrected = (~rejected).nonzero().squeeze(-1), rejected.nonzero().squeeze(-1)
        if len(bonus):
            self._sample(index[bonus], uniforms[bonus], out, bonus)
        if len(corrected):
            self._sample_residual(index[corrected], uniforms[corrected], draft, requests[corrected],
                                  slots[corrected].clamp(max=draft.gamma - 1), out, corrected)
        return out

    def _sample(self, index: torch.Tensor, uniforms: torch.Tensor, out: torch.Tensor, where: torch.Tensor) -> None:
        index, uniforms = index.to(torch.int64).contiguous(), uniforms.contiguous()
        tokens = torch.empty(len(index), dtype=torch.int64)
        load_target_sampling().dspark_sample_softmax(*self._common(), index.data_ptr(), uniforms.data_ptr(), len(index),
                                                     tokens.data_ptr())
        out[where] = tokens

    def _sample_residual(self, index: torch.Tensor, uniforms: torch.Tensor, draft: DraftBlock, requests: torch.Tensor,
                         slots: torch.Tensor, out: torch.Tensor, where: torch.Tensor) -> None:
        vocab = self.logits.shape[1]
        values = draft.probs[requests, slots].to(torch.float32).contiguous()  # [n, draft columns]
        columns = (torch.arange(vocab) if draft.probs_vocab is None else draft.probs_vocab).to(torch.int64).contiguous()
        if values.shape[1] != len(columns) or (len(columns) and int(columns.max()) >= vocab):
            raise ValueError(f"draft distributions of {values.shape[1]} columns for {len(columns)} target ids "
                             f"(vocabulary {vocab})")
        index, uniforms = index.to(torch.int64).contiguous(), uniforms.contiguous()
        tokens = torch.empty(len(index), dtype=torch.int64)
        load_target_sampling().dspark_sample_residual(
            *self._common(), index.data_ptr(), uniforms.data_ptr(), len(index), columns.data_ptr(), len(columns),
            values.data_ptr(), values.stride(0), RESIDUAL_MASS_EPS, tokens.data_ptr())
        out[where] = tokens
