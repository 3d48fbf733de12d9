"""LaCo layer-wise compensation of pruned models, and the LoRA baseline it is measured against.

Public entry: `run(model_cfg, data_cfg, comp_cfg, sparse_dir, out_dir, *, resume, device)`.
"""

from laco_deploy.compensate.stage import run

__all__ = ["run"]
