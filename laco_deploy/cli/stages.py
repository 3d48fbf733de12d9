"""Imports every command module so that each registers its command on the app."""

from laco_deploy.cli import (  # noqa: F401
    build_cmd,
    bench_cmd,
    compensate_cmd,
    export_cmd,
    fidelity_cmd,
    imatrix_cmd,
    inspect_cmd,
    plan_cmd,
    prune_cmd,
)
