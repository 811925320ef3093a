"""The PyTorch DCP recipe's training loop with `hpckpt.dist` in place of `torch.distributed.checkpoint`
(run under torchrun, gloo, CPU): Stateful objects and torch's keyword forms, unchanged.

Usage:
  torchrun --standalone --nproc-per-node 4 recipe_job.py save OUTDIR
  torchrun --standalone --nproc-per-node N recipe_job.py load OUTDIR FIXTURE

The state is the recipe's `{"app": AppState(model, optimizer)}` (its `state_dict()` calls
`get_state_dict`, its `load_state_dict()` calls `set_state_dict`) plus what torchtitan's
checkpoint manager saves beside it: the LR scheduler itself (a LambdaLR: floats, ints, bools, a list
holding None) and a train state whose `state_dict()` returns a 0-d int32 tensor step, ints,
floats, a string, a list of dicts and an `io.BytesIO` holding a torch.save of the loss history.

`save` (4 ranks, FSDP2 `fully_shard` per layer + root, AdamW): trains 2 steps, saves with
`hdist.save(state_dict=..., checkpoint_id=..., process_group=None, no_dist=False)` to OUTDIR/recipe;
trains one more step and saves with `hdist.async_save(...)` to OUTDIR/recipe_async, trains on at
once and calls `.result()`, as torchtitan does before its next save; then the same two with
`format="torch-dcp"` (recipe_dcp, recipe_dcp_async), and torch's own `dcp.save` through
`HpckptWriter` (recipe_writer), training a step between each; and torchtitan's states (titan:
the model's state dict flattened into the top level beside Stateful optimizers, LR schedulers,
dataloader and trainer, as torchtitan 0.3.0's CheckpointManager composes them; the dataloader's
position under a key of each rank's own). For each, rank 0 writes the
reference: the full model and optimizer state, the scheduler's and the train state's state dicts,
and the next step's loss (OUTDIR/NAME.pt).
`load` (any world size) builds everything fresh (another seed, another train state) and loads
each checkpoint as `LOADED_BY` says (`hdist.load`; torch's `dcp.load` through `HpckptReader`;
torch's own `dcp.load`), then compares: the full model and optimizer state bit for bit, the next
step's loss exactly, the scheduler's state dict and every train-state value with its type; the
torchtitan states likewise (each rank gets back the dataloader position it saved). Then,
through `HpckptReader` and torch's `dcp.load`: OUTDIR/model.ckpt (MindSpore's `.ckpt` of the
`recipe` model) into a fresh FSDP2 model, and the HyperParallel fixture FIXTURE into DTensors
sharded over the job's mesh, against its expected.safetensors and expected.json.

Each failed check is `rank R: FAIL ...` on stderr (exit 1); success is `rank R: OK MODE.`.
"""

from __future__ import annotations

import io
import json
import pickle
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     get_state_dict, set_model_state_dict, set_optimizer_state_dict,
                                                     set_state_dict)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import fsdp_job as common  # the model, the data and the bit-exact tree comparison
from fsdp_job import check, compare_trees, data, full_state, rank, step3_loss

import hpckpt.dist as hdist
from hpckpt.dist.torch_storage import HpckptReader, HpckptWriter

SAVE_SEED, LOAD_SEED = 1234, 4321
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
#: each checkpoint the save job writes, and who loads it in the load job
LOADED_BY = {"recipe": "hpckpt", "recipe_async": "torch+HpckptReader", "recipe_dcp": "torch",
             "recipe_dcp_async": "torch", "recipe_writer": "torch"}


class AppState(Stateful):
    """The recipe's wrapper, as the PyTorch DCP tutorial writes it."""

    def __init__(self, model, optimizer=None):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model_state_dict, optimizer_state_dict = get_state_dict(self.model, self.optimizer)
        return {"model": model_state_dict, "optim": optimizer_state_dict}

    def load_state_dict(self, state_dict):
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


class TrainState:
    """torchtitan's kind of train state (a Stateful by protocol only: no base class)."""

    def __init__(self, tag: str):
        self.step, self.tokens, self.tag, self.losses, self.loaded = 0, 0, tag, [], None

    def state_dict(self):
        history = io.BytesIO()
        torch.save(self.losses, history)
        return {"step": torch.tensor(self.step, dtype=torch.int32), "tokens": self.tokens, "tag": self.tag,
                "ratio": 0.25 * self.step, "trace": [{"step": i, "loss": v} for i, v in enumerate(self.losses)],
                "losses": history}

    def load_state_dict(self, state_dict):
        self.loaded = state_dict
        self.step, self.tokens, self.tag = int(state_dict["step"]), state_dict["tokens"], state_dict["tag"]
        state_dict["losses"].seek(0)
        self.losses = torch.load(state_dict["losses"], weights_only=True)


