"""Name presets: the built-in MindSpore <-> PyTorch rename sets, and what each framework's names look like.

The tables say how each framework names what it saves (see the package docstring); the mapping
(`mapping.map_names`) and the two directions' planners (`ms_to_torch`, `torch_to_ms`) read them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

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
MS_STATE = {
    "moment1": "exp_avg", "adam_m": "exp_avg", "exp_avg": "exp_avg",
    "moment2": "exp_avg_sq", "adam_v": "exp_avg_sq", "exp_avg_sq": "exp_avg_sq",
    "vhat": "max_exp_avg_sq", "max_exp_avg_sq": "max_exp_avg_sq",
}
MS_STEPS = ("state_step", "global_step")  # the first present is the Adam step count
MS_POWERS = ("beta1_power", "beta2_power")
MS_LR = "learning_rate"
MS_GLOBALS = frozenset(MS_STEPS + MS_POWERS + (MS_LR,))
TORCH_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step")
LABEL_NORM = "norm gamma/beta <-> weight/bias"
LABEL_BN = "BatchNorm moving_mean/moving_variance <-> running_mean/running_var"
LABEL_EMB = "Embedding embedding_table <-> weight"
LABEL_STATE = "Adam state"


def detect_direction(names: Iterable[str], optim_prefix: str = DEFAULT_OPTIM_PREFIX) -> str | None:
    """"ms-to-torch" when the names look MindSpore-written, "torch-to-ms" when torch-written,
    None when they show neither or both (e.g. a model of Dense layers only)."""
    pre = re.escape(f"{optim_prefix}.") if optim_prefix else ""
    torch_re = re.compile(rf"{pre}(state\..+\.({'|'.join(TORCH_STATE_KEYS)})|param_groups\..+)")
    ms = torch = 0
    for name in names:
        head, dot, _ = name.partition(".")
        leaf = name.rpartition(".")[2]
        if torch_re.fullmatch(name) or leaf in ("running_mean", "running_var", "num_batches_tracked"):
            torch += 1
        elif name in MS_GLOBALS or (dot and head in MS_STATE) or \
                leaf in ("gamma", "beta", "moving_mean", "moving_variance", "embedding_table"):
            ms += 1
    if ms and not torch:
        return MS_TO_TORCH
    if torch and not ms:
        return TORCH_TO_MS
    return None

