"""The layer-wise engine: propagation equals the model's own forward, both paths, checkpoints, resume."""

from __future__ import annotations

import pytest
import torch

from laco_deploy.engine import (
    ActivationCache,
    EmbeddedOnDemand,
    Lane,
    LayerCheckpoints,
    Paths,
    WalkOptions,
    capture_layer_inputs,
    walk_layers,
)
from laco_deploy.errors import ConfigError
from laco_deploy.models import load_model

CPU = torch.device("cpu")
OPTS = WalkOptions(CPU)


def _ids(n=5, seq=12, seed=0):
    return torch.randint(0, 500, (n, seq), generator=torch.Generator().manual_seed(seed))


def _hidden_states(model, ids):
    """The model's own hidden states after each layer: list of [n, seq, hidden]."""
    with torch.no_grad():
        out = model.model(ids, output_hidden_states=True)
    return list(out.hidden_states[1:])


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_walk_reproduces_the_forward_pass(fixture, offload, request, tmp_path):
    model = load_model(str(request.getfixturevalue(fixture))).model
    ids = _ids()
    inputs = capture_layer_inputs(model, ids, CPU, offload=offload, workdir=tmp_path)
    seen = []
    walk_layers(Lane(model, inputs), None, WalkOptions(CPU, batch_size=2),
                on_layer_done=lambda i, rec, sparse, dense: seen.append(sparse.data.clone()))
    expected = _hidden_states(model, ids)
    assert len(seen) == len(expected) == 2
    assert torch.allclose(seen[0], expected[0], atol=1e-5)
    # the last entry of hidden_states is after the final norm
    assert torch.allclose(model.model.norm(seen[1]), expected[1], atol=1e-5)


def _zero_first_rows(ctx):
    """A deterministic in-place change that depends on the layer's inputs (like a pruning step)."""
    w = ctx.layer.mlp.down_proj.weight
    k = int(ctx.inputs.data.abs().mean() * 100) % 7 + 3
    with torch.no_grad():
        w[:k] = 0
    return {"layer": ctx.index, "k": k}


def test_both_paths_give_dense_targets_and_sparse_inputs(tiny_llama_dir):
    dense = load_model(str(tiny_llama_dir)).model
    sparse = load_model(str(tiny_llama_dir)).model
    ids = _ids(4)
    expected_dense = _hidden_states(dense, ids)
    seen = {}

    def step(ctx):
        seen[ctx.index] = (ctx.inputs.data.clone(), ctx.dense_inputs.data.clone(), ctx.dense_targets.data.clone())
        assert ctx.dense_layer is not ctx.layer
        return _zero_first_rows(ctx)

    walk_layers(Lane(sparse, capture_layer_inputs(sparse, ids, CPU)), step, WalkOptions(CPU, batch_size=3),
                paths=Paths.BOTH, dense=Lane(dense))
    sparse_in1, dense_in1, target0 = seen[1][0], seen[1][1], seen[0][2]
    assert torch.allclose(target0, expected_dense[0], atol=1e-5)
    assert torch.allclose(dense_in1, expected_dense[0], atol=1e-5)
    assert torch.allclose(sparse_in1, _hidden_states(sparse, ids)[0], atol=1e-5)  # fed by the changed layer 0
    assert not torch.allclose(sparse_in1, dense_in1, atol=1e-3)
    assert (dense.model.layers[0].mlp.down_proj.weight[0] != 0).all()  # the dense twin is untouched


def test_checkpoint_resume_equals_uninterrupted(tiny_llama_dir, tmp_path):
    ids = _ids(6)
    ref = load_model(str(tiny_llama_dir)).model
    ref_records = walk_layers(Lane(ref, capture_layer_inputs(ref, ids, CPU)), _zero_first_rows, OPTS,
                              checkpoints=LayerCheckpoints(tmp_path / "ref", {"a": (1, 2)}))

    def failing(ctx):
        if ctx.index == 1:
            raise RuntimeError("killed")
        return _zero_first_rows(ctx)

    ckpt = tmp_path / "ckpt"
    first = load_model(str(tiny_llama_dir)).model
    with pytest.raises(RuntimeError):
        walk_layers(Lane(first, capture_layer_inputs(first, ids, CPU)), failing, OPTS,
                    checkpoints=LayerCheckpoints(ckpt, {"a": (1, 2)}))
    assert sorted(p.name for p in ckpt.iterdir()) == ["layer_000.json", "layer_000.safetensors", "meta.json"]
    calls = []
    second = load_model(str(tiny_llama_dir)).model  # a fresh process would reload the dense weights
    records = walk_layers(Lane(second, capture_layer_inputs(second, ids, CPU)),
                          lambda c: calls.append(c.index) or _zero_first_rows(c), OPTS,
                          checkpoints=LayerCheckpoints(ckpt, {"a": (1, 2)}, resume=True))
    assert calls == [1] and records == ref_records
    for (name, a), b in zip(ref.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ConfigError, match="other settings"):
        walk_layers(Lane(second, capture_layer_inputs(second, ids, CPU)), None, OPTS,
                    checkpoints=LayerCheckpoints(ckpt, {"a": (1, 3)}, resume=True))


