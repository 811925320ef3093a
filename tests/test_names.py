"""Name mapping between MindSpore and PyTorch: presets on names the frameworks really write,
user rules, precedence, collisions and rule-file errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from hpckpt.converters import naming as names
from hpckpt.core import dtypes
from hpckpt.core.errors import HpckptError, PathNotFoundError
from hpckpt.converters.naming import MS_TO_TORCH, TORCH_TO_MS, TORCH_TO_MS_ADAMW, NameCollisionError, NameRuleError

from _util import REPO

EXAMPLE = REPO / "examples" / "name-rules.toml"


# --------------------------------------------------------------------------------------------
# What the frameworks write: the same small network in both


@pytest.fixture(scope="module")
def ms_ckpt(tmp_path_factory):
    """Names, shapes and dtypes of what `mindspore.save_checkpoint` writes for a tiny network,
    alone, with nn.Adam (through a TrainOneStepCell) and with nn.AdamWeightDecay."""
    import mindspore as ms
    from mindspore import nn

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.dense = nn.Dense(4, 3)
            self.norm = nn.LayerNorm((3,))
            self.bn = nn.BatchNorm1d(3)
            self.blocks = nn.CellList([nn.Dense(3, 5), nn.LayerNorm((5,))])

        def construct(self, x):
            return self.blocks[1](self.blocks[0](self.bn(self.norm(self.dense(self.embed(x))))))

    tmp = tmp_path_factory.mktemp("ms")
    net = Net()

    def saved(obj, stem):
        path = str(tmp / f"{stem}.ckpt")
        ms.save_checkpoint(obj, path)
        params = ms.load_checkpoint(path)
        return {k: (tuple(p.shape), dtypes.dtype(str(p.dtype))) for k, p in params.items()}

    model = saved(net, "net")
    adam = saved(nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.Adam(net.trainable_params())), "adam")
    adamw = saved(nn.AdamWeightDecay(net.trainable_params()), "adamw")
    return SimpleNamespace(model=model, adam=adam, adamw=adamw)


@pytest.fixture(scope="module")
def torch_ckpt(tmp_path_factory):
    """The equivalent torch.nn module after one Adam step: its state_dict, the flattened
    optimizer state dict, and the keys `dcp.save` writes for {**model, "optim": flat osd}."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.dense = nn.Linear(4, 3)
            self.norm = nn.LayerNorm(3)
            self.bn = nn.BatchNorm1d(3)
            self.blocks = nn.ModuleList([nn.Linear(3, 5), nn.LayerNorm(5)])

        def forward(self, x):
            return self.blocks[1](self.blocks[0](self.bn(self.norm(self.dense(self.embed(x))))))

    def make():
        net = Net()
        return net, torch.optim.Adam(net.parameters(), lr=0.01)

    torch.manual_seed(0)
    net, opt = make()
    net(torch.tensor([1, 2, 3])).sum().backward()
    opt.step()
    opts = StateDictOptions(flatten_optimizer_state_dict=True)
    model = get_model_state_dict(net)
    osd = get_optimizer_state_dict(net, opt, options=opts)
    path = tmp_path_factory.mktemp("dcp")
    dcp.save({**model, "optim": osd}, checkpoint_id=str(path))
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    shapes = {k: tuple(v.size) for k, v in meta.items() if hasattr(v, "size")}
    return SimpleNamespace(model=model, osd=osd, dcp_keys=set(meta), shapes=shapes, make=make, opts=opts,
                           tensor_keys={k for k in meta if k in shapes})


def _shapes(table):
    return {k: shape for k, (shape, _) in table.items()}


def _model_only(ms_table):
    return {k: v for k, v in ms_table.items() if "." in k and k.split(".")[0] not in ("moment1", "moment2", "adam_m", "adam_v")}


# --------------------------------------------------------------------------------------------
# Presets on real names


