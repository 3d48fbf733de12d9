"""The typer app and its global options. Command modules register on `app`; the package
(cli/__init__.py) imports them all and maps errors to exit codes, so no command imports it."""

from __future__ import annotations

import sys

import typer

from laco_deploy import __version__, distributed
from laco_deploy.cli import flags, output
from laco_deploy.cli.common import console, state
from laco_deploy.cli.output import Verbosity

app = typer.Typer(
    name="laco-deploy",
    help=(
        "Prune an LLM, repair it with LaCo layer-wise compensation, check its fidelity against the "
        "dense model, and ship it as GGUF (llama.cpp) or ONNX (onnxruntime).\n\n"
        "Start with `laco-deploy build --target gguf`: it runs every stage on the embedded default "
        "model (SmolLM2-135M-Instruct) and builtin text (Wikipedia + Python source). Each stage is also its own command."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        console.print(f"laco-deploy {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks and every library's debug logs."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also show other libraries' log lines, progress bars and warnings (hidden by default)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only warnings and errors on stderr (for CI); results still go to stdout."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
    threads: int = typer.Option(
        None, "--threads", min=1, envvar="LACO_DEPLOY_THREADS",
        help="PyTorch CPU threads for pruning, compensation and fidelity (default: PyTorch's, usually all "
        "cores). On a busy machine 1 is often several times faster than oversubscribed cores. "
        "Runtime benchmarks have their own --threads."),
) -> None:
    state.debug = debug
    flags.use(ctx.command, ctx.invoked_subcommand)  # library messages name settings; show this command's flags
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    level = Verbosity.DEBUG if debug else Verbosity.VERBOSE if verbose else Verbosity.QUIET if quiet else Verbosity.NORMAL
    output.configure(level if distributed.is_main() else Verbosity.QUIET)
    if not distributed.is_main():
        _silence_rank()


def _silence_rank() -> None:
    """Ranks other than 0 of a torchrun job: no logs, bars or results (rank 0 shows them once);
    their errors still reach stderr (cli/__init__.py lets the first failing rank print)."""
    import logging
    import os

    for name in ("laco_deploy", "exporters"):
        logging.getLogger(name).setLevel(logging.ERROR)
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
