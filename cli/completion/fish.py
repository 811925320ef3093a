"""Renders the fish script: one ``complete`` line per option and subcommand, guarded by a condition."""

from __future__ import annotations

import re

from .model import Command, Value
from .script import header

HOW_TO_LOAD = "Install as ~/.config/fish/completions/{prog}.fish, or `source` it."

_VALUE_FLAGS = {
    "file": "-r -F",
    "dir": "-x -a '(__fish_complete_directories (commandline -ct))'",
    "none": "-x",
}


def _quote(text: str) -> str:
    """Fish single quotes only treat backslash and the quote specially."""
    if re.fullmatch(r"[\w.,+:/@=-]+", text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _condition(cmd: Command) -> str:
    """Every word of the path seen, and none of its subcommands yet.

    At the top level ``not __fish_seen_subcommand_from CHILDREN`` is used
    rather than ``__fish_use_subcommand``, which takes the value of a global
    option (``--config FILE``) for a subcommand and then offers nothing.
    """
    parts = [f"__fish_seen_subcommand_from {_quote(p)}" for p in cmd.path[1:]]
    if cmd.subcommands:
        children = " ".join(_quote(s.name) for s in cmd.subcommands)
        parts.append(f"not __fish_seen_subcommand_from {children}")
    return "; and ".join(parts)


def _names(names: tuple[str, ...]) -> str:
    """Fish wants -l for --long, -s for -x and -o for old-style -long."""
    out = []
    for name in names:
        if name.startswith("--"):
            out.append(f"-l {_quote(name[2:])}")
        elif name.startswith("-") and len(name) == 2:
            out.append(f"-s {_quote(name[1:])}")
        elif name.startswith("-"):
            out.append(f"-o {_quote(name[1:])}")
    return " ".join(out)


def _value_flags(value: Value | None) -> str:
    if value is None:
        return ""
    if value.kind == "choice":
        return "-x -a " + _quote(" ".join(_quote(c) for c in value.choices))
    return _VALUE_FLAGS[value.kind]


def _description(text: str) -> str:
    return f"-d {_quote(text)}" if text else ""


def _complete(prog: str, condition: str, *parts: str) -> str:
    """One ``complete`` line; empty parts are left out."""
    words = ["complete", "-c", _quote(prog)]
    if condition:
        words += ["-n", _quote(condition)]
    return " ".join(words + [p for p in parts if p])


def _command_lines(cmd: Command, prog: str) -> list[str]:
    cond = _condition(cmd)
    lines = [f"# {' '.join(cmd.path)}"]
    for opt in cmd.options:
        lines.append(_complete(prog, cond, _names(opt.names), _value_flags(opt.value), _description(opt.help)))
    for sub in cmd.subcommands:
        lines.append(_complete(prog, cond, "-a", _quote(sub.name), _description(sub.help)))
    if cmd.takes_args and not cmd.subcommands:
        lines.append(_complete(prog, cond, "-F"))
    return lines


def render(root: Command, prog: str) -> str:
    lines = [header(prog, "fish", HOW_TO_LOAD.format(prog=prog)), ""]
    lines += ["# No file names unless an option or argument wants them.", _complete(prog, "", "-f")]
    for cmd in root.walk():
        lines += [""] + _command_lines(cmd, prog)
    return "\n".join(lines) + "\n"
