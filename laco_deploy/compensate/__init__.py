"""LaCo layer-wise compensation of pruned models, and the LoRA baseline it is measured against.

Public entry: `run(model_cfg, data_cfg, comp_cfg, sparse_dir, out_dir, *, resume, device)`; a build,
whose boundary checked everything once, calls `run_checked(checked, sparse_dir, out_dir, resume=)`.
"""

from laco_deploy.compensate.stage import run, run_checked

__all__ = ["run", "run_checked"]
