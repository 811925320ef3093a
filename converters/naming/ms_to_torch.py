"""The ms-to-torch preset: MindSpore cell and optimizer names -> torch module and optimizer names."""

from __future__ import annotations

import re

from hpckpt.converters.naming.entries import Derived
from hpckpt.converters.naming.preset_plan import PresetPlan, join_name, modules_of, rename_in_module, split_name
from hpckpt.converters.naming.presets import (
    LABEL_BN,
    LABEL_EMB,
    LABEL_NORM,
    LABEL_STATE,
    MS_GLOBALS,
    MS_LR,
    MS_POWERS,
    MS_STATE,
    MS_STEPS,
    Preset,
)
from hpckpt.core import dtypes


def _ms_module(plan: PresetPlan, module: str, leaves: set[str]) -> None:
    """Propose torch names for one MindSpore cell's parameters (only the last component changes)."""
    for leaf in sorted(leaves):
        name = join_name(module, leaf)
        if leaf in ("gamma", "beta"):
            if {"gamma", "beta"} <= leaves:  # every MindSpore norm layer has both
                rename_in_module(plan, name, "weight" if leaf == "gamma" else "bias", leaves, LABEL_NORM)
            else:
                other = "beta" if leaf == "gamma" else "gamma"
                plan.ambiguous[name] = f"{leaf} without {other}: not a MindSpore norm layer"
        elif leaf in ("moving_mean", "moving_variance"):
            new = "running_mean" if leaf == "moving_mean" else "running_var"
            rename_in_module(plan, name, new, leaves, LABEL_BN)
        elif leaf == "embedding_table":
            rename_in_module(plan, name, "weight", leaves, LABEL_EMB)


def plan_ms_to_torch(preset: Preset, names: list[str], shapes: dict, prefix: str,
                     renamed: dict[str, str]) -> PresetPlan:
    """Propose torch names for a MindSpore checkpoint's `names`, so `map_names` can apply the preset.

    Args:
        preset: the ms-to-torch preset.
        names: the source names, in order.
        shapes: source name -> shape (unused here: MindSpore names say what a parameter is).
        prefix: the torch-side optimizer prefix ("optim"; "" for none).
        renamed: what user rules renamed, so optimizer state follows its parameter's final name.
    """
    plan, model = PresetPlan(), PresetPlan()
    pre, present = f"{prefix}." if prefix else "", set(names)
    state: dict[str, tuple[str, str]] = {}  # state name -> (param, torch key)
    for name in names:
        head, dot, param = name.partition(".")
        if dot and param and head in MS_STATE:
            state[name] = (param, MS_STATE[head])
    params = [n for n in names if n not in state and n not in MS_GLOBALS]
    for module, leaves in modules_of(params + [p for p, _ in state.values()]).items():
        _ms_module(model, module, leaves)  # also params known only from their optimizer state
    plan.adopt(model, params)

    def final(param: str) -> str:
        return renamed.get(param) or model.dest.get(param) or param

    with_state: dict[str, None] = {}  # torch FQNs that have optimizer state, in order
    for name, (param, key) in state.items():
        head = name.partition(".")[0]
        plan.set(name, f"{pre}state.{final(param)}.{key}", f"{LABEL_STATE} {head}.<param> -> {pre}state.<fqn>.{key}")
        plan.param_of[name] = param
        with_state[final(param)] = None
    step = next((s for s in MS_STEPS if s in present), None)
    f32, label = dtypes.dtype("float32"), f"preset {preset.name}"
    if with_state:
        count = f"{len(with_state)} parameter(s)"
        for other in MS_STEPS:
            if other in present and other != step:
                plan.set(other, None, "step counter", f"dropped: {step} is the step count")
        if step:
            plan.set(step, None, "step counter", f"feeds {pre}state.<fqn>.step of {count}")
            plan.derived += [Derived(f"{pre}state.{fqn}.step", (step,), "step", f32, (),
                                     f"{label}: {step} -> {pre}state.<fqn>.step") for fqn in with_state]
        if MS_LR in present:
            plan.set(MS_LR, None, "learning rate", f"feeds {pre}param_groups.<fqn>.lr of {count}")
            plan.derived += [Derived(f"{pre}param_groups.{fqn}.lr", (MS_LR,), "lr", f32, (),
                                     f"{label}: {MS_LR} -> {pre}param_groups.<fqn>.lr") for fqn in with_state]
    else:
        for name in MS_STEPS + (MS_LR,):
            if name in present:
                plan.ambiguous[name] = "no optimizer state in the source to attach it to"
    for name in MS_POWERS:
        if name in present:
            plan.set(name, None, "Adam bias correction", "dropped: torch Adam computes beta**step from step")
    for name in names:
        if re.fullmatch(r"learning_rate_group_\d+", name):
            plan.ambiguous[name] = "a group learning rate: which parameters are in the group is not in the checkpoint"
    for name in params:  # torch BatchNorm also has a batch counter
        dest = final(name)
        if split_name(name)[1] == "moving_mean" and split_name(dest)[1] == "running_mean":
            plan.derived.append(Derived(join_name(split_name(dest)[0], "num_batches_tracked"), (),
                                        "num_batches_tracked", dtypes.dtype("int64"), (),
                                        f"{label}: BatchNorm num_batches_tracked = 0"))
    return plan
