"""onnxruntime runner and benchmark: scoring math, provider selection, errors, a tiny benchmark."""

from __future__ import annotations

import json
import math

import numpy as np
import onnxruntime as ort
import pytest
import torch

from laco_deploy.bench.harness import window_nll
from laco_deploy.bench.onnxrt_bench import eval_tokens, run_benchmark
from laco_deploy.config import BenchConfig
from laco_deploy.errors import RuntimeBackendError
from laco_deploy.runtimes.cpu import physical_cores
from laco_deploy.runtimes.onnxrt import OrtRunner, providers_for

HAS_CUDA_EP = "CUDAExecutionProvider" in ort.get_available_providers()


def test_second_half_nll_matches_cross_entropy():
    """llama-perplexity: logits at positions ctx/2 .. ctx-2 score tokens ctx/2+1 .. ctx-1."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(10, 7, generator=gen) * 3
    tokens = torch.randint(0, 7, (10,), generator=gen)
    nll = window_nll(logits.numpy(), tokens.tolist(), first=5)
    ref = torch.nn.functional.cross_entropy(logits[5:9], tokens[6:10], reduction="sum")
    assert nll.shape == (4,) and nll.sum() == pytest.approx(ref.item(), rel=1e-6)


def test_physical_cores_and_cpu_provider():
    assert 1 <= physical_cores() <= (torch.get_num_threads() * 4 or 1024)
    assert providers_for("cpu") == (["CPUExecutionProvider"], "cpu", 0)


@pytest.mark.skipif(HAS_CUDA_EP, reason="this onnxruntime has the CUDA provider")
def test_cuda_without_the_gpu_build_is_a_clear_error():
    with pytest.raises(RuntimeBackendError, match=r"device cuda:1 .*CUDAExecutionProvider.*laco-deploy\[gpu\]"):
        providers_for("cuda:1")


@pytest.mark.skipif(not HAS_CUDA_EP, reason="needs onnxruntime-gpu")
def test_cuda_provider_options():
    providers, kind, dev = providers_for("cuda:1")
    assert providers[0] == ("CUDAExecutionProvider", {"device_id": 1}) and (kind, dev) == ("cuda", 1)


def test_bad_device_and_missing_model(tmp_path):
    with pytest.raises(RuntimeBackendError, match="'tpu'"):
        providers_for("tpu")
    with pytest.raises(RuntimeBackendError, match="no ONNX model"):
        OrtRunner(tmp_path)
    (tmp_path / "model.onnx").write_bytes(b"not a graph")
    with pytest.raises(RuntimeBackendError, match="cannot load"):
        OrtRunner(tmp_path)


@pytest.fixture(scope="module")
def tiny_export(tiny_llama_dir, tmp_path_factory):
    from exporters.onnx import export

    out = tmp_path_factory.mktemp("bench") / "tiny-onnx"
    export(tiny_llama_dir, out, "fp32")
    return out


CFG = BenchConfig(repetitions=2, n_prompt=48, n_gen=8, ppl_ctx=32, ppl_windows=3)


@pytest.fixture(scope="module")
def bench_result(tiny_export):
    return run_benchmark({"ref": tiny_export, "again": tiny_export / "model.onnx"}, eval_spec="builtin", cfg=CFG)


def test_benchmark_metrics(bench_result, tiny_export):
    r = bench_result
    assert r.runtime == "onnxruntime" and list(r.models) == ["ref", "again"]
    assert r.environment["provider"] == "CPUExecutionProvider" and r.environment["threads"] == physical_cores()
    for m in r.models.values():
        for key in ("pp_tps", "tg_tps", "ttft_s", "load_s"):
            assert set(m[key]) == {"median", "spread"} and m[key]["median"] > 0 and m[key]["spread"] >= 0
        assert m["ppl_windows"] == 3 and m["ppl_tokens"] == 3 * (32 - 16 - 1)
        assert m["peak_rss_mib"] > m["base_rss_mib"] > 0
        files = (tiny_export / "model.onnx").stat().st_size + (tiny_export / "model.onnx_data").stat().st_size
        assert m["size_mib"] * 2**20 == pytest.approx(files)
        assert m["provider"] == "CPUExecutionProvider" and m["quant"] == "fp32"
    assert r.models["ref"]["tg_speedup"] == 1.0
    assert r.models["ref"]["ppl"] == pytest.approx(r.models["again"]["ppl"], rel=1e-9)
    assert str(CFG.ppl_ctx) in r.protocol["perplexity"] and r.protocol["repetitions"] == 2


def test_benchmark_perplexity_equals_pytorch(bench_result, tiny_llama_dir, tiny_export):
    """The same windows scored by the PyTorch model give the same perplexity."""
    from laco_deploy.models import load_model

    model = load_model(str(tiny_llama_dir)).model
    total, count = 0.0, 0
    for window in eval_tokens(tiny_export, "builtin", CFG)["windows"]:
        ids = torch.tensor(window)
        with torch.no_grad():
            logits = model(ids.view(1, -1)).logits[0].numpy()
        nll = window_nll(logits, window, len(window) // 2)
        total, count = total + nll.sum(), count + nll.size
    assert bench_result.models["ref"]["ppl"] == pytest.approx(math.exp(total / count), rel=1e-4)


def test_bench_cli(cli, tiny_export, tmp_path):
    out = tmp_path / "bench.json"
    code, stdout, err = cli("bench", "run", f"tiny={tiny_export}", "--runtime", "onnxruntime", "--repetitions", "1",
                            "--n-prompt", "16", "--n-gen", "4", "--ppl-ctx", "32", "--ppl-windows", "1", "--out", out)
    assert code == 0, err
    assert "| tiny |" in stdout and "runtime: onnxruntime" in stdout
    data = json.loads(out.read_text())
    assert data["models"]["tiny"]["tg_tps"]["median"] > 0


@pytest.mark.skipif(HAS_CUDA_EP, reason="this onnxruntime has the CUDA provider")
def test_bench_cli_errors(cli, tiny_export, tmp_path):
    code, out, err = cli("bench", "run", f"tiny={tiny_export}", "--runtime", "onnxruntime", "--device", "cuda")
    assert code == 2 and "onnxruntime-gpu" in out + err
    (tmp_path / "empty").mkdir()
    code, out, err = cli("bench", "run", f"x={tmp_path / 'empty'}", "--runtime", "onnxruntime")
    assert code == 2 and "no ONNX model" in out + err


def test_generate_stops_at_eos(tiny_export):
    runner = OrtRunner(tiny_export)
    prompt = np.arange(10, 20)
    free = runner.generate(prompt, 6)
    assert len(free) == 6
    stopped = runner.generate(prompt, 6, eos_token_id=free[2])
    assert stopped == free[: free.index(free[2]) + 1]


def test_logits_written_into_our_array_equal_onnxruntimes_own(tiny_export):
    """The logits output bound to a numpy buffer of ours (one copy of [seq, vocab], not two) holds the
    values onnxruntime returns when it allocates the output itself; decode steps too."""
    decoder = OrtRunner(tiny_export).decoder
    assert decoder.logits_vocab is not None  # the exporter names the vocabulary: the buffer path runs
    ids = np.arange(5, 29)
    ours, past = decoder.prefill(ids)
    step_ours, _ = decoder.step(7, len(ids), past)
    decoder.logits_vocab = None
    theirs, past = decoder.prefill(ids)
    step_theirs, _ = decoder.step(7, len(ids), past)
    assert ours.shape == theirs.shape == (len(ids), decoder.session.get_outputs()[0].shape[-1])
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(step_ours, step_theirs)
