"""Exporters from a Hugging Face model directory to edge formats: GGUF (llama.cpp) and ONNX."""
