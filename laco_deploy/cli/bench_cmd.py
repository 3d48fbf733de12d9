"""`laco-deploy bench` (being built; see the issue tracker)."""

from __future__ import annotations

import typer

from laco_deploy.cli import app
from laco_deploy.errors import ConfigError

bench_app = typer.Typer(help="Benchmark an exported model on its runtime, or compare two benchmark results.")
app.add_typer(bench_app, name="bench")


@bench_app.command("run")
def bench_run() -> None:
    """Not available yet in this build."""
    raise ConfigError("'bench' is not available yet in this version")
