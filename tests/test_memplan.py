"""The memory planner: weight sizes from the config alone, stage estimates that move the right way,
and `laco-deploy plan`. (Its accuracy against measured peaks is benchmarks/scale_bench.py's job.)"""

from __future__ import annotations

import dataclasses
import json

import torch

from laco_deploy import memplan
from laco_deploy.config import BuildConfig
from laco_deploy.memplan import PROCESS_BYTES, Workload, estimate_build, estimate_compensate
from laco_deploy.sizing import FP32, MIB, ZEROSHOT_TAIL_TOKENS, ZEROSHOT_TOKENS, model_bytes, zeroshot_batch


def test_weight_sizes_from_the_config(tiny_llama_dir, tiny_llama_untied_dir):
    from laco_deploy.models import load_model

    for path, tied in ((tiny_llama_dir, True), (tiny_llama_untied_dir, False)):
        model = load_model(str(path)).model
        w = model_bytes(path)
        layers = [sum(p.numel() for p in layer.parameters()) * FP32 for layer in model.model.layers]
        assert w["total"] == sum(p.numel() for p in model.parameters()) * FP32
        assert w["layers"] == sum(layers) and w["layer_max"] == max(layers) and w["num_layers"] == len(layers)
        assert w["embed"] == model.model.embed_tokens.weight.numel() * FP32
        assert (w["head"] == 0) == tied
        assert w["total"] == w["layers"] + w["embed"] + w["head"] + model.model.norm.weight.numel() * FP32


