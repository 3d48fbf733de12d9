"""Sizing helpers: what a model's weights take in fp32 (from its config alone, a skeleton on `meta`,
no weights read; each decoder layer at its own width), how much RAM is available, and what one
layer step, the final KL pass or a whole-model step adds. Read by compensation to size its steps
(compensate/steps.py) and by the build estimator above the stages (memplan.py).
"""

from __future__ import annotations

from pathlib import Path

from laco_deploy.config import PRUNABLE_LINEARS
from laco_deploy.memory import proc_bytes
from laco_deploy.models import decoder_layers, linear_modules
from laco_deploy.structured import skeleton_of

FP32 = 4  # bytes per weight: every stage computes in float32
MIB = 2**20
KL_CHUNK_TOKENS = 32  # the final KL pass makes its logits this many tokens at a time (compensate/klpass.py)
# zero-shot (lm-eval): tokens of a batch's longest request; laco_lastword_quick on the default model grew
# the process by 797 MiB at batch 4 and 1,479 at 16 (the fp32 model + logits and their log-softmax)
ZEROSHOT_TOKENS = 192
# fidelity.task_batch_size unset: one sequence per harness call, whose LM head runs on the longest
# continuation's positions only (fidelity/harness_lm.py): a word or an answer choice, a few to a few tens
# of tokens. On the default model's three models: 254 MiB lower peak than batch 4, 11% longer (52 -> 58 s
# on 2 CPU cores), the same accuracy (benchmarks/RESULTS.md). A GPU user may raise it for speed.
ZEROSHOT_TAIL_TOKENS = 64


def weight_bytes(model) -> dict[str, int]:
    """fp32 bytes of a (skeleton) model: all decoder layers, the largest one and its largest linear,
    embeddings, head (0 when tied), total; plus the shapes the estimates need."""
    layers = [sum(p.numel() for p in layer.parameters()) * FP32 for layer in decoder_layers(model)]
    linears = [lin.weight.numel() * FP32 for layer in decoder_layers(model)
               for lin in linear_modules(layer, PRUNABLE_LINEARS).values()]
    embed = model.model.embed_tokens.weight.numel() * FP32
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    head = 0 if tied else model.lm_head.weight.numel() * FP32
    total = sum(p.numel() for p in model.parameters()) * FP32  # tied weights counted once
    widths = [layer.mlp.down_proj.in_features for layer in decoder_layers(model)]
    dims = sum(sum(lin.weight.shape) + (lin.bias.numel() if lin.bias is not None else 0)
               for layer in decoder_layers(model) for lin in linear_modules(layer, PRUNABLE_LINEARS).values())
    return {"linear_dims": dims * FP32, "layers": sum(layers), "layer_max": max(layers, default=0), "linear_max": max(linears, default=0),
            "embed": embed, "head": head, "total": total, "num_layers": len(layers),
            "hidden": int(model.config.hidden_size), "vocab": int(model.config.vocab_size),
            "ffn_max": max(widths, default=0)}


def model_bytes(path: Path, trust_remote_code: bool = False) -> dict[str, int]:
    """weight_bytes of the model in the HF directory `path`."""
    return weight_bytes(skeleton_of(path, trust_remote_code))


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none, e.g. macOS)."""
    return proc_bytes("/proc/meminfo", "MemAvailable")


def layer_batch_bytes(w: dict[str, int], tokens: int) -> int:
    """Activations inside one decoder layer's forward for `tokens` tokens (attention, MLP)."""
    return tokens * (8 * w["hidden"] + 3 * w["ffn_max"]) * FP32


def largest_rest(w: dict[str, int]) -> int:
    """The largest non-layer tensor: the embedding or the untied head (read one at a time when a
    streamed model is saved: LazyModel.save copies them from the source file)."""
    return max(w["embed"], w["head"])


def zeroshot_batch(setting: int | None) -> int:
    """Sequences per harness forward: fidelity.task_batch_size where set, else 1 (see ZEROSHOT_TAIL_TOKENS)."""
    return setting if setting is not None else 1


