"""Parameter names between MindSpore and PyTorch checkpoints: presets, user rules, one mapping.

`convert-ms-torch` copies tensors; this module only decides what each one is called on the other
side, so a dry run can show the whole table before a byte is written. No framework is imported.

What the frameworks write (MindSpore 2.10 `nn` sources, checked against `save_checkpoint`; torch
2.13 `nn`, `optim` and `torch.distributed.checkpoint.state_dict`):

* MindSpore saves a parameter under its attribute path (`blocks.0.weight`); wrapper cells
  (`WithLossCell`, `TrainOneStepCell`) add no prefix. Dense/Conv: `weight` (out, in) and `bias`,
  as in torch. LayerNorm/GroupNorm: `gamma`, `beta`. BatchNorm/InstanceNorm: `gamma`, `beta`,
  `moving_mean`, `moving_variance` (no `num_batches_tracked`). Embedding/EmbeddingLookup:
  `embedding_table` (vocab, dim). The `mint`-style cells (LayerNormExt, EmbeddingExt, Linear)
  already say `weight`/`bias`.
* MindSpore optimizer state is a prefix on the parameter name (`Parameter.clone(prefix=...)`):
  nn.Adam/AdamOffload/LazyAdam `moment1.<p>`, `moment2.<p>` (and `vhat.<p>` with amsgrad);
  nn.AdamWeightDecay `adam_m.<p>`, `adam_v.<p>`; `mindspore.experimental.optim` Adam/AdamW
  `exp_avg.<p>`, `exp_avg_sq.<p>`, `max_exp_avg_sq.<p>`. Only trainable parameters have state.
  Counters: `global_step` (int32, shape (1,), +1 per step, every nn optimizer), nn.Adam's
  `beta1_power`/`beta2_power` (float32 beta**t, shape (); (1,) in AdamOffload), experimental
  `state_step`; `learning_rate` (float32 (), 1-D for a list schedule, `learning_rate_group_<i>`
  with group learning rates). Saving the optimizer also saves the parameters themselves.
* torch: `<module path>.<name>`; BatchNorm adds `running_mean`, `running_var` and
  `num_batches_tracked` (int64, ()). Adam/AdamW state per parameter: `exp_avg`, `exp_avg_sq`,
  `max_exp_avg_sq` (amsgrad) and `step` (float32, ()). `get_optimizer_state_dict(...,
  StateDictOptions(flatten_optimizer_state_dict=True))` names them `state.<fqn>.<key>` and the
  hyperparameters `param_groups.<fqn>.<key>` (lr, betas, eps, ...: Python values).

hpckpt's torch side: model tensors under their bare FQN (as `get_model_state_dict` gives them)
and the optimizer under `optim_prefix` (default "optim", the key of the DCP recipe), i.e. the
keys `dcp.save({**get_model_state_dict(m), "optim": flat_osd})` writes:
`optim.state.<fqn>.exp_avg`, `optim.state.<fqn>.exp_avg_sq`, `optim.state.<fqn>.step`,
`optim.param_groups.<fqn>.lr`. The tensor keys are the same without the flatten option.

Mapping rules, in order of precedence (docs/name-rules.md has the file format):

1. User rules (`Rule`, from a TOML file): the first whose regex matches the whole name claims it.
   A rule without `rename` keeps the preset's (or the original) name and only adds transpose/dtype.
2. The preset of the conversion direction, for names no user rule renamed. Optimizer state
   follows its parameter's *final* name (after user rules), and a parameter's transpose applies
   to its same-shaped state (exp_avg...) unless a user rule matches the state name itself.
3. Anything else keeps its name and is listed as unmapped.

Counters that have no one-to-one counterpart are not renamed but `Derived`: e.g. MindSpore's one
`global_step` becomes one `step` per torch parameter. A preset never renames onto a name already
in the module, and what it cannot decide (torch `weight` without shape, or a 2-D weight without
bias and no embedding-like module name) stays unmapped and is listed in `ambiguous`. Two sources
that end up with one destination raise `NameCollisionError`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

from hpckpt.core import dtypes
from hpckpt.core.dtypes import DType
from hpckpt.core.errors import HpckptError, PathNotFoundError, UnknownFormatError
from hpckpt.core.layout import check_table_keys

__all__ = [
    "MS_TO_TORCH", "TORCH_TO_MS", "TORCH_TO_MS_ADAMW", "DIRECTIONS", "DEFAULT_OPTIM_PREFIX", "DEFAULT_ADAM_BETAS",
    "PRESETS",
    "Preset", "Rule", "NameRules", "Mapped", "Derived", "NameMapping",
    "NameRuleError", "NameCollisionError",
    "load_rules", "parse_rules", "map_names", "render_mapping", "mapping_json", "detect_direction",
]


class NameRuleError(HpckptError, ValueError):
    """A name-rules file or option is wrong: a usage error (exit 2, like a bad option value).

    Also a ValueError, so the CLI's `except ValueError -> typer.BadParameter` path takes it.
    """

    exit_code = 2
    kind = "name-rules"


class NameCollisionError(NameRuleError):
    """Two source tensors would be written under one destination name."""

    kind = "name-collision"

    def __init__(self, destination: str, sources: tuple[str, str], rules: tuple[str, str]):
        super().__init__(
            f"{sources[0]!r} ({rules[0]}) and {sources[1]!r} ({rules[1]}) both map to {destination!r}",
            hint="add a rule that renames one of them (first matching rule wins), or --exclude one",
        )
        self.destination = destination
        self.sources = sources


# --------------------------------------------------------------------------------------------
# Presets

MS_TO_TORCH = "ms-to-torch"
TORCH_TO_MS = "torch-to-ms"
TORCH_TO_MS_ADAMW = "torch-to-ms-adamw"
DEFAULT_OPTIM_PREFIX = "optim"
# torch.optim.Adam's and MindSpore nn.Adam's default betas: beta1_power/beta2_power are derived with
# them when the source has no `param_groups.<fqn>.betas` (safetensors cannot hold them, and a torch
# file written from a MindSpore checkpoint has none).
DEFAULT_ADAM_BETAS = (0.9, 0.999)
DIRECTIONS = (MS_TO_TORCH, TORCH_TO_MS)


@dataclass(frozen=True)
class Preset:
    """A built-in rename set; torch->ms presets also say which MindSpore optimizer to name for,
    since torch calls Adam's and AdamW's state alike."""

    name: str
    direction: str
    description: str
    # the MindSpore prefixes written for exp_avg, exp_avg_sq and max_exp_avg_sq (None: no such state)
    ms_state_prefixes: tuple[str, str, str | None] = ("moment1", "moment2", "vhat")
    beta_powers: bool = False  # torch->ms: derive nn.Adam's beta1_power/beta2_power


PRESETS: dict[str, Preset] = {
    p.name: p for p in (
        Preset(MS_TO_TORCH, MS_TO_TORCH,
               "MindSpore nn names -> torch.nn; Adam/AdamWeightDecay/experimental Adam(W) state -> "
               "<optim>.state.<fqn>.exp_avg/exp_avg_sq/max_exp_avg_sq/step"),
        Preset(TORCH_TO_MS, TORCH_TO_MS,
               "torch.nn -> MindSpore nn names; torch Adam state -> nn.Adam (moment1/moment2/vhat, "
               "beta1_power/beta2_power, global_step)", ("moment1", "moment2", "vhat"), beta_powers=True),
        Preset(TORCH_TO_MS_ADAMW, TORCH_TO_MS,
               "torch.nn -> MindSpore nn names; torch AdamW state -> nn.AdamWeightDecay (adam_m/adam_v, "
               "global_step)", ("adam_m", "adam_v", None)),
    )
}

# MindSpore optimizer-state prefix -> torch Adam state key.
_MS_STATE = {
    "moment1": "exp_avg", "adam_m": "exp_avg", "exp_avg": "exp_avg",
    "moment2": "exp_avg_sq", "adam_v": "exp_avg_sq", "exp_avg_sq": "exp_avg_sq",
    "vhat": "max_exp_avg_sq", "max_exp_avg_sq": "max_exp_avg_sq",
}
_MS_STEPS = ("state_step", "global_step")  # the first present is the Adam step count
_MS_POWERS = ("beta1_power", "beta2_power")
_MS_LR = "learning_rate"
_MS_GLOBALS = frozenset(_MS_STEPS + _MS_POWERS + (_MS_LR,))
_TORCH_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step")
_TORCH_BN = {"weight": "gamma", "bias": "beta", "running_mean": "moving_mean", "running_var": "moving_variance"}
_LABEL_NORM = "norm gamma/beta <-> weight/bias"
_LABEL_BN = "BatchNorm moving_mean/moving_variance <-> running_mean/running_var"
_LABEL_EMB = "Embedding embedding_table <-> weight"
_LABEL_STATE = "Adam state"
_EMBED_HINT = re.compile(r"(?i).*emb.*|wte|wpe")
_NORM_HINT = re.compile(r"(?i).*norm.*|ln(_?\w+)?|bn\d*|gn\d*")


# --------------------------------------------------------------------------------------------
# User rules


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
    p = Path(path)
    if not p.is_file():
        raise PathNotFoundError(f"{p}: no such file")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise NameRuleError(f"{p}: cannot read the name-rules file ({exc})") from None
    return parse_rules(text, str(p), direction)


def parse_rules(text: str, where: str = "<name rules>", direction: str | None = None) -> NameRules:
    """Parse name rules from TOML text; `where` prefixes every error. See `load_rules`."""
    import tomllib

    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise NameRuleError(f"{where}: not valid TOML ({exc})") from None
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


# --------------------------------------------------------------------------------------------
# The mapping


@dataclass(frozen=True)
class Mapped:
    """What happens to one source tensor.

    `destination` None: not written under any name (dropped, or only feeds `Derived` entries;
    `note` says which). `rule` names the rule(s) that decided it, None when none did.
    """

    source: str
    destination: str | None
    transpose: tuple[int, ...] | None = None
    dtype: DType | None = None
    rule: str | None = None
    note: str | None = None


@dataclass(frozen=True)
class Derived:
    """A destination tensor with no one-to-one source, computed by the converter.

    Kinds: "step" (a step count: the value of the one source counter, or of the per-parameter
    steps, which must agree), "lr" (the learning rate; a 1-D MindSpore schedule is indexed at
    the step), "beta1_power"/"beta2_power" (beta**step with the betas of the sources' param
    groups), "num_batches_tracked" (0: MindSpore does not count BatchNorm batches; torch reads
    it only when momentum is None).
    """

    destination: str
    sources: tuple[str, ...]
    kind: str
    dtype: DType
    shape: tuple[int, ...]
    rule: str


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

    def destinations(self) -> list[str]:
        """Every name the converted checkpoint will hold: written sources, then derived."""
        return [e.destination for e in self.entries.values() if e.destination is not None] + \
               [d.destination for d in self.derived]


Rules = Union[NameRules, str, None]


@dataclass
class _Plan:
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
    plan = _Plan()
    if rules.preset is not None:
        preset = PRESETS[rules.preset]
        planner = _ms_to_torch if preset.direction == MS_TO_TORCH else _torch_to_ms
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


def _entry(name: str, claimed: dict[str, tuple[Rule, str | None]], plan: _Plan, preset: str | None) -> Mapped:
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


def _split(name: str) -> tuple[str, str]:
    """`(module path, leaf)`; the module of a top-level name is ""."""
    module, _, leaf = name.rpartition(".")
    return module, leaf


def _join(module: str, leaf: str) -> str:
    return f"{module}.{leaf}" if module else leaf


def _modules(params: Iterable[str]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for p in params:
        module, leaf = _split(p)
        out.setdefault(module, set()).add(leaf)
    return out


def _rename_in_module(plan: _Plan, name: str, new_leaf: str, leaves: set[str], label: str) -> None:
    """Propose `module.new_leaf` unless the module already has that leaf (then it is ambiguous)."""
    module, leaf = _split(name)
    if new_leaf in leaves:
        plan.ambiguous[name] = f"{leaf} -> {new_leaf} would collide with {_join(module, new_leaf)!r}"
    else:
        plan.set(name, _join(module, new_leaf), label)


def _ms_module(plan: _Plan, module: str, leaves: set[str]) -> None:
    """Propose torch names for one MindSpore cell's parameters (only the last component changes)."""
    for leaf in sorted(leaves):
        name = _join(module, leaf)
        if leaf in ("gamma", "beta"):
            if {"gamma", "beta"} <= leaves:  # every MindSpore norm layer has both
                _rename_in_module(plan, name, "weight" if leaf == "gamma" else "bias", leaves, _LABEL_NORM)
            else:
                other = "beta" if leaf == "gamma" else "gamma"
                plan.ambiguous[name] = f"{leaf} without {other}: not a MindSpore norm layer"
        elif leaf in ("moving_mean", "moving_variance"):
            new = "running_mean" if leaf == "moving_mean" else "running_var"
            _rename_in_module(plan, name, new, leaves, _LABEL_BN)
        elif leaf == "embedding_table":
            _rename_in_module(plan, name, "weight", leaves, _LABEL_EMB)


