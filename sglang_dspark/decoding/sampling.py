"""Per-request sampling parameters and the logits -> probabilities transform.

Speculative decoding is lossless only if the draft distribution p_d used for rejection is the
exact distribution the drafts were sampled from, and the target distribution p_t is the one the
target would sample from without speculation. Both therefore go through the single function
:func:`logits_to_probs` here, in fp32.

The transform follows SGLang's native sampler so that a request served with DSpark sees the same
distribution as without it: divide by the temperature, softmax, then keep a token iff its rank
(by probability, descending) is below ``top_k``, the probability mass strictly before it is at
most ``top_p`` and its probability is at least ``min_p`` times the largest, all measured on the
full tempered distribution, then renormalise. Temperature 0 means greedy: the row becomes one-hot
on the argmax of the raw logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy (the DeepSpec evaluator's threshold)."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, one entry per batch row.

    temperature: ``[B]`` float, ``0`` means greedy (argmax).
    top_p: ``[B]`` float in ``(0, 1]``, ``1`` disables nucleus filtering.
    top_k: ``[B]`` int, ``0`` disables top-k filtering.
    min_p: ``[B]`` float in ``[0, 1]``, ``0`` (the default when omitted) disables min-p filtering.
    """

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    min_p: torch.Tensor = field(default=None)  # type: ignore[assignment]  (zeros when omitted)

    def __post_init__(self) -> None:
        if self.min_p is None:
            object.__setattr__(self, "min_p", torch.zeros_like(self.temperature, dtype=torch.float32))
        for name in ("temperature", "top_p", "top_k", "min_p"):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) or value.dim() != 1:
                raise ValueError(f"SamplingParams.{name} must be a 1-D tensor [B], got {value!r}")
        sizes = {self.temperature.numel(), self.top_p.numel(), self.top_k.numel(), self.min_p.numel()}
        if len(sizes) != 1:
            raise ValueError(
                "SamplingParams tensors must all have one entry per request, got sizes "
                f"temperature={self.temperature.numel()}, top_p={self.top_p.numel()}, "
                f"top_k={self.top_k.numel()}, min_p={self.min_p.numel()}"
            )
        if bool((self.temperature < 0).any()):
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature.tolist()}")
        if bool(((self.top_p <= 0) | (self.top_p > 1)).any()):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p.tolist()}")
        if self.top_k.is_floating_point() or bool((self.top_k < 0).any()):
            raise ValueError(f"top_k must be a non-negative integer tensor (0 = off), got {self.top_k!r}")
        if bool(((self.min_p < 0) | (self.min_p > 1)).any()):
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p.tolist()}")

    @classmethod
    def uniform(
        cls,
        batch_size: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        device: torch.device | str | None = None,
        min_p: float = 0.0,
    ) -> SamplingParams:
        """The same settings for every one of ``batch_size`` requests."""
        return cls(
            temperature=torch.full((batch_size,), float(temperature), device=device),
            top_p=torch.full((batch_size,), float(top_p), device=device),
            top_k=torch.full((batch_size,), int(top_k), dtype=torch.long, device=device),
            min_p=torch.full((batch_size,), float(min_p), device=device),
        )

    @property
    def batch_size(self) -> int:
        return self.temperature.numel()

    @property
    def greedy(self) -> torch.Tensor:
        """``[B]`` bool: rows decoded by argmax."""
        return self.temperature < GREEDY_TEMPERATURE

    def select(self, rows: torch.Tensor) -> SamplingParams:
        """The parameters of a subset of rows (index or bool mask)."""
        return SamplingParams(self.temperature[rows], self.top_p[rows], self.top_k[rows], self.min_p[rows])

    def to(self, device: torch.device | str) -> SamplingParams:
        return SamplingParams(
            self.temperature.to(device), self.top_p.to(device), self.top_k.to(device), self.min_p.to(device)
        )


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """fp32 sampling distribution of ``logits [B, ..., V]`` under per-row ``params``.

    Extra dims between the batch and the vocabulary (e.g. block slots) share their row's
    parameters. Greedy rows become one-hot on the argmax; the others are the tempered softmax
    restricted by top-k / top-p / min-p and renormalised.
    """
    if logits.dim() < 2:
        raise ValueError(f"logits must be [B, ..., V], got shape {tuple(logits.shape)}")
    batch = logits.shape[0]
    if params.batch_size != batch:
        raise ValueError(
            f"SamplingParams has {params.batch_size} rows but logits have batch size {batch}"
        )
    vocab = logits.shape[-1]
    flat = logits.reshape(batch, -1, vocab).float()
    slots = flat.shape[1]

    def per_row(values: torch.Tensor) -> torch.Tensor:
        values = values.to(flat.device)
        return values if slots == 1 else values.repeat_interleave(slots)

    flat = flat.reshape(-1, vocab)
    greedy = per_row(params.greedy)
    if bool(greedy.all()):
        return _one_hot_argmax(flat).reshape(logits.shape)
    temperature = torch.where(greedy, torch.ones_like(per_row(params.temperature)), per_row(params.temperature))
    if bool((temperature != 1.0).any()):  # (a pass over every row's 49,152 logits otherwise)
        flat = flat / temperature.unsqueeze(-1)
    probs = torch.softmax(flat, dim=-1)
    probs = _filter_top_k_top_p(probs, per_row(params.top_k), per_row(params.top_p))
    probs = _filter_min_p(probs, per_row(params.min_p))
    if bool(greedy.any()):
        probs = torch.where(greedy.unsqueeze(-1), _one_hot_argmax(flat), probs)
    return probs.reshape(logits.shape)


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)


