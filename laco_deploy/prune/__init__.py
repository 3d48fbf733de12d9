"""Pruning: magnitude, Wanda and SparseGPT; unstructured, N:M and structured, on the layer-wise engine.

Public entry: `run(model_cfg, data_cfg, prune_cfg, out_dir, *, resume=False, device=None)`.
"""

from laco_deploy.prune.run import checkpoint_dir, run

__all__ = ["checkpoint_dir", "run"]
