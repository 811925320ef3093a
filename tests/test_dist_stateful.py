"""`hpckpt.dist` as a drop-in for `torch.distributed.checkpoint` in a training loop: Stateful
objects and torch's keyword forms.

Three torchrun jobs of tests/dist_scripts/recipe_job.py (gloo, CPU): the PyTorch DCP recipe's
`{"app": AppState(model, optimizer)}` with an FSDP2 model, beside an LR scheduler and a
torchtitan-style train state, saved on 4 ranks with `save(state_dict=..., checkpoint_id=...)` and
with `async_save` (trained on while it persists, then `.result()`), each in HyperParallel's
format and with `format="torch-dcp"`, and by torch's own `dcp.save` through `HpckptWriter`;
loaded on 2 and on 3 ranks (by `hdist.load`; by torch's own `dcp.load` for the torch-dcp ones, and
through `HpckptReader` for a HyperParallel one): model and optimizer bit-exact, the next step's
loss equal, every value equal with its type. The same for torchtitan's checkpoint states: its
package (0.3.0) needs datasets, wandb, tensorboard and torchdata, too much to install for a test,
so the job rebuilds the Stateful objects its CheckpointManager saves, with their value shapes
(model keys at the top level, a flat optimizer state dict, `{"last_epoch"}`, a dataloader
position pickled under `dp_rank_{r}` on each rank, the trainer's ints). Every checkpoint passes
`hpckpt verify --deep`. The
load jobs also read, through `HpckptReader` and torch's `dcp.load`, a `.ckpt` MindSpore wrote of
the model (into the FSDP2 model: bit-exact, the same loss) and the HyperParallel fixture
`m0-torch-4rank` (into DTensors sharded over the job's mesh, against its expected values).
The rest runs in this process (one rank): how Stateful objects are found and restored, the
torch-only parameters refused, the future's methods.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _util import FIXTURES, run_torchrun

import hpckpt.dist as hdist
from hpckpt.converters import open_index
from hpckpt.core.errors import UnsafePickleError

JOB = Path(__file__).parent / "dist_scripts" / "recipe_job.py"
HPCKPT = Path(sys.executable).with_name("hpckpt")
#: the job's checkpoints: save and async_save, each in HyperParallel's format and in PyTorch DCP,
#: and torch's own dcp.save through HpckptWriter
FORMATS = {"recipe": "hyperparallel", "recipe_async": "hyperparallel", "recipe_dcp": "torch-dcp",
           "recipe_dcp_async": "torch-dcp", "recipe_writer": "torch-dcp", "titan": "hyperparallel"}
TIMEOUT = 240


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> tuple[Path, int | None, str]:
    out = tmp_path_factory.mktemp("recipe")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    code, log = run_torchrun(4, [str(JOB), "save", str(out)], out / "save.log", env, TIMEOUT)
    if code == 0:  # MindSpore's own .ckpt of the saved model, for the load jobs' HpckptReader
        subprocess.run([sys.executable, "-c", MINDSPORE_CKPT, str(out / "recipe.pt"), str(out / "model.ckpt")],
                       check=True, timeout=TIMEOUT)
    return out, code, log


MINDSPORE_CKPT = """
import sys, torch, mindspore as ms
model = torch.load(sys.argv[1], weights_only=False)["model"]
ms.save_checkpoint([{"name": k, "data": ms.Parameter(ms.Tensor(v.numpy()), name=k)} for k, v in model.items()],
                   sys.argv[2])