def build(mesh, seed: int, tag: str):
    model, optim = common.build(mesh, seed)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: min(1.0, (step + 1) / 4))
    return model, optim, sched, TrainState(tag)


def train_step(model, optim, sched, train) -> None:
    """Data parallel: each rank its slice of the fixed global batch."""
    x, y = data()
    per_rank = common.GLOBAL_BATCH // dist.get_world_size()
    part = slice(rank() * per_rank, (rank() + 1) * per_rank)
    loss = F.mse_loss(model(x[part]), y[part])
    loss.backward()
    optim.step()
    optim.zero_grad()
    sched.step()
    train.step += 1
    train.tokens += per_rank * dist.get_world_size()
    mean = loss.detach().clone()
    dist.all_reduce(mean)  # the job's loss: a value every rank holds alike (hpckpt refuses ranks that differ)
    train.losses.append(round(mean.item() / dist.get_world_size(), 6))


# --- torchtitan 0.3.0's checkpoint states, rebuilt (its package pulls in datasets, wandb, tensorboard,
# torchdata; see test_dist_stateful.py): CheckpointManager saves the model's state dict flattened
# into the top level beside Stateful "optimizer", "lr_scheduler", "dataloader" and "train_state".


class TitanOptimizers:
    """OptimizersContainer: a flat, FQN-keyed optimizer state dict."""

    def __init__(self, model, optim):
        self.model, self.optim = model, optim

    def state_dict(self):
        return get_optimizer_state_dict(self.model, self.optim, options=FLAT)

    def load_state_dict(self, state_dict):
        set_optimizer_state_dict(self.model, self.optim, state_dict, options=FLAT)


class TitanSchedulers:
    """LRSchedulersContainer: only `last_epoch`."""

    def __init__(self, sched):
        self.sched = sched

    def state_dict(self):
        return {"last_epoch": self.sched.last_epoch}

    def load_state_dict(self, state_dict):
        self.sched.last_epoch = state_dict["last_epoch"]
        self.sched._step_count = state_dict["last_epoch"] + 1
        self.sched._last_lr = self.sched.get_lr()


class TitanDataloader:
    """ParallelAwareDataloader: its position pickled under a key of this data-parallel rank only."""

    def __init__(self, position: int):
        self.position, self.loaded = position, None

    def state_dict(self):
        return {f"dp_rank_{rank()}": pickle.dumps({"position": self.position}), "world_size": dist.get_world_size()}

    def load_state_dict(self, state_dict):
        self.loaded = state_dict
        self.position = pickle.loads(state_dict[f"dp_rank_{rank()}"])["position"]


class TitanTrainer:
    """The trainer's own state: plain ints."""

    def __init__(self, step: int, tokens: int):
        self.step, self.ntokens_seen = step, tokens

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict):
        self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]


def titan_states(model, optim, sched, train) -> dict:
    return {**model.state_dict(), "optimizer": TitanOptimizers(model, optim), "lr_scheduler": TitanSchedulers(sched),
            "dataloader": TitanDataloader(100 + rank()), "train_state": TitanTrainer(train.step, train.tokens)}


