"""`hpckpt convert-ms-torch` proven with both real frameworks, no mocks.

One small network is written twice, as a MindSpore `nn.Cell` and as the equivalent `torch.nn.Module`
(Embedding, BatchNorm1d, Dense/Linear, Tanh, LayerNorm, Dense/Linear). Each side trains two real Adam
steps, saves its checkpoint with its own framework's API, and the CLI (a subprocess, as a user runs
it) converts it. Then the other framework:

* loads the model strictly (torch `load_state_dict(strict=True)`, MindSpore
  `load_param_into_net(strict_load=True)` with nothing left unloaded) and its eval-mode forward pass
  agrees with the original's on the same input (BatchNorm on its moving statistics);
* finds the Adam state under its own names, bit-exact, with the counters derived right
  (MindSpore `global_step` <-> torch `step`, `beta1_power`/`beta2_power`, learning rate);
* loads that optimizer state into its own Adam (torch through `set_optimizer_state_dict` with the
  flattened names, MindSpore through `load_param_into_net` on `nn.Adam`), takes one more step, and
  lands on the parameters the original framework reached with its own third step: the moments and
  the step count mean the same thing on both sides, not only the same names.

Also: a safetensors output read by `safetensors.torch.load_file`, bf16/fp16 MindSpore tensors that
arrive in torch with the same bits and dtype, `--dry-run` printing the name table and writing
nothing, and round trips (ms -> torch safetensors -> ms, torch -> ms -> torch) giving the source back.

The model keys are picked from a converted torch file in the test (everything outside `optim.`):
`--include`/`--exclude` globs match *source* names, so they cannot select by torch name.

LayerNorm epsilon is set to 1e-5 on both sides (MindSpore's default is 1e-7, torch's 1e-5).
BatchNorm's momentum conventions differ (MindSpore 0.9 = torch 0.1) but the defaults are the same
rule, and only inference and the trained parameters are compared, not the running statistics after
the extra step.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import mindspore as ms
import numpy as np
import pytest
import torch
from mindspore import nn as msnn
from safetensors.torch import load_file
from torch import nn as tnn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from _util import assert_bit_equal

# MindSpore's own log lines ("[WARNING] ME ...") go to stderr, not through `warnings`; nothing in
# these tests is expected to raise a Python warning beyond the categories pyproject already ignores.

ms.set_context(mode=ms.PYNATIVE_MODE)

VOCAB, SEQ, BATCH, DIM, HIDDEN, OUT = 10, 5, 8, 4, 6, 3
EPS = 1e-5  # LayerNorm and BatchNorm epsilon, the same on both sides
LR = 0.01
OPTIM = "optim."  # the torch-side prefix of the optimizer (converters/naming/presets.py's DEFAULT_OPTIM_PREFIX)

# MindSpore parameter name -> torch state_dict key: the rename the preset must make.
MS_TO_TORCH_NAMES = {
    "embed.embedding_table": "embed.weight",
    "dense.weight": "dense.weight",
    "dense.bias": "dense.bias",
    "norm.gamma": "norm.weight",
    "norm.beta": "norm.bias",
    "bn.gamma": "bn.weight",
    "bn.beta": "bn.bias",
    "bn.moving_mean": "bn.running_mean",
    "bn.moving_variance": "bn.running_var",
    "head.weight": "head.weight",
    "head.bias": "head.bias",
}
MS_TRAINABLE = [n for n in MS_TO_TORCH_NAMES if not n.startswith("bn.moving")]


class MsNet(msnn.Cell):
    def __init__(self):
        super().__init__()
        self.embed = msnn.Embedding(VOCAB, DIM)
        self.bn = msnn.BatchNorm1d(DIM, eps=EPS)
        self.dense = msnn.Dense(DIM, HIDDEN)
        self.act = msnn.Tanh()
        self.norm = msnn.LayerNorm((HIDDEN,), epsilon=EPS)
        self.head = msnn.Dense(HIDDEN, OUT)

    def construct(self, x):
        return self.head(self.norm(self.act(self.dense(self.bn(self.embed(x).mean(axis=1))))))


class TorchNet(tnn.Module):
    def __init__(self):
        super().__init__()
        self.embed = tnn.Embedding(VOCAB, DIM)
        self.bn = tnn.BatchNorm1d(DIM, eps=EPS)
        self.dense = tnn.Linear(DIM, HIDDEN)
        self.act = tnn.Tanh()
        self.norm = tnn.LayerNorm(HIDDEN, eps=EPS)
        self.head = tnn.Linear(HIDDEN, OUT)

    def forward(self, x):
        return self.head(self.norm(self.act(self.dense(self.bn(self.embed(x).mean(dim=1))))))


def batch(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32),
            rng.standard_normal((BATCH, OUT)).astype(np.float32))


BATCHES = [batch(1), batch(2)]
NEXT = batch(3)  # the step taken after the checkpoint, on both sides
PROBE = batch(4)[0]  # the eval-mode forward input


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m hpckpt convert-ms-torch ...` as a user runs it."""
    proc = subprocess.run([sys.executable, "-m", "hpckpt", "convert-ms-torch", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def ms_np(value) -> np.ndarray:
    """A MindSpore tensor as numpy; bfloat16 as its raw bits (uint16)."""
    if value.dtype == ms.bfloat16:
        return (value.astype(ms.float32).asnumpy().view(np.uint32) >> 16).astype(np.uint16)
    return value.asnumpy()


def torch_np(t: torch.Tensor) -> np.ndarray:
    """A torch tensor as numpy; bfloat16 as its raw bits (uint16)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def ms_forward(net: MsNet, x: np.ndarray) -> np.ndarray:
    net.set_train(False)
    return net(ms.Tensor(x)).asnumpy()


def torch_forward(model: TorchNet, x: np.ndarray) -> np.ndarray:
    model.eval()
    with torch.no_grad():
        return model(torch.from_numpy(x.astype(np.int64))).numpy()


def ms_train_step(train: msnn.TrainOneStepCell, x: np.ndarray, y: np.ndarray) -> None:
    train.set_train(True)
    train(ms.Tensor(x), ms.Tensor(y))


def torch_train_step(model: TorchNet, opt: torch.optim.Optimizer, x: np.ndarray, y: np.ndarray) -> None:
    model.train()
    opt.zero_grad()
    tnn.functional.mse_loss(model(torch.from_numpy(x.astype(np.int64))), torch.from_numpy(y)).backward()
    opt.step()


def ms_trainer(net: MsNet, eps: float = 1e-8) -> tuple[msnn.Adam, msnn.TrainOneStepCell]:
    opt = msnn.Adam(net.trainable_params(), learning_rate=LR, eps=eps)
    return opt, msnn.TrainOneStepCell(msnn.WithLossCell(net, msnn.MSELoss()), opt)


def ms_params(net: MsNet) -> dict[str, np.ndarray]:
    return {p.name: p.asnumpy().copy() for p in net.get_parameters()}


# Adam's eps sits in different places: MindSpore's nn.Adam divides m by (sqrt(v) + eps) and then
# bias-corrects, torch bias-corrects sqrt(v) and then adds eps. The two updates are the same
# formula when eps_torch = eps_ms / sqrt(1 - beta2**t), t the step being taken: the resumed step
# (the third) uses these, so that only the converted state can make the two sides differ.
# (The layer order also matters: a parameter whose true gradient is zero, e.g. a Dense bias or
# LayerNorm affine right before a train-mode BatchNorm, gets float noise as gradient, which Adam
# scales up to a full step that differs between the frameworks. The tanh keeps every gradient real.)
RESUMED_STEP = len(BATCHES) + 1
TORCH_EPS = 1e-8
MS_EPS = TORCH_EPS * (1 - 0.999 ** RESUMED_STEP) ** 0.5


def assert_params_close(ms_side: dict[str, np.ndarray], torch_side: dict[str, np.ndarray], what: str) -> None:
    """Trainable parameters after the resumed step, MindSpore name -> torch name. A wrong step
    count (bias correction), a swapped or stale moment or a wrong learning rate moves them by
    about lr = 1e-2; float32 rounding of the two implementations by ~1e-7."""
    for ms_name in MS_TRAINABLE:
        np.testing.assert_allclose(torch_side[MS_TO_TORCH_NAMES[ms_name]], ms_side[ms_name], rtol=1e-5, atol=1e-6,
                                   err_msg=f"{what}: {ms_name}")


# --------------------------------------------------------------------------------------------
# MindSpore trains and saves; torch loads


@pytest.fixture(scope="module")
def ms_side(tmp_path_factory):
    """A MindSpore net after two nn.Adam steps, saved with its optimizer; its eval output, and its
    parameters after one more step (taken after the save)."""
    tmp = tmp_path_factory.mktemp("ms-side")
    ms.set_seed(0)
    net = MsNet()
    opt, train = ms_trainer(net, eps=MS_EPS)  # only the third step is compared; see RESUMED_STEP
    for x, y in BATCHES:
        ms_train_step(train, x, y)
    ckpt = tmp / "net.ckpt"
    ms.save_checkpoint(train, str(ckpt))  # the TrainOneStepCell: parameters, Adam moments, counters
    saved = {k: ms_np(v) for k, v in ms.load_checkpoint(str(ckpt)).items()}
    probe = ms_forward(net, PROBE)
    ms_train_step(train, *NEXT)
    return SimpleNamespace(tmp=tmp, ckpt=ckpt, saved=saved, probe=probe, after_next=ms_params(net))


def test_the_mindspore_checkpoint_is_non_trivial(ms_side):
    """The proof below means something only if the state it carries is not initial values."""
    s = ms_side.saved
    assert set(MS_TO_TORCH_NAMES) <= set(s)
    assert s["global_step"].tolist() == [2]
    assert s["global_step"].dtype == np.int32
    for name in MS_TRAINABLE:
        assert np.any(s[f"moment1.{name}"] != 0) and np.any(s[f"moment2.{name}"] != 0), name
    assert np.any(s["bn.moving_mean"] != 0) and np.any(s["bn.moving_variance"] != 1)
    np.testing.assert_allclose([s["beta1_power"], s["beta2_power"]], [0.9 ** 2, 0.999 ** 2], rtol=1e-6)


@pytest.fixture(scope="module")
def ms_to_pt(ms_side):
    out = ms_side.tmp / "net.pt"
    cli(str(ms_side.ckpt), "-o", str(out), cwd=ms_side.tmp)
    return torch.load(out, weights_only=True)


def model_keys(converted: dict) -> dict:
    """The model's entries of a converted file: everything but the optimizer's `optim.` prefix."""
    return {k: v for k, v in converted.items() if not k.startswith(OPTIM)}


def test_ms_ckpt_to_pt_loads_strictly_and_forward_agrees(ms_side, ms_to_pt):
    model = TorchNet()
    model_sd = model_keys(ms_to_pt)
    assert sorted(model_sd) == sorted(model.state_dict())
    model.load_state_dict(model_sd, strict=True)
    for ms_name, torch_name in MS_TO_TORCH_NAMES.items():  # every model tensor bit-exact, no transpose
        assert_bit_equal(torch_np(model_sd[torch_name]), ms_side.saved[ms_name], f"{ms_name} -> {torch_name}")
    assert model_sd["bn.num_batches_tracked"].dtype == torch.int64
    assert model_sd["bn.num_batches_tracked"].item() == 0
    np.testing.assert_allclose(torch_forward(model, PROBE), ms_side.probe, rtol=1e-5, atol=1e-6)


def test_ms_adam_state_arrives_under_the_torch_names(ms_side, ms_to_pt):
    s = ms_side.saved
    state = {k for k in ms_to_pt if k.startswith(OPTIM)}
    expected = set()
    for ms_name in MS_TRAINABLE:
        fqn = MS_TO_TORCH_NAMES[ms_name]
        pre = f"{OPTIM}state.{fqn}"
        expected |= {f"{pre}.exp_avg", f"{pre}.exp_avg_sq", f"{pre}.step", f"{OPTIM}param_groups.{fqn}.lr"}
        assert_bit_equal(torch_np(ms_to_pt[f"{pre}.exp_avg"]), s[f"moment1.{ms_name}"], f"moment1.{ms_name}")
        assert_bit_equal(torch_np(ms_to_pt[f"{pre}.exp_avg_sq"]), s[f"moment2.{ms_name}"], f"moment2.{ms_name}")
        step = ms_to_pt[f"{pre}.step"]
        assert (step.dtype, tuple(step.shape)) == (torch.float32, ()), fqn  # what torch.optim.Adam keeps
        assert step.item() == float(s["global_step"][0]) == 2.0, fqn
        assert ms_to_pt[f"{OPTIM}param_groups.{fqn}.lr"].item() == float(s["learning_rate"]), fqn
    assert state == expected  # nothing else: beta powers dropped, no MindSpore names left over


def test_torch_adam_resumes_from_the_converted_state_like_mindspore(ms_side, ms_to_pt):
    """torch's own `set_optimizer_state_dict(flatten_optimizer_state_dict=True)` takes the converted
    names; the hyperparameters MindSpore's nn.Adam keeps as constructor arguments (betas, eps...)
    come from the fresh torch optimizer, the learning rate from the file. One torch step from there
    reaches what MindSpore's third step reached."""
    torch.manual_seed(123)  # any initial values: everything is loaded
    model = TorchNet()
    model.load_state_dict(model_keys(ms_to_pt), strict=True)
    opt = torch.optim.Adam(model.parameters(), lr=0.5, eps=TORCH_EPS / (1 - 0.999 ** RESUMED_STEP) ** 0.5)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    template = get_optimizer_state_dict(model, opt, options=options)
    flat = {k[len(OPTIM):]: v for k, v in ms_to_pt.items() if k.startswith(OPTIM)}
    # lr as a Python number (a tensor lr is another Adam code path); the tensors cloned, since
    # set_optimizer_state_dict keeps them and the step would update the fixture's in place
    flat = {k: (v.item() if k.endswith(".lr") else v.clone()) for k, v in flat.items()}
    missing_state = [k for k in template if k.startswith("state.") and k not in flat]
    assert not missing_state
    set_optimizer_state_dict(model, opt, optim_state_dict={**template, **flat}, options=options)
    assert opt.param_groups[0]["lr"] == pytest.approx(LR)
    torch_train_step(model, opt, *NEXT)
    resumed = {k: v.detach().numpy() for k, v in model.named_parameters()}
    assert_params_close(ms_side.after_next, resumed, "torch resumed from MindSpore's checkpoint")


def test_ms_ckpt_to_safetensors_loads_in_torch(ms_side, ms_to_pt):
    out = ms_side.tmp / "net.safetensors"
    cli(str(ms_side.ckpt), "-o", str(out), "--to-format", "safetensors", cwd=ms_side.tmp)
    converted = load_file(str(out))
    assert sorted(converted) == sorted(ms_to_pt)  # the same names and tensors as the .pt output
    for key, value in converted.items():
        assert value.dtype == ms_to_pt[key].dtype, key
        assert_bit_equal(torch_np(value), torch_np(ms_to_pt[key]), key)
    model = TorchNet()
    model.load_state_dict(model_keys(converted), strict=True)
    np.testing.assert_allclose(torch_forward(model, PROBE), ms_side.probe, rtol=1e-5, atol=1e-6)
    assert_bit_equal(torch_np(converted["optim.state.norm.weight.exp_avg"]), ms_side.saved["moment1.norm.gamma"])


def test_bf16_and_fp16_mindspore_tensors_reach_torch_bit_exact(ms_side):
    """Half-precision tensors keep their dtype and bits (no float32 round trip on the way)."""
    tmp = ms_side.tmp
    rng = np.random.default_rng(5)
    # bf16 patterns: 1, -2, 0, -0, inf, -inf, smallest subnormal, ~pi, max, min normal
    bf16_bits = np.array([0x3F80, 0xC000, 0x0000, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x4049, 0x7F7F, 0x0080],
                         dtype=np.uint16)
    fp16_special = np.array([1, -2, 0, -0.0, np.inf, -np.inf, 6e-8, 65504, 6.1e-5, 1 / 3], dtype=np.float16)
    params = {}
    for i, ms_name in enumerate(MS_TO_TORCH_NAMES):
        value = ms_side.saved[ms_name]  # trained values, rounded once by MindSpore's own cast
        half = ms.bfloat16 if i % 2 == 0 else ms.float16
        params[ms_name] = ms.Parameter(ms.Tensor(value).astype(half), name=ms_name)
    params["extra.bf16"] = ms.Parameter(
        ms.Tensor((bf16_bits.astype(np.uint32) << 16).view(np.float32), dtype=ms.bfloat16), name="extra.bf16")
    params["extra.fp16"] = ms.Parameter(ms.Tensor(fp16_special), name="extra.fp16")
    params["extra.fp16_random"] = ms.Parameter(ms.Tensor(rng.standard_normal((7, 3)).astype(np.float16)),
                                               name="extra.fp16_random")
    ckpt = tmp / "half.ckpt"
    ms.save_checkpoint(params, str(ckpt))  # Parameters, not Tensors: see platform-notes (dict trap)
    written = ms.load_checkpoint(str(ckpt))
    cli(str(ckpt), "-o", str(tmp / "half.pt"), cwd=tmp)
    converted = torch.load(tmp / "half.pt", weights_only=True)
    names = {**MS_TO_TORCH_NAMES, "extra.bf16": "extra.bf16", "extra.fp16": "extra.fp16",
             "extra.fp16_random": "extra.fp16_random"}
    kinds = set()
    for ms_name, torch_name in names.items():
        expected = {ms.bfloat16: torch.bfloat16, ms.float16: torch.float16}[written[ms_name].dtype]
        kinds.add(expected)
        assert converted[torch_name].dtype == expected, ms_name
        assert_bit_equal(torch_np(converted[torch_name]), ms_np(written[ms_name]), ms_name)
    assert kinds == {torch.bfloat16, torch.float16}
    assert torch_np(converted["extra.bf16"]).tolist() == bf16_bits.tolist()
    model = TorchNet()  # the half-precision file still loads strictly (load_state_dict casts)
    model.load_state_dict({k: v for k, v in converted.items() if not k.startswith("extra.")}, strict=True)


def test_dry_run_shows_the_name_table_and_writes_nothing(ms_side, tmp_path):
    out = tmp_path / "out" / "net.pt"
    before = sorted(os.listdir(ms_side.tmp))
    text = cli(str(ms_side.ckpt), "-o", str(out), "--dry-run", cwd=tmp_path).stdout
    rows = {}
    for line in text.splitlines():
        cells = line.split()
        if len(cells) >= 2:
            rows.setdefault(cells[0], cells[1])
    for ms_name, torch_name in MS_TO_TORCH_NAMES.items():
        assert rows.get(ms_name) == torch_name, (ms_name, text)
    assert rows["moment1.norm.gamma"] == "optim.state.norm.weight.exp_avg"
    assert rows["moment2.embed.embedding_table"] == "optim.state.embed.weight.exp_avg_sq"
    assert re.search(r"^<- global_step\s+optim\.state\.bn\.weight\.step\s+step float32\[\]", text, re.M), text
    assert re.search(r"^beta1_power\s+\(dropped", text, re.M), text
    assert "nothing written" in text
    assert not out.exists() and not out.parent.exists()
    assert sorted(os.listdir(tmp_path)) == []
    assert sorted(os.listdir(ms_side.tmp)) == before

    report = json.loads(cli(str(ms_side.ckpt), "-o", str(out), "--dry-run", "--json", cwd=tmp_path).stdout)
    table = {e["source"]: e["destination"] for e in report["names"]["entries"]}
    assert {k: table[k] for k in MS_TO_TORCH_NAMES} == MS_TO_TORCH_NAMES
    assert report["dry_run"] is True and not out.parent.exists()


# --------------------------------------------------------------------------------------------
# torch trains and saves; MindSpore loads


@pytest.fixture(scope="module")
def torch_side(tmp_path_factory):
    """A torch module after two torch.optim.Adam steps, saved as one torch.save dict: the model's
    state_dict plus the optimizer flattened by torch's own API under `optim.` (the keys
    `dcp.save({**model_sd, "optim": flat_osd})` writes); its eval output, and its parameters after
    one more step."""
    tmp = tmp_path_factory.mktemp("torch-side")
    torch.manual_seed(0)
    model = TorchNet()
    opt = torch.optim.Adam(model.parameters(), lr=LR, eps=TORCH_EPS)
    for x, y in BATCHES:
        torch_train_step(model, opt, x, y)
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    model_sd = {k: v.clone() for k, v in model.state_dict().items()}
    optim = {f"{OPTIM}{k}": (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in osd.items()}
    torch.save({**model_sd, **optim}, tmp / "model.pt")
    torch.save(model_sd, tmp / "state_dict.pt")
    probe = torch_forward(model, PROBE)
    torch_train_step(model, opt, *NEXT)
    after = {k: v.detach().numpy().copy() for k, v in model.named_parameters()}
    return SimpleNamespace(tmp=tmp, model_sd=model_sd, optim=optim, probe=probe, after_next=after)


@pytest.fixture(scope="module")
def pt_to_ms(torch_side):
    out = torch_side.tmp / "model.ckpt"
    cli(str(torch_side.tmp / "model.pt"), "-o", str(out), cwd=torch_side.tmp)
    return out


def test_pt_to_ms_ckpt_loads_strictly_and_forward_agrees(torch_side, pt_to_ms):
    params = ms.load_checkpoint(str(pt_to_ms))
    net = MsNet()
    not_loaded, _ = ms.load_param_into_net(net, params, strict_load=True)
    assert not_loaded == []
    for ms_name, torch_name in MS_TO_TORCH_NAMES.items():
        assert_bit_equal(ms_np(params[ms_name]), torch_np(torch_side.model_sd[torch_name]), ms_name)
        assert_bit_equal(ms_np(net.parameters_dict()[ms_name]), torch_np(torch_side.model_sd[torch_name]), ms_name)
    np.testing.assert_allclose(ms_forward(net, PROBE), torch_side.probe, rtol=1e-5, atol=1e-6)


def test_model_only_state_dict_converts_too(torch_side):
    out = torch_side.tmp / "state_dict.ckpt"
    cli(str(torch_side.tmp / "state_dict.pt"), "-o", str(out), cwd=torch_side.tmp)
    params = ms.load_checkpoint(str(out))
    assert sorted(params) == sorted(MS_TO_TORCH_NAMES)  # num_batches_tracked dropped, nothing else
    net = MsNet()
    assert ms.load_param_into_net(net, params, strict_load=True)[0] == []
    np.testing.assert_allclose(ms_forward(net, PROBE), torch_side.probe, rtol=1e-5, atol=1e-6)


def test_torch_adam_state_arrives_as_ms_adam_state_and_resumes(torch_side, pt_to_ms):
    """The converted file loads into a fresh nn.Adam with nothing left out; moments bit-exact,
    global_step = torch's step, beta powers = beta**step, the learning rate; then one MindSpore
    step from there reaches what torch's third step reached."""
    params = ms.load_checkpoint(str(pt_to_ms))
    optim = torch_side.optim
    for ms_name in MS_TRAINABLE:
        fqn = MS_TO_TORCH_NAMES[ms_name]
        assert_bit_equal(ms_np(params[f"moment1.{ms_name}"]), torch_np(optim[f"{OPTIM}state.{fqn}.exp_avg"]), ms_name)
        assert_bit_equal(ms_np(params[f"moment2.{ms_name}"]), torch_np(optim[f"{OPTIM}state.{fqn}.exp_avg_sq"]),
                         ms_name)
        assert optim[f"{OPTIM}state.{fqn}.step"].item() == 2.0
    step = ms_np(params["global_step"])
    assert (step.dtype, step.shape, step.tolist()) == (np.dtype(np.int32), (1,), [2])
    for name, beta in (("beta1_power", 0.9), ("beta2_power", 0.999)):
        value = ms_np(params[name])
        assert (value.dtype, value.shape) == (np.dtype(np.float32), ()), name
        np.testing.assert_allclose(value, beta ** 2, rtol=1e-6, err_msg=name)
    assert ms_np(params["learning_rate"]) == np.float32(LR)

    ms.set_seed(99)  # any initial values: everything is loaded
    net = MsNet()
    opt, train = ms_trainer(net, eps=MS_EPS)
    opt_not_loaded, _ = ms.load_param_into_net(opt, params, strict_load=True)
    assert opt_not_loaded == []  # every nn.Adam parameter (moments, counters, lr) came from the file
    assert ms.load_param_into_net(net, params, strict_load=True)[0] == []
    ms_train_step(train, *NEXT)
    assert_params_close(ms_params(net), torch_side.after_next, "MindSpore resumed from torch's checkpoint")


# --------------------------------------------------------------------------------------------
# Round trips: what one direction writes, the other reads back


def test_ms_round_trip_through_torch_safetensors_keeps_everything(ms_side):
    """ms .ckpt -> torch-named safetensors -> ms .ckpt gives MindSpore's checkpoint back, and it
    loads into net and nn.Adam with nothing missing. Safetensors holds no param-group betas, so
    beta1_power/beta2_power are derived with the default betas (MindSpore accumulates beta**t in
    float32, hence not bit-exact)."""
    tmp = ms_side.tmp
    cli(str(ms_side.ckpt), "-o", str(tmp / "rt.safetensors"), cwd=tmp)
    cli(str(tmp / "rt.safetensors"), "-o", str(tmp / "rt.ckpt"), "--to", "mindspore", cwd=tmp)
    params = ms.load_checkpoint(str(tmp / "rt.ckpt"))
    back = {k: ms_np(v) for k, v in params.items()}
    assert sorted(back) == sorted(ms_side.saved)
    for name, value in ms_side.saved.items():
        if name in ("beta1_power", "beta2_power"):
            assert (back[name].dtype, back[name].shape) == (value.dtype, value.shape), name
            np.testing.assert_allclose(back[name], value, rtol=1e-6, err_msg=name)
        else:
            assert_bit_equal(back[name], value, name)
    net = MsNet()
    opt, _ = ms_trainer(net)
    assert ms.load_param_into_net(net, params, strict_load=True)[0] == []
    assert ms.load_param_into_net(opt, params, strict_load=True)[0] == []


def test_torch_round_trip_through_mindspore_keeps_the_tensors(torch_side, pt_to_ms):
    """torch .pt -> ms .ckpt -> torch .pt: every tensor comes back under its name, bit-exact, but
    BatchNorm's batch counter (MindSpore has none: it returns as 0) and the param-group entries
    other than lr (MindSpore optimizers take them as constructor arguments)."""
    tmp = torch_side.tmp
    cli(str(pt_to_ms), "-o", str(tmp / "rt.pt"), cwd=tmp)
    back = torch.load(tmp / "rt.pt", weights_only=True)
    original = {**torch_side.model_sd, **{k: v for k, v in torch_side.optim.items()
                                          if isinstance(v, torch.Tensor) or k.endswith(".lr")}}
    assert sorted(back) == sorted(original)
    for key, value in original.items():
        if key == "bn.num_batches_tracked":
            assert (back[key].dtype, back[key].item()) == (torch.int64, 0)
        elif key.endswith(".lr"):
            assert back[key].item() == pytest.approx(value)
        else:
            assert back[key].dtype == value.dtype, key
            assert_bit_equal(torch_np(back[key]), torch_np(value), key)
