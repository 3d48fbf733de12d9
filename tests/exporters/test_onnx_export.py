"""ONNX export (fp32) of a tiny Llama: layout, graph signature, KV-cache decoding, padding,
greedy generation, metadata, runner and the errors for bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from exporters import onnx as onnx_exporter
from exporters.onnx_graph import _cache_argument
from laco_deploy.errors import ExportError
from laco_deploy.models import load_model
from laco_deploy.runtimes import parity
from laco_deploy.runtimes.onnxrt import OrtDecoder, OrtRunner
from laco_deploy.runtimes.parity import onnx_parity


@pytest.fixture(scope="module")
def tagged_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """The tiny Llama with a `laco_deploy` settings dict in config.json, as prune/compensate write it."""
    d = tmp_path_factory.mktemp("tagged") / "model"
    shutil.copytree(tiny_llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["laco_deploy"] = {"stage": "compensate", "method": "wanda", "pattern": "unstructured 50%", "sparsity": 0.5}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def export_fp32(tagged_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx") / "fp32"
    result = onnx_exporter.export(tagged_dir, out, "fp32", metadata={"build": "test"}, check=onnx_parity)
    return result, out


@pytest.fixture(scope="module")
def torch_model(tagged_dir):
    return load_model(str(tagged_dir)).model


def test_layout_and_result(export_fp32):
    result, out = export_fp32
    assert result.target == "onnx" and result.quant == "fp32" and Path(result.path) == out
    for name in ("model.onnx", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    graph, data = (out / "model.onnx").stat().st_size, (out / "model.onnx_data").stat().st_size
    assert data > graph and result.size_bytes == graph + data  # weights always as external data
    assert not list(out.parent.glob(".*partial"))
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out)("hello world")["input_ids"]


def test_graph_signature_is_optimum_style(export_fp32):
    _, out = export_fp32
    model = onnx.load(str(out / "model.onnx"))
    onnx.checker.check_model(model)
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    outputs = {o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in model.graph.output}
    assert list(inputs)[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert inputs["input_ids"] == ["batch_size", "sequence_length"]
    assert inputs["attention_mask"] == ["batch_size", "total_sequence_length"]
    assert inputs["past_key_values.1.value"] == ["batch_size", 2, "past_sequence_length", 16]
    assert set(outputs) == {"logits"} | {f"present.{i}.{k}" for i in range(2) for k in ("key", "value")}
    assert outputs["logits"] == ["batch_size", "sequence_length", 512]
    assert outputs["present.0.key"][2] == "past_sequence_length + sequence_length"


def test_parity_checks_meet_fp32_bar(export_fp32):
    checks = export_fp32[0].checks
    assert checks["onnx_checker"] == "passed"
    p = checks["parity"]
    assert p["prefill_tokens"] == parity.PARITY_PREFILL and p["decode_steps"] == parity.PARITY_DECODE
    assert p["max_abs_diff_prefill"] <= 1e-3 and p["max_abs_diff_decode"] <= 1e-3
    assert p["top1_agreement"] >= 0.999
    assert checks["greedy"]["identical"] is True


def test_metadata_props_record_settings(export_fp32):
    meta = {p.key: p.value for p in onnx.load(str(export_fp32[1] / "model.onnx"), load_external_data=False).metadata_props}
    assert meta["laco_deploy.stage"] == "compensate" and meta["laco_deploy.method"] == "wanda"
    assert meta["laco_deploy.pattern"] == "unstructured 50%" and json.loads(meta["laco_deploy.sparsity"]) == 0.5
    assert meta["laco_deploy.quant"] == "fp32" and meta["build"] == "test"


def test_kv_cache_decoding_matches_pytorch_cache(export_fp32, torch_model):
    """Prefill 10 tokens, decode 5 one by one: logits and every present tensor match HF's DynamicCache."""
    decoder = OrtDecoder(export_fp32[1])
    ids = torch.randint(3, 512, (15,), generator=torch.Generator().manual_seed(0))
    _, past = decoder.prefill(ids[:10].numpy())
    arg = _cache_argument(torch_model)  # transformers 5 renames past_key_values to cache
    with torch.no_grad():
        out = torch_model(ids[:10].view(1, -1), use_cache=True)
    cache = getattr(out, arg, None) or out.past_key_values
    for pos in range(10, 15):
        got, past = decoder.step(int(ids[pos]), pos, past)
        with torch.no_grad():
            out = torch_model(ids[pos:pos + 1].view(1, 1), use_cache=True, **{arg: cache})
        cache = getattr(out, arg, None) or out.past_key_values
        assert np.abs(got - out.logits[0, -1].numpy()).max() <= 1e-4
    for i, layer in enumerate(cache.layers):
        assert past[2 * i].numpy().shape == tuple(layer.keys.shape) == (1, 2, 15, 16)
        assert np.abs(past[2 * i].numpy() - layer.keys.numpy()).max() <= 1e-4
        assert np.abs(past[2 * i + 1].numpy() - layer.values.numpy()).max() <= 1e-4


