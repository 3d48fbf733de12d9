"""Versions of Python, laco-deploy and the libraries that shape results: one list, one collector.

Recorded in every build manifest, fidelity report and benchmark-suite result.
"""

from __future__ import annotations

import platform
from importlib import metadata

from laco_deploy import __version__

DISTRIBUTIONS = ("torch", "transformers", "safetensors", "numpy", "gguf", "onnx", "onnxruntime", "onnxruntime-gpu",
                 "llama-cpp-python", "matplotlib", "lm_eval")


def package_versions() -> dict[str, str]:
    """{"python", "laco_deploy", and each installed distribution of DISTRIBUTIONS} -> version string."""
    out = {"python": platform.python_version(), "laco_deploy": __version__}
    for name in DISTRIBUTIONS:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out
