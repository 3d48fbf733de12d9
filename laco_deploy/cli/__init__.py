"""The `laco-deploy` command line. The only place that prints or exits.

Each command lives in its own module (one per stage) and registers itself on `app` (cli/app.py).
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

# the app (cli/app.py), then every command module registering on it (stages.py), then their help epilogs
from laco_deploy import distributed
from laco_deploy.cli import flags, helptext, stages  # noqa: F401
from laco_deploy.cli.app import app
from laco_deploy.cli.common import err_console, state
from laco_deploy.errors import LacoError, ResourceError
from laco_deploy.fsutil import disk_full
from laco_deploy.memory import map_large_allocations

helptext.attach(app)


TYPER_INTERRUPT_CODE = 130  # typer turns KeyboardInterrupt into Exit(130), which app() returns
_terminated = False  # set by the SIGTERM handler, so the interrupt path can exit 143 instead of 130


def _on_sigterm(signum, frame) -> None:
    """SIGTERM (a cancelled CI job, `docker stop`, `kill`) unwinds like Ctrl-C, removing partial files."""
    global _terminated
    _terminated = True
    raise KeyboardInterrupt


def _interrupted() -> None:
    if distributed.claim_report():
        again = ("rerun with --resume to continue where it stopped" if flags.running_has("--resume")
                 else "rerun the command to start it again")
        err_console.print(f"interrupted: partial files were removed; {again}")
    sys.exit(143 if _terminated else 130)


def _report(message: str, code: int) -> None:
    """Print one error line and exit. In a torchrun job only the first rank to fail prints (the
    others fail because of it, or with the same error), prefixed with its rank."""
    if distributed.claim_report():
        where = distributed.describe()
        err_console.print(f"{where}: {message}" if where else message, highlight=False, soft_wrap=True)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the app, map errors to messages and exit codes."""
    global _terminated
    _terminated = False
    args = sys.argv[1:] if argv is None else argv
    map_large_allocations()  # before any model is read: freed stages must leave the footprint
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if on_main_thread else None
    try:
        _run(args)
    finally:
        if on_main_thread and previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run(args: list[str]) -> None:
    try:
        distributed.init_from_env()  # a no-op unless torchrun started more than one process
        code = app(args=args, prog_name="laco-deploy", standalone_mode=False)
    except LacoError as e:
        if state.debug:
            raise
        _report(f"[bold red]error:[/] {flags.user_text(str(e))}", e.exit_code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except click_exceptions.ClickException as e:
        if distributed.claim_report():
            e.show()
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        _interrupted()
    except Exception as e:  # a bug, not a user error: one line unless --debug
        if state.debug:
            raise
        if disk_full(e):  # a library's own wrapper around ENOSPC: still the user's to fix
            resume = ", adding --resume" if flags.running_has("--resume") else ""
            _report("[bold red]error:[/] no space left on the device while writing results; free disk space (or "
                    f"write to another disk) and rerun{resume}", ResourceError.exit_code)
        _report(f"[bold red]internal error:[/] {type(e).__name__}: {e} (rerun with --debug for the traceback and please report it)", 3)
    finally:
        distributed.teardown()
    if code == TYPER_INTERRUPT_CODE:
        _interrupted()
    sys.exit(code if isinstance(code, int) else 0)
