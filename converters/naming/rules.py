"""User name rules (`--name-rules`): regex renames, transposes and casts, from a TOML file.

The file format is in docs/name-rules.md. `core.safety.rules_file` reads the file; every mistake in it
raises `NameRuleError` (a usage error, exit 2) naming the file and rule, and a file that does not
exist raises `PathNotFoundError` (exit 3).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

from hpckpt.converters.naming.presets import DEFAULT_OPTIM_PREFIX, DIRECTIONS, PRESETS
from hpckpt.core import dtypes
from hpckpt.core.dtypes import DType
from hpckpt.core.errors import NameRuleError, UnknownFormatError
from hpckpt.core.safety.rules_file import check_table_keys, parse_rules_toml, read_rules_text

_TEMPLATE = re.compile(r"\\(?:(\d{1,2})|g<([^>]*)>|(\\)|(.?))", re.S)


def _parse_template(template: str, pattern: re.Pattern, where: str) -> tuple[Union[str, int], ...]:
    r"""Split a `rename` into literals and group references (`\1`, `\g<1>`, `\g<name>`, `\\`).

    Done once at load so a bad reference fails with the rule's location, not mid-conversion.
    """
    parts: list[Union[str, int]] = []
    pos = 0
    for m in _TEMPLATE.finditer(template):
        parts.append(template[pos:m.start()])
        pos = m.end()
        number, named, backslash, other = m.groups()
        if backslash:
            parts.append("\\")
            continue
        if other is not None:
            raise NameRuleError(f"{where}: bad escape {m.group(0)!r} in rename {template!r}",
                                hint=r"use \1 or \g<name> for groups and \\ for a backslash")
        ref: Union[str, int] = int(number) if number else (int(named) if named.isdigit() else named)
        if isinstance(ref, int):
            if ref > pattern.groups or (number and ref == 0):
                raise NameRuleError(f"{where}: rename {template!r} refers to group {ref} but the pattern has "
                                    f"{pattern.groups} group(s)")
            parts.append(ref)
        elif ref not in pattern.groupindex:
            raise NameRuleError(f"{where}: rename {template!r} refers to an unknown group name {ref!r}")
        else:
            parts.append(pattern.groupindex[ref])
    parts.append(template[pos:])
    return tuple(p for p in parts if p != "")


@dataclass(frozen=True)
class Rule:
    r"""One user rule: `match` (regex on the whole name), optional `rename` (with `\1` groups),
    `transpose` (a permutation of the dims) and `dtype` (cast to). Validated on construction.

    Raises:
        NameRuleError: bad regex, bad group reference, not a permutation, unknown dtype.
    """

    match: str
    rename: str | None = None
    transpose: tuple[int, ...] | None = None
    dtype: DType | None = None
    where: str = "rule"
    _pattern: re.Pattern = field(init=False, repr=False, compare=False)
    _template: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.match, str) or not self.match:
            raise NameRuleError(f"{self.where}: 'match' must be a non-empty string (a regular expression)")
        try:
            pattern = re.compile(self.match)
        except re.error as exc:
            raise NameRuleError(f"{self.where}: bad regex {self.match!r} ({exc})") from None
        object.__setattr__(self, "_pattern", pattern)
        if self.rename is not None and (not isinstance(self.rename, str) or not self.rename):
            raise NameRuleError(f"{self.where}: 'rename' must be a non-empty string")
        template = () if self.rename is None else _parse_template(self.rename, pattern, self.where)
        object.__setattr__(self, "_template", template)
        if self.transpose is not None:
            object.__setattr__(self, "transpose", _permutation(self.transpose, self.where))
        if self.dtype is not None:
            object.__setattr__(self, "dtype", _dtype(self.dtype, self.where))

    def apply(self, name: str) -> tuple[bool, str | None]:
        """`(matched, new name or None when the rule does not rename)` for one name."""
        m = self._pattern.fullmatch(name)
        if m is None:
            return False, None
        if self.rename is None:
            return True, None
        return True, "".join(p if isinstance(p, str) else (m.group(p) or "") for p in self._template)


def _permutation(value: object, where: str) -> tuple[int, ...] | None:
    """A transpose as a tuple, None when it is the identity (nothing for the converter to do)."""
    items = list(value) if isinstance(value, (list, tuple)) else None
    if not items or not all(isinstance(i, int) and not isinstance(i, bool) for i in items) \
            or sorted(items) != list(range(len(items))):
        raise NameRuleError(f"{where}: transpose {value!r} is not a permutation of the dims 0..n-1",
                            hint="e.g. transpose = [1, 0] swaps the two dims of a matrix")
    perm = tuple(items)
    return None if perm == tuple(range(len(perm))) else perm


def _dtype(value: object, where: str) -> DType:
    if isinstance(value, DType):
        return value
    if not isinstance(value, str):
        raise NameRuleError(f"{where}: dtype must be a string such as \"bf16\", got {value!r}")
    try:
        return dtypes.dtype(value)
    except UnknownFormatError:
        known = ", ".join(d.name for d in dtypes.all_dtypes())
        raise NameRuleError(f"{where}: unknown dtype {value!r}", hint=f"known dtypes: {known}") from None


@dataclass(frozen=True)
class NameRules:
    """User rules (tried in order) plus the preset applied to names they do not rename.

    Raises:
        NameRuleError: unknown preset, or an optimizer prefix that is not a dotted name.
    """

    rules: tuple[Rule, ...] = ()
    preset: str | None = None
    optim_prefix: str = DEFAULT_OPTIM_PREFIX

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(self.rules))
        if self.preset is not None and self.preset not in PRESETS:
            raise NameRuleError(f"unknown name preset {self.preset!r}",
                                hint=f"choose one of {', '.join(PRESETS)} or none")
        if not isinstance(self.optim_prefix, str) or \
                (self.optim_prefix and not re.fullmatch(r"[^.]+(\.[^.]+)*", self.optim_prefix)):
            raise NameRuleError(f"optim_prefix {self.optim_prefix!r} must be a dotted name like \"optim\" or empty")


_TOP_KEYS = {"preset", "optim_prefix", "rule"}
_RULE_KEYS = {"match", "rename", "transpose", "dtype"}


def load_rules(path: str | Path, direction: str | None = None) -> NameRules:
    """Read a TOML name-rules file (format in docs/name-rules.md).

    `direction` is the conversion's ("ms-to-torch"/"torch-to-ms"): its preset applies when the
    file has no `preset` key, and a file preset of the other direction is refused.

    Raises:
        PathNotFoundError: the file does not exist.
        NameRuleError: not TOML, unknown keys, bad regex/rename/transpose/dtype/preset.
    """
    return parse_rules(read_rules_text(path, "name-rules file", NameRuleError), str(Path(path)), direction)


def parse_rules(text: str, where: str = "<name rules>", direction: str | None = None) -> NameRules:
    """Parse name rules from TOML text; `where` prefixes every error. See `load_rules`."""
    doc = parse_rules_toml(text, where, NameRuleError)
    if direction is not None and direction not in DIRECTIONS:
        raise NameRuleError(f"unknown direction {direction!r}; expected one of {', '.join(DIRECTIONS)}")
    check_table_keys(doc, _TOP_KEYS, where, NameRuleError)
    preset = _file_preset(doc.get("preset"), where, direction)
    prefix = doc.get("optim_prefix", DEFAULT_OPTIM_PREFIX)
    if not isinstance(prefix, str):
        raise NameRuleError(f"{where}: optim_prefix must be a string")
    tables = doc.get("rule", [])
    if not isinstance(tables, list):
        raise NameRuleError(f"{where}: 'rule' must be an array of tables ([[rule]])")
    rules = []
    for i, table in enumerate(tables, 1):
        what = f"{where}: rule {i}"
        check_table_keys(table, _RULE_KEYS, what, NameRuleError)
        if "match" not in table:
            raise NameRuleError(f"{what}: needs 'match' (a regular expression for the whole name)")
        if not any(k in table for k in ("rename", "transpose", "dtype")):
            raise NameRuleError(f"{what}: does nothing; give 'rename', 'transpose' or 'dtype'")
        for key in ("match", "rename"):
            if key in table and not isinstance(table[key], str):
                raise NameRuleError(f"{what}: {key!r} must be a string")
        rules.append(Rule(table["match"], table.get("rename"), table.get("transpose"), table.get("dtype"), what))
    try:
        return NameRules(tuple(rules), preset, prefix)
    except NameRuleError as exc:
        raise NameRuleError(f"{where}: {exc.message}", hint=exc.hint) from None


def _file_preset(value: object, where: str, direction: str | None) -> str | None:
    if value is None:
        return direction  # each direction's default preset is named after it
    if not isinstance(value, str) or (value != "none" and value not in PRESETS):
        raise NameRuleError(f"{where}: unknown preset {value!r}",
                            hint=f"choose one of {', '.join(PRESETS)} or \"none\"")
    if value == "none":
        return None
    if direction is not None and PRESETS[value].direction != direction:
        raise NameRuleError(f"{where}: preset {value!r} converts {PRESETS[value].direction}, "
                            f"but this conversion is {direction}")
    return value