def _ms_to_torch(preset: Preset, names: list[str], shapes: dict, prefix: str, renamed: dict[str, str]) -> _Plan:
    plan, model = _Plan(), _Plan()
    pre, present = f"{prefix}." if prefix else "", set(names)
    state: dict[str, tuple[str, str]] = {}  # state name -> (param, torch key)
    for name in names:
        head, dot, param = name.partition(".")
        if dot and param and head in _MS_STATE:
            state[name] = (param, _MS_STATE[head])
    params = [n for n in names if n not in state and n not in _MS_GLOBALS]
    for module, leaves in _modules(params + [p for p, _ in state.values()]).items():
        _ms_module(model, module, leaves)  # also params known only from their optimizer state
    for name in params:
        if name in model.dest:
            plan.set(name, model.dest[name], model.label[name])
        elif name in model.ambiguous:
            plan.ambiguous[name] = model.ambiguous[name]

    def final(param: str) -> str:
        return renamed.get(param) or model.dest.get(param) or param

    with_state: dict[str, None] = {}  # torch FQNs that have optimizer state, in order
    for name, (param, key) in state.items():
        head = name.partition(".")[0]
        plan.set(name, f"{pre}state.{final(param)}.{key}", f"{_LABEL_STATE} {head}.<param> -> {pre}state.<fqn>.{key}")
        plan.param_of[name] = param
        with_state[final(param)] = None
    step = next((s for s in _MS_STEPS if s in present), None)
    f32, label = dtypes.dtype("float32"), f"preset {preset.name}"
    if with_state:
        count = f"{len(with_state)} parameter(s)"
        for other in _MS_STEPS:
            if other in present and other != step:
                plan.set(other, None, "step counter", f"dropped: {step} is the step count")
        if step:
            plan.set(step, None, "step counter", f"feeds {pre}state.<fqn>.step of {count}")
            plan.derived += [Derived(f"{pre}state.{fqn}.step", (step,), "step", f32, (),
                                     f"{label}: {step} -> {pre}state.<fqn>.step") for fqn in with_state]
        if _MS_LR in present:
            plan.set(_MS_LR, None, "learning rate", f"feeds {pre}param_groups.<fqn>.lr of {count}")
            plan.derived += [Derived(f"{pre}param_groups.{fqn}.lr", (_MS_LR,), "lr", f32, (),
                                     f"{label}: {_MS_LR} -> {pre}param_groups.<fqn>.lr") for fqn in with_state]
    else:
        for name in _MS_STEPS + (_MS_LR,):
            if name in present:
                plan.ambiguous[name] = "no optimizer state in the source to attach it to"
    for name in _MS_POWERS:
        if name in present:
            plan.set(name, None, "Adam bias correction", "dropped: torch Adam computes beta**step from step")
    for name in names:
        if re.fullmatch(r"learning_rate_group_\d+", name):
            plan.ambiguous[name] = "a group learning rate: which parameters are in the group is not in the checkpoint"
    for name in params:  # torch BatchNorm also has a batch counter
        dest = final(name)
        if _split(name)[1] == "moving_mean" and _split(dest)[1] == "running_mean":
            plan.derived.append(Derived(_join(_split(dest)[0], "num_batches_tracked"), (), "num_batches_tracked",
                                        dtypes.dtype("int64"), (), f"{label}: BatchNorm num_batches_tracked = 0"))
    return plan


