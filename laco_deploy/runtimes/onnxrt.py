"""onnxruntime backend: a KV-cache decoder session, the CausalRunner adapter and greedy generation.

`OrtDecoder` drives an export folder written by exporters.onnx (optimum's input/output names:
input_ids, attention_mask, position_ids, past_key_values.N.key/value -> logits, present.N.*).
It is the documented equivalent of optimum's `ORTModelForCausalLM` generate loop, which cannot
be installed next to transformers 5. Keys and values stay in onnxruntime memory between steps
(IO binding), so the same code runs on the CPU and the CUDA execution provider.

This module imports numpy and onnxruntime only (torch lazily in OrtRunner), so the benchmark's
child process (bench/onnxrt_bench.py) measures the runtime's memory, not PyTorch's.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from laco_deploy.errors import RuntimeBackendError
from laco_deploy.runtimes.cpu import physical_cores
from laco_deploy.targets import ONNX

log = logging.getLogger(__name__)

MODEL_FILE = ONNX.folder_marker  # "model.onnx" in an export folder
_NP_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}


def model_file(path: Path) -> Path:
    """An export folder or an .onnx file -> the .onnx file."""
    path = Path(path)
    candidate = path / MODEL_FILE if path.is_dir() else path
    if not candidate.is_file():
        raise RuntimeBackendError(f"no ONNX model at {candidate}; pass an export folder holding {MODEL_FILE} (export.target onnx) or an .onnx file")
    return candidate


def providers_for(device: str) -> tuple[list, str, int]:
    """device 'cpu' | 'cuda' | 'cuda:N' -> (onnxruntime providers list, ORT device type, device id)."""
    import onnxruntime as ort

    if device == "cpu":
        return ["CPUExecutionProvider"], "cpu", 0
    if device == "cuda" or device.startswith("cuda:"):
        dev_id = int(device.partition(":")[2] or 0)
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise RuntimeBackendError(
                f"device {device} needs onnxruntime's CUDAExecutionProvider, which this onnxruntime lacks "
                f"(has {', '.join(ort.get_available_providers())}); pip install 'laco-deploy[gpu]' (onnxruntime-gpu) or run on cpu")
        return [("CUDAExecutionProvider", {"device_id": dev_id}), "CPUExecutionProvider"], "cuda", dev_id
    raise RuntimeBackendError(f"device {device!r} is not one of cpu, cuda, cuda:N for onnxruntime")


def _session_options(threads: int, external: dict[str, np.ndarray]) -> tuple[Any, list]:
    """Session options (threads, full graph optimisation) and the OrtValues of densified weights,
    which onnxruntime borrows: the caller keeps them alive as long as the session."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    values = [ort.OrtValue.ortvalue_from_numpy(a) for a in external.values()]
    if values:
        so.add_external_initializers(list(external), values)
    return so, values


