"""The `laco-deploy` command line. The only place that prints or exits.

Each command lives in its own module (one per stage) and registers itself on `app`.
Library errors (LacoError) become one line on stderr and a non-zero exit; `--debug` shows the
traceback instead.
"""

from __future__ import annotations

import signal
import sys
import threading

import typer

try:  # recent typer vendors click; older ones use the click package
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover
    from click import exceptions as click_exceptions

from laco_deploy import __version__
from laco_deploy.cli import output
from laco_deploy.cli.common import console, err_console, state
from laco_deploy.cli.output import Verbosity
from laco_deploy.errors import LacoError

app = typer.Typer(
    name="laco-deploy",
    help=(
        "Prune an LLM, repair it with LaCo layer-wise compensation, check its fidelity against the "
        "dense model, and ship it as GGUF (llama.cpp) or ONNX (onnxruntime).\n\n"
        "Start with `laco-deploy build --target gguf`: it runs every stage on the embedded default "
        "model (SmolLM2-135M-Instruct) and builtin Wikipedia text. Each stage is also its own command."
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
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    output.configure(Verbosity.DEBUG if debug else Verbosity.VERBOSE if verbose else Verbosity.QUIET if quiet else Verbosity.NORMAL)


# Register the stage commands (each module adds its command to `app`), then their examples and exit codes.
from laco_deploy.cli import helptext, stages  # noqa: E402,F401

helptext.attach(app)


TYPER_INTERRUPT_CODE = 130  # typer turns KeyboardInterrupt into Exit(130), which app() returns
_terminated = False  # set by the SIGTERM handler, so the interrupt path can exit 143 instead of 130


def _on_sigterm(signum, frame) -> None:
    """SIGTERM (a cancelled CI job, `docker stop`, `kill`) unwinds like Ctrl-C, removing partial files."""
    global _terminated
    _terminated = True
    raise KeyboardInterrupt


def _interrupted() -> None:
    err_console.print("interrupted: partial files were removed; rerun with --resume to continue where it stopped")
    sys.exit(143 if _terminated else 130)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the app, map errors to messages and exit codes."""
    global _terminated
    _terminated = False
    args = sys.argv[1:] if argv is None else argv
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if on_main_thread else None
    try:
        _run(args)
    finally:
        if on_main_thread and previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run(args: list[str]) -> None:
    try:
        code = app(args=args, prog_name="laco-deploy", standalone_mode=False)
    except LacoError as e:
        if state.debug:
            raise
        err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except click_exceptions.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        _interrupted()
    except Exception as e:  # a bug, not a user error: one line unless --debug
        if state.debug:
            raise
        err_console.print(f"[bold red]internal error:[/] {type(e).__name__}: {e} (rerun with --debug for the traceback and please report it)", highlight=False, soft_wrap=True)
        sys.exit(3)
    if code == TYPER_INTERRUPT_CODE:
        _interrupted()
    sys.exit(code if isinstance(code, int) else 0)
