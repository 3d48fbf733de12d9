"""One call run in a fresh child process, so that what it imports and leaves in the heap goes with it.

Why: a build's ONNX exports left torch.onnx's tracer, onnxscript and onnx_ir imported and their
freed heap resident; the fidelity stage after them started at 942 MiB and peaked at 1,816, where the
same stage in a fresh process peaked at 1,418 (benchmarks/RESULTS.md, issue 33). In the child the
call logs through the parent's handlers, raises the parent's exception types, and reports its
peak resident set. The parent stays resident meanwhile: `memory.measure` counts both (the parent's
resident set plus the pages only the child maps, sampled), and the child's own peak where higher.
"""

from __future__ import annotations

import logging
import logging.handlers
import multiprocessing
import resource
import signal
from typing import Any, Callable

import torch

from laco_deploy.errors import ResourceError
from laco_deploy.memory import note_child_peak

_CLEANUP_S = 60  # how long an interrupted child may take to remove its partial files


def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) in a spawned process (fn, its arguments and result picklable) -> its result;
    its exception is raised here. Ctrl-C or SIGTERM here stops the child, which cleans up as it would."""
    ctx = multiprocessing.get_context("spawn")  # fork would copy this process's heap, the thing to avoid
    records = ctx.Queue()
    receive, send = ctx.Pipe(duplex=False)
    root = logging.getLogger()
    listener = logging.handlers.QueueListener(records, *root.handlers, respect_handler_level=True)
    child = ctx.Process(target=_child, args=(send, records, root.level, torch.get_num_threads(), fn, args, kwargs))
    listener.start()
    try:
        child.start()
        send.close()
        try:
            outcome, value, peak_bytes = receive.recv()
        except EOFError:
            child.join()
            raise _died(fn, child.exitcode) from None
        child.join()
    finally:
        if child.is_alive():  # interrupted here: the child unwinds like the CLI (partial files removed)
            child.terminate()
            child.join(_CLEANUP_S)
        listener.stop()
        records.close()
    note_child_peak(peak_bytes)
    if outcome == "error":
        raise value
    return value


def _died(fn: Callable[..., Any], exitcode: int | None) -> Exception:
    name = getattr(fn, "__qualname__", repr(fn))
    if exitcode == -signal.SIGKILL:
        return ResourceError(f"the child process running {name} was killed (SIGKILL), most likely out of memory; "
                             "free memory or run the step alone (its own laco-deploy command)")
    return RuntimeError(f"the child process running {name} ended without a result (exit code {exitcode})")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _child(send, records, level: int, threads: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    signal.signal(signal.SIGTERM, _interrupt)  # the parent's terminate(): unwind, removing partial files
    root = logging.getLogger()
    root.handlers[:] = [logging.handlers.QueueHandler(records)]
    root.setLevel(level)
    logging.captureWarnings(True)  # Python warnings as records too: the parent's filters decide what shows
    torch.set_num_threads(threads)
    try:
        outcome = ("ok", fn(*args, **kwargs))
    except BaseException as e:  # noqa: BLE001 - every exception, Ctrl-C included, goes to the parent
        outcome = ("error", e)
    peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        send.send((*outcome, peak_bytes))
    except Exception as e:  # noqa: BLE001 - an exception or result that does not pickle
        send.send(("error", RuntimeError(f"{type(outcome[1]).__name__}: {outcome[1]} (not picklable: {e})"), peak_bytes))
    finally:
        records.close()
        records.join_thread()
