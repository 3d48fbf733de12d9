"""Progress bars that stay readable in logs.

On a terminal tqdm redraws in place. Redirected to a file or a CI log, every redraw would be
kept, so there the bars redraw at most every 30 s and status updates do not force a redraw.
`--quiet` turns the bars off (`set_enabled`).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Iterator

from tqdm.auto import tqdm

LOG_INTERVAL_S = 30.0
_enabled = True


def set_enabled(enabled: bool) -> None:
    """Show progress bars (the default) or not (the CLI's --quiet)."""
    global _enabled
    _enabled = enabled


def interactive() -> bool:
    return hasattr(sys.stderr, "isatty") and sys.stderr.isatty()


def progress_bar(iterable, **kwargs) -> tqdm:
    """tqdm over `iterable`, throttled when stderr is not a terminal."""
    if not interactive():
        kwargs.setdefault("mininterval", LOG_INTERVAL_S)
    kwargs.setdefault("dynamic_ncols", True)
    kwargs.setdefault("disable", not _enabled)
    return tqdm(iterable, **kwargs)


@contextlib.contextmanager
def library_bar(module_name: str, desc: str, unit: str = "it") -> Iterator[None]:
    """Show the loop a library drives with its module-level `tqdm` as our bar named `desc`.

    For slow library steps whose bar cannot be switched off otherwise (transformers' GGUF
    dequantization uses plain tqdm); a no-op when the module or its `tqdm` is not there.
    """
    try:
        module = importlib.import_module(module_name)
    except ImportError:  # another version of the library, laid out differently
        module = None
    original = getattr(module, "tqdm", None)
    if original is None:
        yield
        return
    module.tqdm = lambda iterable=None, *args, **kwargs: progress_bar(iterable, desc=desc, unit=unit)
    try:
        yield
    finally:
        module.tqdm = original


def set_status(bar: tqdm, text: str) -> None:
    """Show `text` after the bar; redraw now only on a terminal."""
    bar.set_postfix_str(text, refresh=interactive())