def test_batch_with_left_padding(export_fp32, torch_model):
    """Two prompts of different length in one batch (left padding), then a batched decode step."""
    decoder = OrtDecoder(export_fp32[1])
    a, b = torch.arange(20, 32), torch.arange(40, 47)  # 12 and 7 tokens
    ids = np.zeros((2, 12), np.int64)
    ids[0], ids[1, 5:] = a.numpy(), b.numpy()
    mask = (np.arange(12)[None] >= np.array([[0], [5]])).astype(np.int64)
    pos = np.clip(mask.cumsum(-1) - 1, 0, None)
    logits, past = decoder.forward(ids, mask, pos, decoder.empty_past(2))
    with torch.no_grad():
        ref_a = torch_model(a.view(1, -1)).logits[0].numpy()
        ref_b = torch_model(b.view(1, -1)).logits[0].numpy()
    assert np.abs(logits[0] - ref_a).max() <= 1e-4 and np.abs(logits[1, 5:] - ref_b).max() <= 1e-4
    nxt = np.array([[7], [9]])
    step, _ = decoder.forward(nxt, np.concatenate([mask, np.ones((2, 1), np.int64)], 1), np.array([[12], [7]]), past)
    with torch.no_grad():
        ref_a = torch_model(torch.cat([a, torch.tensor([7])]).view(1, -1)).logits[0, -1].numpy()
        ref_b = torch_model(torch.cat([b, torch.tensor([9])]).view(1, -1)).logits[0, -1].numpy()
    assert np.abs(step[0, -1] - ref_a).max() <= 1e-4 and np.abs(step[1, -1] - ref_b).max() <= 1e-4


def test_greedy_text_equals_pytorch_generate(export_fp32, torch_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(export_fp32[1])
    prompt = torch.tensor(tok("The history of the city")["input_ids"])
    runner = OrtRunner(export_fp32[1])
    got = runner.generate(prompt, 12)
    with torch.no_grad():
        ref = torch_model.generate(prompt.view(1, -1), attention_mask=torch.ones(1, prompt.numel(), dtype=torch.long),
                                   max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, prompt.numel():]
    assert got == ref.tolist()[: len(got)] and len(got) >= 1
    assert tok.decode(got) == tok.decode(ref[: len(got)])


def test_runner_logits_match_torch_runner(export_fp32, torch_model):
    from laco_deploy.runtimes.runner import TorchRunner, open_runner

    runner = open_runner(export_fp32[1])
    assert isinstance(runner, OrtRunner) and runner.name == "onnxruntime" and runner.provider == "CPUExecutionProvider"
    ids = torch.randint(0, 512, (33,), generator=torch.Generator().manual_seed(1))
    got = runner.logits(ids)
    assert got.dtype == torch.float32 and got.shape == (33, 512)
    assert (got - TorchRunner(torch_model).logits(ids)).abs().max() <= 1e-4
    assert OrtRunner(export_fp32[1] / "model.onnx", threads=1).threads == 1  # a bare .onnx file works too


# ---- bad input -------------------------------------------------------------------------------------


def test_unknown_type_is_refused(tiny_llama_dir, tmp_path):
    with pytest.raises(ExportError, match=r"'int4'.*fp32, fp16, int8"):
        onnx_exporter.export(tiny_llama_dir, tmp_path / "o", "int4")


def test_unsupported_architecture_is_refused(tiny_llama_dir, tmp_path):
    d = tmp_path / "gpt2"
    shutil.copytree(tiny_llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match=r"GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        onnx_exporter.export(d, tmp_path / "o", "fp32")


def test_missing_model_and_bad_destinations(tiny_llama_dir, tmp_path):
    with pytest.raises(ExportError, match="no config.json"):
        onnx_exporter.export(tmp_path / "nowhere", tmp_path / "o", "fp32")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="is a file"):
        onnx_exporter.export(tiny_llama_dir, tmp_path / "file", "fp32")
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="not an ONNX export"):
        onnx_exporter.export(tiny_llama_dir, tmp_path / "keep", "fp32")
    assert (tmp_path / "keep" / "notes.txt").read_text() == "mine"


def test_failed_export_leaves_nothing(tiny_llama_dir, tmp_path, monkeypatch):
    def killed(model, quant, notes, path):
        partial = next(tmp_path.glob(".o.*partial"))  # the folder being written
        (partial / "model.onnx").write_bytes(b"half-written")
        raise KeyboardInterrupt

    monkeypatch.setattr(onnx_exporter, "_build_graph", killed)
    with pytest.raises(KeyboardInterrupt):
        onnx_exporter.export(tiny_llama_dir, tmp_path / "o", "fp32")
    assert list(tmp_path.iterdir()) == []


def test_trace_failure_is_an_export_error(tiny_llama_dir, tmp_path, monkeypatch):
    import exporters.onnx_graph

    def broken(model, path, data_file):
        raise RuntimeError("Could not guard on data-dependent expression u0 > 1")

    monkeypatch.setattr(exporters.onnx_graph, "trace", broken)
    with pytest.raises(ExportError, match=r"torch.onnx.export failed for LlamaForCausalLM \(Could not guard"):
        onnx_exporter.export(tiny_llama_dir, tmp_path / "o", "fp32")
    assert not (tmp_path / "o").exists()


def test_cli_rejects_bad_type(cli, tiny_llama_dir, tmp_path):
    code, out, err = cli("export", "--model", tiny_llama_dir, "--target", "onnx", "--quant", "q4_k_m", "--out", tmp_path / "o")
    assert code == 2 and "q4_k_m" in out + err and "fp32" in out + err


def test_parity_runs_after_the_pytorch_model_is_released(tiny_llama_dir, tmp_path):
    """The ONNX session opens only once the PyTorch model is gone, so the export never holds both
    (issue 33): the check's first phase sees the model, its second finds it collected."""
    import weakref

    from laco_deploy.runtimes.parity import TwoPhaseCheck, onnx_compare, onnx_reference

    seen = {}

    def reference(model, tokenizer):
        seen["model"] = weakref.ref(model)
        return onnx_reference(model, tokenizer)

    def compare(ref, tokenizer, folder):
        seen["alive_at_compare"] = seen["model"]() is not None
        return onnx_compare(ref, tokenizer, folder)

    result = onnx_exporter.export(tiny_llama_dir, tmp_path / "o", "fp32", check=TwoPhaseCheck(reference, compare))
    assert seen["alive_at_compare"] is False
    assert result.checks["parity"]["top1_agreement"] == 1.0
