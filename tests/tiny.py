"""Tiny random-init models and tokenizers for tests: built from configs in seconds, on CPU."""

from __future__ import annotations

from pathlib import Path

import torch

from laco_deploy.data import builtin_path

VOCAB = 512


def train_bpe_tokenizer(vocab_size: int = VOCAB):
    """A GPT-2-style byte-level BPE tokenizer trained on the builtin calibration text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = builtin_path("calib").read_text(encoding="utf-8")[:200_000]
    tok.train_from_iterator([text], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")


def train_sentencepiece_tokenizer(workdir: Path, vocab_size: int = 400):
    """A SentencePiece (Llama-2 style) tokenizer trained on the builtin calibration text."""
    import json
    import shutil

    import sentencepiece as spm
    from transformers import AutoTokenizer

    workdir.mkdir(parents=True, exist_ok=True)
    corpus = workdir / "corpus.txt"
    corpus.write_text(builtin_path("calib").read_text(encoding="utf-8")[:200_000], encoding="utf-8")
    prefix = workdir / "sp"
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(prefix), vocab_size=vocab_size,
                                   model_type="bpe", bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
                                   byte_fallback=True, minloglevel=2)
    tok_dir = workdir / "tok"
    tok_dir.mkdir(exist_ok=True)
    shutil.copy(str(prefix) + ".model", tok_dir / "tokenizer.model")
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    return AutoTokenizer.from_pretrained(tok_dir)


def llama_config(vocab: int = VOCAB, tied: bool = True, layers: int = 2, hidden: int = 64):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=tied, rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=0, eos_token_id=0)


def mistral_config(vocab: int = VOCAB, layers: int = 2, hidden: int = 64):
    """Mistral: Llama's layer, untied head, no sliding window (as Mistral-7B-v0.3)."""
    from transformers import MistralConfig

    return MistralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=512,
                         sliding_window=None, tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0,
                         bos_token_id=0, eos_token_id=0)


def qwen2_config(vocab: int = VOCAB, layers: int = 2, hidden: int = 64):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=0, eos_token_id=0)


def qwen3_config(vocab: int = VOCAB, layers: int = 2, hidden: int = 64):
    """Qwen3: q/k norms over head_dim, head_dim given explicitly, tied head (as Qwen3-0.6B)."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=512,
                       tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=0, eos_token_id=0)


def gemma2_config(vocab: int = VOCAB, layers: int = 2, hidden: int = 64):
    """Gemma 2: layer 0 sliding (window 16, crossed by every parity check), layer 1 full; soft-capping
    of attention scores and logits; query scaling by head_dim as llama.cpp assumes; tied head."""
    from transformers import Gemma2Config

    return Gemma2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, query_pre_attn_scalar=hidden // 4,
                        sliding_window=16, max_position_embeddings=512, attn_logit_softcapping=50.0,
                        final_logit_softcapping=30.0, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def gemma3_config(vocab: int = VOCAB, layers: int = 6, hidden: int = 64):
    """Gemma 3 text: 6 layers so both kinds exist (5 sliding with local RoPE base 1e4, then 1 full
    with global base 1e6), window 16, q/k norms, tied head."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                            query_pre_attn_scalar=hidden // 4, sliding_window=16, max_position_embeddings=512,
                            rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def phi3_config(vocab: int = VOCAB, layers: int = 2, hidden: int = 64):
    """Phi-3: fused qkv_proj and gate_up_proj, untied head (as Phi-3-mini-4k, without its sliding window)."""
    from transformers import Phi3Config

    return Phi3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      original_max_position_embeddings=512, sliding_window=None, tie_word_embeddings=False,
                      rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def smollm3_config(vocab: int = VOCAB, layers: int = 4, hidden: int = 64):
    """SmolLM3: Llama's layer; 4 layers so the last is a NoPE layer (no_rope_layers [1, 1, 1, 0], as
    llama.cpp fixes it); a RoPE base small enough that rotation moves the logits; tied head."""
    from transformers import SmolLM3Config

    return SmolLM3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0,
                         rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def build_model(config, seed: int = 0, norms: float = 0.0):
    """Random-init causal LM with weights scaled so activations look trained-ish (not all tiny).
    norms > 0: norm scales drawn around their init with that spread (so a wrong norm offset shows)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif name.endswith("bias"):
                p.normal_(0, 0.02)
            elif norms and name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * norms)
    return model.eval()


def save_tiny(model, tokenizer, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    sp_model = getattr(tokenizer, "vocab_file", None)
    if sp_model and Path(sp_model).is_file():  # keep the SentencePiece model for GGUF export
        import shutil

        shutil.copy(sp_model, path / "tokenizer.model")
    return path


def benchmark_script(name: str):
    """benchmarks/NAME.py as a module (benchmarks/ is not a package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
