"""llama.cpp (llama-cpp-python) as a CausalRunner.

`LlamaCppRunner(path).logits(ids)` gives next-token logits from a GGUF file (fidelity and the
export parity check use it). The benchmark's adapter is bench/llamacpp_bench.py.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from pathlib import Path

import numpy as np

from laco_deploy.errors import ConfigError, RuntimeBackendError
from laco_deploy.runtimes.cpu import physical_cores
from laco_deploy.runtimes.llamacpp_log import raise_pending_interrupt, route_native_logs
from laco_deploy.runtimes.llamacpp_probe import extra_buffers_work, model_params
from laco_deploy.targets import GGUF

log = logging.getLogger(__name__)

RUNNER_N_CTX = 512  # context of a logits runner; sequences longer than this are refused
# llama.cpp's logits for one decode call: a window is decoded this many bytes of [tokens, vocab] float32
# at a time (64 tokens at Gemma's 262k vocabulary, a whole 256-token window at SmolLM2's 49k), so that
# llama.cpp's output buffer holds a block of rows, not a window's worth
LOGIT_BLOCK_BYTES = 64 * 2**20


_LIVE: "weakref.WeakSet[LlamaCppRunner]" = weakref.WeakSet()


@atexit.register
def _close_live_runners() -> None:
    """Free llama.cpp models before interpreter teardown (llama-cpp-python's __del__ fails late)."""
    for runner in list(_LIVE):
        runner.close()


def check_gguf_file(path: Path) -> None:
    if not path.is_file():
        raise RuntimeBackendError(f"GGUF file {path} not found; export one with export.target gguf")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise RuntimeBackendError(f"{path} is not a GGUF file (magic {magic!r}); re-export it with export.target gguf")


class LlamaCppRunner:
    """A GGUF model in llama.cpp. logits: input_ids [seq] int64 -> [seq, vocab] float32 (CPU)."""

    name = GGUF.runtime

    def __init__(self, path: Path, threads: int | None = None, n_ctx: int = RUNNER_N_CTX, *,
                 logits_all: bool = True, n_gpu_layers: int = 0, extra_buffers: bool | None = None):
        """extra_buffers: use llama.cpp's AMX/repack CPU kernels; None probes once whether they work here."""
        self.path = Path(path)
        check_gguf_file(self.path)
        try:
            import llama_cpp
        except ImportError as e:
            raise RuntimeBackendError("llama.cpp needs llama-cpp-python: pip install llama-cpp-python") from e
        route_native_logs()  # llama.cpp's warnings into logging, not straight onto the terminal
        self.threads = threads or physical_cores()
        self.n_ctx = n_ctx
        self.extra_buffers = extra_buffers_work() if extra_buffers is None else extra_buffers
        try:
            with model_params(use_extra_bufts=self.extra_buffers):
                self.llm = llama_cpp.Llama(model_path=str(self.path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                                           n_threads=self.threads, n_threads_batch=self.threads,
                                           logits_all=logits_all, n_gpu_layers=n_gpu_layers, verbose=False)
            raise_pending_interrupt()
        except (ValueError, RuntimeError, OSError) as e:
            raise RuntimeBackendError(f"llama.cpp cannot load {self.path} ({e}); the file is corrupt, truncated or made "
                                      "for a newer llama.cpp: re-export it or upgrade llama-cpp-python") from e
        _LIVE.add(self)
        self.n_vocab = self.llm.n_vocab()
        self.add_bos = bool(self.llm._model.add_bos_token())
        self.bos_id = int(self.llm.token_bos())

    def _check_ids(self, ids: list[int]) -> None:
        if len(ids) > self.n_ctx:
            raise ConfigError(f"sequence of {len(ids)} tokens exceeds the llama.cpp context of {self.n_ctx}; "
                              f"use shorter windows or LlamaCppRunner(..., n_ctx={len(ids)})")
        bad = [i for i in ids if not 0 <= i < self.n_vocab]
        if bad:
            raise ConfigError(f"token id {bad[0]} is outside the vocabulary of {self.path.name} ({self.n_vocab}); "
                              "tokenize with this model's tokenizer")

    def logits(self, input_ids):
        """input_ids: torch.Tensor [seq] int64 -> torch.Tensor [seq, vocab] float32."""
        import torch

        return torch.from_numpy(self.logits_np([int(i) for i in input_ids.reshape(-1).tolist()]))

    def logits_np(self, ids: list[int]) -> np.ndarray:
        """The same without torch (the benchmark worker does not import it). [seq, vocab] float32.

        Decoded in blocks of `block_rows()` tokens, each block's logits copied straight from llama.cpp's
        output buffer into the result: llama-cpp-python's own `scores` array ([n_ctx, vocab], what
        `Llama.eval` fills) is never touched, so the only window-sized array is the one returned."""
        if not self.llm._logits_all:
            raise ConfigError("this LlamaCppRunner was built with logits_all=False; build it with logits_all=True")
        self._check_ids(ids)
        llm, rows = self.llm, self.block_rows()
        out = np.empty((len(ids), self.n_vocab), dtype=np.float32)
        llm.reset()
        llm._ctx.kv_cache_seq_rm(-1, 0, -1)
        for start in range(0, len(ids), rows):
            block = ids[start : start + rows]
            llm._batch.set_batch(batch=block, n_past=start, logits_all=True)
            llm._ctx.decode(llm._batch)
            raise_pending_interrupt()
            out[start : start + len(block)] = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(len(block), self.n_vocab))
        llm.n_tokens = 0  # the runner's own decode bypassed Llama.eval's bookkeeping: start clean next time
        return out

    def block_rows(self) -> int:
        """Tokens per decode call in `logits_np`: LOGIT_BLOCK_BYTES of logits, at most the batch size."""
        return max(1, min(self.llm.n_batch, LOGIT_BLOCK_BYTES // (4 * self.n_vocab)))

    def last_logits(self) -> np.ndarray:
        """Logits after the last evaluated token. [vocab] float32 (a view into llama.cpp's buffer)."""
        return np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.n_vocab,))

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """llama.cpp's own tokenizer; BOS/EOS added exactly when the model says so (add_special);
        parse_special: turn special-token text such as <|im_start|> into its id (as HF does)."""
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special))

    def metadata(self) -> dict[str, str]:
        return dict(self.llm.metadata)

    def close(self) -> None:
        """Free the model and context (idempotent)."""
        self.llm.close()
        _LIVE.discard(self)
