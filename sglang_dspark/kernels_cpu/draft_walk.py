"""The Markov walk of a drafted block in one C++ call (`draft_walk.cpp`), greedy or sampled.

`decoding.sample_block` walks a block slot by slot with ~12 torch ops each (embedding lookup,
Markov bias, confidence head, add, argmax, draft -> target id): at batch 1 and 7 slots that was
~85 ops and 1.1 ms of a 1.9 ms walk on this project's CPU, and 2.6 ms served, where the target's
forward has just pushed everything out of the caches. For greedy rows the kernel does the same
arithmetic (float32 sums, rounded to bfloat16 where the drafter is bfloat16, as torch's linears
round) after one torch GEMM for the block's base logits, so its drafts and confidences are the
torch walk's. Sampled rows draw each slot from softmax(scores / T), cut to the row's top-k /
top-p set as `decoding.logits_to_probs` cuts it, with one uniform from the worker's generator, and
the kernel writes that distribution over the draft vocabulary (p_d for rejection sampling); greedy
rows in a sampled batch take their argmax (a one-hot distribution). Served, the torch walk of
top-p rows cost about what the kernel's does (session 30, T=0.7 / top-p 0.9: 2.4 / 3.5 ms against
2.2 / 4.0 ms at batch 4 / 16: a trained drafter's distributions are peaked, so torch's nucleus
resolves in its first partial sort); on flat ones the kernel is far cheaper (random hidden states,
batch 16: 25 ms against 8 ms), and mixed or top-k / top-p batches no longer take another path.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from sglang_dspark.decoding.sampling import SamplingParams
from sglang_dspark.decoding.tree import DraftTree
from sglang_dspark.decoding.verification import DraftBlock
from sglang_dspark.kernels_cpu.build import load_library
from sglang_dspark.kernels_cpu.gemm_layout import fastest_panel_rows
from sglang_dspark.kernels_cpu.panel_gemm import pack_all_panels, panel_linear

SOURCE = Path(__file__).with_name("draft_walk.cpp")
DTYPES = (torch.float32, torch.bfloat16)


_c = ctypes
WALK_ARGS = [_c.c_void_p, _c.c_int64, _c.c_int64, _c.c_void_p, _c.c_int64, _c.c_int64, _c.c_int64, _c.c_void_p,
             _c.c_void_p, _c.c_void_p, _c.c_int64, _c.c_int64, _c.c_int64, _c.c_void_p, _c.c_float, _c.c_int,
             _c.c_void_p, _c.c_int64, _c.c_int64, _c.c_int64, _c.c_int, _c.c_void_p, _c.c_void_p, _c.c_int]


@functools.cache
def load_draft_walk() -> ctypes.CDLL:
    """The compiled walk, built on first use; raises `KernelUnavailable` with the reason."""
    c = ctypes
    library = load_library(SOURCE, {
        "dspark_greedy_walk": WALK_ARGS,
        "dspark_grow_tree": [c.c_void_p, c.c_int64, c.c_int64, c.c_void_p, c.c_void_p, c.c_void_p, c.c_int64, c.c_int64,
                             c.c_int64, c.c_void_p, c.c_int64, c.c_int, c.c_int64, c.c_int64, c.c_void_p, c.c_void_p,
                             c.c_void_p],
        "dspark_sampled_walk": WALK_ARGS + [c.c_void_p] * 6,
    })
    library.dspark_grow_tree.restype = c.c_int64  # the node count
    return library


def kernel_walk_fits(drafter) -> bool:
    """Whether `KernelWalk` can walk this drafter's blocks: on the CPU, float32 or bfloat16, with a
    vanilla Markov head or none (the gated and RNN heads keep the torch walk)."""
    head = drafter.markov_head
    return (drafter.device.type == "cpu" and drafter.dtype in DTYPES and drafter.lm_head.loaded
            and (head is None or head.kind == "vanilla"))


class KernelWalk:
    """Walks the blocks of one drafter (`kernel_walk_fits` must hold) in one call each:
    `greedy(hidden, anchors)` is `sample_block(drafter, hidden, anchors, <all greedy>)`;
    `sampled(hidden, anchors, params, generator)` is `sample_block` for any per-row temperature,
    top-k and top-p (greedy rows included).

    The block's base logits go through 32-column panels of the drafter's lm_head where those beat
    the BLAS (`fastest_panel_rows`): 0.16 against 0.29-0.37 ms for 7 rows here. `head_panels=False`
    (or no panel kernel on this CPU) keeps torch's linear."""

    def __init__(self, drafter, head_panels: bool = True) -> None:
        if not kernel_walk_fits(drafter):
            raise ValueError("the kernel walk needs a CPU float32/bfloat16 drafter with a vanilla Markov head or none")
        load_draft_walk()
        self.drafter = drafter
        self._panels, self._panel_rows = None, range(0)
        if head_panels:
            self._panel_rows = fastest_panel_rows(drafter.dtype)
            if self._panel_rows:
                self._panels = pack_all_panels([drafter.lm_head.weight])[0]

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """U = lm_head(h) `[B, W, V_draft]`, through the panels where they are faster."""
        rows = hidden.shape[0] * hidden.shape[1]
        if self._panels is None or rows not in self._panel_rows:
            return self.drafter.base_logits(hidden)
        return panel_linear(hidden.contiguous(), self._panels, self.drafter.config.draft_vocab_size)

    def greedy(self, hidden: torch.Tensor, anchors: torch.Tensor, base: torch.Tensor | None = None) -> DraftBlock:
        """Drafts `[B, W]` as target ids and their raw confidence logits (None without a head).
        `base`: the block's `base_logits(hidden)`, where the caller has them already."""
        tokens, confidences = self._walk(hidden, anchors, base)
        return DraftBlock(tokens=tokens, probs=None, confidence_logits=confidences)

    def tree(self, base: torch.Tensor, bonus: int, nodes: int, children_per_node: int = 4) -> DraftTree:
        """One request's tree of `nodes` drafts over its block's base logits `[W, V_draft]`:
        `decoding.tree.grow_tree` with the walk's slot scores (the same nodes, listed best first),
        in one call: 0.28 ms for 15 nodes on the idle Zen 4 CPU, against 0.75 for the torch growth
        (session 53; served, right after the target's forward, walk and tree took ~1.1 ms)."""
        drafter = self.drafter
        if base.dim() != 2 or base.shape[1] != drafter.config.draft_vocab_size or base.dtype != drafter.dtype \
                or base.stride(1) != 1 or nodes < 1 or children_per_node < 1:
            raise ValueError(f"kernel tree: base logits {tuple(base.shape)} {base.dtype}, {nodes} nodes, "
                             f"{children_per_node} children a node: expected [W, {drafter.config.draft_vocab_size}] "
                             f"{drafter.dtype} (unit stride last) and at least one of each")
        head = drafter.markov_head
        w1 = None if head is None else head.markov_w1.weight.contiguous()
        w2 = None if head is None else head.markov_w2.weight
        anchor = torch.tensor([bonus], dtype=torch.int64)
        tokens, parents, depths = (torch.empty(nodes, dtype=torch.int64) for _ in range(3))
        count = load_draft_walk().dspark_grow_tree(
            base.data_ptr(), base.stride(0), base.shape[0], anchor.data_ptr(), _pointer(w1), _pointer(w2),
            0 if w2 is None else w2.stride(0), 0 if w2 is None else w2.stride(1), 0 if head is None else head.rank,
            _pointer(drafter.d2t), base.shape[1], drafter.dtype == torch.bfloat16, nodes, children_per_node,
            tokens.data_ptr(), parents.data_ptr(), depths.data_ptr())
        return DraftTree(tokens=tokens[:count].tolist(), parents=parents[:count].tolist(), depths=depths[:count].tolist())

    def sampled(self, hidden: torch.Tensor, anchors: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None, base: torch.Tensor | None = None) -> DraftBlock:
        """Drafts drawn under `params` (one row each), with the distributions they were drawn from
        over the draft vocabulary (`probs_vocab`: the drafter's d2t); greedy rows' are one-hot."""
        batch, width = hidden.shape[:2]
        if params.batch_size != batch:
            raise ValueError(f"sampled walk: sampling parameters for {params.batch_size} rows, expected {batch}")
        params = params.to("cpu")
        temperatures = params.temperature.to(torch.float32)
        scale = torch.where(params.greedy, torch.zeros_like(temperatures), 1.0 / temperatures).contiguous()
        top_k = params.top_k.to(torch.int64).contiguous()
        top_p = params.top_p.to(torch.float32).contiguous()
        min_p = params.min_p.to(torch.float32).contiguous()
        uniforms = torch.rand(batch, width, dtype=torch.float64, generator=generator)
        probs = torch.empty(batch, width, self.drafter.config.draft_vocab_size, dtype=torch.float32)
        tokens, confidences = self._walk(hidden, anchors, base, [scale.data_ptr(), top_k.data_ptr(), top_p.data_ptr(),
                                                           min_p.data_ptr(), uniforms.data_ptr(), probs.data_ptr()])
        return DraftBlock(tokens=tokens, probs=probs, confidence_logits=confidences, probs_vocab=self.drafter.d2t)

    def _walk(self, hidden: torch.Tensor, anchors: torch.Tensor, base: torch.Tensor | None = None,
              sampling: list | None = None):
        drafter = self.drafter
        batch, width, hidden_size = hidden.shape
        if hidden.dtype != drafter.dtype or hidden.stride(2) != 1 or anchors.shape != (batch,):
            raise ValueError(f"kernel walk: hidden {tuple(hidden.shape)} {hidden.dtype} and anchors "
                             f"{tuple(anchors.shape)}: expected [B, W, d] {drafter.dtype} (unit stride last) and [B]")
        base = self.base_logits(hidden) if base is None else base
        if base.shape != (batch, width, drafter.config.draft_vocab_size) or base.dtype != drafter.dtype \
                or base.stride(2) != 1:
            raise ValueError(f"kernel walk: base logits {tuple(base.shape)} {base.dtype}: expected "
                             f"[{batch}, {width}, {drafter.config.draft_vocab_size}] {drafter.dtype} (unit stride last)")
        anchors = anchors.to(torch.int64).contiguous()
        tokens = torch.empty(batch, width, dtype=torch.int64)
        head, confidence = drafter.markov_head, drafter.confidence_head
        w1 = None if head is None else head.markov_w1.weight.contiguous()
        w2 = None if head is None else head.markov_w2.weight
        proj = confidences = None
        if confidence is not None:
            proj = confidence.proj.weight.reshape(-1).contiguous()
            confidences = torch.empty(batch, width, dtype=torch.float32)
        d2t = drafter.d2t
        arguments = [
            base.data_ptr(), base.stride(0), base.stride(1), hidden.data_ptr(), hidden.stride(0), hidden.stride(1),
            hidden_size, anchors.data_ptr(), _pointer(w1), _pointer(w2), 0 if w2 is None else w2.stride(0),
            0 if w2 is None else w2.stride(1), 0 if head is None else head.rank, _pointer(proj),
            0.0 if confidence is None else float(confidence.proj.bias), int(confidence is not None and confidence.with_markov),
            _pointer(d2t), batch, width, base.shape[-1], drafter.dtype == torch.bfloat16, tokens.data_ptr(),
            _pointer(confidences), torch.get_num_threads()]
        kernel = load_draft_walk()
        if sampling is None:
            kernel.dspark_greedy_walk(*arguments)
        else:
            kernel.dspark_sampled_walk(*arguments, *sampling)
        return tokens, confidences


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()
