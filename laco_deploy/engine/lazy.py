"""Models larger than RAM: decoder layers streamed from the safetensors files, one at a time.

`LazyModel.open(dir, rest=False)` builds the model on the `meta` device (no memory); `capture()`
reads only the embedding rows the calibration samples use, embeds them and drops them before the
first layer runs. `walk_layers(Lane(model, inputs, lazy), ...)` then materialises layer i from disk just
before its step and, after it, writes the (pruned / compensated) layer to a spill file and returns
it to `meta`. `save()` assembles a sharded Hugging Face directory (one shard per layer, one per
non-layer tensor, with `model.safetensors.index.json`) from the spill files and the source files,
one layer or one tensor in memory at a time: the embeddings and the LM head are never held whole.
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from laco_deploy import structured
from laco_deploy.artifacts import with_provenance
from laco_deploy.engine.capture import LayerInputs, capture_layer_inputs
from laco_deploy.errors import ModelError
from laco_deploy.fsutil import atomic_dir, atomic_path
from laco_deploy.memory import trim_heap

log = logging.getLogger(__name__)
INDEX = "model.safetensors.index.json"
REST = ("model.embed_tokens", "model.norm", "lm_head")  # the non-layer modules, in checkpoint order
EMBED = ("model.embed_tokens",)


def _tensor_files(path: Path) -> dict[str, Path]:
    """Map tensor name -> the safetensors file holding it."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{path} has no *.safetensors; streaming decoder layers from disk (offload disk) reads safetensors files only")
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():
                where[key] = f
    return where


def _read(where: dict[str, Path], names: list[str]) -> dict[str, torch.Tensor]:
    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(where[n], []).append(n)
    out = {}
    for f, keys in by_file.items():
        out.update({k: v.to(torch.float32) for k, v in read_tensors(f, keys).items()})
    return out


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _header(f) -> tuple[int, dict]:
    """(byte offset of the data, JSON header) of the safetensors file open as `f`."""
    (size,) = struct.unpack("<Q", f.read(8))
    return 8 + size, json.loads(f.read(size))


