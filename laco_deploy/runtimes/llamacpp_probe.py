"""Does llama.cpp's CPU weight repacking (AMX / repack "extra buffer types") work on this machine?

llama-cpp-python built with -march=native enables Intel AMX kernels when the CPU reports AMX.
Some virtual machines report AMX but fault on its instructions (`ldtilecfg` -> general
protection fault, the process dies with SIGSEGV), which kills any run on a quantized model.
`extra_buffers_work()` finds out once per process by evaluating a tiny synthetic Q8_0 model in
a child process; when the child crashes, runners load models with `use_extra_bufts = false`
(plain ggml CPU kernels: correct, somewhat slower) and the benchmark says so.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

_PATCH_LOCK = threading.Lock()
EXTRA_BUFFERS_NOTE = ("llama.cpp's AMX/repack kernels crash on this machine (the CPU reports AMX but the VM faults on it); "
                      "models were run with extra buffer types disabled (plain ggml CPU kernels)")


def write_probe_model(path: Path) -> None:
    """A 1-layer Llama (hidden 64, Q8_0 matrices, 259-token byte vocabulary) written with the gguf package."""
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
                      + [gguf.TokenType.BYTE] * 256)
    shapes = {"token_embd.weight": (259, 64), "blk.0.attn_q.weight": (64, 64), "blk.0.attn_k.weight": (64, 64),
              "blk.0.attn_v.weight": (64, 64), "blk.0.attn_output.weight": (64, 64),
              "blk.0.ffn_gate.weight": (128, 64), "blk.0.ffn_up.weight": (128, 64), "blk.0.ffn_down.weight": (64, 128)}
    for name, shape in shapes.items():
        data = rng.normal(0, 0.05, shape).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        w.add_tensor(name, np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _probe_child(path: str) -> None:
    """Runs in the child: load with llama.cpp's defaults and decode a few tokens."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_ctx=32, n_batch=32, verbose=False)
    llm.eval([1, 10, 20, 30])
    llm.eval([40])


@functools.cache
def extra_buffers_work() -> bool:
    """True when llama.cpp's default CPU kernels (with AMX/repack) run a Q8_0 model without crashing."""
    with tempfile.TemporaryDirectory(prefix="laco-llamacpp-probe-") as work:
        path = Path(work) / "probe.gguf"
        write_probe_model(path)
        code = f"from laco_deploy.runtimes.llamacpp_probe import _probe_child; _probe_child({str(path)!r})"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=_child_env())
    if proc.returncode != 0:
        how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
        log.warning("llama.cpp's AMX/repack CPU kernels crash on this machine (a test run died with %s); running "
                    "GGUF models on its plain CPU kernels instead (correct, somewhat slower)", how)
    return proc.returncode == 0


def _child_env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


@contextlib.contextmanager
def model_params(use_extra_bufts: bool):
    """Make llama_cpp.Llama load with `use_extra_bufts` set (it has no argument for it)."""
    import llama_cpp.llama_cpp as lib

    if use_extra_bufts:
        yield
        return
    with _PATCH_LOCK:
        original = lib.llama_model_default_params

        def patched():
            params = original()
            params.use_extra_bufts = False
            return params

        lib.llama_model_default_params = patched
        try:
            yield
        finally:
            lib.llama_model_default_params = original
