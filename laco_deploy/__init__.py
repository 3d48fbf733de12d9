"""laco-deploy: prune an LLM, repair it with LaCo layer-wise compensation, check its fidelity
against the dense model, and export it to GGUF (llama.cpp) or ONNX (onnxruntime)."""

__version__ = "0.1.0"