def copy_as_float32(src: Path, name: str, dst: Path, chunk_bytes: int = 16 * 2**20) -> int:
    """Write tensor `name` of the safetensors file `src` as the only tensor of a new safetensors file
    `dst`, in float32, `chunk_bytes` of the source at a time (an embedding matrix is never held
    whole). Returns the bytes of tensor data written."""
    with open(src, "rb") as f:
        base, header = _header(f)
        info = header[name]
        if info["dtype"] not in _DTYPES or not _DTYPES[info["dtype"]].is_floating_point:
            raise ModelError(f"{src}: tensor {name} has dtype {info['dtype']}; expected a floating-point weight")
        dtype, (start, stop) = _DTYPES[info["dtype"]], info["data_offsets"]
        nbytes = (stop - start) // dtype.itemsize * 4
        head = json.dumps({name: {"dtype": "F32", "shape": info["shape"], "data_offsets": [0, nbytes]},
                           "__metadata__": {"format": "pt"}}).encode()
        head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        step = max(1, chunk_bytes // dtype.itemsize) * dtype.itemsize
        f.seek(base + start)
        with open(dst, "wb") as out:
            out.write(struct.pack("<Q", len(head)) + head)
            for pos in range(start, stop, step):
                raw = torch.empty(min(step, stop - pos), dtype=torch.uint8)
                f.readinto(memoryview(raw.numpy()))
                out.write(memoryview(raw.view(dtype).to(torch.float32).numpy()))
    return nbytes


def read_rows(path: Path, name: str, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` (sorted, unique indices) of the 2-D tensor `name` in the safetensors file `path`,
    as float32 [len(rows), columns], each row read on its own: the matrix is never in memory whole."""
    with open(path, "rb") as f:
        base, header = _header(f)
        info = header[name]
        if info["dtype"] not in _DTYPES or len(info["shape"]) != 2:
            raise ModelError(f"{path}: tensor {name} ({info['dtype']}, shape {info['shape']}) is not a 2-D weight matrix")
        dtype, cols = _DTYPES[info["dtype"]], info["shape"][1]
        row_bytes = cols * dtype.itemsize
        raw = torch.empty(len(rows), row_bytes, dtype=torch.uint8)
        for i, r in enumerate(rows.tolist()):
            if not 0 <= r < info["shape"][0]:
                raise ModelError(f"token id {r} is outside {name}'s {info['shape'][0]} rows; tokenize with this model's tokenizer")
            f.seek(base + info["data_offsets"][0] + r * row_bytes)
            if f.readinto(memoryview(raw[i].numpy())) != row_bytes:
                raise ModelError(f"{path} is truncated (tensor {name}); re-save the model")
    return raw.view(dtype).reshape(len(rows), cols).to(torch.float32)


def read_tensors(path: Path, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors `names` (default: all) of one safetensors file, read with plain file reads into fresh
    CPU memory. safe_open's tensors are views of a file mapping whose pages count in the process's
    RSS once touched, so copying them into a module held each weight twice at the peak; read
    into its own buffer and assigned to the module (load_state_dict(assign=True)), a weight is in
    memory once. The format: an 8-byte little-endian header length, a JSON header with each
    tensor's dtype, shape and byte offsets, then the data."""
    with open(path, "rb") as f:
        base, header = _header(f)
        out = {}
        for name in names if names is not None else [k for k in header if k != "__metadata__"]:
            info = header[name]
            if info["dtype"] not in _DTYPES:
                raise ModelError(f"{path}: tensor {name} has dtype {info['dtype']}, which this reader does not handle")
            start, stop = info["data_offsets"]
            raw = torch.empty(stop - start, dtype=torch.uint8)
            f.seek(base + start)
            if f.readinto(memoryview(raw.numpy())) != stop - start:
                raise ModelError(f"{path} is truncated (tensor {name}); re-save the model")
            out[name] = raw.view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


class LazyModel:
    """A causal LM whose decoder layers live on disk until `load(i)`; see the module docstring."""

    def __init__(self, model, path: Path, where: dict[str, Path], spill_dir: Path | None):
        self.model = model
        self.path = path
        self._where = where
        self.spill_dir = spill_dir
        self._spilled: set[int] = set()

    @classmethod
    def open(cls, path: Path, spill_dir: Path | None = None, *, rest: bool = True) -> LazyModel:
        """Build the skeleton on `meta`; with `rest`, load the non-layer weights (embeddings, final
        norm, LM head) on CPU now, else leave them to `load_rest`. spill_dir: where processed layers
        go (None: processed layers are dropped, e.g. for a frozen dense twin or a read-only pass)."""
        from transformers import AutoConfig

        path = Path(path)
        model = structured.skeleton(AutoConfig.from_pretrained(path, trust_remote_code=False))
        model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)  # recompute its tables on CPU
        if spill_dir is not None:
            Path(spill_dir).mkdir(parents=True, exist_ok=True)
        lazy = cls(model, path, _tensor_files(path), spill_dir)
        if rest:
            lazy.load_rest()
        return lazy

    def load_rest(self, modules: tuple[str, ...] = REST) -> None:
        """Materialise non-layer modules (names from REST) on CPU from the source files. With tied
        embeddings the head is the embedding matrix, so asking for either loads both."""
        model, tied = self.model, bool(self.model.config.tie_word_embeddings)
        wanted = self._with_tied(modules)
        if "lm_head" in wanted and not tied and "lm_head.weight" not in self._where:
            raise ModelError(f"{self.path}: lm_head.weight missing and embeddings are not tied; the checkpoint is incomplete")
        for name in wanted:
            module = model.get_submodule(name)
            module.to_empty(device="cpu")
            _init_buffers(model, module)
        prefixes = tuple(f"{name}." for name in wanted)
        names = [n for n, _ in model.named_parameters() if n.startswith(prefixes) and n in self._where]
        model.load_state_dict(self._read(names), strict=False, assign=True)  # the read buffers become the weights
        if tied:
            model.tie_weights()

    def release_rest(self, modules: tuple[str, ...] = REST) -> None:
        """Return non-layer modules to `meta` (their weights are read again by the next `load_rest`)."""
        for name in self._with_tied(modules):
            self.model.get_submodule(name).to("meta")
        if self.model.config.tie_word_embeddings:
            self.model.tie_weights()

    def _with_tied(self, modules: tuple[str, ...]) -> set[str]:
        """`modules`, plus the other half of a tied embedding / head pair."""
        wanted, embedding = set(modules), {"model.embed_tokens", "lm_head"}
        if self.model.config.tie_word_embeddings and wanted & embedding:
            wanted |= embedding
        return wanted

    def capture(self, input_ids: torch.Tensor, device: torch.device, offload: str = "cpu",
                workdir: Path | None = None) -> LayerInputs:
        """engine.capture_layer_inputs of input_ids [n, seq], reading only the embedding rows these
        samples use (a few thousand of Gemma 3's 262,144: 671 MiB in fp32 for the whole matrix); the
        ids are renumbered into those rows for the capture, which a row lookup cannot tell apart.
        The rows go back to `meta` right after: no stage needs them past the layer-0 inputs."""
        embed = self.model.model.embed_tokens
        used, local_ids = torch.unique(input_ids, return_inverse=True)
        name = "model.embed_tokens.weight"
        if name not in self._where:
            raise ModelError(f"{self.path}: {name} missing from the safetensors files; the checkpoint is incomplete")
        rows = read_rows(self._where[name], name, used)  # [used, hidden] float32
        padding, embed.padding_idx = embed.padding_idx, None  # an index into the full matrix, not the rows
        skeleton = embed.weight  # [vocab, hidden] on `meta`, what later loads of the embedding (or tied head) fill
        embed.weight = torch.nn.Parameter(torch.empty(0, rows.shape[1]), requires_grad=False)
        for key, buf in list(embed.named_buffers(recurse=False)):
            embed.register_buffer(key, torch.empty_like(buf, device="cpu"), persistent=key not in embed._non_persistent_buffers_set)
        _init_buffers(self.model, embed)
        embed.weight = torch.nn.Parameter(rows, requires_grad=False)
        try:
            return capture_layer_inputs(self.model, local_ids.view_as(input_ids), device, offload=offload, workdir=workdir)
        finally:
            embed.padding_idx, embed.weight = padding, skeleton
            self.release_rest(EMBED)
            trim_heap()

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor of the source checkpoint, read from its file, as float32 on CPU."""
        return self._read([name])[name]

    def head_name(self) -> str:
        """The checkpoint name of the LM head's weight (the embedding matrix when tied)."""
        if self.model.config.tie_word_embeddings or "lm_head.weight" not in self._where:
            if not self.model.config.tie_word_embeddings:
                raise ModelError(f"{self.path}: lm_head.weight missing and embeddings are not tied; the checkpoint is incomplete")
            return "model.embed_tokens.weight"
        return "lm_head.weight"

    def head_blocks(self, rows: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor | None]]:
        """(first row, weight [<=rows, hidden], bias [<=rows] or None) of the LM head, float32 on CPU, in
        blocks of `rows` vocabulary rows. Each block is read from the file when reached, through a file
        handle of its own: safetensors maps the file, and pages touched through a handle left open stay
        resident, so the whole head would be in memory by the last block."""
        weight, bias = self.head_name(), ("lm_head.bias" if "lm_head.bias" in self._where else None)
        with safe_open(str(self._where[weight]), framework="pt") as handle:
            vocab = handle.get_slice(weight).get_shape()[0]
        for start in range(0, vocab, rows):
            stop = min(start + rows, vocab)
            yield start, self._rows(weight, start, stop), (self._rows(bias, start, stop) if bias else None)

    def _rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        with safe_open(str(self._where[name]), framework="pt") as handle:
            return handle.get_slice(name)[start:stop].to(torch.float32)

    def has_tensor(self, name: str) -> bool:
        return name in self._where

    def _read(self, names: list[str]) -> dict[str, torch.Tensor]:
        return _read(self._where, names)

    def without_spill(self) -> LazyModel:
        """A loader over the same model that drops layers after use (read-only passes, dense twins)."""
        return LazyModel(self.model, self.path, self._where, None)

    def load(self, i: int, layer: torch.nn.Module) -> None:
        """Materialise decoder layer i on CPU from the source files (or its spill file)."""
        state = self.layer_state(i, layer)
        layer.to_empty(device="cpu")
        _assign(layer, state)

    def layer_state(self, i: int, layer: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
        """Decoder layer i's tensors by name within the layer: from its spill file once processed,
        else from the source files. `layer`: the module whose names to read (default: layer i)."""
        trim_heap()  # what the previous layer freed goes back to the OS before this one is read
        spill = self._spill_path(i)
        if spill is not None and i in self._spilled:
            return read_tensors(spill)
        prefix = f"model.layers.{i}."
        layer = layer if layer is not None else self.model.model.layers[i]
        names = [prefix + k for k in layer.state_dict()]
        return {k[len(prefix):]: v for k, v in self._read(names).items()}

    def release(self, i: int, layer: torch.nn.Module) -> None:
        """Spill the processed layer to disk (when a spill dir is set) and return it to `meta`."""
        spill = self._spill_path(i)
        if spill is not None:
            with atomic_path(spill) as tmp:
                save_file({k: v.detach().contiguous().cpu() for k, v in layer.state_dict().items()}, str(tmp))
            self._spilled.add(i)
        layer.to("meta")
        trim_heap()

    def _spill_path(self, i: int) -> Path | None:
        return Path(self.spill_dir) / f"spill_{i:03d}.safetensors" if self.spill_dir is not None else None

    def save(self, out_dir: Path, tokenizer: Any, extra_files: dict[str, str] | None = None) -> None:
        """Write a sharded HF directory from the spilled layers and the source's non-layer tensors
        (one layer or one tensor in memory at a time)."""
        extra_files = with_provenance(self.path, extra_files)
        layers = self.model.model.layers
        weight_map: dict[str, str] = {}
        total = 0
        with atomic_dir(Path(out_dir)) as tmp:
            for i, layer in enumerate(layers):
                self.load(i, layer)
                shard = f"model-layer-{i:03d}.safetensors"
                state = {f"model.layers.{i}.{k}": v.detach().contiguous() for k, v in layer.state_dict().items()}
                save_file(state, str(tmp / shard), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(state, shard))
                total += sum(v.numel() * v.element_size() for v in state.values())
                layer.to("meta")
            for j, name in enumerate(self._rest_names()):  # unchanged by every stage: copied from the source
                shard = f"model-rest-{j:02d}.safetensors"
                total += copy_as_float32(self._where[name], name, tmp / shard)
                weight_map[name] = shard
            (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
            self.model.config.save_pretrained(tmp)
            if self.model.generation_config is not None:
                self.model.generation_config.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            for name, text in (extra_files or {}).items():
                (tmp / name).write_text(text)

    def _rest_names(self) -> list[str]:
        """The checkpoint names of the non-layer tensors a saved model holds (the tied head is the embedding)."""
        tied = bool(self.model.config.tie_word_embeddings)
        names = [k for k in self.model.state_dict() if not k.startswith("model.layers.") and not (k == "lm_head.weight" and tied)]
        missing = [k for k in names if k not in self._where]
        if missing:
            raise ModelError(f"{self.path}: {missing[0]} missing from the safetensors files; the checkpoint is incomplete")
        return names


def capture_inputs(model, loader: Any, input_ids: torch.Tensor, device: torch.device, offload: str = "cpu",
                   workdir: Path | None = None) -> LayerInputs:
    """Layer-0 inputs of input_ids [n, seq] for the model a stage walks: a streamed model (`loader` a
    LazyModel) reads its embedding matrix only for this (LazyModel.capture); a resident one embeds in place."""
    if isinstance(loader, LazyModel):
        return loader.capture(input_ids, device, offload, workdir)
    return capture_layer_inputs(model, input_ids, device, offload=offload, workdir=workdir)


def _init_buffers(model, module: torch.nn.Module) -> None:
    """Fill the non-persistent buffers `to_empty` left uninitialised (they are not in the checkpoint),
    e.g. Gemma's embedding scale sqrt(hidden), with the model's own initialiser. The initialiser also
    writes the module's parameters, which the checkpoint replaces right after: it sees stand-ins
    without elements instead, so that an embedding matrix is not written whole (every page of it
    resident) only to be thrown away."""
    for sub in module.modules():
        if getattr(sub, "_non_persistent_buffers_set", None):
            params, padding = dict(sub._parameters), getattr(sub, "padding_idx", None)
            for key, param in params.items():
                if param is not None:
                    sub._parameters[key] = torch.nn.Parameter(torch.empty(0, device=param.device), requires_grad=False)
            if padding is not None:
                sub.padding_idx = None
            try:
                model._init_weights(sub)
            finally:
                sub._parameters.update(params)
                if padding is not None:
                    sub.padding_idx = padding


def _assign(layer: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """The tensors of `state` become the layer's weights (no copy: each weight is in memory once)."""
    missing, unexpected = layer.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ModelError(f"layer weights do not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")