def test_resume_restores_shrunk_linears(tiny_llama_dir, tmp_path):
    """A step that replaces a Linear by a smaller one (structured pruning) is restored with its shape."""
    ids = _ids(3)

    def shrink(ctx):
        if ctx.index == 1:
            raise RuntimeError("killed")
        mlp = ctx.layer.mlp
        keep = torch.arange(0, mlp.gate_proj.out_features, 2)
        for name, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
            old = getattr(mlp, name)
            w = old.weight.data.index_select(dim, keep)
            new = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
            new.weight.data.copy_(w)
            setattr(mlp, name, new)
        return {}

    model = load_model(str(tiny_llama_dir)).model
    with pytest.raises(RuntimeError):
        walk_layers(Lane(model, capture_layer_inputs(model, ids, CPU)), shrink, OPTS,
                    checkpoints=LayerCheckpoints(tmp_path, {}))
    fresh = load_model(str(tiny_llama_dir)).model
    walk_layers(Lane(fresh, capture_layer_inputs(fresh, ids, CPU)), lambda c: {}, OPTS,
                checkpoints=LayerCheckpoints(tmp_path, {}, resume=True))
    assert fresh.model.layers[0].mlp.down_proj.weight.shape == (64, 64)
    assert fresh.model.layers[0].mlp.down_proj.in_features == 64
    assert torch.equal(fresh.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)


def test_activation_cache_on_disk(tmp_path):
    cache = ActivationCache((3, 4, 5), "disk", tmp_path)
    values = torch.randn(2, 4, 5)
    cache.store(1, values)
    assert torch.equal(cache.batch(1, 3, CPU), values)
    twin = cache.clone_empty()
    assert twin.offload == "disk" and len(list(tmp_path.iterdir())) == 2
    twin.copy_from(cache)
    assert torch.equal(twin.data, cache.data)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_lazy_model_streams_one_layer_at_a_time(fixture, request, tmp_path):
    from laco_deploy.engine import LazyModel

    src = request.getfixturevalue(fixture)
    lazy = LazyModel.open(src, spill_dir=tmp_path / "spill")
    layers = lazy.model.model.layers
    assert all(p.is_meta for p in layers.parameters())
    ids = _ids(3)
    on_device = []

    def step(ctx):
        on_device.append([not next(l.parameters()).is_meta for l in layers])
        return _zero_first_rows(ctx)

    seen = []
    walk_layers(Lane(lazy.model, capture_layer_inputs(lazy.model, ids, CPU), lazy), step, OPTS,
                on_layer_done=lambda i, r, s, d: seen.append(s.data.clone()))
    assert on_device == [[True, False], [False, True]]
    assert all(p.is_meta for p in layers.parameters())
    eager = load_model(str(src)).model
    eager_seen = []
    walk_layers(Lane(eager, capture_layer_inputs(eager, ids, CPU)), _zero_first_rows, OPTS,
                on_layer_done=lambda i, r, s, d: eager_seen.append(s.data.clone()))
    assert all(torch.equal(a, b) for a, b in zip(seen, eager_seen))
    lazy.save(tmp_path / "out", None)  # sharded, without a tokenizer
    from transformers import AutoModelForCausalLM

    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    for name, tensor in eager.state_dict().items():
        assert torch.equal(saved[name], tensor), name