def test_structured_widths_are_counted_per_layer(tiny_llama_dir, tmp_path):
    import shutil

    src = tmp_path / "structured"
    shutil.copytree(tiny_llama_dir, src)
    config = json.loads((src / "config.json").read_text())
    widths = [{"intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2},
              {"intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}]
    config["laco_layer_widths"] = widths
    (src / "config.json").write_text(json.dumps(config))
    full, shrunk = model_bytes(tiny_llama_dir), model_bytes(src)
    assert shrunk["layers"] < full["layers"] and shrunk["ffn_max"] == 128


def _job(**kw) -> Workload:
    return dataclasses.replace(Workload.of_build(BuildConfig(), torch.device("cpu")), **kw)


def test_estimates_move_with_the_settings(tiny_llama_dir):
    w = model_bytes(tiny_llama_dir)
    ram = {e.stage: e for e in estimate_build(w, _job(prune_offload="cpu", compensate_offload="cpu"))}
    disk = {e.stage: e for e in estimate_build(w, _job(prune_offload="disk", compensate_offload="disk"))}
    assert disk["prune"].host_bytes < ram["prune"].host_bytes
    # the walk streamed is lighter; the final pass streamed holds one more cache in place of the model,
    # which on this tiny model (0.4 MiB of weights) weighs more than the model
    walk = {"compensate_final_kl": False}
    walk_ram, walk_disk = (estimate_compensate(w, _job(compensate_offload=o, **walk)) for o in ("cpu", "disk"))
    assert walk_disk.host_bytes < walk_ram.host_bytes
    more = {e.stage: e for e in estimate_build(w, _job(eval_windows=1000))}
    assert more["fidelity"].host_bytes > ram["fidelity"].host_bytes
    assert all(e.host_bytes == sum(e.terms.values()) for e in ram.values())
    assert ram["compensate"].device_bytes > 4 * w["layer_max"]  # the layer + grads + AdamW + mask
    twin = {e.stage: e for e in estimate_build(w, _job(compensate_dense_twin=True))}
    assert twin["compensate"].device_bytes == disk["compensate"].device_bytes + w["layer_max"]


def test_final_kl_pass_adds_its_training_state(tiny_llama_dir):
    w = model_bytes(tiny_llama_dir)
    few = {"compensate_samples": 1, "compensate_offload": "cpu", "compensate_kl_samples": 4}
    off = {e.stage: e for e in estimate_build(w, _job(compensate_final_kl=False, **few))}
    on = {e.stage: e for e in estimate_build(w, _job(compensate_final_kl=True, compensate_kl_optimizer="adafactor", **few))}
    adamw = {e.stage: e for e in estimate_build(w, _job(compensate_final_kl=True, compensate_kl_optimizer="adamw", **few))}
    assert on["compensate"].host_bytes > off["compensate"].host_bytes
    assert on["compensate"].terms["optimizer"] == w["linear_dims"] < w["layers"] // 8  # factored: rows + columns
    assert adamw["compensate"].terms["optimizer"] == 2 * w["layers"]
    streamed = {e.stage: e for e in estimate_build(w, _job(compensate_final_kl=True, **{**few, "compensate_offload": "disk"}))}
    assert "norm + head" in streamed["compensate"].terms and "pruned model" not in streamed["compensate"].terms
    # the pass holds its teacher; a streamed model also its samples' embeddings (a resident one embeds per batch)
    one_cache = 4 * _job().compensate_seqlen * w["hidden"] * 4
    for offload, caches in (("cpu", 1), ("disk", 2)):
        job = _job(compensate_final_kl=True, **{**few, "compensate_offload": offload})
        assert memplan._final_kl_phases(w, job, {})["final KL"]["pass caches"] == caches * one_cache
    cfg = BuildConfig()
    job = Workload.of_build(cfg, torch.device("cpu"))
    assert job.compensate_final_kl and job.compensate_kl_samples == cfg.compensate.cpu_samples
    cfg = dataclasses.replace(cfg, compensate=dataclasses.replace(cfg.compensate, final_kl_epochs=0))
    assert not Workload.of_build(cfg, torch.device("cpu")).compensate_final_kl


def test_zero_shot_row_counts_one_model_and_its_batch_of_logits(tiny_llama_dir):
    """The harness holds one whole model and a batch's [batch, tokens, vocab] logits with their log-softmax:
    the default build's fidelity peak (2,836 MiB measured at batch 16, 2,101 at batch 4). Unset, the batch
    is 1 at every vocabulary: one sequence per call, its head on the continuation's positions only."""
    # a real vocabulary and a whole model of 1 GiB: the zero-shot phase is the fidelity stage's peak
    w = {**model_bytes(tiny_llama_dir), "vocab": 49152, "total": 2**30}
    small = {"eval_windows": 1, "torch_candidates": 0, "runtime_candidates": 0}
    off = {e.stage: e for e in estimate_build(w, _job(zeroshot=False, **small))}["fidelity"]
    auto = {e.stage: e for e in estimate_build(w, _job(zeroshot=True, **small))}["fidelity"]
    four = {e.stage: e for e in estimate_build(w, _job(zeroshot=True, zeroshot_batch=4, **small))}["fidelity"]
    sixteen = {e.stage: e for e in estimate_build(w, _job(zeroshot=True, zeroshot_batch=16, **small))}["fidelity"]
    assert "task logits" not in off.terms and four.terms["model"] == w["total"]
    assert sixteen.terms["task logits"] == 4 * four.terms["task logits"] and sixteen.host_bytes > four.host_bytes
    one = {e.stage: e for e in estimate_build(w, _job(zeroshot=True, zeroshot_batch=1, **small))}["fidelity"]
    assert auto.terms == one.terms and zeroshot_batch(None) == 1
    assert one.terms["task logits"] == 2 * ZEROSHOT_TAIL_TOKENS * w["vocab"] * FP32 < four.terms["task logits"]
    assert zeroshot_batch(16) == 16  # a batch the user set is taken as set
    cfg = BuildConfig()
    job = Workload.of_build(cfg, torch.device("cpu"))
    assert job.zeroshot and job.zeroshot_batch == cfg.fidelity.task_batch_size
    quiet = dataclasses.replace(cfg, fidelity=dataclasses.replace(cfg.fidelity, tasks=()))
    assert not Workload.of_build(quiet, torch.device("cpu")).zeroshot


def test_the_process_grows_with_the_vocabulary_and_one_sequence_costs_its_continuation(tiny_llama_dir):
    """PROCESS_BYTES were measured with SmolLM2's 49,152-token tokenizer: there they are taken as they are.
    Gemma 3's 262,144 tokens add what its tokenizer was measured to hold beyond that one's (40 MiB), in
    every stage. With one sequence per harness call (the default) the task logits are those of the
    longest continuation, not of the whole request (fidelity/harness_lm.py)."""
    small = {"eval_windows": 1, "torch_candidates": 0, "runtime_candidates": 0}
    w = {**model_bytes(tiny_llama_dir), "total": 2**30}  # a whole model of 1 GiB: zero-shot is the fidelity peak
    smollm2 = {e.stage: e for e in estimate_build({**w, "vocab": 49152}, _job(zeroshot=True, **small))}
    gemma3 = {e.stage: e for e in estimate_build({**w, "vocab": 262144}, _job(zeroshot=True, **small))}
    for stage, est in smollm2.items():
        assert est.terms["process"] == PROCESS_BYTES[stage]
        assert 35 * MIB < gemma3[stage].terms["process"] - PROCESS_BYTES[stage] < 45 * MIB
    assert gemma3["fidelity"].terms["task logits"] == 2 * ZEROSHOT_TAIL_TOKENS * 262144 * FP32  # [1, tail, vocab] + log-softmax
    assert smollm2["fidelity"].terms["task logits"] == 2 * ZEROSHOT_TAIL_TOKENS * 49152 * FP32
    four = {e.stage: e for e in estimate_build({**w, "vocab": 49152}, _job(zeroshot=True, zeroshot_batch=4, **small))}
    assert four["fidelity"].terms["task logits"] == 2 * 4 * ZEROSHOT_TOKENS * 49152 * FP32  # 4 right-padded sequences: all positions


def test_build_workload_follows_the_config():
    job = Workload.of_build(BuildConfig(), torch.device("cpu"))
    cfg = BuildConfig()
    assert job.calib_samples == cfg.data.samples and job.seqlen == cfg.data.seqlen
    assert job.compensate_samples == cfg.compensate.cpu_samples  # the walk's (the pass's are compensate_kl_samples)
    assert job.eval_windows == cfg.data.eval_samples * 5  # builtin + four shipped domains
    assert Workload.of_build(cfg, torch.device("cuda")).compensate_samples == cfg.compensate.gpu_samples


def test_plan_command(cli, tiny_llama_dir):
    code, out, _ = cli("plan", "--model", tiny_llama_dir, "--offload", "disk", "--json")
    assert code == 0
    doc = json.loads(out)
    assert [s["stage"] for s in doc["stages"]] == ["prune", "compensate", "export", "fidelity"]
    assert doc["workload"]["prune_offload"] == "disk" and all(s["host_bytes"] > 0 for s in doc["stages"])
    code, out, _ = cli("plan", "--model", tiny_llama_dir)
    assert code == 0 and "compensate" in out and "peak RAM" in out
