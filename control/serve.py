"""`dspark-ctl serve`: start `python -m sglang.launch_server` with DSPARK_LIVE (a thin wrapper).

The plain SGLang command works on its own (`--print-command` shows it); this wrapper only fills
in the prepared default target, the shipped drafter and the CPU settings. Nothing here imports
torch or sglang: the server runs in its own process.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import typer

REPO_ROOT = Path(__file__).resolve().parent.parent
SHIPPED_DRAFTER = "drafters/smollm2-135m-dspark"


@dataclass
class ServerLaunch:
    """Everything needed to start one SGLang server, as a command line and an environment."""

    model_path: str
    port: int = 30000
    host: str = "127.0.0.1"
    device: str = "cpu"
    dtype: str = "bfloat16"
    drafter_path: str | None = None
    overlap: bool = True
    max_total_tokens: int = 16384
    max_running_requests: int = 16
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)

    def command(self) -> list[str]:
        args = [sys.executable, "-m", "sglang.launch_server", "--model-path", self.model_path,
                "--device", self.device, "--host", self.host, "--port", str(self.port),
                "--dtype", self.dtype, "--max-total-tokens", str(self.max_total_tokens),
                "--max-running-requests", str(self.max_running_requests)]
        if self.device == "cpu":
            args.append("--sleep-on-idle")
        if self.drafter_path:
            args += ["--speculative-algorithm", "DSPARK_LIVE", "--speculative-draft-model-path", self.drafter_path]
        if not self.overlap:
            args.append("--disable-overlap-schedule")
        return args + list(self.extra_args)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
        env.update(self.extra_env)
        return env

    def shell_line(self) -> str:
        prefix = "SGLANG_USE_CPU_ENGINE=1 " if self.device == "cpu" else ""
        prefix += "".join(f"{k}={shlex.quote(v)} " for k, v in self.extra_env.items())
        return prefix + shlex.join(self.command())

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def find_shipped_drafter() -> Path | None:
    """The DSpark drafter this repository ships for the default target, or None if it is missing.

    Named explicitly: `drafters/` also holds the DFlash twin, which has no confidence head."""
    drafter = REPO_ROOT / SHIPPED_DRAFTER
    return drafter if (drafter / "config.json").is_file() and (drafter / "model.safetensors").is_file() else None


def drafter_or_shipped(drafter: str | None) -> str | None:
    """`drafter` if given, else the shipped DSpark drafter, else None."""
    shipped = find_shipped_drafter()
    return drafter or (str(shipped) if shipped else None)


def prepared_target_path() -> str:
    """The default target folder, converting it once if needed (imports torch: only when asked)."""
    from sglang_dspark.training.prepare import prepare_target

    return str(prepare_target().model_path)


def start(launch: ServerLaunch, log_path: Path) -> subprocess.Popen:
    """Start the server in its own process group, output to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        return subprocess.Popen(launch.command(), stdout=log, stderr=subprocess.STDOUT, env=launch.env(),
                                start_new_session=True)


def wait_healthy(launch: ServerLaunch, process: subprocess.Popen, log_path: Path, timeout_s: float = 600) -> None:
    """Block until /health answers 200; raise with the log tail if the server dies or times out."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}; log tail:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{launch.url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"server not healthy after {timeout_s:.0f}s; log tail:\n{log_path.read_text()[-3000:]}")


@contextmanager
def running(launches: dict[str, ServerLaunch], log_dir: Path) -> Iterator[None]:
    """All servers started (logs `<log_dir>/<name>.log`) and healthy; all stopped on exit."""
    processes = {}
    try:
        for name, launch in launches.items():
            processes[name] = start(launch, log_dir / f"{name}.log")
        for name, launch in launches.items():
            wait_healthy(launch, processes[name], log_dir / f"{name}.log")
        yield
    finally:
        for process in processes.values():
            stop(process)


def stop(process: subprocess.Popen) -> None:
    """Stop the server's whole process group (scheduler and detokenizer are its children)."""
    import signal

    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


TARGET_OPTION = typer.Option(None, "--model-path", help="Target folder (default: the prepared SmolLM2).")
DRAFTER_OPTION = typer.Option(None, "--drafter", help="Drafter folder (default: the shipped one).")
DEVICE_OPTION = typer.Option("cpu", help="cpu or cuda.")
"""Options every command that starts servers takes alike (serve, bench serve, bench sps-serve, bench prefix)."""


def serve_command(
    model_path: str = TARGET_OPTION,
    drafter: str = DRAFTER_OPTION,
    no_speculation: bool = typer.Option(False, "--no-speculation", help="Serve the target alone."),
    port: int = typer.Option(30000, help="HTTP port."),
    host: str = typer.Option("127.0.0.1", help="Bind address."),
    device: str = DEVICE_OPTION,
    dtype: str = typer.Option("bfloat16", help="Weights and activations dtype (bfloat16: the plugin's weight panels stream half the bytes of float32, so on this CPU it serves faster and verifies drafts cheaper; on the CPU engine greedy answers equal non-speculative serving bit for bit in either dtype: the plugin computes verify rows exactly like decode rows)."),
    overlap: bool = typer.Option(True, "--overlap/--no-overlap", help="SGLang overlap scheduling."),
    print_command: bool = typer.Option(False, "--print-command", help="Print the plain SGLang command, do not run."),
) -> None:
    """Serve with DSPARK_LIVE through `python -m sglang.launch_server` (runs in the foreground)."""
    target = model_path or prepared_target_path()
    drafter_path = None
    if not no_speculation:
        found = drafter or find_shipped_drafter()
        if found is None:
            typer.echo("error: no drafter given and none shipped under drafters/ or profiles/; "
                       "pass --drafter PATH or --no-speculation", err=True)
            raise typer.Exit(code=2)
        drafter_path = str(found)
    launch = ServerLaunch(model_path=target, port=port, host=host, device=device, dtype=dtype,
                          drafter_path=drafter_path, overlap=overlap)
    if print_command:
        typer.echo(launch.shell_line())
        return
    typer.echo(f"starting: {launch.shell_line()}", err=True)
    raise typer.Exit(code=subprocess.call(launch.command(), env=launch.env()))