"""


def _assert_ok(code: int | None, log: str, ranks: int, mode: str) -> None:
    assert code == 0, f"torchrun exited {code}\n{log[-12000:]}"
    assert sorted(log.count(f"rank {r}: OK {mode}.") for r in range(ranks)) == [1] * ranks, log[-12000:]


@pytest.mark.dist
@pytest.mark.parametrize("ranks", [2, 3])
def test_the_recipe_saved_on_4_ranks_loads_on_other_world_sizes_bit_exact(recipe, ranks):
    out, code, log = recipe
    _assert_ok(code, log, 4, "save")
    for name, fmt in FORMATS.items():
        index = open_index(out / name)
        assert index.format == fmt
        if name == "titan":
            assert {"l1.weight", "optimizer.state.l1.weight.exp_avg"} <= set(index.tensors)
            assert {f"dataloader.dp_rank_{r}" for r in range(4)} | {"lr_scheduler.last_epoch"} <= set(index.values)
        else:
            assert "app.model.l1.weight" in index.tensors and "app.optim.state.l1.weight.exp_avg" in index.tensors
            assert {"lr_scheduler.base_lrs", "train_state.tag", "train_state.losses"} <= set(index.values)
            assert isinstance(index.decode_value("train_state.losses"), bytes)  # offline: a BytesIO's content
        verified = subprocess.run([str(HPCKPT), "verify", "--deep", str(out / name)], capture_output=True, text=True)
        assert verified.returncode == 0 and f"({fmt})" in verified.stdout, verified.stdout + verified.stderr
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = [str(JOB), "load", str(out), str(FIXTURES / "m0-torch-4rank")]
    _assert_ok(*run_torchrun(ranks, job, out / f"load-{ranks}.log", env, TIMEOUT), ranks, "load")


# --- in this process: one rank ---------------------------------------------------------------------


class Counter:
    """A Stateful by protocol: a tensor, values of several types and a BytesIO."""

    def __init__(self, n: int):
        self.n, self.restored = n, []
        self.weights = torch.full((3,), float(n))

    def state_dict(self):
        return {"n": self.n, "w": self.weights, "info": {"name": f"c{self.n}", "ratio": self.n / 4, "flag": True,
                                                         "pair": (self.n, None), "blob": io.BytesIO(b"x" * self.n)}}

    def load_state_dict(self, state_dict):
        self.restored.append(state_dict)
        self.n = state_dict["n"]


def test_stateful_objects_anywhere_in_the_callers_dicts_and_lists_are_saved_and_restored(tmp_path):
    saved = {"top": Counter(3), "nested": {"list": [Counter(5), {"deep": Counter(7)}]}, "plain": {"k": 1}}
    hdist.save(state_dict=saved, checkpoint_id=tmp_path / "c")
    index = open_index(tmp_path / "c")
    assert set(index.tensors) == {"top.w", "nested.list.0.w", "nested.list.1.deep.w"}
    assert index.decode_value("nested.list.1.deep.info.name") == "c7"

    target = {"top": Counter(0), "nested": {"list": [Counter(0), {"deep": Counter(0)}]}, "plain": {"k": 0}}
    objects = [target["top"], target["nested"]["list"][0], target["nested"]["list"][1]["deep"]]
    result = hdist.load(state_dict=target, checkpoint_id=tmp_path / "c")
    assert not result.missing and not result.unused
    # the objects stay where they were; each got its own filled state dict, once
    assert [target["top"], target["nested"]["list"][0], target["nested"]["list"][1]["deep"]] == objects
    assert target["plain"] == {"k": 1}  # a value outside any Stateful goes into the caller's dict
    for obj, n in zip(objects, (3, 5, 7)):
        assert obj.n == n and len(obj.restored) == 1
        state = obj.restored[0]
        assert torch.equal(obj.weights, torch.full((3,), float(n))) and state["w"] is obj.weights  # in place
        info = state["info"]
        assert (info["name"], info["ratio"], info["flag"], info["pair"]) == (f"c{n}", n / 4, True, (n, None))
        assert [type(info[k]) for k in ("ratio", "flag", "pair")] == [float, bool, tuple]
        assert isinstance(info["blob"], io.BytesIO) and info["blob"].getvalue() == b"x" * n


def test_a_saved_bytesio_loads_as_bytes_into_a_bytes_target(tmp_path):
    hdist.save({"b": io.BytesIO(b"abc")}, tmp_path / "c")
    target = {"b": b""}
    hdist.load(target, tmp_path / "c")
    assert target == {"b": b"abc"}


def test_what_torch_dcp_would_not_do_either_is_one_clear_error(tmp_path):
    class Bad(Counter):
        def state_dict(self):
            return [1, 2]

    with pytest.raises(TypeError, match=r"^x: Bad.state_dict\(\) returned a list, not a mapping"):
        hdist.save({"x": Bad(1)}, tmp_path / "bad")

    class Holder(Counter):
        def state_dict(self):
            return {"inner": Counter(2)}

    with pytest.raises(UnsafePickleError, match=r"x.inner: a Counter \(a Stateful object\) inside another Stateful"):
        hdist.save({"x": Holder(1)}, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("call, kwargs, named", [
    ("save", {"planner": object()}, "planner=object: hpckpt plans the save itself"),
    ("save", {"storage_writer": object()}, "storage_writer=object: pass the destination as `checkpoint_id=`"),
    ("async_save", {"async_stager": object()}, "async_stager=object"),
    ("async_save", {"async_checkpointer_type": "process"}, "async_checkpointer_type=str"),
    ("load", {"storage_reader": object()}, "storage_reader=object: pass the checkpoint as `checkpoint_id=`"),
    ("load", {"planner": object()}, "planner=object"),
    ("save", {"checkpoint_id": None}, r"save\(\) needs checkpoint_id"),
])
def test_torch_only_parameters_are_refused_naming_what_to_use(tmp_path, call, kwargs, named):
    kwargs = {"checkpoint_id": tmp_path / "c", **kwargs}
    with pytest.raises(TypeError, match=named):
        getattr(hdist, call)({"w": torch.ones(2)}, **kwargs)
    assert not (tmp_path / "c").exists()


def test_torchs_keyword_forms_and_future(tmp_path):
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    state = {"w": torch.arange(4.0)}
    done = []
    future = hdist.async_save(state_dict=state, checkpoint_id=tmp_path / "a", process_group=None, no_dist=False,
                              async_checkpointer_type=AsyncCheckpointerType.THREAD)
    future.add_done_callback(done.append)
    assert future.result(timeout=60).committed and future.exception() is None
    assert future.done() and not future.running() and not future.cancel() and done == [future]

    result = hdist.save(state_dict=state, checkpoint_id=tmp_path / "r", use_collectives=False)
    assert result.coordination == "none" and (tmp_path / "r" / "0.metadata").exists()
    with pytest.raises(ValueError, match="use_collectives=False is coordination='none'"):
        hdist.save(state, tmp_path / "x", use_collectives=False, coordination="storage")

    target = {"w": torch.zeros(4)}
    loaded = hdist.load(state_dict=target, checkpoint_id=tmp_path / "a", process_group=None, no_dist=True)
    assert loaded.world_size == 1 and torch.equal(target["w"], state["w"])


def test_torch_dcp_output_refuses_what_it_cannot_hold_before_writing(tmp_path):
    import datetime

    with pytest.raises(UnsafePickleError, match=r"^when: a datetime value cannot be saved: a torch.save record cannot"):
        hdist.save({"w": torch.ones(2), "when": datetime.datetime(2026, 1, 1)}, tmp_path / "c", format="torch-dcp")
    with pytest.raises(ValueError, match="format='torch-dcp' needs coordination='collectives' or 'storage'"):
        hdist.save({"w": torch.ones(2)}, tmp_path / "c", format="torch-dcp", coordination="none")
    with pytest.raises(ValueError, match="format must be one of hyperparallel, torch-dcp, not 'safetensors'"):
        hdist.save({"w": torch.ones(2)}, tmp_path / "c", format="safetensors")
    assert not (tmp_path / "c").exists()


# --- hpckpt inside torch DCP: HpckptReader, HpckptWriter (one rank) ---------------------------------


def test_torchs_own_load_reads_every_format_through_hpckpt_reader(tmp_path):
    """safetensors, Hugging Face sharded, torch.save, torch DCP and hpckpt's own output, into a
    strided target and a bfloat16 one (converted on the copy); then HyperParallel's legacy layout
    (the fixture its own code wrote) against its expected values. A value reaches torch as hpckpt
    re-wrote it, of its type."""
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from safetensors.torch import save_file

    from hpckpt.dist.torch_storage import HpckptReader

    weight, ids = torch.randn(6, 4), torch.arange(5, dtype=torch.int64)
    save_file({"m.weight": weight, "m.ids": ids}, tmp_path / "model.safetensors")
    shard = tmp_path / "hf"
    shard.mkdir()
    save_file({"m.weight": weight}, shard / "model-00001-of-00002.safetensors")
    save_file({"m.ids": ids}, shard / "model-00002-of-00002.safetensors")
    (shard / "model.safetensors.index.json").write_text(
        '{"metadata": {}, "weight_map": {"m.weight": "model-00001-of-00002.safetensors", '
        '"m.ids": "model-00002-of-00002.safetensors"}}')
    torch.save({"m.weight": weight, "m.ids": ids}, tmp_path / "model.pt")
    hdist.save({"m": {"weight": weight, "ids": ids}, "note": "hp"}, tmp_path / "hp")
    dcp.save({"m.weight": weight, "m.ids": ids}, checkpoint_id=str(tmp_path / "torch"), no_dist=True)
    for name in ("model.safetensors", "hf", "model.pt", "hp", "torch"):
        wide = torch.zeros(4, 6)  # a transposed view: strided, read through a buffer
        target = {"m.weight": wide.t(), "m.ids": torch.zeros(5, dtype=torch.int64)}
        if name == "hp":
            target = {"m": {"weight": torch.zeros(6, 4, dtype=torch.bfloat16), "ids": target["m.ids"]}, "note": None}
        dcp.load(target, storage_reader=HpckptReader(tmp_path / name), no_dist=True)
        if name == "hp":
            assert torch.equal(target["m"]["weight"], weight.bfloat16()) and target["note"] == "hp"
            assert torch.equal(target["m"]["ids"], ids)
        else:
            assert torch.equal(wide.t(), weight) and torch.equal(target["m.ids"], ids), name

    legacy = FIXTURES / "legacy-torch-4rank"  # HyperParallel's legacy layout, written by its own code
    expected = json.loads((legacy / "expected.json").read_text())
    names = ("model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight", "optimizer.state.0.step")
    with safe_open(str(legacy / "expected.safetensors"), "pt") as f:
        want = {n: f.get_tensor(n) for n in names}
    target = {n: torch.zeros_like(want[n]) for n in names}
    target.update({"extra_state.global_step": 0, "extra_state.run_name": "", "extra_state.milestones": []})
    dcp.load(target, storage_reader=HpckptReader(legacy), no_dist=True)
    for n in names:
        assert target[n].dtype == want[n].dtype and torch.equal(target[n], want[n]), n
    for n in ("extra_state.global_step", "extra_state.run_name", "extra_state.milestones"):
        assert target[n] == expected[n]["value"] and type(target[n]).__name__ == expected[n]["type"], n


def test_hpckpt_writer_commits_atomically_with_a_manifest_and_hdist_takes_it(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from hpckpt.dist.torch_storage import HpckptWriter

    state = {"w": torch.randn(3, 2), "note": {"text": "x", "io": io.BytesIO(b"abc")}}
    dest = tmp_path / "w"

    class Broken(dict):  # a planner's item that cannot be resolved: the save fails while writing
        pass

    with pytest.raises(CheckpointException, match="Can't pickle local object"):
        dcp.save({"w": torch.randn(3, 2), "bad": Broken(x=lambda: 0)}, storage_writer=HpckptWriter(dest),
                 no_dist=True)
    assert not dest.exists()  # (its staging directory is removed by the next save, from another writer too)
    dcp.save(state, storage_writer=HpckptWriter(dest), no_dist=True)
    names = sorted(p.name for p in dest.iterdir())
    assert names == [".hpckpt-manifest.jsonl", ".metadata", "__0_0.distcp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w"]  # no staging directory left
    verified = subprocess.run([str(HPCKPT), "verify", "--deep", str(dest)], capture_output=True, text=True)
    assert verified.returncode == 0 and "(torch-dcp)" in verified.stdout, verified.stdout + verified.stderr
    target = {"w": torch.zeros(3, 2), "note": {"text": "", "io": io.BytesIO()}}
    dcp.load(target, checkpoint_id=str(dest), no_dist=True)  # torch's own reader
    assert torch.equal(target["w"], state["w"]) and target["note"]["io"].getvalue() == b"abc"

    result = hdist.save(state, storage_writer=HpckptWriter(tmp_path / "by-hdist"))
    assert result.committed and open_index(tmp_path / "by-hdist").format == "torch-dcp"
