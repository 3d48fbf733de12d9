"""What reaches the terminal, and what goes to the build log.

"Ours" means: log records from loggers under `laco_deploy` and `exporters`, the progress bars made
by `laco_deploy.progress`, and what the commands print themselves (stage lines on stderr, results
and summaries on stdout). By default the terminal shows only that: third-party logs (gguf's writer,
transformers, matplotlib, ...), third-party progress bars (transformers' "Loading weights") and
Python warnings are silenced. Warnings that matter are rephrased by our code, once, in its own words.

    --quiet    our warnings and errors only; no progress bars or stage lines
    (default)  our INFO lines (message only), progress bars, stage lines; others' errors
    --verbose  everything at INFO with logger names, third-party bars and Python warnings included
    --debug    everything at DEBUG (and tracebacks instead of one-line errors)

`build` also writes the full detail to `<out>/build.log`: our DEBUG records, every library's INFO
and up (DEBUG with --debug), Python warnings, timestamps.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Iterator

from laco_deploy.cli import flags

OURS = ("laco_deploy", "exporters")  # top-level packages whose loggers are ours
FILE_ONLY = {"file_only": True}  # `extra=` for records meant for the build log, not the terminal
_DETAIL_FORMAT = "%(levelname)s %(name)s: %(message)s"


class Verbosity(enum.IntEnum):
    QUIET = 0
    NORMAL = 1
    VERBOSE = 2
    DEBUG = 3


# (lowest level shown for our loggers, for everyone else's) on the terminal
_TERMINAL_LEVELS = {
    Verbosity.QUIET: (logging.WARNING, logging.ERROR),
    Verbosity.NORMAL: (logging.INFO, logging.ERROR),
    Verbosity.VERBOSE: (logging.INFO, logging.INFO),
    Verbosity.DEBUG: (logging.DEBUG, logging.DEBUG),
}
_current = Verbosity.NORMAL


def is_ours(logger_name: str) -> bool:
    return logger_name.split(".", 1)[0] in OURS


class _TerminalFilter(logging.Filter):
    def __init__(self, ours: int, others: int):
        super().__init__()
        self.ours, self.others = ours, others

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "file_only", False):
            return False
        return record.levelno >= (self.ours if is_ours(record.name) else self.others)


class _FlagsFormatter(logging.Formatter):
    """Our records name settings (prune.offload); the terminal and build.log show the running command's flags."""

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        return flags.user_text(message) if is_ours(record.name) else message


class _PlainFormatter(_FlagsFormatter):
    """Our INFO lines as bare messages; warnings and errors prefixed `warning:` / `error:`, and with the
    logger's name when another library's error gets through."""

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        if not is_ours(record.name):
            message = f"{record.name}: {message}"
        return message if record.levelno < logging.WARNING else f"{record.levelname.lower()}: {message}"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (pytest swaps it per test)."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr


def configure(level: Verbosity) -> None:
    """Set up the terminal handler, Python warnings and third-party output for one CLI run."""
    global _current
    _current = level
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, "laco_terminal", False)]:
        root.removeHandler(handler)
    terminal = _StderrHandler()
    terminal.laco_terminal = True  # type: ignore[attr-defined]
    terminal.addFilter(_TerminalFilter(*_TERMINAL_LEVELS[level]))
    terminal.setFormatter(_FlagsFormatter(_DETAIL_FORMAT) if level >= Verbosity.VERBOSE else _PlainFormatter("%(message)s"))
    root.addHandler(terminal)
    root.setLevel(min(_TERMINAL_LEVELS[level]))
    logging.captureWarnings(True)  # Python warnings become records of the third-party `py.warnings` logger
    from laco_deploy import progress

    progress.set_enabled(level > Verbosity.QUIET)
    _third_party(level)


