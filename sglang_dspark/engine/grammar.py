"""Grammar-constrained decoding (JSON schema, regex, EBNF, structural tags) on DSPARK_LIVE's verify rows.

SGLang keeps each constrained request's grammar matcher on the request and advances it over the
tokens each step commits. Our algorithm does not advance it inside verify, so SGLang runs a batch
that holds a grammar synchronously (`ScheduleBatch.grammar_needs_sync`): when the worker sees the
batch, every matcher stands after the request's bonus token. A verify window is a chain (bonus,
then the drafts), so SGLang's own tree walk for speculative grammars (`traverse_tree`) fills each
row's bitmask: the grammar's allowed next tokens after the drafts before that row, accepting and
rolling back each draft, and leaving the rows after a draft the grammar refuses unconstrained
(that draft's target probability is zero, so acceptance stops there).
"""

from __future__ import annotations

import torch
from sglang.srt.speculative.spec_utils import traverse_tree


def apply_grammar_masks(logits: torch.Tensor, reqs, bonus: torch.Tensor, drafts: torch.Tensor,
                        window_lens: torch.Tensor, vocab_size: int) -> None:
    """Mask, in place, the packed verify rows of every request with a grammar (request b's
    `window_lens[b]` rows, its window being the bonus and `drafts[b, :window_lens[b] - 1]`)."""
    grammars = [req.grammar for req in reqs if req.grammar is not None]
    if not grammars:
        return
    masks = grammars[0].allocate_vocab_mask(vocab_size=vocab_size, batch_size=int(window_lens.sum()), device="cpu")
    first = 0
    for b, req in enumerate(reqs):
        width = int(window_lens[b])
        if req.grammar is not None and not req.finished():
            chain = torch.cat([bonus[b:b + 1].cpu(), drafts[b, : width - 1].cpu()]).to(torch.int64)
            next_token = torch.arange(1, width + 1)
            next_token[-1] = -1
            traverse_tree(next_token, torch.full((width,), -1), chain, req.grammar, masks[first:first + width],
                          vocab_size=vocab_size)
        first += width
    grammars[0].apply_vocab_mask(logits, grammars[0].move_vocab_mask(masks, logits.device))