def _torch_to_ms(preset: Preset, names: list[str], shapes: dict, prefix: str, renamed: dict[str, str]) -> _Plan:
    plan = _Plan()
    shown = f"{prefix}." if prefix else ""
    pre = re.escape(shown)
    state_re = re.compile(rf"{pre}state\.(.+)\.({'|'.join(_TORCH_STATE_KEYS)})")
    group_re = re.compile(rf"{pre}param_groups\.(.+)\.([A-Za-z_]\w*)")
    state: dict[str, tuple[str, str]] = {}
    groups: dict[str, tuple[str, str]] = {}
    for name in names:
        if m := state_re.fullmatch(name):
            state[name] = (m.group(1), m.group(2))
        elif m := group_re.fullmatch(name):
            groups[name] = (m.group(1), m.group(2))
    params = [n for n in names if n not in state and n not in groups]
    shape_of = dict(shapes)
    for name, (param, key) in state.items():
        if key == "exp_avg" and name in shapes:
            shape_of.setdefault(param, shapes[name])
    model = _Plan()
    for module, leaves in _modules(params + [p for p, _ in state.values()]).items():
        _torch_module(model, module, leaves, shape_of)  # also params known only from their state
    for name in params:
        if name in model.dest:
            plan.set(name, model.dest[name], model.label[name], model.note.get(name))
        elif name in model.ambiguous:
            plan.ambiguous[name] = model.ambiguous[name]

    def final(param: str) -> str:
        return renamed.get(param) or model.dest.get(param) or param

    m1, m2, vhat = preset.ms_state_prefixes
    steps, lrs, betas = [], [], []
    for name, (param, key) in state.items():
        if key == "step":
            steps.append(name)
            fed = "global_step, beta1_power, beta2_power" if preset.beta_powers else "global_step"
            plan.set(name, None, "step counter", f"feeds {fed}")
            continue
        ms = {"exp_avg": m1, "exp_avg_sq": m2, "max_exp_avg_sq": vhat}[key]
        if ms is None:
            plan.ambiguous[name] = f"{preset.name} names no MindSpore state for {key}"
            continue
        plan.set(name, f"{ms}.{final(param)}", f"{_LABEL_STATE} {shown}state.<fqn>.{key} -> {ms}.<param>")
        plan.param_of[name] = param
    for name, (_, key) in groups.items():
        if key == "lr":
            lrs.append(name)
            plan.set(name, None, "learning rate", f"feeds {_MS_LR}")
        else:
            if key == "betas":
                betas.append(name)
            plan.set(name, None, "optimizer hyperparameter",
                     "dropped: MindSpore optimizers take it as a constructor argument")
    label = f"preset {preset.name}"
    f32 = dtypes.dtype("float32")
    if steps:
        plan.derived.append(Derived("global_step", tuple(steps), "step", dtypes.dtype("int32"), (1,),
                                    f"{label}: {shown}state.<fqn>.step -> global_step"))
        if preset.beta_powers:
            how = "" if betas else f" (no betas in the source: the default {DEFAULT_ADAM_BETAS})"
            plan.derived += [Derived(p, tuple(steps + betas), p, f32, (), f"{label}: beta**step -> {p}{how}")
                             for p in _MS_POWERS]
    if lrs:
        plan.derived.append(Derived(_MS_LR, tuple(lrs), "lr", f32, (),
                                    f"{label}: {shown}param_groups.<fqn>.lr -> {_MS_LR}"))
    return plan