def test_ms_to_torch_model_names_are_exactly_the_torch_state_dict(ms_ckpt, torch_ckpt):
    mapping = names.map_names(ms_ckpt.model, MS_TO_TORCH, shapes=_shapes(ms_ckpt.model))
    assert sorted(mapping.destinations()) == sorted(torch_ckpt.model)
    assert not mapping.ambiguous
    assert mapping["norm.gamma"].destination == "norm.weight"
    assert mapping["bn.moving_variance"].destination == "bn.running_var"
    assert mapping["embed.embedding_table"].destination == "embed.weight"
    assert set(mapping.unmapped) == {"dense.weight", "dense.bias", "blocks.0.weight", "blocks.0.bias"}
    for entry in mapping.entries.values():  # same layout on both sides: nothing to transpose
        assert ms_ckpt.model[entry.source][0] == tuple(torch_ckpt.model[entry.destination].shape), entry
        assert entry.transpose is None and entry.dtype is None
    (counter,) = mapping.derived
    assert counter.destination == "bn.num_batches_tracked"
    assert (counter.dtype.torch, counter.shape) == (str(torch_ckpt.model["bn.num_batches_tracked"].dtype), ())


def test_torch_to_ms_model_names_are_exactly_the_mindspore_checkpoint(ms_ckpt, torch_ckpt):
    shapes = {k: tuple(v.shape) for k, v in torch_ckpt.model.items()}
    mapping = names.map_names(torch_ckpt.model, TORCH_TO_MS, shapes=shapes)
    assert sorted(mapping.destinations()) == sorted(ms_ckpt.model)
    assert not mapping.ambiguous and not mapping.derived
    assert mapping["blocks.1.weight"].destination == "blocks.1.gamma"  # 1-D weight + bias: LayerNorm
    assert mapping["blocks.0.weight"].destination == "blocks.0.weight"  # 2-D weight + bias: Dense
    assert mapping["embed.weight"].destination == "embed.embedding_table"
    assert mapping["bn.weight"].destination == "bn.gamma"  # running_mean present: BatchNorm
    assert mapping.dropped == ("bn.num_batches_tracked",)


def test_ms_adam_state_maps_to_the_keys_torch_dcp_writes(ms_ckpt, torch_ckpt):
    mapping = names.map_names(ms_ckpt.adam, MS_TO_TORCH, shapes=_shapes(ms_ckpt.adam))
    got = set(mapping.destinations())
    lrs = {k for k in torch_ckpt.dcp_keys if re.fullmatch(r"optim\.param_groups\..*\.lr", k)}
    assert got == torch_ckpt.tensor_keys | lrs
    assert mapping["moment1.norm.gamma"].destination == "optim.state.norm.weight.exp_avg"
    assert mapping["moment2.embed.embedding_table"].destination == "optim.state.embed.weight.exp_avg_sq"
    assert set(mapping.dropped) == {"beta1_power", "beta2_power", "global_step", "learning_rate"}
    for entry in mapping.entries.values():
        if entry.destination in torch_ckpt.shapes:
            assert ms_ckpt.adam[entry.source][0] == torch_ckpt.shapes[entry.destination], entry
    step = torch_ckpt.osd["state.dense.weight.step"]
    for d in mapping.derived:
        if d.kind == "step":
            assert d.sources == ("global_step",)
            assert (d.dtype.torch, d.shape) == (str(step.dtype), tuple(step.shape))


def test_ms_adamweightdecay_state_maps_like_adam(ms_ckpt, torch_ckpt):
    adam = names.map_names(ms_ckpt.adam, MS_TO_TORCH)
    adamw = names.map_names(ms_ckpt.adamw, MS_TO_TORCH)
    state = {d for d in adam.destinations() if d.startswith("optim.")}
    assert {d for d in adamw.destinations() if d.startswith("optim.")} == state
    assert adamw["adam_m.dense.weight"].destination == "optim.state.dense.weight.exp_avg"
    assert adamw["adam_v.blocks.1.beta"].destination == "optim.state.blocks.1.bias.exp_avg_sq"


