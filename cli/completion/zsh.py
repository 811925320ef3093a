"""Renders the zsh script: one ``_arguments`` function per command, groups delegating to children.

The file works both autoloaded from $fpath (as ``_PROG``) and sourced after compinit.
"""

from __future__ import annotations

import re

from .model import Command, Option, Value
from .script import function_name, header

HOW_TO_LOAD = "Install as `_{prog}` in a directory on $fpath, or `source` it after compinit."

_FOOTER = """
if [[ ${{zsh_eval_context[-1]}} == loadautofunc ]]; then
    # Autoloaded from $fpath: this file is the body of {fn}, so complete now.
    {fn} "$@"
elif (( $+functions[compdef] )); then
    compdef {fn} {prog}
else
    print -u2 "{prog}: run 'autoload -Uz compinit && compinit' before loading this file"
fi
"""

_PATH_ACTIONS = {"file": "_files", "dir": "_files -/", "none": " "}


def _quote(text: str) -> str:
    """Single quotes protect everything in zsh except the quote itself."""
    return "'" + text.replace("'", "'\\''") + "'"


def _escape(text: str, chars: str) -> str:
    """Backslash-escape characters that are special inside _arguments specs."""
    return "".join("\\" + ch if ch in chars or ch == "\\" else ch for ch in text)


def _action(value: Value) -> str:
    if value.kind == "choice":
        return "(" + " ".join(_escape(c, " ()[]:'\"$`") for c in value.choices) + ")"
    return _PATH_ACTIONS[value.kind]


def _option_specs(opt: Option) -> list[str]:
    """One _arguments spec per spelling, excluding the other spellings."""
    prefix = "*" if opt.repeatable else f"({' '.join(opt.names)})"
    desc = f"[{_escape(opt.help, '[]')}]" if opt.help else ""
    specs = []
    for name in opt.names:
        spec = prefix + name
        if opt.value is not None:
            spec += "=" if name.startswith("--") else "+"
            spec += f"{desc}:{_escape(opt.label, ':')}:{_action(opt.value)}"
        else:
            spec += desc
        specs.append(_quote(spec))
    return specs


def _arguments(cmd: Command, flags: str, positional: list[str]) -> str:
    specs = [s for o in cmd.options for s in _option_specs(o)] + positional
    return " \\\n".join([f"    _arguments {flags}"] + [f"        {s}" for s in specs])


def _leaf(cmd: Command) -> str:
    positional = ["'*:file:_files'"] if cmd.takes_args else []
    return f"{function_name(*cmd.path)}() {{\n{_arguments(cmd, '-s', positional)}\n}}\n"


def _group(cmd: Command) -> str:
    """A group completes its options, then a subcommand, then delegates to the subcommand's function."""
    arguments = _arguments(cmd, "-s -C", ["'1: :->command'", "'*:: :->argument'"])
    items = "".join(
        f"                {_quote(_escape(s.name, ':') + ':' + s.help)}\n" for s in cmd.subcommands
    )
    arms = "".join(
        f"                {_quote(s.name)}) {function_name(*s.path)} && ret=0 ;;\n" for s in cmd.subcommands
    )
    title = _quote(" ".join(cmd.path) + " command")
    context = re.sub(r"[^\w-]", "_", "-".join(cmd.path))
    return (
        f"{function_name(*cmd.path)}() {{\n"
        "    local curcontext=$curcontext state state_descr line ret=1\n"
        "    typeset -A opt_args\n"
        f"{arguments} && ret=0\n"
        "    case $state in\n"
        "        command)\n"
        f"            local -a commands=(\n{items}            )\n"
        f"            _describe -t commands {title} commands && ret=0\n"
        "            ;;\n"
        "        argument)\n"
        f"            curcontext=${{curcontext%:*:*}}:{context}-$words[1]:\n"
        "            case $words[1] in\n"
        f"{arms}"
        "            esac\n"
        "            ;;\n"
        "    esac\n"
        "    return ret\n"
        "}\n"
    )


def render(root: Command, prog: str) -> str:
    functions = [_group(cmd) if cmd.subcommands else _leaf(cmd) for cmd in root.walk()]
    return (
        f"#compdef {prog}\n{header(prog, 'zsh', HOW_TO_LOAD.format(prog=prog))}\n\n"
        + "\n".join(functions)
        + _FOOTER.format(fn=function_name(prog), prog=prog)
    )