def _torch_module(plan: _Plan, module: str, leaves: set[str], shape_of: dict) -> None:
    """Decide what one torch module is, from its leaf names, the weight's rank and its name."""
    def rename(leaf: str, new: str, label: str) -> None:
        if leaf in leaves:
            _rename_in_module(plan, _join(module, leaf), new, leaves, label)

    if leaves & {"running_mean", "running_var"}:
        for leaf, new in _TORCH_BN.items():
            rename(leaf, new, _LABEL_BN if leaf.startswith("running") else _LABEL_NORM)
        if "num_batches_tracked" in leaves:
            plan.set(_join(module, "num_batches_tracked"), None, "BatchNorm num_batches_tracked",
                     "dropped: MindSpore BatchNorm has no batch counter")
        return
    if "weight" not in leaves:
        return
    weight = _join(module, "weight")
    rank = len(shape_of[weight]) if weight in shape_of else None
    has_bias = "bias" in leaves
    last = module.rpartition(".")[2]
    if rank == 1 or (rank is None and _NORM_HINT.fullmatch(last)):
        if has_bias:
            rename("weight", "gamma", _LABEL_NORM)
            rename("bias", "beta", _LABEL_NORM)
        else:
            plan.ambiguous[weight] = ("a 1-D weight without bias: an RMSNorm keeps 'weight', a LayerNorm(bias=False) "
                                      "would be 'gamma'")
    elif rank in (None, 2) and not has_bias and _EMBED_HINT.fullmatch(last):
        rename("weight", "embedding_table", _LABEL_EMB)
    elif rank == 2 and not has_bias:
        plan.ambiguous[weight] = ("a 2-D weight without bias: a Dense keeps 'weight', an Embedding would be "
                                  "'embedding_table' (the module name does not say 'emb')")
    elif rank is None:
        plan.ambiguous[weight] = "no shape: cannot tell a Dense/Conv weight from a LayerNorm/Embedding one"
        if has_bias:
            plan.ambiguous[_join(module, "bias")] = plan.ambiguous[weight]


