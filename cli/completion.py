"""Static shell completion scripts for bash, zsh and fish.

Typer's own ``--show-completion`` scripts call back into the program on every
TAB, which is slow on HPC login nodes and cannot be reviewed.  Here the click
command tree is walked once and turned into plain shell code, so the scripts
can be committed under ``completions/`` and checked in tests.

The tree is first reduced to a small shell-neutral model (:class:`_Command`,
:class:`_Option`, :class:`_Value`); each shell renderer only reads that model.
"""

from __future__ import annotations

import inspect
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import PurePath
from typing import Any, get_args, get_origin

from typer import _click

SHELLS: tuple[str, ...] = ("bash", "zsh", "fish")


# --------------------------------------------------------------------------
# Shell-neutral model
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Value:
    """How a value is completed: ``none``, ``choice``, ``file`` or ``dir``."""

    kind: str
    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Option:
    """One visible option; ``value`` is None for flags, which take no value."""

    names: tuple[str, ...]
    label: str
    help: str
    value: _Value | None
    repeatable: bool


@dataclass(frozen=True)
class _Command:
    """One visible command; ``path`` starts with the program name."""

    path: tuple[str, ...]
    help: str
    options: tuple[_Option, ...]
    takes_args: bool
    subcommands: tuple[_Command, ...]

    @property
    def name(self) -> str:
        return self.path[-1]


_NO_VALUE = _Value("none")


def _first_line(text: str | None) -> str:
    """Descriptions must fit on one line in every shell's menu."""
    for line in inspect.cleandoc(text or "").splitlines():
        line = line.strip()
        if line and line != "\b":
            return line
    return ""


def _choice_text(choice: Any) -> str:
    """Enum choices are typed on the command line by their value."""
    return str(choice.value) if isinstance(choice, Enum) else str(choice)


def _path_value(file_okay: bool, dir_okay: bool) -> _Value:
    """Only directory-only paths restrict the completion to directories."""
    return _Value("dir") if dir_okay and not file_okay else _Value("file")


def _is_path_list(annotation: Any) -> bool:
    """``list[Path]`` options are paths too, but typer's is_path says no."""
    if get_origin(annotation) is not list:
        return False
    args = get_args(annotation)
    return len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], PurePath)


def _typer_value(desc: Any) -> _Value:
    """Typer parameters describe their type with a ``TypeDescriptor``."""
    if desc.choices is not None:
        return _Value("choice", tuple(_choice_text(c) for c in desc.choices))
    if desc.is_file or desc.is_path or _is_path_list(desc.annotation):
        info = desc.parameter_info
        return _path_value(info.file_okay, info.dir_okay)
    return _NO_VALUE


def _click_value(ptype: Any) -> _Value:
    """Plain click parameters carry a ParamType (Choice, Path, File, ...)."""
    choices = getattr(ptype, "choices", None)
    if choices is not None:
        return _Value("choice", tuple(_choice_text(c) for c in choices))
    kinds = {cls.__name__ for cls in type(ptype).__mro__}
    if "Path" in kinds:
        return _path_value(ptype.file_okay, ptype.dir_okay)
    if "File" in kinds:
        return _Value("file")
    return _NO_VALUE


def _value_of(param: Any) -> _Value:
    """Classify a parameter's value, whichever click flavour built it."""
    desc = getattr(param, "type_descriptor", None)
    if desc is not None:
        return _typer_value(desc)
    return _click_value(getattr(param, "type", None))


def _option(param: Any) -> _Option:
    """Flags and counters take no value; everything else takes one."""
    is_flag = bool(getattr(param, "is_flag", False) or getattr(param, "count", False))
    # click builds the help option's names from a set: sort for output that never changes.
    names = tuple(sorted(param.opts, key=lambda n: (not n.startswith("--"), n))) + tuple(param.secondary_opts)
    return _Option(
        names=names,
        label=param.metavar or param.name or "value",
        help=_first_line(getattr(param, "help", None)),
        value=None if is_flag else _value_of(param),
        repeatable=bool(param.multiple or getattr(param, "count", False)),
    )


def _context(command: Any, name: str, parent: Any) -> Any:
    """A context is needed to get the help option (and its custom names)."""
    context_class = getattr(command, "context_class", _click.Context)
    settings = dict(getattr(command, "context_settings", None) or {})
    return context_class(command, parent=parent, info_name=name, **settings)


def _subcommands(command: Any, ctx: Any) -> Iterator[tuple[str, Any]]:
    """Visible subcommands in declaration order; leaves have none."""
    if not hasattr(command, "list_commands"):
        return
    for name in command.list_commands(ctx):
        sub = command.get_command(ctx, name)
        if sub is not None and not getattr(sub, "hidden", False):
            yield name, sub