def run_load_titan(out: Path) -> None:
    """torchtitan's states saved on 4 ranks, loaded here: the model (top-level keys, filled in
    place), the flat optimizer state, `last_epoch`, this rank's dataloader position (ranks 0-3
    saved one each) and the trainer's ints."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    want = torch.load(out / "titan.pt", weights_only=False)
    model, optim, sched, train = build(mesh, LOAD_SEED, "fresh")
    state = titan_states(model, optim, sched, train)
    result = hdist.load(state, out / "titan")
    model.load_state_dict(state, strict=False)  # as CheckpointManager.dcp_load does after dcp.load
    check(not result.missing, f"titan: missing {result.missing}")
    check(sorted(result.unused) == [f"dataloader.dp_rank_{r}" for r in range(4) if r != rank()],
          f"titan: unused {result.unused}: only the other ranks' dataloader positions")
    got = reference(model, optim, sched, train)
    if rank() == 0:
        compare_trees({"model": got["model"], "optim": got["optim"]}, {"model": want["model"], "optim": want["optim"]},
                      "titan: full state")
    check(got["loss"] == want["loss"], f"titan: the loss {got['loss']!r} != {want['loss']!r}")
    check(sched.last_epoch == want["sched"]["last_epoch"], f"titan: last_epoch {sched.last_epoch}")
    loader, trainer = state["dataloader"], state["train_state"]
    check(loader.position == 100 + rank() and loader.loaded["world_size"] == 4, f"titan: dataloader {loader.loaded}")
    check((trainer.step, trainer.ntokens_seen) == (want["train"]["step"], want["train"]["tokens"]),
          f"titan: trainer {trainer.step}, {trainer.ntokens_seen}")


def states(model, optim, sched, train) -> dict:
    return {"app": AppState(model, optim), "lr_scheduler": sched, "train_state": train}


def reference(model, optim, sched, train) -> dict:
    """What a load must give back (every rank takes part; rank 0 gets the full state)."""
    full_m, full_o = full_state(model, optim)
    return {"model": full_m, "optim": full_o, "sched": sched.state_dict(), "train": train.state_dict(),
            "loss": step3_loss(model)}


def write_reference(out: Path, name: str, ref: dict) -> None:
    if rank() == 0:
        ref = dict(ref, train={k: (v.getvalue() if isinstance(v, io.BytesIO) else v) for k, v in ref["train"].items()})
        torch.save(ref, out / f"{name}.pt")


def run_save(out: Path) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, optim, sched, train = build(mesh, SAVE_SEED, "saved")
    for _ in range(2):
        train_step(model, optim, sched, train)
    write_reference(out, "recipe", reference(model, optim, sched, train))
    result = hdist.save(state_dict=states(model, optim, sched, train), checkpoint_id=str(out / "recipe"),
                        process_group=None, no_dist=False)
    check(result.committed and result.files, f"save: committed {result.committed}, files {result.files}")

    train_step(model, optim, sched, train)
    write_reference(out, "recipe_async", reference(model, optim, sched, train))
    future = hdist.async_save(state_dict=states(model, optim, sched, train), checkpoint_id=str(out / "recipe_async"),
                              process_group=None)
    train_step(model, optim, sched, train)  # trains on while the checkpoint persists
    check(future.result().committed, "async_save: not committed")
    check(future.done() and future.exception() is None, "async_save: the future is not done without error")

    # PyTorch DCP out of the same save, for torch's own dcp.load
    write_reference(out, "recipe_dcp", reference(model, optim, sched, train))
    hdist.save(state_dict=states(model, optim, sched, train), checkpoint_id=str(out / "recipe_dcp"), format="torch-dcp")
    train_step(model, optim, sched, train)
    write_reference(out, "recipe_dcp_async", reference(model, optim, sched, train))
    future = hdist.async_save(states(model, optim, sched, train), str(out / "recipe_dcp_async"), format="torch-dcp")
    train_step(model, optim, sched, train)
    check(future.result().committed, "async_save (torch-dcp): not committed")

    # torch's own dcp.save, through hpckpt's StorageWriter
    write_reference(out, "recipe_writer", reference(model, optim, sched, train))
    dcp.save(states(model, optim, sched, train), storage_writer=HpckptWriter(out / "recipe_writer"))

    ref = reference(model, optim, sched, train)  # torchtitan's states
    write_reference(out, "titan", dict(ref, train={"step": train.step, "tokens": train.tokens}))
    hdist.save(titan_states(model, optim, sched, train), out / "titan")


def run_load(out: Path) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for name in LOADED_BY:
        want = torch.load(out / f"{name}.pt", weights_only=False)
        model, optim, sched, train = build(mesh, LOAD_SEED, "fresh")
        # another history of as many steps (a list of dicts is a structure the target must have,
        # as for torch DCP): the load must replace every value in it
        train.losses = [9.0] * int(want["train"]["step"])
        state = states(model, optim, sched, train)
        app = state["app"]
        if LOADED_BY[name] == "hpckpt":
            result = hdist.load(state_dict=state, checkpoint_id=str(out / name), process_group=None, no_dist=False)
            check(not result.missing and not result.unused, f"{name}: missing {result.missing}, unused {result.unused}")
        elif LOADED_BY[name] == "torch+HpckptReader":
            dcp.load(state_dict=state, storage_reader=HpckptReader(out / name))
        else:  # torch's own FileSystemReader, on hpckpt's torch-dcp output
            dcp.load(state_dict=state, checkpoint_id=str(out / name))
        check(state["app"] is app and state["train_state"] is train, f"{name}: the Stateful objects were replaced")
        got = reference(model, optim, sched, train)
        if rank() == 0:
            n = compare_trees({"model": got["model"], "optim": got["optim"]},
                              {"model": want["model"], "optim": want["optim"]}, f"{name}: full state")
            check(n >= 16, f"{name}: compared only {n} tensors")
        check(got["loss"] == want["loss"], f"{name}: next step's loss {got['loss']!r} != saved {want['loss']!r}")
        check(got["sched"] == want["sched"], f"{name}: scheduler {got['sched']} != {want['sched']}")
        loaded = train.loaded or {}
        for key, value in want["train"].items():
            value_got = loaded.get(key)
            if key == "losses":
                check(isinstance(value_got, io.BytesIO) and value_got.getvalue() == value,
                      f"{name}: train_state.losses is {type(value_got).__name__}, or other bytes")
            elif isinstance(value, torch.Tensor):
                check(isinstance(value_got, torch.Tensor) and value_got.dtype == value.dtype
                      and torch.equal(value_got, value), f"{name}: train_state.{key} {value_got!r} != {value!r}")
            else:
                check(type(value_got) is type(value) and value_got == value,
                      f"{name}: train_state.{key} {value_got!r} ({type(value_got).__name__}) != {value!r}")
        check(train.step == int(want["train"]["step"]) and train.tag == "saved" and len(train.losses) == train.step,
              f"{name}: the train state after load_state_dict: step {train.step}, tag {train.tag}, {train.losses}")


def run_load_foreign(out: Path, fixture: Path) -> None:
    """torch's own dcp.load through HpckptReader: a MindSpore `.ckpt` of the model (written by
    MindSpore from the `recipe` reference, OUTDIR/model.ckpt) into the FSDP2 model, and a
    HyperParallel fixture into DTensor targets sharded over this job's mesh."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    want = torch.load(out / "recipe.pt", weights_only=False)
    model, optim, _sched, _train = build(mesh, LOAD_SEED, "fresh")
    model_sd = get_model_state_dict(model)
    dcp.load(model_sd, storage_reader=HpckptReader(out / "model.ckpt"))
    set_model_state_dict(model, model_sd)
    got = reference(model, optim, _sched, _train)
    if rank() == 0:
        check(compare_trees(got["model"], want["model"], "MindSpore .ckpt -> FSDP2 model") >= 8, "too few tensors")
    check(got["loss"] == want["loss"], f".ckpt: the loss {got['loss']!r} != {want['loss']!r}")

    expected = load_file(fixture / "expected.safetensors")
    values = json.loads((fixture / "expected.json").read_text())
    targets = {k: distribute_tensor(torch.zeros_like(t), mesh, [Shard(0)]) if t.ndim else torch.zeros_like(t)
               for k, t in expected.items()}
    targets.update({k: None for k in values})
    dcp.load(targets, storage_reader=HpckptReader(fixture))
    for k, t in expected.items():
        full = targets[k].full_tensor() if isinstance(targets[k], DTensor) else targets[k]
        common.same_tensor(full, t, f"fixture {k}")
    for k, v in values.items():
        value = tuple(v["value"]) if v["type"] == "tuple" else v["value"]
        check(type(targets[k]).__name__ == v["type"] and targets[k] == value, f"fixture {k}: {targets[k]!r} != {v}")


def main() -> int:
    mode, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        if mode == "save":
            run_save(out)
        else:
            run_load(out)
            run_load_titan(out)
            run_load_foreign(out, Path(sys.argv[3]))
    except Exception:  # noqa: BLE001 - reported as a failure of this rank
        check(False, f"{mode} raised:\n{traceback.format_exc()}")
    ok = not common.FAILURES
    if ok:
        print(f"rank {rank()}: OK {mode}.", flush=True)
    dist.destroy_process_group()
    time.sleep(0.05)  # the job's own last collectives are torch's: the README's workaround ("Clean exits")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
