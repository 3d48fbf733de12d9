"""Fidelity stage: how far a pruned, compensated or exported model is from the dense model.

`run(model_cfg, data_cfg, fid_cfg, candidates, report_dir)` scores each candidate (a Hugging
Face directory, an ONNX export or a GGUF file) on the same evaluation tokens and writes
fidelity.json (schema: schema.json next to this file), fidelity.md and fidelity.html.
"""

from laco_deploy.fidelity.evaluate import FidelityResult, run, run_checked

__all__ = ["FidelityResult", "run", "run_checked"]
