"""`build(cfg)`: the only module that sequences stages.

prune -> compensate -> export -> fidelity -> bench, each writing into one build folder: the
stages are the methods of `pipeline_stages.BuildRecipe`, run over a `stagecache.StageCache` that
reuses a stage whose settings and input hashes are unchanged and rewrites `manifest.json`
atomically after each stage (files with hashes, settings, input hashes, wall time, peak memory).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from laco_deploy import __version__, distributed
from laco_deploy.checked import Checked, check_build
from laco_deploy.config import BuildConfig, to_dict
from laco_deploy.fsutil import mark_folder
from laco_deploy.pipeline_stages import BuildRecipe
from laco_deploy.stagecache import StageCache
from laco_deploy.versions import package_versions


def check_inputs(cfg: BuildConfig) -> Checked:
    """A build's boundary, passed once before a model is loaded or converted (seconds, not the
    minutes a bad input would otherwise cost): the device, every setting, the model source, the
    calibration and evaluation texts (checked.check_build), the zero-shot tasks. The stages trust it."""
    checked = check_build(cfg)
    if cfg.fidelity.tasks:
        from laco_deploy.fidelity.tasks import resolve

        for task in cfg.fidelity.tasks:
            resolve(task)
    return checked


def prepare(cfg: BuildConfig, on_stage: Callable[[str, str], None] | None = None,
            checked: Checked | None = None, size_budget: dict[str, Any] | None = None) -> BuildRecipe:
    """The recipe of a build over its folder's stage cache (the folder is created, a previous
    manifest's stages become candidates for reuse). `checked`: what check_inputs(cfg) returned, when
    the caller passed the boundary already (the CLI does, before its log file exists). `size_budget`:
    the record of the size-budget choice that made `cfg` (budget.Choice.record), kept in the manifest."""
    checked = checked if checked is not None else check_inputs(cfg)
    device = checked.device
    root = Path(cfg.out)
    mark_folder(root)  # a rerun may build into it again; a user's folder is refused (fsutil.check_output)
    header = {
        "tool": "laco-deploy",
        "version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": to_dict(cfg),
        "device": str(device),
        "seed": cfg.data.seed,
        "versions": package_versions(),
    }
    if size_budget is not None:
        header["size_budget"] = size_budget
    return BuildRecipe(cfg, StageCache(root, header, device, on_stage), checked)


def build(cfg: BuildConfig, on_stage: Callable[[str, str], None] | None = None,
          checked: Checked | None = None, size_budget: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the whole chain; return the manifest (also written to <out>/manifest.json). `checked`,
    `size_budget`: as for `prepare`."""
    from laco_deploy.summary import summarize

    recipe = prepare(cfg, on_stage, checked, size_budget)
    manifest = recipe.cache.manifest
    manifest["gates_passed"] = recipe.run()
    if distributed.is_main():  # torchrun: the other ranks did not run export and bench themselves
        manifest["summary"] = summarize(manifest)
        recipe.cache.save()
    return distributed.gather_all(manifest if distributed.is_main() else None)[0]
