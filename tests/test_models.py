"""Loader tests: every source kind and every bad input, with messages and exit codes."""

from __future__ import annotations

import json

import pytest
import torch

from laco_deploy.errors import ModelError
from laco_deploy.models import check_architecture, default_gguf_path, load_model, resolve_device


def test_hf_dir_loads_llama_and_qwen2(tiny_llama_dir, tiny_qwen2_dir):
    llama = load_model(str(tiny_llama_dir))
    qwen = load_model(str(tiny_qwen2_dir))
    assert llama.kind == "hf_dir" and check_architecture(llama.model.config) == "llama"
    assert check_architecture(qwen.model.config) == "qwen2"
    assert qwen.model.model.layers[0].self_attn.q_proj.bias is not None
    ids = llama.tokenizer("The letter A", return_tensors="pt").input_ids
    assert torch.isfinite(llama.model(ids).logits).all()


def test_pickle_refused_unless_allowed(tmp_path, tiny_llama_dir):
    loaded = load_model(str(tiny_llama_dir))
    model = loaded.model
    pickled = tmp_path / "pickled"
    model.save_pretrained(pickled, safe_serialization=False)
    loaded.tokenizer.save_pretrained(pickled)
    if not any(pickled.glob("*.bin")):  # transformers 5 may refuse to write pickles; make one by hand
        torch.save(model.state_dict(), pickled / "pytorch_model.bin")
        for f in pickled.glob("*.safetensors"):
            f.unlink()
    with pytest.raises(ModelError, match="model.allow_pickle"):
        load_model(str(pickled))
    assert load_model(str(pickled), allow_pickle=True).model is not None


def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelError, match="unsupported architecture GPT2LMHeadModel.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        load_model(str(tmp_path))


def test_missing_path_and_non_model_dir(tmp_path):
    with pytest.raises(ModelError, match="not found"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ModelError, match="no config.json"):
        load_model(str(tmp_path))


def test_hub_id_offline_says_so(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="offline.*local Hugging Face directory"):
        load_model("someone/some-model")


def test_corrupt_and_truncated_gguf(tmp_path, cache_dir):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ModelError, match="not a GGUF file"):
        load_model(str(bad))
    truncated = tmp_path / "trunc.gguf"
    truncated.write_bytes(default_gguf_path().read_bytes()[:4096])
    with pytest.raises(ModelError, match="corrupt or truncated"):
        load_model(str(truncated))
    assert not list(cache_dir.rglob("*.safetensors"))  # nothing half-converted left behind


def test_non_gguf_file_refused(tmp_path):
    f = tmp_path / "weights.pt"
    f.write_bytes(b"x")
    with pytest.raises(ModelError, match="not a .gguf"):
        load_model(str(f))


def test_default_model_ships_with_the_package():
    path = default_gguf_path()
    assert path.is_file() and path.read_bytes()[:4] == b"GGUF"


def test_device_resolution():
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ModelError, match="no CUDA GPU"):
            resolve_device("cuda")


def test_provenance_follows_the_weights(tmp_path, tiny_llama_dir):
    import shutil

    from laco_deploy.artifacts import SOURCE_FILE
    from laco_deploy.models import save_model

    src = tmp_path / "src"
    shutil.copytree(tiny_llama_dir, src)
    (src / SOURCE_FILE).write_text('{"gguf": "/somewhere/model.gguf"}')
    loaded = load_model(str(src))
    save_model(loaded.model, loaded.tokenizer, tmp_path / "next")
    assert (tmp_path / "next" / SOURCE_FILE).read_text() == '{"gguf": "/somewhere/model.gguf"}'


def test_gguf_file_loads_and_is_cached(tmp_path, tiny_llama_dir, cache_dir):
    """A tiny GGUF written with the gguf package (through our exporter) loads back with equal logits."""
    from exporters.gguf import export

    gguf = tmp_path / "tiny.f32.gguf"
    export(tiny_llama_dir, gguf, "f32")
    loaded = load_model(str(gguf))
    assert loaded.kind == "gguf" and loaded.gguf_path == gguf
    assert list(cache_dir.rglob("*.safetensors"))  # converted once into the cache
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    reference = load_model(str(tiny_llama_dir)).model
    with torch.no_grad():
        assert torch.allclose(loaded.model(ids).logits, reference(ids).logits, atol=1e-4)
    assert load_model(str(gguf)).path == loaded.path  # second load comes from the cache