class OrtDecoder:
    """One onnxruntime session over a KV-cache decoder graph; numpy in, numpy out."""

    def __init__(self, path: Path, device: str = "cpu", threads: int | None = None):
        import onnxruntime as ort

        from exporters import onnx_sparse

        self.file = model_file(path)
        self.threads = threads or physical_cores()
        providers, self.device_type, self.device_id = providers_for(device)
        external = onnx_sparse.external_initializers(self.file.parent) if onnx_sparse.needs_densify(self.file.parent) else {}
        self._options, self._borrowed = _session_options(self.threads, external)
        try:
            self.session = ort.InferenceSession(str(self.file), self._options, providers=providers)
        except Exception as e:  # onnxruntime raises its own Fail/InvalidGraph/... types
            raise RuntimeBackendError(f"onnxruntime cannot load {self.file}: {str(e).splitlines()[0][:300]}; re-export it with export.target onnx") from e
        self.provider = self.session.get_providers()[0]
        if self.device_type == "cuda" and self.provider != "CUDAExecutionProvider":
            raise RuntimeBackendError(f"onnxruntime fell back to {self.provider} for device {device}; check the CUDA and cuDNN libraries that onnxruntime-gpu needs")
        self._read_signature()

    def _read_signature(self) -> None:
        inputs = {i.name: i for i in self.session.get_inputs()}
        missing = {"input_ids", "attention_mask", "position_ids"} - set(inputs)
        if missing:
            raise RuntimeBackendError(f"{self.file} lacks inputs {sorted(missing)}: not a laco-deploy/optimum decoder export; re-export it")
        self.past_names = [n for n in inputs if n.startswith("past_key_values.")]
        self.present_names = [o.name for o in self.session.get_outputs() if o.name.startswith("present.")]
        if len(self.past_names) != len(self.present_names) or not self.past_names:
            raise RuntimeBackendError(f"{self.file} has {len(self.past_names)} past inputs and {len(self.present_names)} present outputs; re-export it with KV cache")
        self.kv_dtype = _NP_TYPES[inputs[self.past_names[0]].type]
        self.kv_dims = {n: (inputs[n].shape[1], inputs[n].shape[3]) for n in self.past_names}  # (heads, head_dim)
        logits = next(o for o in self.session.get_outputs() if o.name == "logits")
        vocab = logits.shape[-1]
        self.logits_vocab = vocab if isinstance(vocab, int) else None  # None: onnxruntime allocates the output
        self.logits_dtype = _NP_TYPES.get(logits.type, np.float32)

    def empty_past(self, batch: int) -> list:
        """Zero-length keys/values for a prefill: [batch, kv_heads, 0, head_dim] per past input."""
        import onnxruntime as ort

        return [ort.OrtValue.ortvalue_from_numpy(np.zeros((batch, h, 0, d), dtype=self.kv_dtype), self.device_type, self.device_id)
                for h, d in self.kv_dims.values()]

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, past: list) -> tuple[np.ndarray, list]:
        """input_ids/position_ids [b, s], attention_mask [b, p + s], past (OrtValues) ->
        (logits [b, s, vocab] float32 numpy, present OrtValues kept on the device)."""
        binding = self.session.io_binding()
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64))
        binding.bind_cpu_input("attention_mask", np.ascontiguousarray(attention_mask, dtype=np.int64))
        binding.bind_cpu_input("position_ids", np.ascontiguousarray(position_ids, dtype=np.int64))
        for name, value in zip(self.past_names, past):
            binding.bind_ortvalue_input(name, value)
        logits = self._bind_logits(binding, input_ids.shape)
        for name in self.present_names:
            binding.bind_output(name, self.device_type, self.device_id)
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        if logits is None:
            logits = outputs[0].numpy()
        return logits.astype(np.float32, copy=False), list(outputs[1:])

    def _bind_logits(self, binding, ids_shape: tuple[int, ...]) -> np.ndarray | None:
        """The logits written straight into a numpy array of ours: bound to an onnxruntime buffer,
        they were copied out of it, and both copies ([seq, vocab] each, 48 MiB at 256 x 49,152) were
        alive at once. Returns that array, or None where the graph leaves the vocabulary unnamed."""
        if self.logits_vocab is None:
            binding.bind_output("logits", "cpu")
            return None
        out = np.empty((*ids_shape, self.logits_vocab), dtype=self.logits_dtype)
        binding.bind_output("logits", "cpu", 0, out.dtype, list(out.shape), out.ctypes.data)
        return out

    def prefill(self, ids: np.ndarray) -> tuple[np.ndarray, list]:
        """ids [seq] -> (logits [seq, vocab], present) with an empty past."""
        n = ids.shape[0]
        logits, present = self.forward(ids[None], np.ones((1, n), np.int64), np.arange(n)[None], self.empty_past(1))
        return logits[0], present

    def step(self, token: int, position: int, past: list) -> tuple[np.ndarray, list]:
        """One decode step for a single sequence: token at `position` -> (logits [vocab], present)."""
        logits, present = self.forward(np.array([[token]]), np.ones((1, position + 1), np.int64), np.array([[position]]), past)
        return logits[0, -1], present

    def generate(self, prompt: np.ndarray, max_new_tokens: int, eos_token_id: int | list[int] | None = None) -> list[int]:
        """Greedy decoding with KV cache: prompt [seq] -> the new token ids (stops after EOS)."""
        eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
        logits, past = self.prefill(np.asarray(prompt, dtype=np.int64))
        token, out, pos = int(logits[-1].argmax()), [], int(prompt.shape[0])
        while True:
            out.append(token)
            if token in eos or len(out) >= max_new_tokens:
                return out
            step_logits, past = self.step(token, pos, past)
            token, pos = int(step_logits.argmax()), pos + 1


class OrtRunner:
    """CausalRunner over an ONNX export: logits of one sequence from a prefill with empty past."""

    name = ONNX.runtime

    def __init__(self, path: Path, device: str = "cpu", threads: int | None = None):
        self.decoder = OrtDecoder(Path(path), device=str(device), threads=threads)
        self.provider, self.threads = self.decoder.provider, self.decoder.threads

    def logits(self, input_ids):
        """input_ids [seq] int64 (torch or numpy) -> [seq, vocab] float32 torch tensor on CPU."""
        import torch

        ids = input_ids.detach().cpu().numpy() if isinstance(input_ids, torch.Tensor) else np.asarray(input_ids)
        logits, _ = self.decoder.prefill(ids.astype(np.int64).reshape(-1))
        return torch.from_numpy(np.ascontiguousarray(logits))

    def generate(self, prompt, max_new_tokens: int, eos_token_id=None) -> list[int]:
        return self.decoder.generate(np.asarray(prompt, dtype=np.int64).reshape(-1), max_new_tokens, eos_token_id)
