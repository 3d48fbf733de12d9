"""One decision per fact: model-source resolution, the family table, shared artifact names."""

from __future__ import annotations

from pathlib import Path

import pytest

from laco_deploy import families
from laco_deploy.artifacts import SPARSITY_FILE, checkpoint_dir, pattern_label
from laco_deploy.config import DEFAULT_MODEL, ModelConfig, PruneConfig
from laco_deploy.errors import ConfigError, ModelError
from laco_deploy.models import DEFAULT, GGUF_FILE, HF_DIR, HUB, default_gguf_path, local_model_dir, resolve_source


def test_resolve_source_tags_every_kind(tmp_path, tiny_llama_dir):
    assert ModelConfig().model == DEFAULT_MODEL
    default = resolve_source(DEFAULT_MODEL)
    assert default.kind == DEFAULT and default.path == default_gguf_path()
    assert resolve_source(str(tiny_llama_dir)).kind == HF_DIR and resolve_source(str(tiny_llama_dir)).path == tiny_llama_dir
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_source(str(gguf)).kind == GGUF_FILE
    hub = resolve_source("someone/some-model")
    assert hub.kind == HUB and hub.path is None
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelError, match="not a .gguf"):
        resolve_source(str(tmp_path / "weights.bin"))
    with pytest.raises(ModelError, match="not found"):
        resolve_source(str(tmp_path / "missing"))
    assert local_model_dir(str(tiny_llama_dir)) == tiny_llama_dir


def test_offload_disk_refuses_hub_ids_by_source_kind(tmp_path):
    from laco_deploy.config import DataConfig
    from laco_deploy.prune import run

    with pytest.raises(ConfigError, match="prune.offload disk .* hub id"):
        run(ModelConfig(model="someone/some-model", device="cpu"), DataConfig(samples=1, seqlen=8),
            PruneConfig(offload="disk"), tmp_path / "out")


def test_one_family_table_for_loader_and_exporters():
    from exporters.gguf_names import ARCHITECTURES as GGUF_ARCHS
    from exporters.gguf_names import MODEL_TYPES
    from laco_deploy.models import SUPPORTED_ARCHITECTURES

    assert SUPPORTED_ARCHITECTURES is families.ARCHITECTURES and MODEL_TYPES is families.MODEL_TYPES
    assert set(GGUF_ARCHS) == set(families.ARCHITECTURES)  # every family has its GGUF layout


def test_shared_artifact_names():
    assert checkpoint_dir(Path("/b/recovered")) == Path("/b/recovered.ckpt") and SPARSITY_FILE == "sparsity.json"
    from laco_deploy.prune.record import label

    assert label(PruneConfig(sparsity=0.5)) == pattern_label("unstructured", 0.5) == "unstructured 50%"
    assert label(PruneConfig(structured=0.3)) == "structured 30%" and label(PruneConfig(pattern="2:4")) == "2:4"
    assert label(PruneConfig(sparsity=0.7, owl=True)) == "unstructured 70% (OWL)"
    assert pattern_label(None) == "unknown"
