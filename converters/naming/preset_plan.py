"""A preset's proposal for a checkpoint's names, and the module/leaf helpers the planners share.

A name is a module path and a leaf (`blocks.0.ln.gamma`: module `blocks.0.ln`, leaf `gamma`); the
presets only ever change the leaf, and never onto a leaf the module already has.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from hpckpt.converters.naming.entries import Derived


@dataclass
class PresetPlan:
    """A preset's proposal; `param_of` links same-shaped optimizer state to its parameter."""

    dest: dict[str, str | None] = field(default_factory=dict)
    label: dict[str, str] = field(default_factory=dict)
    note: dict[str, str] = field(default_factory=dict)
    param_of: dict[str, str] = field(default_factory=dict)
    derived: list[Derived] = field(default_factory=list)
    ambiguous: dict[str, str] = field(default_factory=dict)

    def set(self, name: str, dest: str | None, label: str, note: str | None = None) -> None:
        self.dest[name], self.label[name] = dest, label
        if note:
            self.note[name] = note

    def adopt(self, model: "PresetPlan", names: Iterable[str]) -> None:
        """Take what the per-module pass (`model`) proposed for `names`, renamed or ambiguous."""
        for name in names:
            if name in model.dest:
                self.set(name, model.dest[name], model.label[name], model.note.get(name))
            elif name in model.ambiguous:
                self.ambiguous[name] = model.ambiguous[name]


def split_name(name: str) -> tuple[str, str]:
    """`(module path, leaf)`; the module of a top-level name is ""."""
    module, _, leaf = name.rpartition(".")
    return module, leaf


def join_name(module: str, leaf: str) -> str:
    """Return the name of `leaf` in `module` (`split_name` undone)."""
    return f"{module}.{leaf}" if module else leaf


def modules_of(params: Iterable[str]) -> dict[str, set[str]]:
    """Group names by module, so a preset can decide a module from all its leaves at once."""
    out: dict[str, set[str]] = {}
    for p in params:
        module, leaf = split_name(p)
        out.setdefault(module, set()).add(leaf)
    return out


def rename_in_module(plan: PresetPlan, name: str, new_leaf: str, leaves: set[str], label: str) -> None:
    """Propose `module.new_leaf` unless the module already has that leaf (then it is ambiguous)."""
    module, leaf = split_name(name)
    if new_leaf in leaves:
        plan.ambiguous[name] = f"{leaf} -> {new_leaf} would collide with {join_name(module, new_leaf)!r}"
    else:
        plan.set(name, join_name(module, new_leaf), label)
