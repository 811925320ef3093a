"""Renders the bash script: lookup tables generated from the model, then the fixed driver.

Every table is a shell function with one ``case`` arm per command path, so the
script needs no associative arrays and runs in any bash since 3.2.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable

from .bash_driver import COMPLETE_FUNCTION
from .model import Command
from .script import function_name, header

HOW_TO_LOAD = "Load with `source FILE` (e.g. from ~/.bashrc) or install into bash_completion.d."


def _array(words: Iterable[str]) -> str:
    return "(" + " ".join(shlex.quote(w) for w in words) + ")"


def _key(*words: str) -> str:
    """Tables are keyed by the space-joined command path (and option name)."""
    return shlex.quote(" ".join(words))


def _table(name: str, doc: str, arms: list[str], default: str) -> str:
    body = "".join(f"        {arm}\n" for arm in arms)
    return f"# {doc}\n{name}() {{\n    case $1 in\n{body}        *) {default} ;;\n    esac\n}}\n"


def _tables(fn: str, commands: list[Command]) -> list[str]:
    words = f"{fn}_words"

    def words_arm(cmd: Command, items: Iterable[str]) -> str:
        return f"{_key(*cmd.path)}) {words}={_array(items)} ;;"

    value_arms = []
    for cmd in commands:
        for opt in cmd.options:
            if opt.value is None:
                continue
            keys = "|".join(_key(*cmd.path, name) for name in opt.names)
            choices = f" {words}={_array(opt.value.choices)}" if opt.value.choices else ""
            value_arms.append(f"{keys}) {fn}_kind={opt.value.kind}{choices} ;;")
    return [
        _table(
            f"{fn}_commands",
            "Subcommand names of the command PATH.",
            [words_arm(c, (s.name for s in c.subcommands)) for c in commands if c.subcommands],
            f"{words}=()",
        ),
        _table(
            f"{fn}_options",
            "Option names of the command PATH.",
            [words_arm(c, (n for o in c.options for n in o.names)) for c in commands],
            f"{words}=()",
        ),
        _table(
            f"{fn}_value",
            "How the value of an option completes, keyed by 'PATH OPTION' "
            "(none, choice, file, dir); empty kind for flags.",
            value_arms,
            f"{fn}_kind= {words}=()",
        ),
        _table(
            f"{fn}_takes_args",
            "Succeed when the command PATH takes positional arguments.",
            [f"{_key(*c.path)}) return 0 ;;" for c in commands if c.takes_args],
            "return 1",
        ),
    ]


def render(root: Command, prog: str) -> str:
    fn = function_name(prog)
    tables = "\n".join(_tables(fn, list(root.walk())))
    driver = COMPLETE_FUNCTION.format(fn=fn, root=shlex.quote(prog), prog=shlex.quote(prog))
    return header(prog, "bash", HOW_TO_LOAD) + "\n\n" + tables + driver