@pytest.mark.parametrize("preset, which", [(TORCH_TO_MS, "adam"), (TORCH_TO_MS_ADAMW, "adamw")])
def test_torch_adam_state_maps_to_what_mindspore_writes(ms_ckpt, torch_ckpt, preset, which):
    """Every key of the torch DCP checkpoint (tensors and param-group values) in, exactly the
    names of the MindSpore optimizer checkpoint out; derived counters as MindSpore has them."""
    expected = getattr(ms_ckpt, which)
    mapping = names.map_names(torch_ckpt.dcp_keys, preset, shapes=torch_ckpt.shapes)
    got = set(mapping.destinations())
    if which == "adamw":  # the AdamWeightDecay save does not hold the BatchNorm statistics
        got -= {"bn.moving_mean", "bn.moving_variance"}
    assert got == set(expected)
    assert not mapping.ambiguous
    for d in mapping.derived:
        assert (expected[d.destination][0], expected[d.destination][1]) == (d.shape, d.dtype), d
    moment = "moment1" if which == "adam" else "adam_m"
    assert mapping["optim.state.norm.weight.exp_avg"].destination == f"{moment}.norm.gamma"
    assert mapping["optim.param_groups.dense.weight.betas"].destination is None


def test_mapped_names_load_through_the_torch_state_dict_api(ms_ckpt, torch_ckpt, tmp_path):
    """A DCP checkpoint holding exactly the ms->torch destinations loads with the documented
    get/set_*_state_dict recipe (values taken from the trained torch model)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    mapping = names.map_names(ms_ckpt.adam, MS_TO_TORCH)
    source = {**torch_ckpt.model, **{f"optim.{k}": v for k, v in torch_ckpt.osd.items()}}
    dcp.save({d: source[d] for d in mapping.destinations()}, checkpoint_id=str(tmp_path))
    torch.manual_seed(1)
    net, opt = torch_ckpt.make()
    sd = {**get_model_state_dict(net), "optim": get_optimizer_state_dict(net, opt, options=torch_ckpt.opts)}
    dcp.load(sd, checkpoint_id=str(tmp_path), planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    osd = sd.pop("optim")
    set_model_state_dict(net, sd)
    set_optimizer_state_dict(net, opt, osd, options=torch_ckpt.opts)
    assert torch.equal(net.state_dict()["norm.weight"], torch_ckpt.model["norm.weight"])
    state = opt.state[net.norm.weight]
    assert torch.equal(state["exp_avg"], torch_ckpt.osd["state.norm.weight.exp_avg"])
    assert float(state["step"]) == 1.0
    assert opt.param_groups[0]["lr"] == 0.01


def test_detect_direction(ms_ckpt, torch_ckpt):
    assert names.detect_direction(ms_ckpt.adam) == MS_TO_TORCH
    assert names.detect_direction(ms_ckpt.model) == MS_TO_TORCH
    assert names.detect_direction(torch_ckpt.dcp_keys) == TORCH_TO_MS
    assert names.detect_direction(torch_ckpt.model) == TORCH_TO_MS
    assert names.detect_direction(["fc.weight", "fc.bias"]) is None
    assert names.detect_direction(["ln.gamma", "bn.running_mean"]) is None


# --------------------------------------------------------------------------------------------
# Context in the torch -> ms direction


def test_torch_to_ms_ambiguous_names_are_kept_and_listed():
    shapes = {"lm_head.weight": (10, 4), "final.weight": (4,), "tok_embeddings.weight": (10, 4),
              "conv.weight": (3, 3, 1, 1), "conv.bias": (3,)}
    mapping = names.map_names(shapes, TORCH_TO_MS, shapes=shapes)
    assert set(mapping.ambiguous) == {"lm_head.weight", "final.weight"}
    assert "Embedding" in mapping.ambiguous["lm_head.weight"] and "RMSNorm" in mapping.ambiguous["final.weight"]
    assert mapping["lm_head.weight"].destination == "lm_head.weight"
    assert mapping["tok_embeddings.weight"].destination == "tok_embeddings.embedding_table"
    assert mapping["conv.weight"].destination == "conv.weight"
    assert set(mapping.unmapped) == {"lm_head.weight", "final.weight", "conv.weight", "conv.bias"}


def test_torch_to_ms_without_shapes_uses_names_or_lists():
    mapping = names.map_names(["ln_f.weight", "ln_f.bias", "fc.weight", "fc.bias", "wte.weight"], TORCH_TO_MS)
    assert mapping["ln_f.weight"].destination == "ln_f.gamma"
    assert mapping["wte.weight"].destination == "wte.embedding_table"
    assert set(mapping.ambiguous) == {"fc.weight", "fc.bias"}


def test_torch_to_ms_shape_from_optimizer_state_only():
    shapes = {"optim.state.ln.weight.exp_avg": (8,), "optim.state.ln.bias.exp_avg": (8,)}
    mapping = names.map_names(shapes, TORCH_TO_MS, shapes=shapes)
    assert mapping["optim.state.ln.weight.exp_avg"].destination == "moment1.ln.gamma"


def test_preset_never_renames_onto_an_existing_name():
    mapping = names.map_names(["odd.embedding_table", "odd.weight", "x.gamma"], MS_TO_TORCH)
    assert mapping.destinations() == ["odd.embedding_table", "odd.weight", "x.gamma"]
    assert set(mapping.ambiguous) == {"odd.embedding_table", "x.gamma"}


def test_optim_prefix_and_experimental_optimizer_names():
    src = ["lin.weight", "exp_avg.lin.weight", "exp_avg_sq.lin.weight", "max_exp_avg_sq.lin.weight", "state_step"]
    mapping = names.map_names(src, names.NameRules(preset=MS_TO_TORCH, optim_prefix="optimizer"))
    assert mapping.destinations() == ["lin.weight", "optimizer.state.lin.weight.exp_avg",
                                      "optimizer.state.lin.weight.exp_avg_sq",
                                      "optimizer.state.lin.weight.max_exp_avg_sq", "optimizer.state.lin.weight.step"]
    bare = names.map_names(["state.lin.weight.exp_avg"], names.NameRules(preset=TORCH_TO_MS, optim_prefix=""))
    assert bare.destinations() == ["moment1.lin.weight"]


# --------------------------------------------------------------------------------------------
# User rules


RULES = r"""
[[rule]]
match = 'dense\.(weight|bias)'
rename = 'proj.\1'
transpose = [1, 0]
dtype = "bf16"

