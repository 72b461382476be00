"""Process-level torch settings the CLI applies, so control/ never imports torch itself."""

import torch


def set_torch_threads(threads: int) -> None:
    """Use `threads` intra-op threads (1 is often best on a busy 2-core CPU)."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
