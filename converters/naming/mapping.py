"""The mapping: every source name's destination, from the user rules first, then the preset.

Precedence (the package docstring has the whole story): the first user rule whose regex matches
claims a name; the direction's preset (`ms_to_torch`, `torch_to_ms`) renames the rest; anything
else keeps its name and is listed as unmapped. Two sources with one destination are refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Union

from hpckpt.converters.naming.entries import Derived, Mapped
from hpckpt.converters.naming.ms_to_torch import plan_ms_to_torch
from hpckpt.converters.naming.preset_plan import PresetPlan
from hpckpt.converters.naming.presets import MS_TO_TORCH, PRESETS
from hpckpt.converters.naming.rules import NameRules, Rule
from hpckpt.converters.naming.torch_to_ms import plan_torch_to_ms
from hpckpt.core.errors import NameCollisionError, NameRuleError


@dataclass(frozen=True)
class NameMapping:
    """Per source name: destination, transpose, dtype, rule; plus derived tensors and the names
    no rule touched (`unmapped`, kept as they are) or a preset could not decide (`ambiguous`)."""

    entries: dict[str, Mapped]
    derived: tuple[Derived, ...] = ()
    ambiguous: dict[str, str] = field(default_factory=dict)
    preset: str | None = None

    def __getitem__(self, source: str) -> Mapped:
        return self.entries[source]

    @property
    def unmapped(self) -> tuple[str, ...]:
        return tuple(s for s, e in self.entries.items() if e.rule is None)

    @property
    def dropped(self) -> tuple[str, ...]:
        return tuple(s for s, e in self.entries.items() if e.destination is None)

    def selected(self, keeps) -> "NameMapping":
        """The mapping of the entries a selection keeps (`keeps(source, destination)`, e.g.
        `Selection.keeps`): what a report counts when `--include`/`--exclude` left the rest out."""
        entries = {s: e for s, e in self.entries.items() if keeps(s, *(() if e.destination is None else (e.destination,)))}
        return NameMapping(entries, tuple(d for d in self.derived if keeps(d.destination)),
                           {s: why for s, why in self.ambiguous.items() if s in entries}, self.preset)

    def destinations(self) -> list[str]:
        """Every name the converted checkpoint will hold: written sources, then derived."""
        return [e.destination for e in self.entries.values() if e.destination is not None] + \
               [d.destination for d in self.derived]


Rules = Union[NameRules, str, None]


def map_names(names: Iterable[str], rules: Rules = None, *,
              shapes: Mapping[str, Sequence[int]] | None = None) -> NameMapping:
    """Map every source name to its destination: user rules first, then the preset.

    Args:
        names: the source checkpoint's tensor names (order is kept, duplicates ignored).
        rules: a `NameRules`, a preset name ("ms-to-torch", "torch-to-ms", "torch-to-ms-adamw"),
            or None for no renaming at all.
        shapes: source name -> shape. torch->ms needs them to tell a LayerNorm `weight` (1-D)
            from a Dense one; rules with `transpose` are checked against them.

    Raises:
        NameRuleError: a transpose does not fit a tensor's rank, or an unknown preset.
        NameCollisionError: two sources map to one destination.
    """
    if rules is None or isinstance(rules, str):
        rules = NameRules(preset=rules)
    names = list(dict.fromkeys(names))
    shapes = {k: tuple(int(s) for s in v) for k, v in (shapes or {}).items()}
    claimed: dict[str, tuple[Rule, str | None]] = {}
    for name in names:
        for rule in rules.rules:
            matched, new = rule.apply(name)
            if matched:
                if rule.transpose and name in shapes and len(shapes[name]) != len(rule.transpose):
                    raise NameRuleError(f"{rule.where}: transpose {list(rule.transpose)} does not fit {name!r} "
                                        f"of shape {list(shapes[name])}")
                claimed[name] = (rule, new)
                break
    renamed = {n: new for n, (_, new) in claimed.items() if new is not None}
    plan = PresetPlan()
    if rules.preset is not None:
        preset = PRESETS[rules.preset]
        planner = plan_ms_to_torch if preset.direction == MS_TO_TORCH else plan_torch_to_ms
        plan = planner(preset, names, shapes, rules.optim_prefix, renamed)
    entries = {n: _entry(n, claimed, plan, rules.preset) for n in names}
    for name, param in plan.param_of.items():  # a parameter's transpose applies to its moments
        entry = entries[name]
        rule = claimed.get(param, (None, None))[0]
        if name not in claimed and rule is not None and rule.transpose is not None:
            entries[name] = Mapped(entry.source, entry.destination, rule.transpose, entry.dtype, entry.rule,
                                   f"transpose of {param!r} ({rule.where})")
    by_dest: dict[str, Mapped] = {}
    for entry in entries.values():
        if entry.destination is None:
            continue
        other = by_dest.setdefault(entry.destination, entry)
        if other is not entry:
            raise NameCollisionError(entry.destination, (other.source, entry.source),
                                     (other.rule or "no rule", entry.rule or "no rule"))
    taken, derived = set(by_dest), []
    for d in plan.derived:  # an explicitly mapped name wins over an invented one
        if d.destination not in taken:
            taken.add(d.destination)
            derived.append(d)
    ambiguous = {n: why for n, why in plan.ambiguous.items() if n in entries and n not in renamed}
    return NameMapping(entries, tuple(derived), ambiguous, rules.preset)


def _entry(name: str, claimed: dict[str, tuple[Rule, str | None]], plan: PresetPlan, preset: str | None) -> Mapped:
    rule, new = claimed.get(name, (None, None))
    if new is not None:
        return Mapped(name, new, rule.transpose, rule.dtype, rule.where)
    labels = [rule.where] if rule is not None else []
    if name in plan.dest:
        labels.append(f"preset {preset}: {plan.label[name]}")
        dest = plan.dest[name]
    else:
        dest = name
    return Mapped(name, dest, rule.transpose if rule else None, rule.dtype if rule else None,
                  " + ".join(labels) or None, plan.note.get(name))