def _third_party(level: Verbosity) -> None:
    """Quiet (or not) the libraries that print through handlers and bars of their own.

    Before they are imported, environment variables suffice (read at import time and inherited by our
    child processes), so a command that never loads a model does not pay for importing them. Once
    imported, `route_libraries` sends their records through the root logger and its filters.
    """
    bars = level >= Verbosity.VERBOSE
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "0" if bars else "1"
    os.environ["TRANSFORMERS_VERBOSITY"] = {Verbosity.VERBOSE: "info", Verbosity.DEBUG: "debug"}.get(level, "error")
    if not bars:
        os.environ["TORCH_LOGS"] = "-all"  # torch's own handler: errors only (a user's TORCH_LOGS wins with --verbose)
    elif os.environ.get("TORCH_LOGS") == "-all":
        del os.environ["TORCH_LOGS"]
    route_libraries()


def route_libraries() -> None:
    """Send the log records of transformers and torch, where imported, through the root logger (so the
    terminal filter and the build log see them) instead of their own stderr handlers; set their bars."""
    bars = _current >= Verbosity.VERBOSE
    if "transformers" in sys.modules:
        import transformers.utils.logging as tf_logging

        tf_logging.disable_default_handler()
        tf_logging.enable_propagation()
        tf_logging.set_verbosity(logging.DEBUG if _current >= Verbosity.DEBUG else logging.INFO)
    with warnings.catch_warnings():  # the hub warns when its environment variable, read at import, overrules us
        warnings.simplefilter("ignore")
        if "huggingface_hub" in sys.modules:
            from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

            (enable_progress_bars if bars else disable_progress_bars)()
        if "transformers" in sys.modules:
            (tf_logging.enable_progress_bar if bars else tf_logging.disable_progress_bar)()
    if "torch" in sys.modules:
        for name, logger in list(logging.root.manager.loggerDict.items()):
            if (name == "torch" or name.startswith("torch.")) and isinstance(logger, logging.Logger) and logger.handlers:
                for handler in [h for h in logger.handlers if type(h) is logging.StreamHandler]:
                    logger.removeHandler(handler)
                logger.propagate = True
        logging.getLogger("torch").setLevel(logging.DEBUG if _current >= Verbosity.DEBUG else logging.WARNING)


@contextlib.contextmanager
def log_file(path: Path) -> Iterator[Path]:
    """Append the full detail to `path` while the block runs: our DEBUG records, every library's INFO
    and up (their DEBUG too with --debug), Python warnings, with timestamps. In a torchrun job only
    rank 0 writes it."""
    from laco_deploy import distributed

    path = Path(path)
    if not distributed.is_main():
        yield path
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(_FlagsFormatter("%(asctime)s " + _DETAIL_FORMAT))
    root = logging.getLogger()
    ours = [logging.getLogger(name) for name in OURS]
    previous = root.level, [logger.level for logger in ours]
    root.addHandler(handler)
    root.setLevel(min(root.level, logging.INFO))
    for logger in ours:
        logger.setLevel(logging.DEBUG)
    import transformers.utils.logging  # noqa: F401  (imported now so that its records reach the file from the start)

    route_libraries()
    try:
        yield path
    except BaseException as e:  # the terminal gets one line; the file keeps the traceback
        logging.getLogger("laco_deploy.cli").error("stopped by %s: %s", type(e).__name__, e, exc_info=True, extra=FILE_ONLY)
        raise
    finally:
        root.removeHandler(handler)
        root.setLevel(previous[0])
        for logger, level in zip(ours, previous[1]):
            logger.setLevel(level)
        handler.close()


def say(text: str, styled: str | None = None) -> None:
    """A line of our own progress (stage started, reused, done): on stderr unless --quiet, and in the build log."""
    from laco_deploy.cli.common import err_console

    logging.getLogger("laco_deploy.cli").info(text, extra=FILE_ONLY)
    if _current > Verbosity.QUIET:
        err_console.print(styled or text, highlight=False, soft_wrap=True)
