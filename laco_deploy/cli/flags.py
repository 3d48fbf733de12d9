"""Settings -> flags. Library errors name settings (`prune.sparsity`, config.py); when the CLI
prints one it shows the flag of the command that ran (`--sparsity`), so flag names live only here
and in the command modules. A setting the command has no flag for stays as it is: that is the key
to fix in a `--config` YAML file."""

from __future__ import annotations

import re

import click

SECTIONS = ("model", "data", "prune", "compensate", "fidelity", "export", "bench")

# The settings each command's flags set (other sections' fields keep their setting name).
COMMAND_SECTIONS = {
    "build": SECTIONS,
    "prune": ("model", "data", "prune"),
    "compensate": ("model", "data", "compensate"),
    "fidelity": ("model", "data", "fidelity"),
    "export": ("model", "export"),
    "bench": ("bench",),
    "plan": ("model", "data", "prune"),
    "inspect": ("model",),
}

# Where a flag is not `--` + the field name with dashes: (command or "*", setting) -> flag,
# or None where the command's flag of that name sets another setting.
RENAMED: dict[tuple[str, str], str | None] = {
    ("*", "prune.sparsegpt_damp"): "--damp",
    ("*", "prune.sparsegpt_blocksize"): "--blocksize",
    ("compensate", "model.model"): "--dense",
    ("fidelity", "model.model"): "--dense",
    ("build", "compensate.method"): "--recover",  # build's --method is prune.method
    ("build", "compensate.samples"): None,  # build's --samples is data.samples
}

_SETTING = re.compile(rf"\b({'|'.join(SECTIONS)})\.([a-z][a-z0-9_]*)\b")


def command_flags(group: click.Group, name: str | None) -> set[str]:
    """Every option string of command `name` (and of its subcommands, for a group like bench)."""
    cmd = group.commands.get(name) if name else None
    todo, flags = [cmd] if cmd is not None else [], set()
    while todo:
        c = todo.pop()
        flags |= {o for p in c.params for o in (*p.opts, *p.secondary_opts)}
        if isinstance(c, click.Group):
            todo += list(c.commands.values())
    return flags


def flag_for(setting: str, command: str | None, flags: set[str]) -> str | None:
    """The flag of `command` that sets `setting` (e.g. "prune.sparsegpt_damp" -> "--damp"), or None."""
    for key in ((command, setting), ("*", setting)):
        if key in RENAMED:
            flag = RENAMED[key]
            return flag if flag in flags else None
    section, _, field = setting.partition(".")
    if section not in COMMAND_SECTIONS.get(command or "", ()):
        return None
    flag = "--" + field.replace("_", "-")
    return flag if flag in flags else None


def with_flags(message: str, command: str | None, flags: set[str]) -> str:
    """`message` with each setting name the command has a flag for replaced by that flag."""
    return _SETTING.sub(lambda m: flag_for(m.group(0), command, flags) or m.group(0), message)
