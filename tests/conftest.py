"""Session-scoped SGLang server fixtures (tests marked `server`).

One tiny target (random Llama + trained byte-level BPE) and one tiny drafter are built per
session; servers start on first use, at most once per session, in parallel where a test asks
for several (each start costs ~40-60 s on 2 cores). Everything is torn down at session end.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from server_fixtures import ServerHandle, build_tiny_drafter, build_tiny_target, launch_servers

PROFILE = Path(__file__).resolve().parent.parent / "profiles" / "cpu-smollm2-135m-target-context.json"
FAST_ENGINE_TABLE = Path(__file__).resolve().parent / "data" / "fast-engine-sps.json"
DRAFTER_VARIANTS = {"dspark_skip": "wrong", "dspark_tree": "runner_up"}
"""Flavours served with a variant of the tiny drafter (`build_tiny_drafter(bigrams=...)`): wrong
bigrams, or right ones often only as the runner-up."""
SERVER_FLAVOURS = {
    # name: (extra launch_server arguments, extra environment)
    "baseline": ([], {}),
    # plain serving without overlap: the reference for penalties and for custom logit processors
    # that read the request, which SGLang's overlap scheduler applies a step late (it reads a
    # request's last output before the previous step is processed)
    "baseline_sync": (["--disable-overlap-schedule", "--enable-custom-logit-processor",
                       "--enable-return-hidden-states"], {}),
    # verify every draft: uniform windows (a lone request drafts a chain, not a tree),
    # overlap scheduling on; prompts over 48 tokens are prefilled in chunks, so the drafter context
    # is seeded chunk by chunk; every step drafts
    "dspark_overlap": (["--speculative-algorithm", "DSPARK_LIVE", "--chunked-prefill-size", "48",
                        "--enable-custom-logit-processor", "--enable-return-hidden-states"],
                       {"DSPARK_TREE_NODES": "0", "DSPARK_STEP_LOG": "{log_dir}/dspark_overlap-steps.jsonl"}),
    # the production planner (any cost table will do: it only has to make windows ragged),
    # overlap scheduling off
    "dspark_sync": (["--speculative-algorithm", "DSPARK_LIVE", "--disable-overlap-schedule",
                     "--enable-custom-logit-processor", "--enable-return-hidden-states"],
                    {"DSPARK_PLANNER": "production", "DSPARK_SPS_PATH": str(PROFILE),
                     "DSPARK_STEP_LOG": "{log_dir}/dspark_sync-steps.jsonl"}),
    # the production planner with a drafter whose drafts the target almost never accepts (over a
    # table of ~1 ms steps): drafting costs more than it returns, so most steps skip the drafter
    # and now and then a probe drafts; every step is logged
    "dspark_skip": (["--speculative-algorithm", "DSPARK_LIVE"],
                    {"DSPARK_PLANNER": "production", "DSPARK_SPS_PATH": str(FAST_ENGINE_TABLE),
                     "DSPARK_STEP_LOG": "{log_dir}/dspark_skip-steps.jsonl"}),
    # verify every draft, and at batch 1 a tree of 2 x gamma + 1 drafts instead of a chain (the
    # default), with the drafter whose right bigram is often only its runner-up
    "dspark_tree": (["--speculative-algorithm", "DSPARK_LIVE"],
                    {"DSPARK_STEP_LOG": "{log_dir}/dspark_tree-steps.jsonl"}),
    # a KV pool far smaller than the running requests need, admitted optimistically: requests are
    # retracted mid-decode (their KV freed) and prefilled again later
    "dspark_tight": (["--speculative-algorithm", "DSPARK_LIVE", "--max-total-tokens", "400",
                      "--schedule-conservativeness", "0.05"], {}),
    # bfloat16 pair: SGLang's own bf16 attention rounds a verify window differently from a decode
    # step; the plugin's paged attention must not
    "baseline_bf16": (["--dtype", "bfloat16"], {}),
    "dspark_bf16": (["--speculative-algorithm", "DSPARK_LIVE", "--dtype", "bfloat16"], {}),
}


def _free_port() -> int:
    """A free port in 12000-19999: below the kernel's ephemeral range (32768+ by default), which
    every outgoing connection (our own health polls included) draws from, and below the
    22000-29999 where SGLang picks its NCCL ports. A port from bind(0) could be handed to such a
    socket before the server bound it (a server of CI's 4 then failed with "address already in
    use")."""
    for port in random.sample(range(12000, 20000), 64):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 12000-19999 for a test server")


class ServerPool:
    """Starts each flavour at most once per session; `get(*names)` starts missing ones together."""

    def __init__(self, target: Path, drafter: Path, variant_drafters: dict[str, Path], log_dir: Path) -> None:
        self.target, self.drafter, self.variant_drafters, self.log_dir = target, drafter, variant_drafters, log_dir
        self.running: dict[str, ServerHandle] = {}

    def get(self, *names: str) -> list[ServerHandle]:
        missing = [name for name in names if name not in self.running]
        if missing:
            specs = []
            for name in missing:
                args, env = SERVER_FLAVOURS[name]
                if "--speculative-algorithm" in args:
                    drafter = self.variant_drafters.get(DRAFTER_VARIANTS.get(name), self.drafter)
                    args = [*args, "--speculative-draft-model-path", str(drafter)]
                env = {key: value.format(log_dir=self.log_dir) for key, value in env.items()}
                specs.append((name, _free_port(), args, env))
            self.running.update(launch_servers(self.target, specs, self.log_dir))
        return [self.running[name] for name in names]

    def stop_all(self) -> None:
        for handle in self.running.values():
            handle.stop()


@pytest.fixture(scope="session")
def tiny_serving_models(tmp_path_factory) -> tuple[Path, Path]:
    """(target folder, drafter folder) built once per session."""
    root = tmp_path_factory.mktemp("serving-models")
    target = build_tiny_target(root / "target")
    return target, build_tiny_drafter(target, root / "drafter")


@pytest.fixture(scope="session")
def server_pool(tiny_serving_models, tmp_path_factory):
    target = tiny_serving_models[0]
    variants = {variant: build_tiny_drafter(target, tmp_path_factory.mktemp(f"{variant}-drafter"), bigrams=variant)
                for variant in set(DRAFTER_VARIANTS.values())}
    pool = ServerPool(*tiny_serving_models, variants, tmp_path_factory.mktemp("server-logs"))
    yield pool
    pool.stop_all()


@pytest.fixture(scope="session")
def baseline_server(server_pool) -> ServerHandle:
    """Plain SGLang serving of the tiny target (no speculation)."""
    return server_pool.get("baseline")[0]


@pytest.fixture(scope="session")
def dspark_server(server_pool) -> ServerHandle:
    """DSPARK_LIVE with overlap scheduling (SGLang's default)."""
    return server_pool.get("dspark_overlap")[0]


@pytest.fixture
def one_torch_thread():
    """Tiny torch ops run far faster on one thread than on two contended ones."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test of the plugin's C++ kernels reports *skipped*, with the reason, where the kernel
    refuses to load because this CPU has neither AVX-512F nor AVX2 with FMA: the kernels need one
    of them, and the server serves on its torch paths there. Any other failure stays a failure."""
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is not None and report.failed and _lacks_vector_isa(call.excinfo):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {call.excinfo.value}")


def _lacks_vector_isa(excinfo) -> bool:
    from sglang_dspark.kernels_cpu.build import KernelUnavailable, vector_isa_supported

    return (excinfo.errisinstance(KernelUnavailable) and not vector_isa_supported()
            and "neither AVX-512F nor AVX2" in str(excinfo.value))
