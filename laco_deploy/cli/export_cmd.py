"""`laco-deploy export` (being built; see the issue tracker)."""

from __future__ import annotations

from laco_deploy.cli import app
from laco_deploy.errors import ConfigError


@app.command("export")
def export_command() -> None:
    """Not available yet in this build."""
    raise ConfigError("'export' is not available yet in this version")
