"""Draft sampling, lossless verification and the reference speculative decoder (pure torch).

The SGLang worker calls :func:`logits_to_probs`, :func:`sample_block` and :func:`verify` on every
decode step; :func:`generate` runs the whole loop over a transformers target for evaluation,
data generation and tests. Nothing here imports sglang.
"""

from sglang_dspark.decoding.drafting import sample_block
from sglang_dspark.decoding.reference import GenerateOutput, RoundStats, generate
from sglang_dspark.decoding.sampling import SamplingParams, logits_to_probs
from sglang_dspark.decoding.verification import DraftBlock, VerifyResult, verify, verify_greedy, verify_packed

__all__ = [
    "DraftBlock",
    "GenerateOutput",
    "RoundStats",
    "SamplingParams",
    "VerifyResult",
    "generate",
    "logits_to_probs",
    "sample_block",
    "verify",
    "verify_greedy",
    "verify_packed",
]
