"""DSPARK_LIVE knobs: the draft checkpoint folder plus `DSPARK_*` environment variables.

SGLang plugins cannot add CLI flags, so everything SGLang has no flag for is read here, once per
process, with a clear error for a bad value:

| variable | default | meaning |
|---|---|---|
| `DSPARK_GAMMA` | checkpoint `block_size` | drafts per block (1..block_size) |
| `DSPARK_PLANNER` | `production` if an SPS table is found, else `all` | `all`: verify every draft; `production`: the draft width worth its measured cost, then early-stop verification in survival order (`scheduling.EarlyStopPlanner`), drafter skipped on steps where it cannot pay, and wherever drafted steps measurably delivered more than 3 % fewer tokens/s than skipped ones at this batch size; `fixed:N`: verify N drafts per request; `sweep`: a measurement mode for `dspark-ctl bench sps-serve` (step s verifies s mod (gamma+1) drafts per request) |
| `DSPARK_SPS_PATH` | `<draft>/sps-<dtype>-<cpu>.json` on a CPU (`<cpu>`: `amx`, `avx512bf16`, `avx512` or `avx2`, its widest matrix instructions), else `<draft>/sps-<dtype>.json`, else `<draft>/sps.json`, if present | cost model JSON (`scheduling.load_cost_model`) |
| `DSPARK_STS_PATH` | `<draft>/sts.json` if present | STS temperatures JSON (`calibration.StsCalibration`) |
| `DSPARK_STS_GREEDY_PATH` | `<draft>/sts-greedy.json` if present | STS calibration for greedy requests (a greedy draft survives by argmax match, a different event from sampled acceptance, so one calibration does not fit both); without it greedy requests use `DSPARK_STS_PATH` |
| `DSPARK_RECALIBRATE_EVERY` | 1024 | with the production planner, refit each temperature class's STS calibration on its last 4,096 served verify rounds every this many new rounds (twice as many after a refit that changed nothing, up to 16x), and keep the refit where it calibrates better on held-out rounds (`engine.live_calibration`); 0: never (the files stay in force) |
| `DSPARK_RECORDS` | 2048 | per-step records kept in memory (bounded ring) |
| `DSPARK_SEED` | 0 | seed of the drafter's and verifier's sampling generator |
| `DSPARK_STEP_LOG` | unset | also append every step record as a JSON line to this file (benchmarks) |
| `DSPARK_DRAFT_DTYPE` | `auto` | the drafter's dtype: `auto` (the target's, except float32 on a CPU without native bf16 math where the plugin's weight panels cannot serve bf16, and there bf16 drafting ran ~2x slower), `float32`, `bfloat16`, `float16` |
| `DSPARK_PREFIX_CACHE` | `on` | keep SGLang's radix (prefix) cache: the worker stores every committed token's taps beside its KV slot (the tap store, one row per KV slot), so a prefix served from the cache seeds the drafter's context without a target forward; `off` disables the radix cache |
| `DSPARK_SERVED_OFFSETS` | `on` | with the production planner, correct each temperature class's calibration per draft position by an offset learnt from the server's own verify rounds (`calibration.served_offsets`: on served greedy traffic the offline calibration under-predicted acceptance from position 2 on, so the early stop refused drafts that paid); `off`: the calibration files (and live refits) alone |
| `DSPARK_LOOKUP` | `on` | lookup drafts: where a request's last 2-4 tokens occurred before in its prompt or output, the tokens that followed their latest occurrence are verified instead of the drafter's block (`engine.lookup`; lossless like any draft: a sampled request's lookup is a point-mass proposal under rejection sampling; their survivals are learnt from served lookup rounds, per temperature class and match length); `greedy`: greedy requests only; `off`: the drafter's blocks only |
| `DSPARK_TREE_NODES` | 2 x gamma + 1 (0 where gamma < 4) | at batch 1, a request the drafter drafts for verifies a tree of at most this many drafts instead of a chain (2k + 1 where the planner would verify k drafts of the chain): the continuations of its bonus token the drafter finds most probable (`decoding.tree`; a sampled request's tree also holds its sampled chain), each node attending to the prefix and its own ancestry in one verify window of nodes + 1 rows, accepted along the target's argmax, or sampled by the chain's rejection sampling and then draws from the target (output distribution unchanged either way). A verify row costs ~0.15 ms of a ~22 ms batch-1 forward on the Zen 4 CPU; offline (18 eval prompts, teacher-forced) a tree of 15 drafts commits 2.72 tokens a round against 2.14 for a chain of 7. The verify window (SGLang's `speculative_num_draft_tokens`, and the KV slots reserved per request a step) is max(gamma, nodes) + 1. Requests whose verify rows SGLang's sampler would change, or that ask for logprobs or hidden states, keep the chain; CPU with the walk kernel and the paged attention kernel only. 0: off |
| `DSPARK_GRAMMAR_STEERING` | `on` | a constrained request's grammar steers the drafter's walk (each slot drafts the best token the grammar allows; `engine.grammar`); `off`: drafts are only cut where the grammar refuses one |
| `DSPARK_VERIFY_ATTENTION` | `linear` | CPU verify attention: `linear` (the window's queries over the request's KV only: the paged kernel, or SDPA with `DSPARK_CPU_ATTENTION=sdpa`) or `native` (SGLang torch_native extend, re-attends the prefix) |
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from sglang_dspark.engine.live_calibration import MIN_ROUNDS
from sglang_dspark.runtime import cpu_profile_tag

PLANNER_MODES = ("all", "production", "fixed", "sweep")
VERIFY_ATTENTION_MODES = ("linear", "native")
DRAFT_DTYPES = ("auto", "float32", "bfloat16", "float16")
LOOKUP_MODES = ("on", "greedy", "off")
DEFAULT_RECALIBRATE_EVERY = 1024
MAX_TREE_NODES = 63


class SettingsError(ValueError):
    """A DSPARK_* variable or the draft folder does not fit; the message says what was expected."""


@dataclass(frozen=True)
class LiveSettings:
    draft_path: Path
    block_size: int
    gamma: int
    planner: str
    fixed_drafts: int
    sps_path: Path | None
    sts_path: Path | None
    max_records: int
    seed: int
    verify_attention: str
    prefix_cache: bool
    step_log: Path | None = None
    draft_dtype: str = "auto"
    sts_greedy_path: Path | None = None
    recalibrate_every: int = 0
    served_offsets: bool = False
    lookup: str = "off"  # LOOKUP_MODES: which requests may draft from their own text
    grammar_steering: bool = False  # constrained requests' grammars steer the drafter's walk
    tree_nodes: int = 0  # drafts verified as a tree at batch 1 (0: a chain)

    @property
    def verify_window(self) -> int:
        """Tokens per request in a full verify: the bonus plus gamma drafts, or a tree's drafts."""
        return max(self.gamma, self.tree_nodes) + 1


