"""llama.cpp's own log lines, routed into Python logging at the right level.

llama-cpp-python installs a log callback that maps ggml's levels with an old table (2 = warning,
3 = error), while the llama.cpp it builds numbers them 1 debug, 2 info, 3 warn, 4 error, 5 continue.
So every llama.cpp warning passed its "errors only" filter and reached the terminal, e.g.
`llama_kv_cache_iswa: using full-size SWA cache` on every Gemma 2/3 model (a note that the sliding-
window layers keep a full-size cache; harmless here). This callback replaces it: llama.cpp's errors
become ERROR records of the `llama_cpp` logger (shown), its warnings INFO (the build log keeps them,
the terminal shows them with --verbose) and everything else DEBUG.

A Ctrl-C (or SIGTERM) that Python delivers while this callback runs would be raised inside it, and
ctypes drops exceptions raised in callbacks: the interrupt was lost. The callback keeps it instead,
and `raise_pending_interrupt()`, called after each llama.cpp call, raises it once C has returned.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("llama_cpp")

# ggml_log_level of the llama.cpp that llama-cpp-python 0.3.x builds (ggml.h)
_LEVELS = {0: logging.DEBUG, 1: logging.DEBUG, 2: logging.DEBUG, 3: logging.INFO, 4: logging.ERROR}
_CONTINUE = 5
_state = {"callback": None, "level": logging.DEBUG, "interrupted": False}


def _emit(level: int, text: bytes, _user_data) -> None:
    try:
        if _state["interrupted"]:
            return
        py_level = _state["level"] if level == _CONTINUE else _LEVELS.get(level, logging.DEBUG)
        _state["level"] = py_level
        message = text.decode("utf-8", errors="replace").rstrip()
        if message and log.isEnabledFor(py_level):
            log.log(py_level, "%s", message)
    except KeyboardInterrupt:  # ctypes would drop it: kept for raise_pending_interrupt
        _state["interrupted"] = True


def raise_pending_interrupt() -> None:
    """Raise the KeyboardInterrupt that arrived during the last llama.cpp call, if one did."""
    if _state["interrupted"]:
        _state["interrupted"] = False
        raise KeyboardInterrupt


def route_native_logs() -> None:
    """Install the callback (once per process; after `import llama_cpp`, which installs its own)."""
    if _state["callback"] is not None:
        return
    import llama_cpp

    callback = llama_cpp.llama_log_callback(_emit)
    _state["callback"] = callback  # ctypes calls it from C: it must outlive this function
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
