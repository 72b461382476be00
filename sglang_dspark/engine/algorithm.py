"""The `DSPARK_LIVE` algorithm object SGLang's scheduler talks to, and server-argument checks.

`CustomSpecAlgo` lacks three methods the 0.5.23 scheduler calls unconditionally
(`create_future_map`, `carries_draft_hidden_states`, `need_topk`); this subclass supplies them.
`is_dflash_family()` stays False on purpose: the scheduler then reserves verify KV slots through
the generic `eagle_prepare_for_decode` path (2 x window per request), which our ragged verify
window always fits, and no DFlash-only machinery (draft KV pools, CUDA-graph dummies) is built.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from sglang_dspark.engine.settings import SettingsError, load_settings, read_draft_config

logger = logging.getLogger(__name__)


class DSparkLiveAlgorithm(CustomSpecAlgo):
    """Predicates and hooks SGLang's scheduler asks of a speculative algorithm."""

    def carries_draft_hidden_states(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return False

    def create_future_map(self, device: torch.device, req_to_token_pool, needs_cpu_seq_lens: bool = True,
                          needs_confidence_relay: bool = False):
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

    def handle_server_args(self, server_args) -> None:
        """Fix the step shape: one linear chain (topk 1, one draft step) of gamma drafts + the bonus,
        in a verify window wide enough for a batch-1 tree (`LiveSettings.verify_window`).

        The radix cache stays on unless `DSPARK_PREFIX_CACHE=off`: the worker keeps each committed
        token's taps beside its KV slot, so a cached prefix seeds the drafter context like a prefill.
        """
        settings = _settings_or_error(server_args)
        if not settings.prefix_cache:
            server_args.disable_radix_cache = True
        server_args.speculative_num_steps = 1
        server_args.speculative_eagle_topk = 1
        server_args.speculative_num_draft_tokens = settings.verify_window


def _settings_or_error(server_args):
    draft_path = getattr(server_args, "speculative_draft_model_path", None)
    if not draft_path:
        raise ValueError(
            "--speculative-algorithm DSPARK_LIVE needs --speculative-draft-model-path: a DSpark drafter "
            "folder (config.json + model.safetensors), e.g. the one `dspark-ctl prepare` writes"
        )
    try:
        return load_settings(draft_path, getattr(server_args, "dtype", None), getattr(server_args, "device", None))
    except SettingsError as error:
        raise ValueError(f"DSPARK_LIVE: {error}") from None


def _target_config(model_path: str) -> dict | None:
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    return config.get("text_config", config)


def check_drafter_fits_target(draft_config: dict, target_config: dict) -> None:
    """Raise ValueError when vocabulary, width or tapped layers of the drafter do not fit the target."""
    target_layers = target_config.get("num_hidden_layers")
    layer_ids = draft_config.get("target_layer_ids") or (draft_config.get("dflash_config") or {}).get(
        "target_layer_ids")
    if not layer_ids:
        raise ValueError("DSPARK_LIVE: drafter config has no target_layer_ids; expected the tapped target layers")
    bad = [layer for layer in layer_ids if not 0 <= int(layer) < int(target_layers)]
    if bad:
        raise ValueError(
            f"DSPARK_LIVE: drafter target_layer_ids {list(layer_ids)} include {bad}, but the target has "
            f"{target_layers} layers (expected ids in 0..{int(target_layers) - 1})"
        )
    for key in ("vocab_size", "hidden_size"):
        if draft_config.get(key) != target_config.get(key):
            raise ValueError(
                f"DSPARK_LIVE: drafter {key}={draft_config.get(key)} does not match the target's "
                f"{key}={target_config.get(key)}; the drafter must be trained for this target"
            )


def validate_server_args(server_args) -> None:
    """Clear errors at launch for a missing/mismatched drafter or an unsupported setting."""
    settings = _settings_or_error(server_args)
    requested = getattr(server_args, "speculative_num_draft_tokens", None)
    if requested is not None and int(requested) != settings.verify_window:
        raise ValueError(
            f"DSPARK_LIVE: --speculative-num-draft-tokens {requested} does not match the drafter: expected "
            f"max(gamma, tree nodes) + 1 = {settings.verify_window} (gamma={settings.gamma}, checkpoint block_size="
            f"{settings.block_size}, DSPARK_TREE_NODES={settings.tree_nodes}); omit the flag, or set DSPARK_GAMMA "
            "and DSPARK_TREE_NODES"
        )
    page_size = getattr(server_args, "page_size", None)
    if page_size not in (None, 1):
        raise ValueError(f"DSPARK_LIVE: --page-size {page_size} is not supported; expected 1")
    target_config = _target_config(str(server_args.model_path))
    if target_config is not None:
        check_drafter_fits_target(read_draft_config(settings.draft_path), target_config)


def create_worker_class(server_args):
    """Factory SGLang calls in the scheduler process; imports the worker lazily (it is heavy)."""
    from sglang_dspark.engine.worker import DSparkLiveWorker

    return DSparkLiveWorker