[[rule]]
match = 'norm\.gamma'
rename = 'norm.scale'

[[rule]]
match = 'embed\.(?P<what>\w+)'
dtype = "float16"
"""


def test_user_rules_rename_transpose_dtype_and_carry_to_optimizer_state():
    rules = names.parse_rules(RULES, "r.toml", MS_TO_TORCH)
    src = ["dense.weight", "moment1.dense.weight", "norm.gamma", "norm.beta", "moment2.norm.gamma",
           "embed.embedding_table", "global_step"]
    mapping = names.map_names(src, rules, shapes={"dense.weight": (3, 4)})
    w = mapping["dense.weight"]
    assert (w.destination, w.transpose, w.dtype.name, w.rule) == ("proj.weight", (1, 0), "bfloat16", "r.toml: rule 1")
    m = mapping["moment1.dense.weight"]  # follows the new name and the transpose, not the dtype
    assert (m.destination, m.transpose, m.dtype) == ("optim.state.proj.weight.exp_avg", (1, 0), None)
    assert mapping["norm.gamma"].destination == "norm.scale"  # the user rule wins over the preset
    assert mapping["norm.beta"].destination == "norm.bias"
    assert mapping["moment2.norm.gamma"].destination == "optim.state.norm.scale.exp_avg_sq"
    e = mapping["embed.embedding_table"]  # no rename: the preset renames, the rule casts
    assert (e.destination, e.dtype.name) == ("embed.weight", "float16")
    assert e.rule == "r.toml: rule 3 + preset ms-to-torch: Embedding embedding_table <-> weight"
    steps = sorted(d.destination for d in mapping.derived)
    assert steps == ["optim.state.norm.scale.step", "optim.state.proj.weight.step"]


def test_preset_none_and_default_preset():
    text = 'preset = "none"\n[[rule]]\nmatch = "a"\nrename = "b"\n'
    rules = names.parse_rules(text, "r.toml", MS_TO_TORCH)
    assert rules.preset is None
    mapping = names.map_names(["a", "n.gamma", "n.beta"], rules)
    assert mapping.destinations() == ["b", "n.gamma", "n.beta"] and mapping.unmapped == ("n.gamma", "n.beta")
    assert names.parse_rules("", "r.toml", TORCH_TO_MS).preset == TORCH_TO_MS
    assert names.parse_rules('preset = "torch-to-ms-adamw"', "r.toml", TORCH_TO_MS).preset == TORCH_TO_MS_ADAMW
    assert names.parse_rules("", "r.toml").preset is None


def test_transpose_must_fit_the_rank():
    rules = names.parse_rules("[[rule]]\nmatch = 'b'\ntranspose = [1, 0]\n", "r.toml")
    with pytest.raises(NameRuleError, match=r"r.toml: rule 1: transpose \[1, 0\] does not fit 'b' of shape \[3\]"):
        names.map_names(["b"], rules, shapes={"b": (3,)})
    assert names.parse_rules("[[rule]]\nmatch = 'b'\ntranspose = [0, 1]\n").rules[0].transpose is None


def test_collision_names_both_sources_and_the_destination():
    rules = names.parse_rules("[[rule]]\nmatch = '(a|b)\\.w'\nrename = 'x.w'\n", "r.toml")
    with pytest.raises(NameCollisionError) as info:
        names.map_names(["a.w", "keep", "b.w"], rules)
    err = info.value
    assert err.message == "'a.w' (r.toml: rule 1) and 'b.w' (r.toml: rule 1) both map to 'x.w'"
    assert err.sources == ("a.w", "b.w") and err.destination == "x.w"
    assert err.exit_code == 2 and isinstance(err, ValueError) and isinstance(err, HpckptError)
    onto_kept = names.parse_rules("[[rule]]\nmatch = 'n\\.beta'\nrename = 'n.gamma'\n", "r.toml")  # no preset
    with pytest.raises(NameCollisionError, match=r"'n.gamma' \(no rule\) and 'n.beta' \(r.toml: rule 1\)"):
        names.map_names(["n.gamma", "n.beta"], onto_kept)


def test_explicit_name_wins_over_a_derived_one():
    rules = names.parse_rules("[[rule]]\nmatch = 'my_step'\nrename = 'optim.state.w.step'\n", "r.toml", MS_TO_TORCH)
    mapping = names.map_names(["w", "moment1.w", "global_step", "my_step"], rules)
    assert mapping.destinations().count("optim.state.w.step") == 1
    assert not mapping.derived


@pytest.mark.parametrize("text, message", [
    ("renamee = 1", r"unknown key\(s\) \['renamee'\]"),
    ("[[rule]]\nmatch = 'a'\nrenam = 'b'\n", r"r.toml: rule 1: unknown key\(s\) \['renam'\]"),
    ("[[rule]]\nrename = 'b'\n", r"rule 1: needs 'match'"),
    ("[[rule]]\nmatch = 'a'\n", r"rule 1: does nothing"),
    ("[[rule]]\nmatch = 'a('\nrename = 'b'\n", r"rule 1: bad regex 'a\('"),
    ("[[rule]]\nmatch = 3\nrename = 'b'\n", r"rule 1: 'match' must be a string"),
    ("[[rule]]\nmatch = '(a)'\nrename = 'b\\2'\n", r"refers to group 2 but the pattern has 1 group"),
    ("[[rule]]\nmatch = 'a'\nrename = '\\g<x>'\n", r"unknown group name 'x'"),
    ("[[rule]]\nmatch = 'a'\nrename = 'b\\d'\n", r"bad escape '\\\\d'"),
    ("[[rule]]\nmatch = 'a'\ntranspose = [1, 1]\n", r"transpose \[1, 1\] is not a permutation"),
    ("[[rule]]\nmatch = 'a'\ntranspose = [0, 2]\n", r"is not a permutation"),
    ("[[rule]]\nmatch = 'a'\ntranspose = [true, false]\n", r"is not a permutation"),
    ("[[rule]]\nmatch = 'a'\ntranspose = '1,0'\n", r"is not a permutation"),
    ("[[rule]]\nmatch = 'a'\ndtype = 'bf17'\n", r"rule 1: unknown dtype 'bf17'"),
    ("preset = 'pytorch'", r"unknown preset 'pytorch'"),
    ("preset = 'torch-to-ms'", r"preset 'torch-to-ms' converts torch-to-ms, but this conversion is ms-to-torch"),
    ("optim_prefix = 'a..b'", r"optim_prefix 'a..b' must be a dotted name"),
    ("rule = 'x'", r"'rule' must be an array of tables"),
    ("[[rule]\n", r"not valid TOML"),
])
def test_bad_rule_files_give_clear_errors(tmp_path, text, message):
    path = tmp_path / "r.toml"
    path.write_text(text)
    with pytest.raises(NameRuleError, match=message) as info:
        names.load_rules(path, MS_TO_TORCH)
    assert info.value.exit_code == 2 and str(path) in info.value.message


def test_unknown_dtype_hint_lists_the_known_ones():
    with pytest.raises(NameRuleError) as info:
        names.parse_rules("[[rule]]\nmatch = 'a'\ndtype = 'bf17'\n")
    assert "bfloat16" in info.value.hint


def test_missing_rules_file(tmp_path):
    with pytest.raises(PathNotFoundError):
        names.load_rules(tmp_path / "nope.toml")


def test_unknown_preset_name():
    with pytest.raises(NameRuleError, match="unknown name preset 'ms2pt'"):
        names.map_names(["a"], "ms2pt")


# --------------------------------------------------------------------------------------------
# The example file, the docs and the output forms


def test_example_file_loads_and_maps():
    rules = names.load_rules(EXAMPLE, MS_TO_TORCH)
    assert rules.preset == MS_TO_TORCH and len(rules.rules) == 10
    src = ["model.tok_embeddings.embedding_weight", "model.layers.0.attention.wq.weight",
           "model.layers.11.attention.wo.weight", "model.layers.0.attention_norm.weight",
           "model.layers.0.feed_forward.w3.weight", "model.norm_out.weight", "lm_head.weight",
           "model.adapter.down.kernel", "adam_m.model.adapter.down.kernel",
           "adam_v.model.layers.0.attention.wq.weight", "global_step", "learning_rate"]
    mapping = names.map_names(src, rules, shapes={"model.adapter.down.kernel": (4, 8)})
    assert [mapping[s].destination for s in src[:7]] == [
        "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
        "model.layers.11.self_attn.o_proj.weight", "model.layers.0.input_layernorm.weight",
        "model.layers.0.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight"]
    assert mapping["lm_head.weight"].dtype.name == "bfloat16"
    assert mapping["adam_m.model.adapter.down.kernel"].destination == "optim.state.model.adapter.down.weight.exp_avg"
    assert mapping["adam_m.model.adapter.down.kernel"].transpose == (1, 0)
    assert mapping["adam_v.model.layers.0.attention.wq.weight"].destination == \
        "optim.state.model.layers.0.self_attn.q_proj.weight.exp_avg_sq"
    assert not mapping.unmapped and not mapping.ambiguous


def test_docs_show_the_example_file_verbatim():
    doc = (REPO / "docs" / "name-rules.md").read_text()
    assert "```toml\n" + EXAMPLE.read_text() + "```" in doc


def test_names_imports_no_framework():
    code = "import sys, hpckpt.converters.naming; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'mindspore')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_render_and_json():
    rules = names.parse_rules(RULES, "r.toml", MS_TO_TORCH)
    mapping = names.map_names(["dense.weight", "moment1.dense.weight", "global_step", "beta1_power", "other",
                               "learning_rate_group_0"], rules)
    lines = names.render_mapping(mapping)
    assert lines[0].split() == ["SOURCE", "DESTINATION", "TRANSFORM", "RULE"]
    row = next(line for line in lines if line.startswith("dense.weight "))
    assert row.split()[:4] == ["dense.weight", "proj.weight", "transpose[1,", "0]"]
    assert any(line.startswith("<- global_step") and "optim.state.proj.weight.step" in line for line in lines)
    assert any(line.startswith("beta1_power") and "dropped" in line for line in lines)
    assert any(line.startswith("ambiguous: learning_rate_group_0:") for line in lines)
    assert lines[-1].startswith("6 source names: 2 renamed, 2 not written, 2 unmapped (kept), 1 ambiguous; 1 derived")
    data = json.loads(json.dumps(names.mapping_json(mapping)))
    assert data["entries"][0] == {"source": "dense.weight", "destination": "proj.weight", "transpose": [1, 0],
                                  "dtype": "bfloat16", "rule": "r.toml: rule 1", "note": None}
    assert data["derived"][0]["destination"] == "optim.state.proj.weight.step"
    assert data["unmapped"] == ["other", "learning_rate_group_0"]
    assert data["dropped"] == ["global_step", "beta1_power"]
    assert data["preset"] == MS_TO_TORCH
