"""Typed errors. Library code raises these; only the CLI turns them into messages and exit codes.

Every message names the bad value and the fix, in one line.
"""

from __future__ import annotations


class LacoError(Exception):
    """Base class: a problem the user can fix. The CLI prints it in one line and exits 2."""

    exit_code = 2


class ConfigError(LacoError):
    """An invalid setting or combination of settings."""


class ModelError(LacoError):
    """A model that cannot be found, read or handled (format, architecture, weights)."""


class DataError(LacoError):
    """Calibration or evaluation text that is missing, empty or too short."""


class TaskError(DataError):
    """A zero-shot task that is unknown, whose task file is missing or broken, or whose data is not on disk."""


class ExportError(LacoError):
    """An export that cannot be written for this model or setting."""


class RuntimeBackendError(LacoError):
    """onnxruntime or llama.cpp failed to load or run a model."""


class OutputError(LacoError):
    """An output path that cannot be written: permission, read-only file system, missing or blocked folder."""


class ResourceError(LacoError):
    """Out of disk space or memory."""


class GateFailed(LacoError):
    """A quality gate or regression check failed; the reports are still written. Exit 1."""

    exit_code = 1
