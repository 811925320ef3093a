"""The shell-neutral model of the command tree that every shell renderer reads.

Reading click once into these small frozen records keeps click out of the
renderers: each shell only decides how to spell the same facts.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Value:
    """How a value is completed: ``kind`` is ``none``, ``choice``, ``file`` or ``dir``.

    The kind names appear verbatim in the bash script.
    """

    kind: str
    choices: tuple[str, ...] = ()


NO_VALUE = Value("none")
FILE_VALUE = Value("file")
DIR_VALUE = Value("dir")


@dataclass(frozen=True)
class Option:
    """One visible option; ``value`` is None for flags, which take no value."""

    names: tuple[str, ...]
    label: str
    help: str
    value: Value | None
    repeatable: bool


@dataclass(frozen=True)
class Command:
    """One visible command; ``path`` starts with the program name."""

    path: tuple[str, ...]
    help: str
    options: tuple[Option, ...]
    takes_args: bool
    subcommands: tuple[Command, ...]

    @property
    def name(self) -> str:
        return self.path[-1]

    def walk(self) -> Iterator[Command]:
        """This command and all below it, depth-first in declaration order: keeps the scripts stable."""
        yield self
        for sub in self.subcommands:
            yield from sub.walk()
