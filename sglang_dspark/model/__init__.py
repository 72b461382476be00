"""The DSpark drafter, its heads and DeepSpec checkpoints (pure torch; never imports sglang)."""

from sglang_dspark.model.cache import DraftContextCache
from sglang_dspark.model.checkpoint import load_drafter, save_drafter
from sglang_dspark.model.config import DSparkConfig, default_target_layer_ids
from sglang_dspark.model.drafter import DSparkDrafter, TargetWeights, target_weights_of
from sglang_dspark.model.errors import CheckpointError
from sglang_dspark.model.taps import taps_from_hidden_states

__all__ = [
    "CheckpointError",
    "DSparkConfig",
    "DSparkDrafter",
    "DraftContextCache",
    "TargetWeights",
    "default_target_layer_ids",
    "load_drafter",
    "save_drafter",
    "target_weights_of",
    "taps_from_hidden_states",
]