def _build(command: Any, path: tuple[str, ...], parent: Any = None) -> _Command:
    """Walk the click tree once; renderers never touch click objects."""
    ctx = _context(command, path[-1], parent)
    params = command.get_params(ctx)
    options = tuple(
        _option(p)
        for p in params
        if p.param_type_name == "option" and not getattr(p, "hidden", False)
    )
    return _Command(
        path=path,
        help=_first_line(command.short_help or command.help),
        options=options,
        takes_args=any(p.param_type_name == "argument" for p in params),
        subcommands=tuple(
            _build(sub, path + (name,), ctx) for name, sub in _subcommands(command, ctx)
        ),
    )


def _walk(cmd: _Command) -> Iterator[_Command]:
    """Depth-first, declaration order: keeps the scripts stable."""
    yield cmd
    for sub in cmd.subcommands:
        yield from _walk(sub)


def _ident(*parts: str) -> str:
    """Shell function names may only use word characters."""
    return "_" + "_".join(re.sub(r"\W", "_", p) for p in parts)


_USAGE = {
    "bash": "# Load with `source FILE` (e.g. from ~/.bashrc) or install into bash_completion.d.",
    "zsh": "# Install as `_{prog}` in a directory on $fpath, or `source` it after compinit.",
    "fish": "# Install as ~/.config/fish/completions/{prog}.fish, or `source` it.",
}


def _header(shell: str, prog: str) -> str:
    """The marker line first (after #compdef for zsh), then how to load it."""
    marker = f"# Generated by `{prog} completion {shell}`; do not edit by hand."
    return marker + "\n" + _USAGE[shell].format(prog=prog)


# --------------------------------------------------------------------------
# bash
# --------------------------------------------------------------------------

_BASH_MAIN = r"""
# Append the WORDs that start with PREFIX to COMPREPLY.
{fn}_add_matches() {{
    local prefix=$1 word
    shift
    for word in "$@"; do
        if [[ $word == "$prefix"* ]]; then COMPREPLY+=("$word"); fi
    done
}}

# Append file (KIND=file) or directory (KIND=dir) names that start with PREFIX.
{fn}_add_paths() {{
    local prefix=$1 flag=-f line
    [[ $2 == dir ]] && flag=-d
    compopt -o filenames 2>/dev/null
    while IFS= read -r line; do
        COMPREPLY+=("$line")
    done < <(compgen "$flag" -- "$prefix")
}}

# Succeed when WORD is one of the following words.
{fn}_contains() {{
    local word=$1 item
    shift
    for item in "$@"; do
        if [[ $item == "$word" ]]; then return 0; fi
    done
    return 1
}}

{fn}_complete() {{
    local cur=${{COMP_WORDS[COMP_CWORD]}} path={root} word value_of= i=1 only_args=0
    local {fn}_kind {fn}_words
    COMPREPLY=()
    # Find the current (sub)command, skipping options and their values.
    while ((i < COMP_CWORD)); do
        word=${{COMP_WORDS[i]}}
        if ((only_args)); then
            :
        elif [[ $word == -- ]]; then
            only_args=1
        elif [[ $word == -* ]]; then
            {fn}_value "$path $word"
            if [[ -n ${fn}_kind ]]; then
                # bash splits --opt=value into --opt, =, value
                [[ ${{COMP_WORDS[i+1]-}} == = ]] && ((i++))
                ((i++))
                if ((i >= COMP_CWORD)); then value_of=$word; break; fi
            fi
        else
            {fn}_commands "$path"
            if {fn}_contains "$word" "${{{fn}_words[@]}}"; then path="$path $word"; fi
        fi
        ((i++))
    done
    if [[ -n $value_of ]]; then
        [[ $cur == = ]] && cur=
        {fn}_value "$path $value_of"
        case ${fn}_kind in
            choice) {fn}_add_matches "$cur" "${{{fn}_words[@]}}" ;;
            file | dir) {fn}_add_paths "$cur" "${fn}_kind" ;;
        esac
        return 0
    fi
    if [[ $cur == -* ]] && ((!only_args)); then
        {fn}_options "$path"
        {fn}_add_matches "$cur" "${{{fn}_words[@]}}"
        return 0
    fi
    {fn}_commands "$path"
    if ((${{#{fn}_words[@]}} && !only_args)); then
        {fn}_add_matches "$cur" "${{{fn}_words[@]}}"
    elif {fn}_takes_args "$path"; then
        {fn}_add_paths "$cur" file
    fi
    return 0
}}

complete -F {fn}_complete {prog}
"""


def _bash_words(words: tuple[str, ...]) -> str:
    return "(" + " ".join(shlex.quote(w) for w in words) + ")"


def _bash_key(*parts: str) -> str:
    return shlex.quote(" ".join(parts))


