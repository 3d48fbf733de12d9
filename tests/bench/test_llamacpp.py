"""llama.cpp runner and benchmark on tiny GGUF files: logits, perplexity protocol, metrics, errors."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch

from laco_deploy.config import BenchConfig
from laco_deploy.errors import ConfigError, RuntimeBackendError

pytest.importorskip("llama_cpp")
from laco_deploy.bench.harness import perplexity, plan_tokens, window_nll  # noqa: E402
from laco_deploy.bench.llamacpp_bench import run_benchmark  # noqa: E402
from laco_deploy.runtimes.llamacpp import LlamaCppRunner  # noqa: E402

TINY_BENCH = BenchConfig(repetitions=2, threads=1, n_prompt=16, n_gen=4, ppl_ctx=32, ppl_windows=2)


@pytest.fixture(scope="module")
def ggufs(tiny_llama_dir, tmp_path_factory):
    from exporters.gguf import export

    out = tmp_path_factory.mktemp("bench")
    return {"f32": export(tiny_llama_dir, out / "t.f32.gguf", "f32").path,
            "q8_0": export(tiny_llama_dir, out / "t.q8_0.gguf", "q8_0", metadata={"pattern": "unstructured"}).path}


def test_window_nll_is_next_token_cross_entropy():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 11, generator=gen)
    tokens = torch.randint(0, 11, (8,), generator=gen)
    got = window_nll(logits.numpy(), tokens.tolist(), first=4)  # positions 4..6 predict tokens 5..7
    want = torch.nn.functional.cross_entropy(logits[4:7].double(), tokens[5:8], reduction="none")
    assert got.shape == (3,) and np.allclose(got, want.numpy())


def test_runner_logits_match_pytorch(tiny_llama_dir, ggufs):
    from laco_deploy.runtimes.runner import TorchRunner, open_runner
    from laco_deploy.models import load_model

    runner = open_runner(ggufs["f32"])
    assert isinstance(runner, LlamaCppRunner) and runner.name == "llama.cpp"
    ids = torch.arange(3, 40, dtype=torch.long)
    got = runner.logits(ids)
    want = TorchRunner(load_model(str(tiny_llama_dir)).model).logits(ids)
    assert got.dtype == torch.float32 and got.shape == (37, 512)
    assert torch.allclose(got, want, atol=5e-3)  # llama.cpp keeps the KV cache in F16
    again = runner.logits(ids[:5])  # state is reset between calls
    assert torch.allclose(again, got[:5], atol=1e-5)
    with pytest.raises(ConfigError, match="exceeds the llama.cpp context"):
        runner.logits(torch.zeros(600, dtype=torch.long))
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        runner.logits(torch.tensor([1, 9999]))
    runner.close()


def test_logits_decoded_in_blocks_equal_one_decode(ggufs, monkeypatch):
    """A large vocabulary's window is decoded a few tokens at a time (llama.cpp then holds a block's
    logits, not a window's): the same logits as one decode, and the runner stays usable afterwards."""
    import laco_deploy.runtimes.llamacpp as llamacpp

    runner = LlamaCppRunner(ggufs["f32"], threads=1, n_ctx=64)
    ids = torch.arange(3, 40, dtype=torch.long)
    assert runner.block_rows() == 64  # 64 tokens x 512 vocab fit one block: one decode
    whole = runner.logits(ids)
    monkeypatch.setattr(llamacpp, "LOGIT_BLOCK_BYTES", 8 * 512 * 4)
    assert runner.block_rows() == 8
    blocked = runner.logits(ids)  # 5 decode calls: 8 + 8 + 8 + 8 + 5 tokens
    assert torch.allclose(blocked, whole, atol=1e-4) and not torch.equal(blocked[-1], blocked[-2])
    runner.llm.reset()  # the benchmark's own path (Llama.eval) after a blocked call
    runner.llm.eval(ids[:5].tolist())
    assert np.allclose(runner.last_logits(), whole[4].numpy(), atol=1e-4)
    runner.close()


def test_perplexity_follows_llama_perplexity_protocol(tiny_llama_dir, ggufs):
    from laco_deploy.runtimes.runner import TorchRunner
    from laco_deploy.data import load_texts
    from laco_deploy.models import load_model

    runner = LlamaCppRunner(ggufs["f32"], n_ctx=32)
    tokens = runner.tokenize("\n\n".join(load_texts("builtin", "eval")[:3]))
    windows = plan_tokens(tokens, None, BenchConfig(ppl_ctx=32, ppl_windows=3))["windows"]
    got = perplexity(runner.logits_np, windows)
    torch_runner = TorchRunner(load_model(str(tiny_llama_dir)).model)
    nll = []
    for i in range(3):  # the tiny BPE model adds no BOS, so windows are the plain token stream
        window = torch.tensor(tokens[i * 32 : (i + 1) * 32])
        logits = torch_runner.logits(window)
        nll.append(torch.nn.functional.cross_entropy(logits[16:31], window[17:32], reduction="none"))
    want = math.exp(torch.cat(nll).mean().item())
    assert got["ppl_windows"] == 3 and got["ppl_tokens"] == 3 * 15
    assert got["ppl"] == pytest.approx(want, rel=1e-4)
    runner.close()


