"""Hyper-parameters config.json leaves out (transformers saves only values that differ from its config
class's defaults) are written to GGUF as that class's defaults, not as numbers of our own."""

from __future__ import annotations

import gguf
import pytest
from transformers import AutoConfig

from exporters.gguf_model import plan_model, write_hparams
from exporters.gguf_names import MODEL_TYPES


def _metadata(config: dict, path) -> dict:
    plan = plan_model(config)
    writer = gguf.GGUFWriter(str(path), plan.arch_name)
    write_hparams(writer, plan, config)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith(plan.arch_name + ".")}, plan.arch_name


@pytest.mark.parametrize("model_type", sorted(MODEL_TYPES))
def test_omitted_keys_take_the_config_class_defaults(model_type, tmp_path):
    config = {"model_type": model_type, "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256}
    meta, arch = _metadata(config, tmp_path / "m.gguf")
    defaults = AutoConfig.for_model(model_type)
    rope = getattr(defaults, "rope_parameters", None) or {"rope_theta": getattr(defaults, "rope_theta", None)}
    theta = rope.get("full_attention", rope)["rope_theta"]  # Gemma 3: llama.cpp's freq_base is the full-attention layers'
    assert meta[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(defaults.rms_norm_eps)
    assert meta[f"{arch}.rope.freq_base"] == pytest.approx(theta)
    assert meta[f"{arch}.context_length"] == defaults.max_position_embeddings


def test_values_in_config_json_win(tmp_path):
    config = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "intermediate_size": 128, "vocab_size": 256, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
              "max_position_embeddings": 8192}
    meta, arch = _metadata(config, tmp_path / "m.gguf")
    assert meta[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert meta[f"{arch}.rope.freq_base"] == pytest.approx(100000.0)
    assert meta[f"{arch}.context_length"] == 8192
