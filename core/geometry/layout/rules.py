"""Layout rules files (`--layout-rules`): the target placements of each tensor, chosen by its FQN.

A TOML file with a `mesh`, a default `split` rule, `default` placements and `[[rule]]` tables
tried in order (see `RULES_FILE_EXAMPLE`). `core.safety.rules_file` reads it; every mistake in it raises
`LayoutRuleError` (a usage error, exit 2) naming the file and rule, and a file that does not exist
raises `PathNotFoundError` (exit 3).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from hpckpt.core.errors import LayoutRuleError
from hpckpt.core.geometry.layout.mesh import Mesh
from hpckpt.core.geometry.layout.placements import Placement, check_rule
from hpckpt.core.geometry.layout.text import parse_mesh, parse_placements
from hpckpt.core.safety.rules_file import check_table_keys, load_rules_toml

RULES_FILE_EXAMPLE = """\
# hpckpt layout rules: the target layout of each tensor, chosen by its FQN.
mesh = "2x4"          # device mesh, row-major, ranks 0..7; the command line's mesh overrides it
split = "balanced"    # rule of S<d> without a suffix: "balanced" (HyperParallel) or "ceil" (PyTorch)
default = "R,S0"      # placements of tensors no rule matches (omitted: replicate everywhere)

[[rule]]                                  # rules are tried in order; the first match wins
match = "*.embed_tokens.weight"           # fnmatch glob on the whole FQN
placements = "S0,R"

[[rule]]
regex = 'model\\.layers\\.\\d+\\.mlp\\..*'     # or a regular expression matching the whole FQN
placements = "R,S1:ceil"                  # a ":ceil"/":balanced" suffix overrides `split` for one placement

[[rule]]
match = "*.lm_head.weight"
split = "ceil"                            # a rule may also set `split` for all its placements
placements = "S1,S0"

[[rule]]
match = "*norm.weight"
placements = "R,R"
"""
"""A documented rules file. One placement per mesh dim; a 0-d tensor is always replicated and a
Shard of a dim the tensor does not have (S1 on a bias) becomes Replicate for that mesh dim."""

_TOP_KEYS = {"mesh", "default", "split", "rule"}

_TOP_KEYS = {"mesh", "default", "split", "rule"}
_RULE_KEYS = {"match", "regex", "placements", "split"}
_WHAT = "layout rules file"

T = TypeVar("T")


@dataclass(frozen=True)
class RulesFile:
    """What a layout rules file says: the mesh (the caller's if given), default placements
    (None: replicate everywhere) and the `(pattern, placements)` rules in file order."""

    mesh: Mesh
    default: tuple[Placement, ...] | None
    rules: list[tuple[str, tuple[Placement, ...]]]


def load_rules(path: str | Path) -> list[tuple[str, tuple[Placement, ...]]]:
    """Read the `[[rule]]` tables of a layout rules file as `(pattern, placements)` in file order.

    A pattern is an fnmatch glob on the FQN, or `re:<regex>` (full match) for a `regex` key.
    Placements are parsed with the rule's `split`, else the file's, else "balanced".

    Raises:
        PathNotFoundError: the file does not exist.
        LayoutRuleError: unreadable or invalid TOML, unknown keys, or bad placements.
    """
    return _rules_from(load_rules_toml(path, _WHAT, LayoutRuleError), str(path))


def load_rules_file(path: str | Path, mesh: Mesh | None = None) -> RulesFile:
    """Read a whole layout rules file, for `LayoutSpec.from_toml`; `mesh` overrides its `mesh` key.

    Raises:
        PathNotFoundError: the file does not exist.
        LayoutRuleError: invalid file, or no mesh in the file nor given.
    """
    doc = load_rules_toml(path, _WHAT, LayoutRuleError)
    rules = _rules_from(doc, str(path))
    if mesh is None and "mesh" not in doc:
        raise LayoutRuleError(f"{path}: no 'mesh' key and no mesh given")
    mesh = mesh or _in_file(parse_mesh, str(doc["mesh"]))
    default = _in_file(parse_placements, doc["default"], doc.get("split", "balanced")) if "default" in doc else None
    return RulesFile(mesh, default, rules)


def _rules_from(doc: dict, where: str) -> list[tuple[str, tuple[Placement, ...]]]:
    check_table_keys(doc, _TOP_KEYS, where, LayoutRuleError)
    file_rule = _in_file(check_rule, doc.get("split", "balanced"))
    rules = doc.get("rule", [])
    if not isinstance(rules, list):
        raise LayoutRuleError(f"{where}: 'rule' must be an array of tables ([[rule]])")
    out = []
    for i, r in enumerate(rules):
        what = f"{where}: rule {i + 1}"
        check_table_keys(r, _RULE_KEYS, what, LayoutRuleError)
        if ("match" in r) == ("regex" in r) or "placements" not in r:
            raise LayoutRuleError(f"{what}: needs 'placements' and exactly one of 'match' or 'regex'")
        if not all(isinstance(v, str) for v in r.values()):
            raise LayoutRuleError(f"{what}: every value must be a string")
        pattern = r["match"] if "match" in r else "re:" + r["regex"]
        if pattern.startswith("re:"):
            _compile(pattern[3:], what)
        out.append((pattern, _in_file(parse_placements, r["placements"], r.get("split", file_rule))))
    return out


def _in_file(parse: Callable[..., T], *args: object) -> T:
    """Parse a value of the file, so that a bad one is a `LayoutRuleError` (same message)."""
    try:
        return parse(*args)
    except ValueError as exc:
        raise LayoutRuleError(str(exc)) from None


def _compile(regex: str, where: str) -> re.Pattern:
    try:
        return re.compile(regex)
    except re.error as exc:
        raise LayoutRuleError(f"{where}: bad regex {regex!r} ({exc})") from None


def pattern_matches(pattern: str, fqn: str) -> bool:
    """True when a rule pattern (fnmatch glob, or `re:<regex>` matched in full) matches `fqn`."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], fqn) is not None
    return fnmatch.fnmatchcase(fqn, pattern)