def _bash_case(fn: str, doc: str, arms: list[str], default: str) -> str:
    """All lookup tables are ``case`` statements keyed by the command path."""
    body = "".join(f"        {arm}\n" for arm in arms)
    return (
        f"# {doc}\n{fn}() {{\n    case $1 in\n{body}"
        f"        *) {default} ;;\n    esac\n}}\n"
    )


def _bash_value_arm(var: str, path: tuple[str, ...], names: tuple[str, ...], value: _Value) -> str:
    keys = "|".join(_bash_key(*path, name) for name in names)
    arm = f"{keys}) {var}_kind={value.kind}"
    if value.choices:
        arm += f" {var}_words={_bash_words(value.choices)}"
    return arm + " ;;"


def _render_bash(root: _Command, prog: str) -> str:
    fn = _ident(prog)
    cmds = list(_walk(root))
    tables = [
        _bash_case(
            f"{fn}_commands",
            "Subcommand names of the command PATH.",
            [
                f"{_bash_key(*c.path)}) {fn}_words="
                f"{_bash_words(tuple(s.name for s in c.subcommands))} ;;"
                for c in cmds
                if c.subcommands
            ],
            f"{fn}_words=()",
        ),
        _bash_case(
            f"{fn}_options",
            "Option names of the command PATH.",
            [
                f"{_bash_key(*c.path)}) {fn}_words="
                f"{_bash_words(tuple(n for o in c.options for n in o.names))} ;;"
                for c in cmds
            ],
            f"{fn}_words=()",
        ),
        _bash_case(
            f"{fn}_value",
            "How the value of an option completes, keyed by 'PATH OPTION' "
            "(none, choice, file, dir); empty kind for flags.",
            [
                _bash_value_arm(fn, c.path, o.names, o.value)
                for c in cmds
                for o in c.options
                if o.value is not None
            ],
            f"{fn}_kind= {fn}_words=()",
        ),
        _bash_case(
            f"{fn}_takes_args",
            "Succeed when the command PATH takes positional arguments.",
            [f"{_bash_key(*c.path)}) return 0 ;;" for c in cmds if c.takes_args],
            "return 1",
        ),
    ]
    main = _BASH_MAIN.format(fn=fn, root=shlex.quote(prog), prog=shlex.quote(prog))
    return _header("bash", prog) + "\n\n" + "\n".join(tables) + main


# --------------------------------------------------------------------------
# zsh
# --------------------------------------------------------------------------


def _zsh_quote(text: str) -> str:
    """Single quotes protect everything in zsh except the quote itself."""
    return "'" + text.replace("'", "'\\''") + "'"


def _zsh_escape(text: str, chars: str) -> str:
    """Backslash-escape characters that are special inside _arguments specs."""
    return "".join("\\" + ch if ch in chars or ch == "\\" else ch for ch in text)


def _zsh_action(value: _Value) -> str:
    if value.kind == "choice":
        words = " ".join(_zsh_escape(c, " ()[]:'\"$`") for c in value.choices)
        return f"({words})"
    if value.kind == "file":
        return "_files"
    if value.kind == "dir":
        return "_files -/"
    return " "


def _zsh_option_specs(opt: _Option) -> list[str]:
    """One _arguments spec per spelling, excluding the other spellings."""
    prefix = "*" if opt.repeatable else f"({' '.join(opt.names)})"
    desc = f"[{_zsh_escape(opt.help, '[]')}]" if opt.help else ""
    specs = []
    for name in opt.names:
        spec = prefix + name
        if opt.value is not None:
            spec += "=" if name.startswith("--") else "+"
            spec += f"{desc}:{_zsh_escape(opt.label, ':')}:{_zsh_action(opt.value)}"
        else:
            spec += desc
        specs.append(_zsh_quote(spec))
    return specs


def _zsh_arguments(cmd: _Command, extra: list[str], flags: str) -> str:
    specs = [s for o in cmd.options for s in _zsh_option_specs(o)] + extra
    lines = [f"    _arguments {flags}"] + [f"        {s}" for s in specs]
    return " \\\n".join(lines)


def _zsh_leaf(cmd: _Command, fn: str) -> str:
    extra = ["'*:file:_files'"] if cmd.takes_args else []
    return f"{fn}() {{\n{_zsh_arguments(cmd, extra, '-s')}\n}}\n"