NUCLEUS_CANDIDATES = (256, 4096)
"""Top-k/top-p look at this many most likely tokens first (a partial sort), widening to the next
size, and finally the whole vocabulary, only for rows whose kept set might reach further. The
result is exact either way; peaked rows (the usual case for a language model) stay cheap."""


def _filter_top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens outside top-k / top-p (both judged on ``probs``) and renormalise."""
    vocab = probs.shape[-1]
    use_top_k = (top_k > 0) & (top_k < vocab)
    use_top_p = top_p < 1.0
    unresolved = use_top_k | use_top_p
    if not bool(unresolved.any()):
        return probs
    filtered = probs.clone()
    largest_k = int(top_k[use_top_k].max()) if bool(use_top_k.any()) else 0
    for width in sorted({min(vocab, max(c, largest_k)) for c in NUCLEUS_CANDIDATES} | {vocab}):
        rows = unresolved.nonzero().squeeze(1)
        top_probs, top_ids = probs[rows].topk(width, dim=-1, sorted=True)
        kept, resolved = _nucleus_mask(top_probs, top_k[rows], top_p[rows], use_top_k[rows], use_top_p[rows])
        resolved |= width == vocab
        done = rows[resolved]
        filtered[done] = probs.new_zeros(len(done), vocab).scatter_(
            -1, top_ids[resolved], top_probs[resolved].masked_fill(~kept[resolved], 0.0)
        )
        unresolved[done] = False
        if not bool(unresolved.any()):
            break
    return filtered.div_(filtered.sum(-1, keepdim=True))


def _filter_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens below ``min_p`` times their row's largest probability and renormalise.

    Scaling a row does not move its ratios to the row's largest, so this may follow the top-k /
    top-p renormalisation and keep the set SGLang's sampler keeps (min-p judged on the full
    tempered distribution, like top-k / top-p)."""
    use_min_p = min_p > 0
    if not bool(use_min_p.any()):
        return probs
    threshold = probs.amax(-1) * min_p.to(probs.dtype)
    probs = probs.masked_fill(use_min_p.unsqueeze(-1) & (probs < threshold.unsqueeze(-1)), 0.0)
    return probs.div_(probs.sum(-1, keepdim=True))


def _nucleus_mask(
    sorted_probs: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    use_top_k: torch.Tensor,
    use_top_p: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep mask over the leading ``sorted_probs`` (descending), and per row whether every token
    after them is certainly dropped (so the leading ones decide the whole row)."""
    width = sorted_probs.shape[-1]
    rank = torch.arange(width, device=sorted_probs.device).unsqueeze(0)
    cumulative = torch.cumsum(sorted_probs, dim=-1)
    mass_before = cumulative - sorted_probs
    drop = (use_top_k.unsqueeze(-1) & (rank >= top_k.unsqueeze(-1))) | (
        use_top_p.unsqueeze(-1) & (mass_before > top_p.unsqueeze(-1))
    )
    drop[:, 0] = False  # the most likely token always survives
    drop_rest = (use_top_k & (top_k <= width)) | (use_top_p & (cumulative[:, -1] > top_p))
    return ~drop, drop_rest


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of ``probs [N, V]`` (non-negative, rows need not be normalised).

    Inverse-CDF sampling: one uniform per row against the fp64 cumulative sum. On CPU this is
    several times faster than ``torch.multinomial`` over a large vocabulary, and fp64 keeps the
    cumulative rounding far below any probability that matters. A zero-probability token can
    never be drawn: its CDF step is empty.
    """
    cdf = probs.cumsum(-1, dtype=torch.float64)  # (no float64 copy of the rows first: 6 MB at batch 16)
    total = cdf[:, -1:]
    uniform = torch.rand(total.shape, generator=generator, device=probs.device, dtype=torch.float64)
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(-1)