# --------------------------------------------------------------------------------------------
# Direction and output


def detect_direction(names: Iterable[str], optim_prefix: str = DEFAULT_OPTIM_PREFIX) -> str | None:
    """"ms-to-torch" when the names look MindSpore-written, "torch-to-ms" when torch-written,
    None when they show neither or both (e.g. a model of Dense layers only)."""
    pre = re.escape(f"{optim_prefix}.") if optim_prefix else ""
    torch_re = re.compile(rf"{pre}(state\..+\.({'|'.join(_TORCH_STATE_KEYS)})|param_groups\..+)")
    ms = torch = 0
    for name in names:
        head, dot, _ = name.partition(".")
        leaf = _split(name)[1]
        if torch_re.fullmatch(name) or leaf in ("running_mean", "running_var", "num_batches_tracked"):
            torch += 1
        elif name in _MS_GLOBALS or (dot and head in _MS_STATE) or \
                leaf in ("gamma", "beta", "moving_mean", "moving_variance", "embedding_table"):
            ms += 1
    if ms and not torch:
        return MS_TO_TORCH
    if torch and not ms:
        return TORCH_TO_MS
    return None


def _transform(entry: Mapped | Derived) -> str:
    if isinstance(entry, Derived):
        return f"{entry.kind} {entry.dtype.name}{list(entry.shape)}"
    parts = []
    if entry.transpose:
        parts.append(f"transpose{list(entry.transpose)}")
    if entry.dtype:
        parts.append(f"-> {entry.dtype.name}")
    return " ".join(parts)