def test_run_benchmark_side_by_side(ggufs):
    from laco_deploy.bench.report import bench_table

    result = run_benchmark({"dense": ggufs["f32"], "sparse": ggufs["q8_0"]}, eval_spec="builtin", cfg=TINY_BENCH)
    assert result.runtime == "llama.cpp" and result.environment["threads"] >= 1
    dense, sparse = result.models["dense"], result.models["sparse"]
    for m in (dense, sparse):
        assert m["ppl"] > 1 and m["ppl_windows"] == 2 and m["ppl_tokens"] == 2 * 15
        for key in ("pp_tps", "tg_tps", "ttft_s", "load_s"):
            assert m[key]["median"] > 0 and m[key]["spread"] >= 0
        assert m["peak_rss_mib"] >= m["base_rss_mib"] > 0 and m["size_mib"] > 0
    assert dense["tg_speedup"] == 1.0 and sparse["tg_speedup"] > 0
    assert sparse["size_mib"] < dense["size_mib"] and sparse["pattern"] == "unstructured"
    assert "16..30" in result.protocol["perplexity"]  # second half of a 32-token window
    assert any("no speed-up" in n for n in result.notes)
    assert any(n.startswith("sparse: unstructured") for n in result.notes)
    table = bench_table(result)
    assert "| dense |" in table and "| sparse |" in table and "tg vs ref" in table


def test_corrupt_and_missing_files(ggufs, tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a model at all")
    with pytest.raises(RuntimeBackendError, match="not a GGUF file"):
        LlamaCppRunner(fake)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(open(ggufs["f32"], "rb").read()[:5000])
    with pytest.raises(RuntimeBackendError, match="corrupt, truncated"):
        LlamaCppRunner(truncated)
    with pytest.raises(RuntimeBackendError, match="not found"):
        run_benchmark({"x": tmp_path / "none.gguf"}, eval_spec="builtin", cfg=TINY_BENCH)


def test_cli_bench_run(ggufs, tmp_path, cli):
    out = tmp_path / "bench.json"
    code, stdout, _ = cli("bench", "run", f"dense={ggufs['f32']}", "--runtime", "llama.cpp", "--repetitions", "1",
                          "--n-prompt", "16", "--n-gen", "4", "--ppl-ctx", "32", "--ppl-windows", "1", "--threads", "1",
                          "--out", out)
    assert code == 0 and "| dense |" in stdout
    assert json.loads(out.read_text())["models"]["dense"]["ppl_windows"] == 1
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"junk")
    code, _, err = cli("bench", "run", f"bad={bad}", "--runtime", "llama.cpp")
    assert code == 2 and "not a GGUF file" in err


def test_llama_cpp_warnings_go_to_logging_not_the_terminal(tiny_gemma3_dir, tmp_path, capfd, caplog):
    """A Gemma 3 model makes llama.cpp warn `using full-size SWA cache`; llama-cpp-python's own
    callback put it on stderr (its level table is older than llama.cpp's). Routed, it is an INFO
    record of the `llama_cpp` logger: in the build log, not on the terminal."""
    import logging

    from exporters.gguf import export
    from laco_deploy.runtimes.llamacpp import LlamaCppRunner

    path = export(tiny_gemma3_dir, tmp_path / "g3.f32.gguf", "f32").path
    capfd.readouterr()
    with caplog.at_level(logging.DEBUG, logger="llama_cpp"):
        LlamaCppRunner(path, threads=1, n_ctx=32).close()
    assert "SWA" not in capfd.readouterr().err
    swa = [r for r in caplog.records if r.name == "llama_cpp" and "full-size SWA cache" in r.message]
    assert swa and all(r.levelno == logging.INFO for r in swa)


class _InterruptOnFirstRecord(logging.Handler):
    """Raises KeyboardInterrupt from inside llama.cpp's log callback, as Python's SIGINT handler does
    when Ctrl-C arrives while C calls back into Python."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.fired = 0

    def emit(self, record):
        self.fired += 1
        if self.fired == 1:
            raise KeyboardInterrupt


def test_ctrl_c_during_a_llama_cpp_call_is_not_lost(tmp_path):
    """ctypes drops exceptions raised in callbacks: a Ctrl-C during model loading used to vanish and the
    load finished. The callback keeps it and the runner raises it once the C call returns."""
    from laco_deploy.runtimes.llamacpp_probe import write_probe_model

    path = tmp_path / "probe.gguf"
    write_probe_model(path)
    native = logging.getLogger("llama_cpp")
    handler, level = _InterruptOnFirstRecord(), native.level
    native.addHandler(handler)
    native.setLevel(logging.DEBUG)
    try:
        with pytest.raises(KeyboardInterrupt):
            LlamaCppRunner(path, threads=1, n_ctx=32)
    finally:
        native.removeHandler(handler)
        native.setLevel(level)
    assert handler.fired >= 1  # the interrupt did arrive inside the callback
    runner = LlamaCppRunner(path, threads=1, n_ctx=32)  # nothing pending is left behind
    assert runner.logits(torch.tensor([1, 10, 20])).shape == (3, 259)
    runner.close()
