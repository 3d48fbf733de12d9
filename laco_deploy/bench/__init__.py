"""Runtime benchmarks (onnxruntime, llama.cpp) and the regression compare."""
