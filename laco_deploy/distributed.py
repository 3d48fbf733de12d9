"""Data-parallel runs under `torchrun`: process group, rank helpers, sample shards, reductions.

A job launched by `torchrun --nproc-per-node N laco-deploy ...` runs the same code in N processes.
Calibration samples (and evaluation windows) are split into contiguous shards, one per rank; each
rank walks the layers over its own shard and the steps sum what depends on all samples (input
statistics, gradients, losses, metric sums) with the helpers here. Rank 0 writes every file.

Without WORLD_SIZE > 1 in the environment nothing is initialised and every helper is a no-op
(world 1, rank 0, the whole range as the shard), so a single process runs exactly today's code.
Backends: gloo for CPU tensors, NCCL for CUDA tensors (both registered when CUDA is present).
A collective that fails (a peer died) or times out raises PeerError, a LacoError, so the CLI ends
the rank with one line; `claim_report` lets only the first failing rank print it.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from laco_deploy.config import DIST_TIMEOUT_S
from laco_deploy.errors import ConfigError, LacoError

log = logging.getLogger(__name__)
TIMEOUT_ENV = "LACO_DIST_TIMEOUT_S"
_REPORT_KEY = "laco_deploy/error_reported"


class PeerError(LacoError):
    """A collective failed: another rank died, or a rank did not arrive within the timeout."""

    exit_code = 3


def _dist():
    import torch.distributed as dist

    return dist


def active() -> bool:
    """Whether this process is one rank of a multi-process job."""
    dist = _dist()
    return dist.is_available() and dist.is_initialized()


def world() -> int:
    return _dist().get_world_size() if active() else 1


def rank() -> int:
    return _dist().get_rank() if active() else 0


def is_main() -> bool:
    """Rank 0 writes checkpoints, outputs and reports, and prints results."""
    return rank() == 0


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0")) if active() else 0


def timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return float(DIST_TIMEOUT_S)
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ConfigError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
    return value


def init_from_env() -> bool:
    """Join the torchrun job described by the environment (RANK, WORLD_SIZE, MASTER_ADDR, ...).

    Only when WORLD_SIZE > 1; returns whether a process group is active. Each rank on a CUDA
    machine takes GPU LOCAL_RANK, so NCCL and `--device auto` agree on it.
    """
    if active():
        return True
    try:
        size = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError as e:
        raise ConfigError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number; launch with torchrun") from e
    if size <= 1:
        return False
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ConfigError(f"WORLD_SIZE={size} but {', '.join(missing)} not set; launch multi-process jobs with torchrun")
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        backend = "cpu:gloo,cuda:nccl"
    dist = _dist()
    try:
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s()))
    except (RuntimeError, ValueError) as e:
        raise PeerError(f"could not join the torchrun job (rank {os.environ.get('RANK')} of {size}): {e}") from e
    log.debug("rank %d of %d joined (%s)", rank(), world(), backend)
    return True


def teardown() -> None:
    """Leave the job. Collected before and after so that no gloo work object (or tensor it holds)
    is left for interpreter finalization, where freeing it can abort the process."""
    if active():
        gc.collect()
        _dist().destroy_process_group()
        gc.collect()


def _collective(fn, *args, **kwargs):
    """Run a collective; a dead peer or a timeout becomes PeerError (one line, no traceback)."""
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, ValueError) as e:  # DistBackendError, DistNetworkError are RuntimeErrors
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PeerError(f"rank {rank()}: another rank failed or did not answer within {timeout_s():.0f} s "
                        f"({first}); see that rank's error above") from e


def barrier() -> None:
    if active():
        _collective(_dist().barrier)


def all_reduce_(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over ranks, in place (a no-op in a single process). Returns it."""
    if active():
        _collective(_dist().all_reduce, tensor)
    return tensor


def all_reduce_floats(values: list[float]) -> list[float]:
    """Sum a few Python numbers over ranks (float64)."""
    if not active():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    all_reduce_(t)
    return t.tolist()


def all_reduce_grads(params: list[torch.nn.Parameter]) -> None:
    """Sum the gradients of `params` over ranks. A rank that saw no sample of the batch sends zeros."""
    if not active():
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        all_reduce_(p.grad)


def agree(flag: bool) -> bool:
    """Rank 0's value of `flag` on every rank: decisions that read files rank 0 writes (resume)
    must be the same everywhere, or the ranks would run different collectives and hang."""
    if not active():
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int64)
    _collective(_dist().broadcast, t, src=0)
    return bool(t.item())


def gather_all(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank (objects pass between our own processes)."""
    if not active():
        return [obj]
    out: list[Any] = [None] * world()
    _collective(_dist().all_gather_object, out, obj)
    return out


@dataclass(frozen=True)
class Shard:
    """This rank's contiguous block [start, stop) of `total` samples (all of them in one process)."""

    start: int
    stop: int
    total: int

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == self.total

    def owned(self, idx: torch.Tensor) -> torch.Tensor:
        """Bool [len(idx)]: which of the global sample indices `idx` live on this rank."""
        return (idx >= self.start) & (idx < self.stop)

    def local(self, idx: torch.Tensor) -> torch.Tensor:
        """The rows in this rank's caches of the global indices `idx` it owns, in `idx`'s order."""
        if self.whole:
            return idx
        return idx[self.owned(idx)] - self.start


def shard(total: int, what: str = "calibration samples") -> Shard:
    """This rank's block of `total` samples: sizes differ by at most one, earlier ranks larger."""
    n = world()
    if total < n:
        raise ConfigError(f"{total} {what} cannot be shared by {n} processes; use at least {n} "
                          "(data.samples / data.eval_samples) or fewer processes (torchrun --nproc-per-node)")
    r = rank()
    base, extra = divmod(total, n)
    start = r * base + min(r, extra)
    return Shard(start, start + base + (1 if r < extra else 0), total)


def rank_dir(path: Path) -> Path:
    """Per-rank scratch folder under `path` (the folder itself in a single process)."""
    return Path(path) / f"rank{rank()}" if active() else Path(path)


def claim_report() -> bool:
    """True for the first rank to report an error, so the user sees one line, not one per rank.

    Uses torchrun's key-value store; if it cannot be reached, every rank reports (better twice than never).
    """
    if not active():
        return True
    try:
        store = _dist().distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=10))
        return store.add(_REPORT_KEY, 1) == 1
    except Exception:  # noqa: BLE001 - the store lives in the launcher; it may be gone already
        return True


def describe() -> str:
    """`rank R/N` for messages of a multi-process job, '' otherwise."""
    return f"rank {rank()}/{world()}" if active() else ""
