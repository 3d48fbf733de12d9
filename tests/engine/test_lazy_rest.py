"""Streamed models hold neither the embedding nor the LM head whole: the embedding is read only to
embed the samples, the head is applied in blocks of vocabulary rows, and a saved model copies the
non-layer tensors from the source one at a time; all of it equal to the resident model's results."""

from __future__ import annotations

import pytest
import torch

from laco_deploy.engine import LazyModel, WalkOptions, capture_layer_inputs, walk_side_by_side
from laco_deploy.engine import forward as F
from laco_deploy.models import load_model

CPU = torch.device("cpu")


def _ids(n=3, seq=10):
    return torch.randint(0, 500, (n, seq), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama_untied_dir", "tiny_qwen2_dir", "tiny_gemma3_dir"])
def test_capture_reads_the_embedding_only_while_embedding(fixture, request, monkeypatch):
    """Only the embedding rows the samples use are read (Gemma 3: its scaled embedding and padding
    row too), and the layer-0 inputs equal the resident model's."""
    from laco_deploy.engine import lazy as L

    src = request.getfixturevalue(fixture)
    lazy = LazyModel.open(src, rest=False)
    ids = _ids()
    read = []
    monkeypatch.setattr(L, "read_rows", lambda *a, _f=L.read_rows: read.append(a[2]) or _f(*a))
    got = lazy.capture(ids, CPU)
    want = capture_layer_inputs(load_model(str(src)).model, ids, CPU)
    assert torch.equal(got.hidden.data, want.hidden.data)
    assert len(read) == 1 and torch.equal(read[0], torch.unique(ids))  # not the 512-row matrix
    rest = [lazy.model.model.embed_tokens, lazy.model.model.norm, lazy.model.lm_head]
    assert all(p.is_meta for m in rest for p in m.parameters())  # nothing outside the layers stays loaded
    lazy.load_rest()  # the whole matrix again afterwards (the final KL pass's head): the skeleton kept its shape
    assert torch.equal(lazy.model.model.embed_tokens.weight, load_model(str(src)).model.model.embed_tokens.weight)


def test_loading_the_rest_never_initialises_the_weights_it_replaces(tiny_gemma3_dir, monkeypatch):
    """The model's initialiser fills the non-persistent buffers (Gemma's embedding scale) but sees
    parameters without elements: writing a 262k-row embedding only to replace it made every page of it
    resident (671 MiB on Gemma 3 270M)."""
    lazy = LazyModel.open(tiny_gemma3_dir, rest=False)
    seen = []
    original = lazy.model._init_weights
    monkeypatch.setattr(lazy.model, "_init_weights",
                        lambda m: seen.extend(p.numel() for p in m.parameters(recurse=False)) or original(m))
    lazy.load_rest()
    embed = lazy.model.model.embed_tokens
    resident = load_model(str(tiny_gemma3_dir)).model.model.embed_tokens
    assert seen and all(n == 0 for n in seen)
    assert torch.equal(embed.weight, resident.weight) and torch.equal(embed.embed_scale, resident.embed_scale)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama_untied_dir", "tiny_qwen2_dir", "tiny_gemma2_dir"])
def test_head_in_vocabulary_blocks_equals_the_whole_head(fixture, request, monkeypatch):
    """Blocks of 7 rows (the last one shorter): the logits equal the model's own to float rounding,
    the head module stays on `meta`, and no block read is larger than 7 rows."""
    src = request.getfixturevalue(fixture)
    model = load_model(str(src)).model
    ids = _ids(1, 12)[0]
    with torch.no_grad():
        want = model(ids.view(1, -1), use_cache=False).logits[0]
    monkeypatch.setattr(F, "HEAD_BLOCK_BYTES", 7 * 4 * model.config.hidden_size)
    stream = F.open_stream(src, ids.view(1, -1), CPU)
    walk_side_by_side({"m": stream.lane}, WalkOptions(CPU, batch_size=1, desc=None))
    reads = []
    real = stream.lazy.head_blocks
    monkeypatch.setattr(stream.lazy, "head_blocks", lambda rows: (reads.append(b[1].shape[0]) or b for b in real(rows)))
    head = F.Head(stream, CPU)
    got = head(stream.hidden.data[0])
    assert all(p.is_meta for p in stream.model.lm_head.parameters())
    assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert max(reads) == 7 and sum(reads) == model.config.vocab_size
    other = F.Head(F.open_stream(src, ids.view(1, -1), CPU), CPU)
    assert head.same_weights(other)
    head.close()
    other.close()


def test_heads_that_differ_in_one_block_are_not_shared(tiny_llama_untied_dir, bpe_tokenizer, tmp_path, monkeypatch):
    import tiny

    model = load_model(str(tiny_llama_untied_dir)).model
    with torch.no_grad():
        model.lm_head.weight[-1, 0] += 1.0  # the last block only
    changed = tiny.save_tiny(model, bpe_tokenizer, tmp_path / "changed")
    monkeypatch.setattr(F, "HEAD_BLOCK_BYTES", 7 * 4 * model.config.hidden_size)
    ids = _ids(1, 6)
    a, b = (F.Head(F.open_stream(p, ids, CPU), CPU) for p in (tiny_llama_untied_dir, changed))
    assert not a.same_weights(b)


def test_save_copies_the_non_layer_tensors_from_the_source(tiny_llama_untied_dir, tmp_path):
    """Nothing outside the layers is loaded, yet the saved model has every tensor of the source."""
    from transformers import AutoModelForCausalLM

    lazy = LazyModel.open(tiny_llama_untied_dir, spill_dir=tmp_path / "spill", rest=False)
    lazy.save(tmp_path / "out", None)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    source = load_model(str(tiny_llama_untied_dir)).model.state_dict()
    assert saved.keys() == source.keys()
    assert all(torch.equal(saved[k], v) for k, v in source.items())