def zeroshot_logit_bytes(setting: int | None, vocab: int) -> int:
    """The harness's logits and their log-softmax per call: [batch, ZEROSHOT_TOKENS, vocab] for a batch
    of several sequences, [1, ZEROSHOT_TAIL_TOKENS, vocab] for one (harness_lm.ContinuationLM)."""
    batch = zeroshot_batch(setting)
    tokens = ZEROSHOT_TAIL_TOKENS if batch == 1 else batch * ZEROSHOT_TOKENS
    return 2 * tokens * vocab * FP32


def embedding_rows_bytes(w: dict[str, int], tokens: int) -> int:
    """What embedding `tokens` token ids reads from a streamed model: only the rows they use
    (engine/lazy.py read_rows), at most the whole matrix."""
    return min(w["embed"], tokens * w["hidden"] * FP32)


def final_kl_terms(w: dict[str, int], tokens: int, optimizer: str, on_disk: bool = False) -> dict[str, int]:
    """What the final KL pass (compensate/distill.py, klpass.py) adds to the model it trains: the
    optimizer's state (Adafactor: out + in numbers per matrix; AdamW: two moments per weight, held
    between steps in memory or, `on_disk`, in files (compensate/optstate.py): then one layer's), the masks as bits,
    every layer's input for one batch of `tokens`, one layer's training (its gradients, autocast's
    half-precision copies, the recomputed activations) and the logits of one chunk of tokens with
    their softmax and gradient (~12 fp32 copies)."""
    if optimizer == "adamw":
        state = 2 * (w["layer_max"] if on_disk else w["layers"])
    else:
        state = w["linear_dims"]
    return {"optimizer": state, "masks": w["layers"] // (8 * FP32),
            "layer inputs": w["num_layers"] * tokens * w["hidden"] * FP32,
            "layer training": w["layer_max"] + w["layer_max"] // 2 + 2 * layer_batch_bytes(w, tokens),
            "logits": 12 * KL_CHUNK_TOKENS * w["vocab"] * FP32}


def final_kl_device_bytes(w: dict[str, int], tokens: int, optimizer: str) -> int:
    """Device bytes of the final KL pass's step: one layer, the final norm and head, and its terms."""
    return w["layer_max"] + largest_rest(w) + sum(final_kl_terms(w, tokens, optimizer).values())


def whole_model_terms(w: dict[str, int], tokens: int) -> dict[str, int]:
    """What training the whole resident model in one autograd graph adds to its weights (the LoRA
    baseline's step, sized like the former whole-model KL pass: 3304 MiB measured for it on the
    default build): AdamW-sized state, the largest layer's gradients, a byte per weight, autocast's
    half-precision copies of every weight, ~12 fp32 copies of the logits and every layer's activations."""
    return {"adam": 2 * w["layers"], "grads": w["layer_max"], "masks": w["layers"] // FP32,
            "autocast copies": (w["layers"] + largest_rest(w)) // 2,
            "logits": 12 * tokens * w["vocab"] * FP32, "batch": w["num_layers"] * layer_batch_bytes(w, tokens)}


def layer_step_terms(w: dict[str, int], tokens: int, dense_twin: bool) -> dict[str, int]:
    """The LaCo step on the device besides the layer itself: grads + AdamW moments + the mask,
    autograd activations of `tokens` tokens, and the dense twin where the step runs it (else the
    streamed twin leaves once its outputs are computed)."""
    return {"dense twin": w["layer_max"] if dense_twin else 0,
            "grads+adam+mask": 3 * w["layer_max"] + w["layer_max"] // 4,
            "adam step": 2 * w["linear_max"],  # AdamW's per-tensor temporaries (sqrt, then the denominator)
            "batch": 2 * layer_batch_bytes(w, tokens)}


def activation_cache_bytes(w: dict[str, int], samples: int, seqlen: int) -> int:
    """One activation cache of the walk: [samples, seqlen, hidden] fp32 (the walk keeps two or three)."""
    return samples * seqlen * w["hidden"] * FP32
