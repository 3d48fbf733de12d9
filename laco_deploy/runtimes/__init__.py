"""Runtimes that run an exported model: the CausalRunner interface (runner.py: PyTorch, and the
opener by target), llama.cpp (llamacpp.py, its log routing and AMX probe) and onnxruntime (onnxrt.py,
onnxruntime-genai in genai.py), and the parity checks run right after an export (parity.py).

Below both bench/ (which measures them) and fidelity/ (which scores them); nothing here imports
either."""
