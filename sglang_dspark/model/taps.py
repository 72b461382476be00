"""Target hidden-state taps: the drafter's context features."""

from __future__ import annotations

from typing import Sequence

import torch


def taps_from_hidden_states(
    hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]
) -> torch.Tensor:
    """Concatenate the raw outputs of the tapped target layers: `[..., T, m*d]`.

    `hidden_states` is transformers' `output_hidden_states` tuple (index 0 = embedding output,
    index l+1 = output of layer l), so layer id l reads `hidden_states[l + 1]` and id -1 the
    embedding output. The last entry is post-norm in transformers, which is why the config
    forbids tapping the final layer.
    """
    if max(layer_ids) + 1 >= len(hidden_states) - 1:
        raise ValueError(
            f"layer ids {list(layer_ids)} need hidden_states of a model with more than "
            f"{max(layer_ids) + 1} layers; got {len(hidden_states) - 1} layers"
        )
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)
