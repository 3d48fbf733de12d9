"""Progress bars that stay readable in logs.

On a terminal tqdm redraws in place. Redirected to a file or a CI log, every redraw would be
kept, so there the bars redraw at most every 30 s and status updates do not force a redraw.
`--quiet` turns the bars off (`set_enabled`).
"""

from __future__ import annotations

import sys

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


def set_status(bar: tqdm, text: str) -> None:
    """Show `text` after the bar; redraw now only on a terminal."""
    bar.set_postfix_str(text, refresh=interactive())
