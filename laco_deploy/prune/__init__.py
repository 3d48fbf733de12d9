"""Pruning: magnitude, Wanda and SparseGPT; unstructured, N:M and structured, on the layer-wise engine.

Public entry: `run(model_cfg, data_cfg, prune_cfg, out_dir, *, resume=False, device=None)`; a build,
whose boundary checked everything once, calls `run_checked(checked, out_dir, resume=)`.
"""

from laco_deploy.prune.run import checkpoint_dir, run, run_checked

__all__ = ["checkpoint_dir", "run", "run_checked"]
