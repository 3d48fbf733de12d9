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
from laco_deploy.config import BuildConfig, to_dict
from laco_deploy.fsutil import mark_folder
from laco_deploy.models import resolve_device
from laco_deploy.pipeline_stages import BuildRecipe
from laco_deploy.stagecache import StageCache
from laco_deploy.versions import package_versions


def check_inputs(cfg: BuildConfig) -> None:
    """Everything about a build's inputs that can be checked before a model is loaded or converted
    (seconds, not the minutes a bad input would otherwise cost): the device, the model source, the
    calibration and evaluation texts, the zero-shot tasks. Settings were validated with the config."""
    from laco_deploy.data import check_texts
    from laco_deploy.models import check_source

    resolve_device(cfg.model.device)
    check_source(cfg.model.model, allow_pickle=cfg.model.allow_pickle, trust_remote_code=cfg.model.trust_remote_code,
                 seqlen=cfg.data.seqlen)
    check_texts(cfg.data.calib, "calib")
    check_texts(cfg.data.eval, "eval")
    if cfg.fidelity.tasks:
        from laco_deploy.fidelity.tasks import resolve

        for task in cfg.fidelity.tasks:
            resolve(task)


def prepare(cfg: BuildConfig, on_stage: Callable[[str, str], None] | None = None) -> BuildRecipe:
    """The recipe of a build over its folder's stage cache (the folder is created, a previous
    manifest's stages become candidates for reuse)."""
    check_inputs(cfg)
    device = resolve_device(cfg.model.device)
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
    return BuildRecipe(cfg, StageCache(root, header, device, on_stage), device)


def build(cfg: BuildConfig, on_stage: Callable[[str, str], None] | None = None) -> dict[str, Any]:
    """Run the whole chain; return the manifest (also written to <out>/manifest.json)."""
    from laco_deploy.summary import summarize

    recipe = prepare(cfg, on_stage)
    manifest = recipe.cache.manifest
    manifest["gates_passed"] = recipe.run()
    if distributed.is_main():  # torchrun: the other ranks did not run export and bench themselves
        manifest["summary"] = summarize(manifest)
        recipe.cache.save()
    return distributed.gather_all(manifest if distributed.is_main() else None)[0]