@pytest.mark.parametrize("fixture", ["tiny_gemma2_dir", "tiny_gemma3_dir"])
def test_each_layer_type_gets_its_own_arguments(fixture, request):
    """Gemma's sliding and full-attention layers take different masks (and, in Gemma 3, RoPE tables):
    the walk, over windows longer than the sliding window, equals the model's own forward pass, and
    the engine's logits (final norm, head, soft-capping) equal the model's."""
    from laco_deploy.engine.forward import model_logits

    src = request.getfixturevalue(fixture)
    model = load_model(str(src)).model
    kinds = model.config.layer_types
    ids = _ids(2, seq=40)
    inputs = capture_layer_inputs(model, ids, CPU)
    assert [inputs.kwargs_at(i) is inputs.kwargs_at(kinds.index(k)) for i, k in enumerate(kinds)] == [True] * len(kinds)
    assert inputs.kwargs_at(kinds.index("full_attention")) is not inputs.kwargs_at(kinds.index("sliding_attention"))
    seen = []
    walk_layers(Lane(model, inputs), None, OPTS, on_layer_done=lambda i, r, s, d: seen.append(s.data.clone()))
    expected = _hidden_states(model, ids)
    for got, want in zip(seen[:-1], expected[:-1]):
        assert torch.allclose(got, want, atol=1e-5)
    with torch.no_grad():
        ref = model(ids[:1]).logits[0]
    assert (model_logits(src, ids[0], CPU) - ref).abs().max().item() <= 1e-4


def test_nope_layers_walk_as_the_model_runs_them(tiny_smollm3_dir):
    """SmolLM3's layer 3 applies no RoPE (no_rope_layers [1, 1, 1, 0]): every layer gets the same
    position embeddings and its attention decides. The walk equals the model's own forward pass at
    every layer, the engine's logits equal the model's, and the NoPE layer does change the result
    (the same weights with RoPE on every layer give other hidden states), so the check can fail."""
    from laco_deploy.engine.forward import model_logits

    model = load_model(str(tiny_smollm3_dir)).model
    assert model.config.no_rope_layers == [1, 1, 1, 0]
    ids = _ids(2, seq=40)
    inputs = capture_layer_inputs(model, ids, CPU)
    seen = []
    walk_layers(Lane(model, inputs), None, OPTS, on_layer_done=lambda i, r, s, d: seen.append(s.data.clone()))
    expected = _hidden_states(model, ids)
    assert len(seen) == 4
    for got, want in zip(seen[:-1], expected[:-1]):
        assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(model.model.norm(seen[-1]), expected[-1], atol=1e-5)
    with torch.no_grad():
        ref = model(ids[:1]).logits[0]
    assert (model_logits(tiny_smollm3_dir, ids[0], CPU) - ref).abs().max().item() <= 1e-4
    model.model.layers[3].self_attn.use_rope = 1  # the same model, rotating layer 3 too
    roped = _hidden_states(model, ids)[-1]
    assert (roped - expected[-1]).abs().max().item() > 1e-3


def test_streamed_dense_twin_leaves_before_the_step(tiny_llama_dir):
    """dense_in_step=False: the step sees the same dense targets, but the streamed twin is back on
    `meta` (not in memory) while it runs; with the default the twin is there."""
    from laco_deploy.engine import LazyModel

    ids = _ids(4)
    seen = {}

    def step(ctx):
        dense_layer = ctx.dense_layer
        on_meta = all(p.is_meta for p in twin.model.model.layers[ctx.index].parameters())
        seen.setdefault(keep, []).append((dense_layer is None, on_meta, ctx.dense_targets.data.clone()))
        return _zero_first_rows(ctx)

    for keep in (True, False):
        sparse = load_model(str(tiny_llama_dir)).model
        twin = LazyModel.open(tiny_llama_dir)
        walk_layers(Lane(sparse, capture_layer_inputs(sparse, ids, CPU)), step, OPTS, paths=Paths.BOTH,
                    dense=Lane(twin.model, loader=twin), dense_in_step=keep)
        assert all(p.is_meta for p in twin.model.model.layers.parameters())
    assert [s[:2] for s in seen[True]] == [(False, False)] * 2 and [s[:2] for s in seen[False]] == [(True, True)] * 2
    assert all(torch.equal(a[2], b[2]) for a, b in zip(seen[True], seen[False]))


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_gemma3_dir"])  # Gemma scales its embeddings
def test_embedded_on_demand_equals_the_captured_cache(fixture, request):
    """What the final KL pass embeds per batch is bit for bit what a held cache would give, in any order."""
    model = load_model(str(request.getfixturevalue(fixture))).model
    ids = _ids(n=6)
    held = capture_layer_inputs(model, ids, CPU).hidden
    idx = torch.tensor([4, 0, 5, 2])
    with torch.enable_grad():  # the pass asks with gradients on: the rows must not carry a graph
        rows = EmbeddedOnDemand(model, ids).rows(idx, CPU)
    assert not rows.requires_grad and torch.equal(rows, held.rows(idx, CPU))
    assert torch.is_grad_enabled()
