"""The build recipe: one method per stage, called in order by `BuildRecipe.run()`.

prune -> compensate -> export -> fidelity -> bench, each writing into one build folder. A stage
declares its settings and names its inputs as outputs of earlier stages (or the build's sources);
the StageCache derives the reuse key from them, so a change anywhere upstream reruns everything
downstream and nothing else.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from typing import Any

from laco_deploy import isolated
from laco_deploy.checked import Checked
from laco_deploy.config import BuildConfig, DataConfig, to_dict
from laco_deploy.fsutil import atomic_path
from laco_deploy.memory import release_memory
from laco_deploy.stagecache import Output, StageCache
from laco_deploy.targets import TARGETS

log = logging.getLogger(__name__)
STAGES = ("prune", "compensate", "export", "fidelity", "bench")


@dataclasses.dataclass
class Layout:
    """Where each artifact lives inside the build folder."""

    root: Path
    target: str
    quant: str

    @property
    def pruned(self) -> Path:
        return self.root / "pruned"

    @property
    def recovered(self) -> Path:
        return self.root / "recovered"

    def exported(self, label: str = "model") -> Path:
        """The exported model ("model") at the top, the dense/pruned references under reference/."""
        target = TARGETS[self.target]
        if label == "model":
            return self.root / target.build_artifact.format(quant=self.quant)
        return self.root / "reference" / target.artifact_name(label, self.quant)

    def imatrix(self, label: str) -> Path:
        """The importance matrix the export of `label` was quantized with (export.imatrix calib)."""
        return self.root / "imatrix" / f"{label}.imatrix.gguf"

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"


def _here(fn, *args, **kwargs):
    """Run in this process (isolated.call's counterpart for targets whose exports may stay here)."""
    return fn(*args, **kwargs)


def _calib(data) -> dict:
    """The data settings that shape calibration samples (evaluation settings must not rerun training),
    and how samples are cut (a new cut reruns the stages that read them)."""
    from laco_deploy.data import SAMPLE_FORMAT

    return {"calib": data.calib, "samples": data.samples, "seqlen": data.seqlen, "seed": data.seed,
            "sample_format": SAMPLE_FORMAT}


def _eval(data) -> dict:
    from laco_deploy.data import SAMPLE_FORMAT

    return {"eval": data.eval, "eval_samples": data.eval_samples, "seqlen": data.seqlen, "sample_format": SAMPLE_FORMAT}


class BuildRecipe:
    """The stages of one build over a StageCache; `run()` calls them in order."""

    def __init__(self, cfg: BuildConfig, cache: StageCache, checked: Checked):
        """`checked`: the build's boundary (pipeline.check_inputs), passed once; the stages trust it."""
        self.cfg, self.cache, self.checked, self.device = cfg, cache, checked, checked.device
        self.target = TARGETS[cfg.export.target]
        self.layout = Layout(cache.root, self.target.name, cfg.export.resolved_quant)
        # the build's one "no recovery" decision: the recovered model's label, None when recovery is off
        # (then compensate passes the pruned model on, and export, fidelity and bench have one model less)
        self.recovery = cfg.compensate.method if cfg.compensate.recovers else None

    def run(self) -> bool:
        """Every stage in order; -> whether every quality gate passed."""
        src = self.sources()
        pruned = self.prune(src)
        recovered = self.compensate(src, pruned)
        exported = self.export(src, pruned, recovered)
        passed = self.fidelity(src, pruned, recovered, exported)
        self.bench(exported)
        return passed

    def sources(self) -> dict[str, Output]:
        """Fingerprints of what the build reads from outside its folder: model, texts, task files."""
        from laco_deploy import data
        from laco_deploy.models import source_fingerprint

        cfg, cache = self.cfg, self.cache
        src = {"model": cache.source("model", source_fingerprint(cfg.model.model)),
               "calib": cache.source("calib", data.fingerprint(cfg.data.calib, "calib")),
               "eval": cache.source("eval", data.fingerprint(cfg.data.eval, "eval"))}
        if cfg.fidelity.tasks:  # zero-shot task files and their data: editing one reruns fidelity
            from laco_deploy.fidelity.tasks import tasks_fingerprint

            src["tasks"] = cache.source("tasks", tasks_fingerprint(cfg.fidelity.tasks))
        cache.save()
        return src

    def prune(self, src: dict[str, Output]) -> Output:
        from laco_deploy.prune import run_checked as prune

        cfg, out = self.cfg, self.layout.pruned
        settings = {"model": to_dict(cfg.model), "data": _calib(cfg.data), "prune": to_dict(cfg.prune)}
        settings["model"].pop("device")
        done = self.cache.run("prune", settings, {"model": src["model"], "calib": src["calib"]}, {"pruned": out},
                              lambda: prune(self.checked, out, resume=cfg.resume))
        return done.outputs["pruned"]

    def compensate(self, src: dict[str, Output], pruned: Output) -> Output:
        """The recovered model, or the pruned one when recovery is off."""
        cfg = self.cfg
        if self.recovery is None:
            return pruned
        from laco_deploy.compensate import run_checked as compensate

        out = self.layout.recovered
        settings = {"data": _calib(cfg.data), "compensate": to_dict(cfg.compensate)}
        inputs = {"dense": src["model"], "pruned": pruned, "calib": src["calib"]}
        done = self.cache.run("compensate", settings, inputs, {"recovered": out},
                              lambda: compensate(self.checked, pruned.path, out, resume=cfg.resume))
        return done.outputs["recovered"]

    def export(self, src: dict[str, Output], pruned: Output, recovered: Output) -> dict[str, Output]:
        """Export the recovered model ("model"), plus dense and pruned references for the runtime comparison."""
        from laco_deploy.models import local_model_dir

        cfg, lay, target = self.cfg, self.layout, self.target
        dense_dir = local_model_dir(cfg.model.model)
        inputs = {"dense": src["model"], "pruned": pruned}
        if self.recovery is not None:
            sources = {"dense": dense_dir, "pruned": pruned.path, "model": recovered.path}
            inputs["recovered"] = recovered
        else:
            sources = {"dense": dense_dir, "model": pruned.path}
        outputs = {label: lay.exported(label) for label in sources}
        settings = {"export": to_dict(cfg.export), "quant": lay.quant}
        weighted = cfg.export.imatrix is not None and lay.quant in target.imatrix_quants
        if weighted:  # each model's own importance matrix, from the calibration samples
            inputs["calib"] = src["calib"]
            settings["data"] = _calib(cfg.data)
            outputs.update({f"imatrix-{label}": lay.imatrix(label) for label in sources})

        def run() -> dict:
            results = {}
            for label, model_dir in sources.items():
                sparse = cfg.export.sparse_storage and label != "dense"
                imatrix = self._imatrix(model_dir, lay.imatrix(label), cfg.data) if weighted else None
                run_export = isolated.call if target.export_in_child else _here
                results[label] = run_export(target.export, model_dir, outputs[label], lay.quant,
                                            sparse_storage=sparse, imatrix=imatrix).to_dict()
                release_memory()  # what the export freed goes back to the OS before the next starts
            return results

        return self.cache.run("export", settings, inputs, outputs, run, main_only=True).outputs

    def _imatrix(self, model_dir: Path, out: Path, data: DataConfig) -> str:
        """The importance matrix `model_dir` is exported with: the one QA-LaCo trained it through
        (compensate.quant_imatrix: the export then reproduces that grid), else its own on the calibration samples."""
        from laco_deploy.imatrix import compute, trained_with

        trained = trained_with(Path(model_dir))
        if trained is None:
            return compute(model_dir, data, out, device=self.device).path
        with atomic_path(out) as tmp:
            shutil.copyfile(trained, tmp)
        return str(out)

    def fidelity(self, src: dict[str, Output], pruned: Output, recovered: Output, exported: dict[str, Output]) -> bool:
        """Fidelity reports for the pruned, recovered and exported models; -> whether every gate passed."""
        from laco_deploy.fidelity import run_checked as fidelity
        from laco_deploy.fidelity.gates import verdict

        cfg = self.cfg
        candidates = {"pruned": pruned}
        if self.recovery is not None:
            candidates[self.recovery] = recovered
        candidates[f"{self.target.name}-{self.layout.quant}"] = exported["model"]
        settings = {"data": _eval(cfg.data), "fidelity": to_dict(cfg.fidelity)}
        # the dense model's own export, scored on the same windows: do PyTorch and the runtime agree?
        inputs: dict[str, Any] = {"dense": src["model"], "eval": src["eval"], "candidates": candidates,
                                  "runtime_dense": exported["dense"]}
        if "tasks" in src:
            inputs["tasks"] = src["tasks"]
        outputs = {name: self.layout.root / name for name in ("fidelity.json", "fidelity.md", "fidelity.html")}
        paths = {label: out.path for label, out in candidates.items()}
        done = self.cache.run("fidelity", settings, inputs, outputs,
                              lambda: fidelity(self.checked, paths, self.layout.root, runtime_dense=exported["dense"].path))
        return verdict(done.result)

    def bench(self, exported: dict[str, Output]) -> None:
        """The exported models on their runtime, side by side (bench.json)."""
        from laco_deploy.data import eval_specs
        from laco_deploy.fsutil import write_json

        cfg, target = self.cfg, self.target
        out = self.layout.root / "bench.json"
        models = {"dense": exported["dense"].path}
        if self.recovery is not None:
            models["pruned"] = exported["pruned"].path
        models[self.recovery or "pruned"] = exported["model"].path
        settings = {"bench": to_dict(cfg.bench), "eval": cfg.data.eval}

        def run():
            # runtime perplexity on the first evaluation text (in-domain builtin by default); the
            # fidelity stage covers every domain
            result = target.run_benchmark(models, eval_spec=eval_specs(cfg.data.eval)[0], cfg=cfg.bench,
                                          device=target.runtime_device(self.device))
            write_json(out, result.to_dict())
            return result

        self.cache.run("bench", settings, dict(exported), {"bench.json": out}, run, main_only=True)
