"""Reads a click (or typer) command tree into the shell-neutral model.

This is the only module that touches click objects.  Typer parameters describe
their type with a ``TypeDescriptor``, plain click ones with a ``ParamType``;
both end up as a :class:`~.model.Value`.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from enum import Enum
from pathlib import PurePath
from typing import Any, get_args, get_origin

from .model import DIR_VALUE, FILE_VALUE, NO_VALUE, Command, Option, Value


def _first_line(text: str | None) -> str:
    """Descriptions must fit on one line in every shell's menu."""
    for line in inspect.cleandoc(text or "").splitlines():
        line = line.strip()
        if line and line != "\b":
            return line
    return ""


def _choice_value(choices: Any) -> Value:
    """Enum choices are typed on the command line by their value."""
    return Value("choice", tuple(str(c.value) if isinstance(c, Enum) else str(c) for c in choices))


def _path_value(file_okay: bool, dir_okay: bool) -> Value:
    """Only directory-only paths restrict the completion to directories."""
    return DIR_VALUE if dir_okay and not file_okay else FILE_VALUE


def _is_path_list(annotation: Any) -> bool:
    """``list[Path]`` options are paths too, but typer's is_path says no."""
    if get_origin(annotation) is not list:
        return False
    args = get_args(annotation)
    return len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], PurePath)


def _typer_value(desc: Any) -> Value:
    if desc.choices is not None:
        return _choice_value(desc.choices)
    if desc.is_file or desc.is_path or _is_path_list(desc.annotation):
        info = desc.parameter_info
        return _path_value(info.file_okay, info.dir_okay)
    return NO_VALUE


def _click_value(ptype: Any) -> Value:
    """Matched by class name, so click's own types and typer's vendored copies both count."""
    choices = getattr(ptype, "choices", None)
    if choices is not None:
        return _choice_value(choices)
    kinds = {cls.__name__ for cls in type(ptype).__mro__}
    if getattr(getattr(ptype, "func", None), "__name__", "") == "location":  # a path or a URL (cli._errors)
        return _path_value(True, True)
    if kinds & {"Path", "TyperPath"}:  # typer 0.28's own path type is no click Path
        return _path_value(ptype.file_okay, ptype.dir_okay)
    if kinds & {"File", "TyperFile"}:
        return FILE_VALUE
    return NO_VALUE


def value_of(param: Any) -> Value:
    """Classify a parameter's value, whichever click flavour built it."""
    desc = getattr(param, "type_descriptor", None)
    if desc is not None:
        return _typer_value(desc)
    return _click_value(getattr(param, "type", None))


def _option(param: Any) -> Option:
    """Flags and counters take no value; everything else takes one."""
    counts = bool(getattr(param, "count", False))
    # click builds the help option's names from a set: sort for output that never changes.
    long_first = sorted(param.opts, key=lambda n: (not n.startswith("--"), n))
    return Option(
        names=tuple(long_first) + tuple(param.secondary_opts),
        label=param.metavar or param.name or "value",
        help=_first_line(getattr(param, "help", None)),
        value=None if getattr(param, "is_flag", False) or counts else value_of(param),
        repeatable=bool(param.multiple or counts),
    )


def _context(command: Any, name: str, parent: Any) -> Any:
    """A context is needed to get the help option (and its custom names)."""
    settings = dict(command.context_settings or {})
    return command.context_class(command, parent=parent, info_name=name, **settings)


def _visible_subcommands(command: Any, ctx: Any) -> Iterator[tuple[str, Any]]:
    """Visible subcommands in declaration order; leaves have none."""
    if not hasattr(command, "list_commands"):
        return
    for name in command.list_commands(ctx):
        sub = command.get_command(ctx, name)
        if sub is not None and not getattr(sub, "hidden", False):
            yield name, sub


def build(command: Any, path: tuple[str, ...], parent: Any = None) -> Command:
    """Walk the click tree below ``command``, which is called ``path[-1]``."""
    ctx = _context(command, path[-1], parent)
    params = command.get_params(ctx)
    return Command(
        path=path,
        help=_first_line(command.short_help or command.help),
        options=tuple(
            _option(p) for p in params if p.param_type_name == "option" and not getattr(p, "hidden", False)
        ),
        takes_args=any(p.param_type_name == "argument" for p in params),
        subcommands=tuple(
            build(sub, path + (name,), ctx) for name, sub in _visible_subcommands(command, ctx)
        ),
    )
