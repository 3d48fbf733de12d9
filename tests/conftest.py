"""Shared fixtures: tiny models saved as Hugging Face directories, built once per session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tiny  # noqa: E402
import torch  # noqa: E402

# Tiny models run fastest on one thread; two threads on a busy 2-core machine oversubscribe it.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def bpe_tokenizer():
    return tiny.train_bpe_tokenizer()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, bpe_tokenizer) -> Path:
    """2-layer Llama, hidden 64, 4 heads / 2 KV heads, tied embeddings, BPE tokenizer."""
    return tiny.save_tiny(tiny.build_model(tiny.llama_config()), bpe_tokenizer, tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_llama_untied_dir(tmp_path_factory, bpe_tokenizer) -> Path:
    return tiny.save_tiny(tiny.build_model(tiny.llama_config(tied=False), seed=1), bpe_tokenizer,
                          tmp_path_factory.mktemp("tiny_llama_untied"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, bpe_tokenizer) -> Path:
    """2-layer Qwen2 with q/k/v biases, untied head."""
    return tiny.save_tiny(tiny.build_model(tiny.qwen2_config(), seed=2), bpe_tokenizer, tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="session")
def tiny_llama_sp_dir(tmp_path_factory) -> Path:
    """2-layer Llama with a SentencePiece tokenizer (Llama-2 style vocabulary)."""
    work = tmp_path_factory.mktemp("tiny_llama_sp")
    tok = tiny.train_sentencepiece_tokenizer(work / "spm", vocab_size=400)
    return tiny.save_tiny(tiny.build_model(tiny.llama_config(vocab=len(tok)), seed=3), tok, work / "model")


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch) -> Path:
    """An empty LACO_DEPLOY_CACHE for tests that convert GGUF files."""
    d = tmp_path / "cache"
    monkeypatch.setenv("LACO_DEPLOY_CACHE", str(d))
    return d


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    """Run the CLI in-process; return (exit code, stdout, stderr)."""
    from laco_deploy.cli import main

    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    out = capsys.readouterr()
    code = exc.value.code if isinstance(exc.value.code, int) else 1
    return code, out.out, out.err


@pytest.fixture()
def cli(capsys):
    return lambda *args: run_cli(list(args), capsys)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory, bpe_tokenizer) -> Path:
    """2-layer Qwen3: per-head q/k RMSNorms, explicit head_dim, tied head."""
    return tiny.save_tiny(tiny.build_model(tiny.qwen3_config(), seed=5), bpe_tokenizer, tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="session")
def tiny_gemma2_dir(tmp_path_factory, bpe_tokenizer) -> Path:
    """2-layer Gemma 2: sliding (window 16) then full layer, soft-capping, (1 + w) norms drawn away from 0."""
    return tiny.save_tiny(tiny.build_model(tiny.gemma2_config(), seed=6, norms=0.1), bpe_tokenizer,
                          tmp_path_factory.mktemp("tiny_gemma2"))


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory, bpe_tokenizer) -> Path:
    """6-layer Gemma 3 text: five sliding layers (window 16, local RoPE) then one full layer, q/k norms."""
    return tiny.save_tiny(tiny.build_model(tiny.gemma3_config(), seed=7, norms=0.1), bpe_tokenizer,
                          tmp_path_factory.mktemp("tiny_gemma3"))


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory, bpe_tokenizer) -> Path:
    """2-layer Phi-3: fused qkv_proj ([q; k; v] rows) and gate_up_proj ([gate; up] rows), untied head.
    The folder name must not contain "phi3": llama.cpp then expects Phi-3's own special tokens by name
    (general.name is the folder name), which this small BPE vocabulary lacks."""
    return tiny.save_tiny(tiny.build_model(tiny.phi3_config(), seed=8), bpe_tokenizer, tmp_path_factory.mktemp("tiny_fused"))


@pytest.fixture(scope="session")
def tiny_smollm3_dir(tmp_path_factory, bpe_tokenizer) -> Path:
    """4-layer SmolLM3: layers 0-2 apply RoPE, layer 3 none (no_rope_layers [1, 1, 1, 0]), tied head."""
    return tiny.save_tiny(tiny.build_model(tiny.smollm3_config(), seed=9), bpe_tokenizer,
                          tmp_path_factory.mktemp("tiny_smollm3"))