def _int_env(name: str, default: int, low: int, high: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r}: expected an integer") from None
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise SettingsError(f"{name}={value}: expected an integer {bound}")
    return value


def _optional_file(env_name: str, fallback: Path) -> Path | None:
    raw = os.environ.get(env_name)
    if raw:
        path = Path(raw)
        if not path.is_file():
            raise SettingsError(f"{env_name}={raw!r}: no such file")
        return path
    return fallback if fallback.is_file() else None


def read_draft_config(draft_path: str | Path) -> dict:
    """The drafter's config.json as a dict, with a clear error when the folder is not a drafter."""
    config_file = Path(draft_path) / "config.json"
    if not config_file.is_file():
        raise SettingsError(
            f"--speculative-draft-model-path {draft_path!s}: no config.json there; expected a DSpark "
            "drafter folder (config.json with block_size, target_layer_ids, ... and model.safetensors)"
        )
    return json.loads(config_file.read_text())


def default_sps_file(draft_path: Path, dtype: str | None, hardware: str | None = None) -> Path:
    """The draft folder's cost model for this server: `<draft>/sps-<dtype>-<hardware>.json` when
    the folder has one measured on this kind of machine (`runtime.cpu_profile_tag` on a CPU: the
    marginal cost of a verify token differs by instruction set), else `<draft>/sps-<dtype>.json`
    (the step's shape differs by dtype: on a CPU without native bf16 math, bf16 weights stream
    twice as fast), else `<draft>/sps.json`."""
    candidates = []
    if dtype and hardware:
        candidates.append(draft_path / f"sps-{dtype}-{hardware}.json")
    if dtype:
        candidates.append(draft_path / f"sps-{dtype}.json")
    return next((path for path in candidates if path.is_file()), draft_path / "sps.json")


def _recalibrate_every() -> int:
    """`DSPARK_RECALIBRATE_EVERY`: rounds of a temperature class between live STS refits (0: never)."""
    every = _int_env("DSPARK_RECALIBRATE_EVERY", DEFAULT_RECALIBRATE_EVERY, 0)
    if 0 < every < MIN_ROUNDS:
        raise SettingsError(f"DSPARK_RECALIBRATE_EVERY={every}: expected 0 (never) or at least {MIN_ROUNDS} rounds "
                            "(a refit holds some out to compare with the calibration in force)")
    return every


