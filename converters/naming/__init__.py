"""Parameter names between MindSpore and PyTorch checkpoints: presets, user rules, one mapping.

`convert-ms-torch` copies tensors; this package only decides what each one is called on the other
side, so a dry run can show the whole table before a byte is written, and computes the counters
that have no one-to-one counterpart (`derive`). No framework is imported.

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

Modules: `presets` (the built-in rename sets, the frameworks' name tables, `detect_direction`),
`rules` (user rules files), `entries` (`Mapped`, `Derived`), `preset_plan` (a preset's proposal),
`ms_to_torch` and `torch_to_ms` (the two directions' presets), `mapping` (`map_names`,
`NameMapping`), `report` (the `--dry-run` table and `--json` form) and `derive` (the derived
counters' values).
"""

from hpckpt.converters.naming.derive import derive_values, with_tensors
from hpckpt.converters.naming.entries import Derived, Mapped
from hpckpt.converters.naming.mapping import NameMapping, map_names
from hpckpt.converters.naming.presets import (
    DEFAULT_ADAM_BETAS,
    DEFAULT_OPTIM_PREFIX,
    DIRECTIONS,
    MS_TO_TORCH,
    PRESETS,
    TORCH_TO_MS,
    TORCH_TO_MS_ADAMW,
    Preset,
    detect_direction,
)
from hpckpt.converters.naming.report import mapping_json, render_mapping
from hpckpt.converters.naming.rules import NameRules, Rule, load_rules, parse_rules
from hpckpt.core.errors import NameCollisionError, NameRuleError

__all__ = [
    "MS_TO_TORCH", "TORCH_TO_MS", "TORCH_TO_MS_ADAMW", "DIRECTIONS", "DEFAULT_OPTIM_PREFIX", "DEFAULT_ADAM_BETAS",
    "PRESETS",
    "Preset", "Rule", "NameRules", "Mapped", "Derived", "NameMapping",
    "NameRuleError", "NameCollisionError",
    "load_rules", "parse_rules", "map_names", "render_mapping", "mapping_json", "detect_direction",
    "derive_values", "with_tensors",
]
