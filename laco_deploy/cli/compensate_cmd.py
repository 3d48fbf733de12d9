"""`laco-deploy compensate` (being built; see the issue tracker)."""

from __future__ import annotations

from laco_deploy.cli import app
from laco_deploy.errors import ConfigError


@app.command("compensate")
def compensate_command() -> None:
    """Not available yet in this build."""
    raise ConfigError("'compensate' is not available yet in this version")
