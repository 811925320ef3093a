"""The torch-to-ms presets: torch module and optimizer names -> MindSpore cell and optimizer names.

torch names Adam's and AdamW's state alike, so the preset says which MindSpore optimizer to name
for (`Preset.ms_state_prefixes`); a torch module's kind is told from its leaves, the weight's rank
and its name.
"""

from __future__ import annotations

import re

from hpckpt.converters.naming.entries import Derived
from hpckpt.converters.naming.preset_plan import PresetPlan, join_name, modules_of, rename_in_module
from hpckpt.converters.naming.presets import (
    DEFAULT_ADAM_BETAS,
    LABEL_BN,
    LABEL_EMB,
    LABEL_NORM,
    LABEL_STATE,
    MS_LR,
    MS_POWERS,
    TORCH_STATE_KEYS,
    Preset,
)
from hpckpt.core import dtypes

_TORCH_BN = {"weight": "gamma", "bias": "beta", "running_mean": "moving_mean", "running_var": "moving_variance"}
_EMBED_HINT = re.compile(r"(?i).*emb.*|wte|wpe")
_NORM_HINT = re.compile(r"(?i).*norm.*|ln(_?\w+)?|bn\d*|gn\d*")


def plan_torch_to_ms(preset: Preset, names: list[str], shapes: dict, prefix: str,
                     renamed: dict[str, str]) -> PresetPlan:
    """Propose MindSpore names for a torch checkpoint's `names`, so `map_names` can apply the preset.

    Args:
        preset: a torch-to-ms preset; it says which MindSpore optimizer state to name.
        names: the source names, in order.
        shapes: source name -> shape, to tell a LayerNorm `weight` (1-D) from a Dense one.
        prefix: the torch-side optimizer prefix ("optim"; "" for none).
        renamed: what user rules renamed, so optimizer state follows its parameter's final name.
    """
    plan = PresetPlan()
    shown = f"{prefix}." if prefix else ""
    pre = re.escape(shown)
    state_re = re.compile(rf"{pre}state\.(.+)\.({'|'.join(TORCH_STATE_KEYS)})")
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
    model = PresetPlan()
    for module, leaves in modules_of(params + [p for p, _ in state.values()]).items():
        _torch_module(model, module, leaves, shape_of)  # also params known only from their state
    plan.adopt(model, params)

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
        plan.set(name, f"{ms}.{final(param)}", f"{LABEL_STATE} {shown}state.<fqn>.{key} -> {ms}.<param>")
        plan.param_of[name] = param
    for name, (_, key) in groups.items():
        if key == "lr":
            lrs.append(name)
            plan.set(name, None, "learning rate", f"feeds {MS_LR}")
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
                             for p in MS_POWERS]
    if lrs:
        plan.derived.append(Derived(MS_LR, tuple(lrs), "lr", f32, (),
                                    f"{label}: {shown}param_groups.<fqn>.lr -> {MS_LR}"))
    return plan


def _torch_module(plan: PresetPlan, module: str, leaves: set[str], shape_of: dict) -> None:
    """Decide what one torch module is, from its leaf names, the weight's rank and its name."""
    def rename(leaf: str, new: str, label: str) -> None:
        if leaf in leaves:
            rename_in_module(plan, join_name(module, leaf), new, leaves, label)

    if leaves & {"running_mean", "running_var"}:
        for leaf, new in _TORCH_BN.items():
            rename(leaf, new, LABEL_BN if leaf.startswith("running") else LABEL_NORM)
        if "num_batches_tracked" in leaves:
            plan.set(join_name(module, "num_batches_tracked"), None, "BatchNorm num_batches_tracked",
                     "dropped: MindSpore BatchNorm has no batch counter")
        return
    if "weight" not in leaves:
        return
    weight = join_name(module, "weight")
    rank = len(shape_of[weight]) if weight in shape_of else None
    has_bias = "bias" in leaves
    last = module.rpartition(".")[2]
    if rank == 1 or (rank is None and _NORM_HINT.fullmatch(last)):
        if has_bias:
            rename("weight", "gamma", LABEL_NORM)
            rename("bias", "beta", LABEL_NORM)
        else:
            plan.ambiguous[weight] = ("a 1-D weight without bias: an RMSNorm keeps 'weight', a LayerNorm(bias=False) "
                                      "would be 'gamma'")
    elif rank in (None, 2) and not has_bias and _EMBED_HINT.fullmatch(last):
        rename("weight", "embedding_table", LABEL_EMB)
    elif rank == 2 and not has_bias:
        plan.ambiguous[weight] = ("a 2-D weight without bias: a Dense keeps 'weight', an Embedding would be "
                                  "'embedding_table' (the module name does not say 'emb')")
    elif rank is None:
        plan.ambiguous[weight] = "no shape: cannot tell a Dense/Conv weight from a LayerNorm/Embedding one"
        if has_bias:
            plan.ambiguous[join_name(module, "bias")] = plan.ambiguous[weight]
