"""Options that travel together, declared once as a group and handed to the command as one typed
object: a parameter `write: Write` stands for --max-memory, --no-fsync, --force and --parents,
and the command receives `Write(max_memory, no_fsync, force, parents)`.

typer reads a command's options from its signature (`inspect.signature`, which honours
`__signature__`). `expand_options` gives the command a signature in which every group is
replaced by its options, in the group's order, and the output options (`--json`, `--quiet`,
`--no-progress`, `--debug`) follow the command's own: a list several commands share is written
once, and each `--help` lists the options in the order the signature and the groups give.
"""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Any, Callable, NamedTuple

from hpckpt.cli._options import (Debug, Exclude, Force, Include, Jobs, Json, KeepLayout, LayoutFiles, LayoutRules,
                                 MaxMemory, MeshOption, NoFsync, NoManifest, NoProgress, Parents, Placements, Quiet,
                                 RenamedExclude, RenamedInclude, Split, WorldSize)


class Output(NamedTuple):
    """Every command takes these after its own options; their callbacks set the run's output
    state (`cli._output`), so the command itself never receives them."""

    json_output: Json = False
    quiet: Quiet = False
    no_progress: NoProgress = False
    debug: Debug = False


class Select(NamedTuple):
    """The entries a command works on."""

    include: Include = None
    exclude: Exclude = None

    def selection(self):
        from hpckpt.api import Selection

        return Selection.of(self.include, self.exclude)


class RenamedSelect(NamedTuple):
    """The entries a converting command works on, matched by their source or destination name."""

    include: RenamedInclude = None
    exclude: RenamedExclude = None

    selection = Select.selection


class Write(NamedTuple):
    """How a command writes: the copy buffers' budget, fsync, replacing and making the destination."""

    max_memory: MaxMemory = "64MiB"
    no_fsync: NoFsync = False
    force: Force = False
    parents: Parents = False
    no_manifest: NoManifest = False

    def settings(self, progress=None, jobs: int | None = None):
        """The library's `WriteSettings`.

        Raises:
            ValueError: --max-memory is not a size.
        """
        from hpckpt.api import WriteSettings, parse_size

        return WriteSettings(jobs=jobs, max_memory=parse_size(self.max_memory), sync=not self.no_fsync,
                             force=self.force, progress=progress, parents=self.parents, manifest=not self.no_manifest)


class ParallelWrite(NamedTuple):
    """--jobs, then the Write options: a command that writes several files at once."""

    jobs: Jobs = None
    write: Write = Write()

    def settings(self, progress=None):
        return self.write.settings(progress, self.jobs)


class TargetLayout(NamedTuple):
    """The layout a reshard writes: a world size, or a mesh with placements, rules or layout files;
    or the source's layouts on a new mesh size."""

    world_size: WorldSize = None
    split: Split = "balanced"
    mesh: MeshOption = None
    placements: Placements = None
    rules: LayoutRules = None
    layout_files: LayoutFiles = None
    keep_layout: KeepLayout = False

    def check(self) -> None:
        """A wrong combination is a usage error (exit 2) naming the options."""
        from hpckpt.cli import _targets

        _targets.check_layout_options(self.world_size, self.mesh, self.placements, self.rules, self.layout_files,
                                      self.keep_layout)

    def spec(self, src):
        """The `LayoutSpec` to write; `src` is the source's index or path (read by --keep-layout)."""
        from hpckpt.cli import _targets

        return _targets.layout_spec(src, self.world_size, self.split, self.mesh, self.placements, self.rules,
                                    self.layout_files, self.keep_layout)


class RankLayout(NamedTuple):
    """The layout of a launched job's own ranks: a mesh of the job's world size with placements
    or rules, or HyperParallel layout files."""

    mesh: MeshOption = None
    placements: Placements = None
    rules: LayoutRules = None
    layout_files: LayoutFiles = None
    split: Split = "balanced"


def _is_group(annotation: Any) -> bool:
    """A group is a NamedTuple (lighter than a dataclass: a command's start-up builds them all)."""
    return isinstance(annotation, type) and issubclass(annotation, tuple) and hasattr(annotation, "_field_defaults")


@functools.cache
def _fields(group: type) -> list[tuple[str, Any, Any]]:
    """(name, annotation, default) of each field of a group, in order."""
    hints = typing.get_type_hints(group, include_extras=True)
    return [(name, hints[name], group._field_defaults[name]) for name in group._fields]


def _options(group: type) -> list[inspect.Parameter]:
    """A group's options as parameters, the groups inside it expanded in place."""
    out: list[inspect.Parameter] = []
    for name, annotation, default in _fields(group):
        if _is_group(annotation):
            out += _options(annotation)
        else:
            out.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation))
    return out


def _build(group: type, given: dict[str, Any]) -> Any:
    """The group's object, from the values typer parsed (taken out of `given`)."""
    return group(**{name: _build(annotation, given) if _is_group(annotation) else given.pop(name)
                    for name, annotation, _ in _fields(group)})


def expand_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Give `command` the signature typer reads: its groups replaced by their options, the output
    options last; called, it receives each group as one object.

    Raises:
        TypeError: two options of the expanded signature have the same name.
    """
    signature = inspect.signature(command, eval_str=True)
    groups = {p.name: p.annotation for p in signature.parameters.values() if _is_group(p.annotation)}
    parameters: list[inspect.Parameter] = []
    for p in signature.parameters.values():
        parameters += _options(p.annotation) if p.name in groups else [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)]
    output = _options(Output)
    parameters += output
    names = [p.name for p in parameters]
    if len(set(names)) != len(names):
        raise TypeError(f"{command.__name__}: options named twice: {sorted({n for n in names if names.count(n) > 1})}")

    @functools.wraps(command)
    def expanded(**given: Any) -> Any:
        for p in output:
            given.pop(p.name)
        for name, group in groups.items():
            given[name] = _build(group, given)
        return command(**given)

    expanded.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    expanded.__annotations__ = {**{p.name: p.annotation for p in parameters}, "return": signature.return_annotation}
    return expanded
