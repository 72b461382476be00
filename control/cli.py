"""The `dspark-ctl` Typer app. Each command group lives in its own module and registers here.

Commands that need torch (prepare, train, eval, bench sim) import it inside the command body, so
`import dspark_ctl` stays light enough for an operator's laptop.
"""

import typer

app = typer.Typer(no_args_is_help=True, help="Control and benchmark DSpark speculative decoding.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: JSON results, optional PNG plots.")
app.add_typer(bench_app, name="bench")

from dspark_ctl.prepare import prepare_command  # noqa: E402  (each command in its own module)

app.command("prepare")(prepare_command)

from dspark_ctl.eval import eval_command, eval_merge_command, train_curves_command  # noqa: E402
from dspark_ctl.train import data_app, train_command  # noqa: E402

app.command("train")(train_command)
app.command("eval")(eval_command)
app.command("eval-merge")(eval_merge_command)
app.command("train-curves")(train_curves_command)

from dspark_ctl.ship import ship_command  # noqa: E402

app.command("ship")(ship_command)
app.add_typer(data_app, name="data")

from dspark_ctl import bench_sim  # noqa: E402  (bench sim / planner / sps-cpu)

bench_sim.register(bench_app)

from dspark_ctl.bench_serve import bench_serve_command, sps_serve_command  # noqa: E402
from dspark_ctl.serve import serve_command  # noqa: E402

app.command("serve")(serve_command)
bench_app.command("serve")(bench_serve_command)
bench_app.command("sps-serve")(sps_serve_command)

from dspark_ctl.bench_prefix import bench_prefix_command  # noqa: E402

bench_app.command("prefix")(bench_prefix_command)


def main() -> None:
    """Console-script entry point."""
    app()