def load_settings(draft_path: str | Path, dtype: str | None = None, device: str | None = None) -> LiveSettings:
    """Resolve every knob for the drafter at `draft_path`, served in `dtype` (SGLang's --dtype)
    on `device` (SGLang's --device: on a CPU, the cost model measured on its instruction set wins)."""
    draft_path = Path(draft_path)
    config = read_draft_config(draft_path)
    block_size = config.get("block_size") or (config.get("dflash_config") or {}).get("block_size")
    if not isinstance(block_size, int) or block_size < 1:
        raise SettingsError(f"{draft_path}/config.json: block_size={block_size!r}, expected a positive integer")
    gamma = _int_env("DSPARK_GAMMA", block_size, 1, block_size)
    hardware = cpu_profile_tag() if device == "cpu" else None
    sps_path = _optional_file("DSPARK_SPS_PATH", default_sps_file(draft_path, dtype, hardware))
    sts_path = _optional_file("DSPARK_STS_PATH", draft_path / "sts.json")
    sts_greedy_path = _optional_file("DSPARK_STS_GREEDY_PATH", draft_path / "sts-greedy.json")
    planner_raw = os.environ.get("DSPARK_PLANNER", "").strip().lower() or ("production" if sps_path else "all")
    planner, _, argument = planner_raw.partition(":")
    if planner not in PLANNER_MODES:
        raise SettingsError(f"DSPARK_PLANNER={planner_raw!r}: expected all, production, fixed:N or sweep")
    fixed_drafts = gamma
    if planner == "fixed":
        if not argument.isdigit() or not 0 <= int(argument) <= gamma:
            raise SettingsError(f"DSPARK_PLANNER={planner_raw!r}: expected fixed:N with 0 <= N <= gamma={gamma}")
        fixed_drafts = int(argument)
    if planner == "production" and not config.get("enable_confidence_head", False):
        raise SettingsError(
            f"DSPARK_PLANNER=production needs a drafter with a confidence head; {draft_path}/config.json has "
            "enable_confidence_head=false (a DFlash drafter): use DSPARK_PLANNER=all or fixed:N"
        )
    if planner == "production" and sps_path is None:
        raise SettingsError(
            "DSPARK_PLANNER=production needs a cost model: set DSPARK_SPS_PATH or put sps.json in the draft folder"
        )
    verify_attention = os.environ.get("DSPARK_VERIFY_ATTENTION", "linear").strip().lower()
    if verify_attention not in VERIFY_ATTENTION_MODES:
        raise SettingsError(f"DSPARK_VERIFY_ATTENTION={verify_attention!r}: expected linear or native")
    prefix_cache = os.environ.get("DSPARK_PREFIX_CACHE", "on").strip().lower()
    if prefix_cache not in ("on", "off"):
        raise SettingsError(f"DSPARK_PREFIX_CACHE={prefix_cache!r}: expected on or off")
    served_offsets = os.environ.get("DSPARK_SERVED_OFFSETS", "on").strip().lower()
    if served_offsets not in ("on", "off"):
        raise SettingsError(f"DSPARK_SERVED_OFFSETS={served_offsets!r}: expected on or off")
    lookup = os.environ.get("DSPARK_LOOKUP", "on").strip().lower()
    if lookup not in LOOKUP_MODES:
        raise SettingsError(f"DSPARK_LOOKUP={lookup!r}: expected one of {', '.join(LOOKUP_MODES)}")
    grammar_steering = os.environ.get("DSPARK_GRAMMAR_STEERING", "on").strip().lower()
    if grammar_steering not in ("on", "off"):
        raise SettingsError(f"DSPARK_GRAMMAR_STEERING={grammar_steering!r}: expected on or off")
    draft_dtype = os.environ.get("DSPARK_DRAFT_DTYPE", "auto").strip().lower()
    if draft_dtype not in DRAFT_DTYPES:
        raise SettingsError(f"DSPARK_DRAFT_DTYPE={draft_dtype!r}: expected one of {', '.join(DRAFT_DTYPES)}")
    return LiveSettings(
        draft_path=draft_path,
        draft_dtype=draft_dtype,
        block_size=block_size,
        gamma=gamma,
        planner=planner,
        fixed_drafts=fixed_drafts,
        sps_path=sps_path,
        sts_path=sts_path,
        sts_greedy_path=sts_greedy_path,
        max_records=_int_env("DSPARK_RECORDS", 2048, 1),
        seed=_int_env("DSPARK_SEED", 0, 0),
        verify_attention=verify_attention,
        prefix_cache=prefix_cache == "on",
        step_log=Path(os.environ["DSPARK_STEP_LOG"]) if os.environ.get("DSPARK_STEP_LOG") else None,
        recalibrate_every=_recalibrate_every(),
        served_offsets=served_offsets == "on",
        lookup=lookup,
        grammar_steering=grammar_steering == "on",
        tree_nodes=_int_env("DSPARK_TREE_NODES", 2 * gamma + 1 if gamma >= 4 else 0, 0, MAX_TREE_NODES),
    )