def render_mapping(mapping: NameMapping) -> list[str]:
    """The `--dry-run` table as plain lines: source, destination, transform, rule; then the
    derived tensors, the ambiguous names and a summary."""
    rows = [("SOURCE", "DESTINATION", "TRANSFORM", "RULE")]
    for e in mapping.entries.values():
        dest = e.destination if e.destination is not None else f"({e.note or 'dropped'})"
        rule = e.rule or "(unmapped, kept)"
        rows.append((e.source, dest, _transform(e), f"{rule}; {e.note}" if e.note and e.destination else rule))
    for d in mapping.derived:
        src = ", ".join(d.sources) if len(d.sources) <= 2 else f"{d.sources[0]} and {len(d.sources) - 1} more"
        rows.append((f"<- {src or '(no source)'}", d.destination, _transform(d), d.rule))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3] for r in rows]
    lines = [line.rstrip() for line in lines]
    for name, why in mapping.ambiguous.items():
        lines.append(f"ambiguous: {name}: {why}")
    renamed = sum(1 for e in mapping.entries.values() if e.destination not in (None, e.source))
    lines.append(f"{len(mapping.entries)} source names: {renamed} renamed, {len(mapping.dropped)} not written, "
                 f"{len(mapping.unmapped)} unmapped (kept), {len(mapping.ambiguous)} ambiguous; "
                 f"{len(mapping.derived)} derived; preset {mapping.preset or 'none'}")
    return lines


def mapping_json(mapping: NameMapping) -> dict:
    """The mapping as JSON-able data (for `--json`); dtypes by canonical name."""
    return {
        "preset": mapping.preset,
        "entries": [
            {"source": e.source, "destination": e.destination,
             "transpose": list(e.transpose) if e.transpose else None,
             "dtype": e.dtype.name if e.dtype else None, "rule": e.rule, "note": e.note}
            for e in mapping.entries.values()
        ],
        "derived": [
            {"destination": d.destination, "sources": list(d.sources), "kind": d.kind,
             "dtype": d.dtype.name, "shape": list(d.shape), "rule": d.rule}
            for d in mapping.derived
        ],
        "unmapped": list(mapping.unmapped),
        "ambiguous": dict(mapping.ambiguous),
        "dropped": list(mapping.dropped),
    }
