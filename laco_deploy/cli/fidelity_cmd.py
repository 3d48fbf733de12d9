"""`laco-deploy fidelity` (being built; see the issue tracker)."""

from __future__ import annotations

from laco_deploy.cli import app
from laco_deploy.errors import ConfigError


@app.command("fidelity")
def fidelity_command() -> None:
    """Not available yet in this build."""
    raise ConfigError("'fidelity' is not available yet in this version")
