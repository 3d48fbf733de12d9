"""Settings -> flags. Library errors and log lines name settings (`prune.sparsity`, config.py); when
the CLI shows one it writes the flag of the command that ran (`--sparsity`), so flag names live only
here and in the command modules. A setting of a stage the command does not run is shown as the stage
command's flag (`export.sparse_storage` in `bench run` -> `laco-deploy export --sparse-storage`); a
setting the command runs but has no flag for stays as it is: that is the key to fix in a `--config`
YAML file."""

from __future__ import annotations

import re
from typing import Any, Iterator

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
    "imatrix": ("model", "data"),
}
# The command whose flags set a stage's settings, named when another command's message mentions one.
HOME = {"prune": "prune", "compensate": "compensate", "fidelity": "fidelity", "export": "export", "bench": "bench"}

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

# `section.field`, not inside a path (out/fidelity.json) and not a file name (fidelity.json, model.safetensors)
_FILE_TYPES = "json|jsonl|md|html|log|yaml|yml|txt|gguf|onnx|safetensors|bin|pt|csv|partial|ckpt"
_SETTING = re.compile(rf"(?<![\w./\\-])({'|'.join(SECTIONS)})\.(?!(?:{_FILE_TYPES})\b)([a-z][a-z0-9_]*)\b")

_running: tuple[Any, str | None] | None = None  # (the root group, the command) of this run


def use(group: Any, command: str | None) -> None:
    """Remember the running command, so that `user_text` shows its flags."""
    global _running
    _running = (group, command)


def user_text(message: str) -> str:
    """`message` as the user of the running command should read it (unchanged outside the CLI)."""
    return message if _running is None else with_flags(message, *_running)


def running_has(flag: str) -> bool:
    """Whether the running command takes `flag` (e.g. --resume), for messages that suggest it."""
    return _running is not None and flag in command_flags(*_running)


def _commands(group: Any, name: str) -> Iterator[tuple[str, Any]]:
    """Command `name` and, for a group like bench, each subcommand as ("bench run", command)."""
    todo = [(name, group.commands.get(name))]
    while todo:
        path, cmd = todo.pop(0)
        if hasattr(cmd, "commands"):  # a group (typer may vendor its own click: no isinstance)
            todo += [(f"{path} {n}", c) for n, c in cmd.commands.items()]
        elif cmd is not None:
            yield path, cmd


def _options(cmd: Any) -> set[str]:
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}


def command_flags(group: Any, name: str | None) -> set[str]:
    """Every option string of command `name` (and of its subcommands, for a group like bench)."""
    return {o for _, c in _commands(group, name or "") for o in _options(c)}


def _own_flag(setting: str, command: str | None, flags: set[str]) -> str | None:
    for key in ((command, setting), ("*", setting)):
        if key in RENAMED:
            flag = RENAMED[key]
            return flag if flag in flags else None
    flag = "--" + setting.partition(".")[2].replace("_", "-")
    return flag if flag in flags else None


def flag_for(setting: str, command: str | None, group: Any) -> str | None:
    """How the user of `command` sets `setting`: its flag (prune.sparsegpt_damp -> "--damp"), the
    stage command's flag when `command` does not run that stage ("laco-deploy export --quant"), or None."""
    section = setting.partition(".")[0]
    if section in COMMAND_SECTIONS.get(command or "", ()):
        return _own_flag(setting, command, command_flags(group, command))
    home = HOME.get(section)
    for path, cmd in _commands(group, home) if home else ():
        flag = _own_flag(setting, home, _options(cmd))
        if flag:
            return f"laco-deploy {path} {flag}"
    return None


def with_flags(message: str, group: Any, command: str | None) -> str:
    """`message` with each setting name replaced by the way the user of `command` sets it."""
    return _SETTING.sub(lambda m: flag_for(m.group(0), command, group) or m.group(0), message)