def _zsh_group(cmd: _Command, fn: str) -> str:
    """A group completes its options, then a subcommand, then delegates."""
    arguments = _zsh_arguments(cmd, ["'1: :->command'", "'*:: :->argument'"], "-s -C")
    items = "".join(
        f"                {_zsh_quote(_zsh_escape(s.name, ':') + ':' + s.help)}\n"
        for s in cmd.subcommands
    )
    arms = "".join(
        f"                {_zsh_quote(s.name)}) {_ident(*s.path)} && ret=0 ;;\n"
        for s in cmd.subcommands
    )
    title = _zsh_quote(" ".join(cmd.path) + " command")
    context = re.sub(r"[^\w-]", "_", "-".join(cmd.path))
    return (
        f"{fn}() {{\n"
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


_ZSH_FOOTER = """
if [[ ${{zsh_eval_context[-1]}} == loadautofunc ]]; then
    # Autoloaded from $fpath: this file is the body of {fn}, so complete now.
    {fn} "$@"
elif (( $+functions[compdef] )); then
    compdef {fn} {prog}
else
    print -u2 "{prog}: run 'autoload -Uz compinit && compinit' before loading this file"
fi
"""


def _render_zsh(root: _Command, prog: str) -> str:
    fn = _ident(prog)
    functions = []
    for cmd in _walk(root):
        name = _ident(*cmd.path)
        if cmd.subcommands:
            functions.append(_zsh_group(cmd, name))
        else:
            functions.append(_zsh_leaf(cmd, name))
    return (
        f"#compdef {prog}\n{_header('zsh', prog)}\n\n"
        + "\n".join(functions)
        + _ZSH_FOOTER.format(fn=fn, prog=prog)
    )


# --------------------------------------------------------------------------
# fish
# --------------------------------------------------------------------------


def _fish_quote(text: str) -> str:
    """Fish single quotes only treat backslash and the quote specially."""
    if re.fullmatch(r"[\w.,+:/@=-]+", text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _fish_condition(cmd: _Command) -> str:
    """Every word of the path seen, and none of its subcommands yet.

    At the top level ``not __fish_seen_subcommand_from CHILDREN`` is used
    rather than ``__fish_use_subcommand``, which takes the value of a global
    option (``--config FILE``) for a subcommand and then offers nothing.
    """
    parts = [f"__fish_seen_subcommand_from {_fish_quote(p)}" for p in cmd.path[1:]]
    if cmd.subcommands:
        children = " ".join(_fish_quote(s.name) for s in cmd.subcommands)
        parts.append(f"not __fish_seen_subcommand_from {children}")
    return "; and ".join(parts)


def _fish_names(names: tuple[str, ...]) -> str:
    """Fish wants -l for --long, -s for -x and -o for old-style -long."""
    out = []
    for name in names:
        if name.startswith("--"):
            out.append(f"-l {_fish_quote(name[2:])}")
        elif name.startswith("-") and len(name) == 2:
            out.append(f"-s {_fish_quote(name[1:])}")
        elif name.startswith("-"):
            out.append(f"-o {_fish_quote(name[1:])}")
    return " ".join(out)


def _fish_value(value: _Value | None) -> str:
    if value is None:
        return ""
    if value.kind == "choice":
        return "-x -a " + _fish_quote(" ".join(_fish_quote(c) for c in value.choices))
    if value.kind == "file":
        return "-r -F"
    if value.kind == "dir":
        return "-x -a '(__fish_complete_directories (commandline -ct))'"
    return "-x"


def _fish_line(prog: str, condition: str, *parts: str) -> str:
    words = ["complete", "-c", _fish_quote(prog)]
    if condition:
        words += ["-n", _fish_quote(condition)]
    return " ".join(words + [p for p in parts if p])


def _fish_command(cmd: _Command, prog: str) -> list[str]:
    cond = _fish_condition(cmd)
    lines = [f"# {' '.join(cmd.path)}"]
    for opt in cmd.options:
        desc = f"-d {_fish_quote(opt.help)}" if opt.help else ""
        lines.append(_fish_line(prog, cond, _fish_names(opt.names), _fish_value(opt.value), desc))
    for sub in cmd.subcommands:
        desc = f"-d {_fish_quote(sub.help)}" if sub.help else ""
        lines.append(_fish_line(prog, cond, "-a", _fish_quote(sub.name), desc))
    if cmd.takes_args and not cmd.subcommands:
        lines.append(_fish_line(prog, cond, "-F"))
    return lines


def _render_fish(root: _Command, prog: str) -> str:
    lines = [_header("fish", prog), "", "# No file names unless an option or argument wants them."]
    lines.append(_fish_line(prog, "", "-f"))
    for cmd in _walk(root):
        lines += [""] + _fish_command(cmd, prog)
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------

_RENDERERS: dict[str, Callable[[_Command, str], str]] = {
    "bash": _render_bash,
    "zsh": _render_zsh,
    "fish": _render_fish,
}


def render(shell: str, command: Any, prog_name: str = "hpckpt") -> str:
    """Return the completion script for `shell` for the click command tree `command`."""
    if shell not in _RENDERERS:
        raise ValueError(f"unsupported shell {shell!r}; expected one of {', '.join(SHELLS)}")
    root = _build(command, (prog_name,))
    return _RENDERERS[shell](root, prog_name)
