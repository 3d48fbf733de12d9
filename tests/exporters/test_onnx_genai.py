"""The ONNX export folder also runs in onnxruntime-genai: genai_config.json where the shape allows,
greedy tokens and tokenizer equal to ours, and a config that does not fit the graph is caught."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

from exporters import onnx as onnx_exporter
from exporters.onnx_genai import GENAI_FILE, genai_config
from laco_deploy.models import load_model
from laco_deploy.runtimes.genai import genai_match
from laco_deploy.runtimes.parity import onnx_parity, torch_greedy

og = pytest.importorskip("onnxruntime_genai")

CONFIG = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2}
PROMPT = torch.tensor([5, 17, 42, 99, 3, 250, 7, 64, 128, 33, 1, 9])


@pytest.fixture(scope="module")
def export(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("genai") / "fp32"
    return onnx_exporter.export(tiny_llama_dir, out, "fp32", check=onnx_parity), out


def test_export_runs_in_onnxruntime_genai_like_pytorch(export):
    result, out = export
    assert (out / GENAI_FILE).is_file() and any(GENAI_FILE in n for n in result.notes)
    check = result.checks["genai"]
    assert check["checked"] and check["greedy_identical"] and check["matching_prefix"] == check["new_tokens"] == 16
    assert check["tokenizer_match"]
    decoder = json.loads((out / GENAI_FILE).read_text())["model"]["decoder"]
    assert (decoder["head_size"], decoder["num_key_value_heads"], decoder["num_hidden_layers"]) == (16, 2, 2)


def test_a_config_that_misdescribes_the_graph_is_caught(export, tiny_llama_dir, tmp_path):
    """The check is not vacuous: with the past keys and values fed to each other's inputs, genai's
    decode steps no longer reproduce PyTorch's greedy tokens (the prefill, with an empty past, still does)."""
    _, out = export
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    doc = json.loads((bad / GENAI_FILE).read_text())
    inputs = doc["model"]["decoder"]["inputs"]
    inputs["past_key_names"], inputs["past_value_names"] = inputs["past_value_names"], inputs["past_key_names"]
    (bad / GENAI_FILE).write_text(json.dumps(doc))
    loaded = load_model(str(tiny_llama_dir))
    result = genai_match(torch_greedy(loaded.model, PROMPT, 16), loaded.tokenizer, bad, PROMPT, "The letter A")
    assert result["checked"] and not result["greedy_identical"] and result["matching_prefix"] >= 1


def test_without_the_package_the_check_says_so(export, tiny_llama_dir, monkeypatch):
    _, out = export
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)  # import fails as when not installed
    loaded = load_model(str(tiny_llama_dir))
    result = genai_match(torch_greedy(loaded.model, PROMPT, 4), loaded.tokenizer, out, PROMPT, "text")
    assert result == {"checked": False, "why": "onnxruntime-genai is not installed (pip install onnxruntime-genai)"}


def test_config_follows_the_model_shape():
    doc, why = genai_config(dict(CONFIG, head_dim=32, num_attention_heads=2, num_key_value_heads=1), None,
                            sparse_storage=False)
    decoder = doc["model"]["decoder"]
    assert why == "" and decoder["head_size"] == 32 and decoder["num_key_value_heads"] == 1  # structured, uniform
    assert doc["model"]["eos_token_id"] == 2 and doc["model"]["pad_token_id"] == 2 and doc["model"]["type"] == "llama"
    assert doc["search"]["past_present_share_buffer"] is False  # present = past + new step: separate buffers
    doc, _ = genai_config(CONFIG, {"eos_token_id": [2, 7]}, sparse_storage=False)
    assert doc["model"]["eos_token_id"] == [2, 7] and doc["model"]["pad_token_id"] == 2
    assert doc["model"]["decoder"]["head_size"] == 16  # hidden / heads when config.json has no head_dim


def test_no_config_where_genai_cannot_run_the_folder():
    ffn_only = dict(CONFIG, laco_layer_widths=[{"intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2},
                                               {"intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}])
    assert genai_config(ffn_only, None, sparse_storage=False)[0] is not None  # FFN widths differ: one cache still fits
    per_layer_kv = dict(CONFIG, laco_layer_widths=[{"intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2},
                                                   {"intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}])
    doc, why = genai_config(per_layer_kv, None, sparse_storage=False)
    assert doc is None and "[1, 2] KV heads" in why
    doc, why = genai_config(CONFIG, None, sparse_storage=True)
    assert doc is None and "sparse storage" in why
