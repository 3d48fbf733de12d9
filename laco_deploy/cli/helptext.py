"""Example command lines and the exit codes, shown at the end of each command's --help.

Kept apart from the commands so that every help page lists the same exit codes, and attached to the
registered commands by name (`attach`), so a command module needs no change to get them.
"""

from __future__ import annotations

# The paper the method comes from, named in full: another paper called "LaCo" merges layers instead.
METHOD = (
    "[bold]Method[/]\n"
    "  LaCo: Layer-wise Compensation for Pruned Large Language Models (ACL 2026).\n"
    "  Not \"LaCo: Large Language Model Pruning via Layer Collapse\", another paper\n"
    "  of the same short name that merges layers; here no layer is merged."
)

EXIT_CODES = (
    "[bold]Exit codes[/]\n"
    "  0    done\n"
    "  1    a gate (--max-kl, --min-top1, --max-ppl-ratio) or a regression\n"
    "       check failed; the reports are still written\n"
    "  2    bad input: a setting, path or model to fix (the message says how)\n"
    "  3    internal error, a bug: rerun with --debug and please report it\n"
    "  130  interrupted (Ctrl-C), 143 terminated (SIGTERM): partial files are\n"
    "       removed; rerun with --resume to continue"
)

OUTPUT = (
    "[bold]Output[/]\n"
    "  progress and stage lines on stderr; results (or --json) on stdout\n"
    "  --quiet: only warnings and errors on stderr, for CI logs\n"
    "  --verbose: other libraries' log lines, progress bars and warnings too\n"
    "  the full detail (DEBUG, every library) goes to BUILD_FOLDER/build.log"
)

# (command line, what it does) by command name; lines are kept as written, so each fits 80 columns.
EXAMPLES = {
    "build": [
        ("laco-deploy build --target gguf",
         "SmolLM2-135M-Instruct, Wanda 50%, LaCo, GGUF Q8_0, into ./laco-build"),
        ("laco-deploy build --target gguf --max-kl 0.6 --min-top1 0.6 \\\n    --max-ppl-ratio 1.6",
         "a gated build for CI: exit 1 when the exported model\n"
         "- drifts from the dense model by over 0.6 nats of KL per token,\n"
         "- picks the dense model's likeliest next token under 60% of the time,\n"
         "- or has over 1.6x the dense model's perplexity\n"
         "(the default build measures about 0.52 nats, 64% and 1.5x)"),
        ("laco-deploy build --target onnx --pattern 2:4 --out build-24",
         "2:4 sparsity, exported to ONNX with KV cache"),
        ("laco-deploy build --size 90MiB",
         "the best measured configuration whose file fits 90 MiB for this model\n"
         "(on the default one: QA-LaCo through Q3_K_M, 89.2 MiB); see it first\n"
         "with laco-deploy plan --size 90MiB"),
        ("laco-deploy --quiet build --config build.yaml --json > summary.json",
         "settings from YAML; warnings on stderr, the summary as JSON on stdout"),
    ],
    "prune": [
        ("laco-deploy prune --model default --method wanda --sparsity 0.5 --out pruned",
         "Wanda, 50% of the weights of every row of every decoder linear"),
        ("laco-deploy prune --model my-model/ --method sparsegpt --pattern 2:4 \\\n    --out pruned-24", "SparseGPT, 2 of every 4 weights zeroed"),
    ],
    "compensate": [
        ("laco-deploy compensate --dense default --sparse pruned --out recovered",
         "LaCo on a model pruned from `default`; the sparsity pattern is kept"),
    ],
    "fidelity": [
        ("laco-deploy fidelity --dense default --candidate laco=recovered \\\n    --candidate laco-build/model.q8_0.gguf --report rep",
         "a PyTorch folder and a GGUF file, on the same evaluation tokens"),
        ("laco-deploy fidelity --dense default --max-kl 0.6 --min-top1 0.6 \\\n    --candidate laco-build/model.q8_0.gguf --report rep",
         "exit 1 when the mean KL exceeds 0.6 nats or top-1 agreement is under 60%"),
    ],
    "export": [
        ("laco-deploy export --model recovered --target gguf --quant q4_k_m \\\n    --out model.q4_k_m.gguf", ""),
        ("laco-deploy export --model recovered --target onnx --out model-onnx", "ONNX with KV cache, in a folder"),
    ],
    "inspect": [("laco-deploy inspect --model default", "")],
    "plan": [("laco-deploy plan --model my-model/ --offload disk",
              "peak RAM and GPU memory of each build stage, from the config alone")],
    "bench": [],
    "run": [("laco-deploy bench run --runtime llama.cpp dense=dense.gguf \\\n    laco=model.q8_0.gguf --out bench.json", "")],
    "compare": [("laco-deploy bench compare benchmarks/baselines/ci.json current.json \\\n    --markdown compare.md",
                 "exit 1 when a metric moved past its tolerance")],
}
EXAMPLES[""] = EXAMPLES["build"][:2]  # the top-level help starts where a newcomer starts


def epilog(command: str | None) -> str:
    """Examples for `command` (None: the top-level help), then the output modes and exit codes."""
    parts = [METHOD] if command in (None, "build", "compensate") else []
    examples = EXAMPLES.get(command or "", [])
    if examples:
        lines = ["\n".join([f"  # {line}" for line in what.splitlines()] + [f"  {line}" for line in cmd.splitlines()])
                 for cmd, what in examples]
        parts.append("[bold]Examples[/]\n" + "\n\n".join(lines))
    if command in (None, "build"):
        parts.append(OUTPUT)
    parts.append(EXIT_CODES)
    return "\n\n".join(parts)


def attach(app) -> None:
    """Give the app and each registered command (sub-apps included) its epilog."""
    app.info.epilog = epilog(None)
    for info in app.registered_commands:
        name = info.name or (info.callback.__name__ if info.callback else "")
        info.epilog = info.epilog or epilog(name)
    for group in app.registered_groups:
        attach_commands = group.typer_instance
        if attach_commands is not None:
            for info in attach_commands.registered_commands:
                info.epilog = info.epilog or epilog(info.name)
