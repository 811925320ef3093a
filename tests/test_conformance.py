"""One conformance suite for every format in the registry (`hpckpt.converters.FORMATS`).

Readers: every format has small sample checkpoints written by the format's real producing
library (HyperParallel: the fixtures it wrote; PyTorch DCP: `torch.distributed.checkpoint.save`
in this process; safetensors: `safetensors.numpy` / `safetensors.torch`; Hugging Face sharded:
safetensors shards plus the index JSON written the way transformers writes it; MindSpore:
`mindspore.save_checkpoint`; torch.save: `torch.save`). Each reader's `sniff` accepts its own
samples and declines every other format's; `open_index` + `read_box` give back exactly what
the producer wrote; damaged copies raise the documented typed error, in the library and on the
command line.

Writers: every writable format writes a HyperParallel fixture and an in-memory source through
`api.convert`; the format's own library reads the output back bit-exactly, two runs give the
same bytes, and a writer killed mid-way leaves no destination, only a staging directory that
`verify` refuses and the next run removes.

A format added to the registry is picked up by every parametrization here; the tests fail until
it has a sample (`SAMPLES`) and, if it writes, an independent reader (`OWN_READERS`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _util import FIXTURES, as_json_value, assert_bit_equal, expected_values
from hp_reference import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata
from test_unpickle import stand_in_load
from typer.testing import CliRunner

from hpckpt import api
from hpckpt.cli.app import app
from hpckpt.converters import FORMATS, detect, open_index, writable
from hpckpt.core import dtypes
from hpckpt.core.errors import (
    ERROR_CLASSES,
    CorruptMetadataError,
    HpckptError,
    MissingFileError,
    PathNotFoundError,
)
from hpckpt.core.io.memory_source import MemoryTensor, memory_index
from hpckpt.core.io.read import read_box

runner = CliRunner()

#: Exit codes the README documents for a damaged checkpoint (3 and up; 1 is an internal error).
DOCUMENTED_CODES = {cls.exit_code for cls in ERROR_CLASSES}

#: Formats the registry lists without a reader of their own, and the reader that reads them.
READ_BY = {"hyperparallel-legacy": "hyperparallel"}

WRITE_SOURCE_FIXTURE = "m0-torch-4rank"


def owner(format_name: str) -> str:
    """The registry name of the format whose reader reads checkpoints of `format_name`."""
    fmt = next(f for f in FORMATS if f.name == format_name)
    return fmt.name if fmt.reader is not None else READ_BY[fmt.name]


# --------------------------------------------------------------------------------------------
# What the producers write: small arrays covering bf16, a 0-d tensor, an int tensor.

#: bfloat16 bit patterns (1, -2, 0, -0, ~3.14, -1): raw uint16, as hpckpt reads bf16.
BF16_BITS = np.array([0x3F80, 0xC000, 0x0000, 0x8000, 0x4049, 0xBF80], dtype=np.uint16).reshape(3, 2)


def sample_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(20261201)
    return {
        "model.w": rng.standard_normal((3, 4)).astype(np.float32),
        "model.bf": BF16_BITS.copy(),
        "model.ids": np.arange(-3, 3, dtype=np.int64).reshape(2, 3),
        "model.scale": np.array(0.75, dtype=np.float32),  # 0-d
        "model.half": rng.standard_normal(5).astype(np.float16),
    }


BF16 = {"model.bf"}  # the arrays above holding bfloat16 bits


def sample_values() -> dict[str, Any]:
    return {"step": 7, "lr": 0.5, "name": "run-a", "milestones": [10, 20]}


def to_torch(name: str, array: np.ndarray):
    import torch

    if name in BF16:
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def torch_bits(t) -> np.ndarray:
    """A torch tensor as numpy, bfloat16 as raw uint16 bits."""
    import torch

    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def bf16_as_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def ms_bits(value) -> np.ndarray:
    """A MindSpore Parameter/Tensor as numpy, bfloat16 as raw uint16 bits (bf16 -> f32 is exact)."""
    import mindspore as ms

    if value.dtype == ms.bfloat16:
        return (value.astype(ms.float32).asnumpy().view(np.uint32) >> 16).astype(np.uint16)
    return value.asnumpy()


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, leaf = name.split(".")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


# --------------------------------------------------------------------------------------------
# Samples, one builder per sample: (format name, builder(dir) -> Sample)


@dataclass
class Sample:
    """A checkpoint at `path` and what its producer put in it: {fqn: (dtype name, array)}
    (bfloat16 as raw uint16 bits) and {fqn: value}."""

    format: str
    path: Path
    tensors: dict[str, tuple[str, np.ndarray]]
    values: dict[str, Any] = field(default_factory=dict)


def named(arrays: dict[str, np.ndarray]) -> dict[str, tuple[str, np.ndarray]]:
    return {k: ("bfloat16" if k in BF16 else a.dtype.name, a) for k, a in arrays.items()}


def fixture_tensors(fixture: Path) -> dict[str, tuple[str, np.ndarray]]:
    """A fixture's `expected.safetensors` (via safetensors.torch): dtype names and raw bits."""
    from safetensors.torch import load_file

    return {fqn: (str(t.dtype).removeprefix("torch."), torch_bits(t))
            for fqn, t in load_file(str(fixture / "expected.safetensors")).items()}


def typed_values(fixture: Path) -> dict[str, Any]:
    """`expected.json` as Python values (tuples are stored there as lists with type "tuple")."""
    return {k: tuple(v["value"]) if v["type"] == "tuple" else v["value"] for k, v in expected_values(fixture).items()}


def hp_fixture(name: str, fmt: str) -> Callable[[Path], Sample]:
    def build(_root: Path) -> Sample:
        path = FIXTURES / name
        return Sample(fmt, path, fixture_tensors(path), typed_values(path))

    return build


def build_torch_dcp(root: Path) -> Sample:
    import torch.distributed.checkpoint as dcp

    arrays, values = sample_arrays(), sample_values()
    state = unflatten({**{k: to_torch(k, a) for k, a in arrays.items()}, **values})
    path = root / "dcp"
    dcp.save(state, checkpoint_id=path, no_dist=True)
    return Sample("torch-dcp", path, named(arrays), values)


def build_safetensors_numpy(root: Path) -> Sample:
    from safetensors.numpy import save_file

    arrays = {k: a for k, a in sample_arrays().items() if k not in BF16}  # numpy has no bfloat16
    path = root / "np.safetensors"
    save_file(arrays, str(path))
    return Sample("safetensors", path, named(arrays))


def build_safetensors_torch(root: Path) -> Sample:
    from safetensors.torch import save_file

    arrays = sample_arrays()
    path = root / "pt.safetensors"
    save_file({k: to_torch(k, a) for k, a in arrays.items()}, str(path), metadata={"format": "pt"})
    return Sample("safetensors", path, named(arrays))


def build_hf_sharded(root: Path) -> Sample:
    """Two shards and the index, as `transformers`' `save_pretrained(safe_serialization=True)`
    writes them: shard files `model-0000i-of-0000n.safetensors` with `{"format": "pt"}`, and
    `json.dumps({"metadata": {"total_size"}, "weight_map"}, indent=2, sort_keys=True) + "\\n"`."""
    from safetensors.torch import save_file

    arrays = sample_arrays()
    names = list(arrays)
    shards = [names[:2], names[2:]]
    path = root / "hf"
    path.mkdir()
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: to_torch(k, arrays[k]) for k in shard}, str(path / file), metadata={"format": "pt"})
        for k in shard:
            weight_map[k] = file
            total += arrays[k].nbytes
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return Sample("hf-sharded", path, named(arrays))


def build_hf_torch_bin(root: Path) -> Sample:
    """`save_pretrained(safe_serialization=False)`'s layout: `torch.save` shards
    `pytorch_model-0000i-of-0000n.bin` and `pytorch_model.bin.index.json` in the same JSON form."""
    import torch

    arrays = sample_arrays()
    names = list(arrays)
    path = root / "hf-bin"
    path.mkdir()
    weight_map = {}
    for i, shard in enumerate([names[:2], names[2:]]):
        file = f"pytorch_model-{i + 1:05d}-of-00002.bin"
        torch.save({k: to_torch(k, arrays[k]) for k in shard}, path / file)
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": sum(a.nbytes for a in arrays.values())}, "weight_map": weight_map}
    (path / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return Sample("hf-torch-bin", path, named(arrays))


def build_mindspore(root: Path) -> Sample:
    """`mindspore.save_checkpoint` with every tensor a Parameter (it drops plain Tensor values);
    `append_dict` adds a str (a value) and an int (saved as a 0-d int64 tensor)."""
    import mindspore as ms

    arrays = sample_arrays()
    params = {}
    for k, a in arrays.items():
        tensor = ms.Tensor(bf16_as_f32(a), dtype=ms.bfloat16) if k in BF16 else ms.Tensor(a)
        params[k] = ms.Parameter(tensor, name=k)
    path = root / "net.ckpt"
    ms.save_checkpoint(params, str(path), append_dict={"run_name": "run-a", "epoch": 3})
    path.chmod(0o600)  # MindSpore saves read-only; the damage tests rewrite copies
    tensors = named({**arrays, "epoch": np.array(3, dtype=np.int64)})
    return Sample("mindspore-ckpt", path, tensors, {"run_name": "run-a"})


def build_torch_save(root: Path) -> Sample:
    import torch

    arrays, values = sample_arrays(), sample_values()
    path = root / "state.pt"
    torch.save(unflatten({**{k: to_torch(k, a) for k, a in arrays.items()}, **values}), path)
    return Sample("torch-save", path, named(arrays), values)


def build_mindformers(_root: Path) -> Sample:
    """A 2-rank tensor-parallel save MindFormers 2.1.0 wrote (`fixtures/mindformers/`, its README):
    the full tensors are `RandomState(7)`'s, the values `common.json`'s."""
    path = Path(__file__).resolve().parent / "fixtures" / "mindformers" / "sim2"
    rs = np.random.RandomState(7)
    arrays = {k: rs.randn(*shape).astype(np.float32)
              for k, shape in (("fc1.weight", (8, 4)), ("fc1.bias", (8,)), ("fc2.weight", (2, 8)), ("fc2.bias", (2,)))}
    common = json.loads((path / "iteration_00000005" / "common.json").read_text())
    return Sample("mindformers", path, named(arrays), {f"common.{k}": v for k, v in common.items()})


SAMPLES: dict[str, tuple[str, Callable[[Path], Sample]]] = {
    "hp-m0-torch-4rank": ("hyperparallel", hp_fixture("m0-torch-4rank", "hyperparallel")),
    "hp-m0-mindspore-1rank": ("hyperparallel", hp_fixture("m0-mindspore-1rank", "hyperparallel")),
    "hp-m0-torch-4rank-rankLocal": ("hyperparallel", hp_fixture("m0-torch-4rank-rankLocal", "hyperparallel")),
    "hp-legacy-torch-4rank": ("hyperparallel-legacy", hp_fixture("legacy-torch-4rank", "hyperparallel-legacy")),
    "torch-dcp-no-dist": ("torch-dcp", build_torch_dcp),
    "safetensors-numpy": ("safetensors", build_safetensors_numpy),
    "safetensors-torch": ("safetensors", build_safetensors_torch),
    "hf-sharded-2-shards": ("hf-sharded", build_hf_sharded),
    "hf-torch-bin-2-shards": ("hf-torch-bin", build_hf_torch_bin),
    "mindspore-save-checkpoint": ("mindspore-ckpt", build_mindspore),
    "torch-save": ("torch-save", build_torch_save),
    "mindformers-2rank": ("mindformers", build_mindformers),
}
SAMPLE_IDS = list(SAMPLES)
FORMAT_NAMES = [f.name for f in FORMATS]
READERS = [f for f in FORMATS if f.reader is not None]


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> Callable[[str], Sample]:
    """Each sample built once per run of this module, on first use."""
    root = tmp_path_factory.mktemp("conformance-samples")
    built: dict[str, Sample] = {}

    def get(sample_id: str) -> Sample:
        if sample_id not in built:
            fmt, build = SAMPLES[sample_id]
            where = root / sample_id
            where.mkdir()
            built[sample_id] = build(where)
            assert built[sample_id].format == fmt
        return built[sample_id]

    return get


def read_everything(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    index = open_index(path)
    tensors = {fqn: read_box(index, entry) for fqn, entry in index.tensors.items()}
    return tensors, {fqn: index.decode_value(fqn) for fqn in index.values}


# --------------------------------------------------------------------------------------------
# Readers


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_every_format_has_a_sample(name):
    assert name in {fmt for fmt, _ in SAMPLES.values()}, f"format {name!r} has no sample in SAMPLES"
    owner(name)  # and a reader that reads it


@pytest.mark.parametrize("sample_id", SAMPLE_IDS)
@pytest.mark.parametrize("reader", READERS, ids=[f.name for f in READERS])
def test_sniff_accepts_own_samples_and_declines_all_others(samples, reader, sample_id):
    sample = samples(sample_id)
    assert reader.reader.sniff(sample.path) is (owner(sample.format) == reader.name)


@pytest.mark.parametrize("sample_id", SAMPLE_IDS)
def test_reads_back_exactly_what_the_producer_wrote(samples, sample_id):
    sample = samples(sample_id)
    assert detect(sample.path).name == owner(sample.format)
    index = open_index(sample.path)
    assert index.format == sample.format
    tensors, values = read_everything(sample.path)
    assert sorted(tensors) == sorted(sample.tensors)
    for fqn, (dtype, want) in sample.tensors.items():
        assert index.tensors[fqn].dtype.name == dtype, (fqn, index.tensors[fqn].dtype, dtype)
        assert_bit_equal(tensors[fqn], want, fqn)
    assert values == sample.values
    for fqn, want in sample.values.items():
        assert type(values[fqn]) is type(want), (fqn, values[fqn], want)


# --- damage --------------------------------------------------------------------------------


def damageable_copy(sample: Sample, dest: Path) -> Path:
    if sample.path.is_dir():
        shutil.copytree(sample.path, dest)
    else:
        dest.mkdir()
        dest = dest / sample.path.name
        shutil.copy2(sample.path, dest)
    return dest


def tensor_data_file(path: Path) -> Path:
    """The data file holding the first chunk of the first tensor."""
    index = open_index(path)
    entry = next(iter(index.tensors.values()))
    return index.root / entry.chunks[0].file


def truncate(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def with_metadata(sample_id: str) -> bool:
    fmt = SAMPLES[sample_id][0]
    return next(f for f in FORMATS if f.name == fmt).destination == "dir"


DAMAGES = [(s, kind) for s in SAMPLE_IDS for kind in ("data-deleted", "data-truncated", "metadata-truncated")
           if kind != "metadata-truncated" or with_metadata(s)]


def damage(sample: Sample, kind: str, where: Path) -> tuple[Path, tuple[type[HpckptError], ...]]:
    """A damaged copy of `sample` and the errors the documentation allows for it."""
    path = damageable_copy(sample, where / "damaged")
    if kind == "metadata-truncated":
        truncate(path / open_index(path).metadata_files[0])
        return path, (CorruptMetadataError,)
    data = tensor_data_file(path)
    if kind == "data-deleted":
        data.unlink()
        # a one-file checkpoint is its data file: then the path itself is gone
        return path, (MissingFileError,) if path.is_dir() else (PathNotFoundError,)
    truncate(data)
    return path, (HpckptError,)


@pytest.mark.parametrize(("sample_id", "kind"), DAMAGES)
def test_damage_raises_the_documented_error(samples, tmp_path, sample_id, kind):
    path, allowed = damage(samples(sample_id), kind, tmp_path)
    with pytest.raises(HpckptError) as info:
        read_everything(path)
    assert isinstance(info.value, allowed), repr(info.value)
    assert info.value.exit_code in DOCUMENTED_CODES, repr(info.value)


@pytest.mark.parametrize(("sample_id", "kind"), DAMAGES)
def test_damage_on_the_command_line(samples, tmp_path, sample_id, kind):
    path, allowed = damage(samples(sample_id), kind, tmp_path)
    result = runner.invoke(app, ["verify", str(path)])
    codes = {c.exit_code for c in allowed} if allowed != (HpckptError,) else DOCUMENTED_CODES
    assert result.exit_code in codes, (result.exit_code, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert "internal error" not in errors[0]


# --------------------------------------------------------------------------------------------
# Writers: what each format's own library reads back
#
# A "truth" is {fqn: (dtype name, array)} (bfloat16 as raw uint16 bits) plus {fqn: value};
# every independent reader below returns the same shapes.

Truth = tuple[dict[str, tuple[str, np.ndarray]], dict[str, Any]]

WRITERS = list(writable())
WRITER_IDS = [f.name for f in WRITERS]


def fixture_truth() -> Truth:
    """The write source's ground truth: `expected.safetensors` (via safetensors.torch) and
    `expected.json`, as the fixture's author wrote them."""
    path = FIXTURES / WRITE_SOURCE_FIXTURE
    return fixture_tensors(path), typed_values(path)


MEMORY_TENSORS: dict[str, tuple[str, np.ndarray]] = {
    "bf": ("bfloat16", BF16_BITS.T.copy()),
    "scalar": ("float32", np.array(-2.5, dtype=np.float32)),
    "ids": ("int64", np.array([-(2**63), -1, 0, 2**63 - 1], dtype=np.int64)),
    "empty": ("float32", np.zeros((0, 3), dtype=np.float32)),
    "counts": ("int32", np.arange(6, dtype=np.int32).reshape(3, 2)),
}
MEMORY_VALUES: dict[str, Any] = {"step": 9, "lr": 0.25, "tag": "memory", "flag": True}


def memory_source():
    tensors = {fqn: MemoryTensor.whole(dtypes.dtype(name), array) for fqn, (name, array) in MEMORY_TENSORS.items()}
    return memory_index(tensors, MEMORY_VALUES)


def convert(source: str, fmt, dst: Path, **kwargs):
    if fmt.name == "mindformers":  # equal slices only: the sources' layouts split 10 rows 3+3+2+2
        from hpckpt.api.layouts import layout_spec

        kwargs["layout"] = layout_spec(None, 1, "balanced", None, None, None, None)
    if source == "fixture":
        return api.convert(FIXTURES / WRITE_SOURCE_FIXTURE, dst, fmt.name, **kwargs)
    return api.convert("<memory>", dst, fmt.name, index=memory_source(), **kwargs)


def truth_of(source: str) -> Truth:
    return fixture_truth() if source == "fixture" else (dict(MEMORY_TENSORS), dict(MEMORY_VALUES))


def destination(fmt, root: Path) -> Path:
    return root / ("out" + (fmt.extensions[0] if fmt.extensions else ""))


def json_document(value: Any) -> dict:
    """A value as hpckpt's JSON sidecars write it (`{"type", "value"}`, tuples as lists)."""
    return {"type": type(value).__name__, "value": as_json_value(value)}


# --- independent readers, one per writable format ---------------------------------------------


def read_with_stand_ins(path: Path) -> Truth:
    """HyperParallel: `.metadata` through the stand-in unpickler of test_unpickle (HyperParallel's
    classes as independent dataclasses, stock `pickle`), chunks loaded by `safetensors` and
    assembled here, values unpickled from their byte ranges by the same stand-in unpickler."""
    import torch
    from safetensors import safe_open

    metadata = stand_in_load((path / ".metadata").read_bytes())
    tensors, values = {}, {}
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):
            info = metadata.storage_data[MetadataIndex(fqn)]
            with open(path / info.relative_path, "rb") as f:
                f.seek(info.offset)
                values[fqn] = stand_in_load(f.read(info.length))
            continue
        assert isinstance(item, TensorStorageMetadata), (fqn, item)
        dtype = getattr(torch, item.properties.dtype.removeprefix("torch."))
        whole = torch.zeros(tuple(item.size), dtype=dtype)
        covered = np.zeros(tuple(item.size), dtype=np.int64)
        for chunk in item.chunks:
            info = metadata.storage_data[MetadataIndex(fqn, tuple(chunk.offsets))]
            with safe_open(str(path / info.relative_path), framework="pt") as f:
                part = f.get_tensor(info.tensor_key)
            assert tuple(part.shape) == tuple(chunk.sizes), (fqn, chunk)
            where = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
            whole[where] = part
            covered[where] += 1
        assert (covered == 1).all(), f"{fqn}: chunks do not tile the tensor exactly"
        tensors[fqn] = (item.properties.dtype.removeprefix("torch."), torch_bits(whole))
    return tensors, values


def read_with_torch_dcp(path: Path) -> Truth:
    """PyTorch DCP: `torch.distributed.checkpoint.load` (single process) into zeros of the shapes
    and dtypes torch's own `FileSystemReader` reads from `.metadata`."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    state: dict[str, Any] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):
            state[fqn] = None
        else:
            state[fqn] = torch.zeros(tuple(item.size), dtype=item.properties.dtype)
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    tensors = {fqn: (str(v.dtype).removeprefix("torch."), torch_bits(v)) for fqn, v in state.items()
               if isinstance(v, torch.Tensor)}
    return tensors, {fqn: v for fqn, v in state.items() if not isinstance(v, torch.Tensor)}


def _safetensors_tensors(files: list[Path]) -> dict[str, tuple[str, np.ndarray]]:
    from safetensors import safe_open

    tensors = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                tensors[key] = (str(t.dtype).removeprefix("torch."), torch_bits(t))
    return tensors


def _sidecar(path: Path) -> dict[str, Any]:
    """hpckpt's values sidecar, kept as JSON documents (compared with `json_document`)."""
    return json.loads(path.read_text()) if path.exists() else {}


def read_with_safetensors_hf(path: Path) -> Truth:
    """Hugging Face sharded: the index JSON, then every shard through `safetensors.safe_open`."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    tensors = _safetensors_tensors([path / s for s in shards])
    assert sorted(index["weight_map"]) == sorted(tensors)
    for key, shard in index["weight_map"].items():  # each key is in the shard the index names
        assert key in _safetensors_tensors([path / shard]), key
    return tensors, _sidecar(path / "values.json")


def read_with_safetensors(path: Path) -> Truth:
    return _safetensors_tensors([path]), _sidecar(path.with_name(path.name.removesuffix(".safetensors") + ".values.json"))


def read_with_torch_load(path: Path) -> Truth:
    import torch

    loaded = torch.load(path, weights_only=True)
    tensors = {fqn: (str(v.dtype).removeprefix("torch."), torch_bits(v)) for fqn, v in loaded.items()
               if isinstance(v, torch.Tensor)}
    return tensors, {fqn: v for fqn, v in loaded.items() if not isinstance(v, torch.Tensor)}


def read_with_mindspore(path: Path) -> Truth:
    """`mindspore.load_checkpoint`; its dtype names (`Float32`, `BFloat16`, ...) lower-cased."""
    import mindspore as ms

    loaded = ms.load_checkpoint(str(path))
    tensors = {fqn: (str(v.dtype).lower(), ms_bits(v)) for fqn, v in loaded.items() if not isinstance(v, str)}
    return tensors, {fqn: v for fqn, v in loaded.items() if isinstance(v, str)}


def read_with_mindformers_rules(path: Path) -> Truth:
    """MindFormers Checkpoint 2.0 as its loader reads it (MindFormers itself does not install
    here: tests/fixtures/mindformers shows its loader accepting hpckpt's output): `metadata.json`
    with the json module, each chunk's slice number placed row-major on `axis_fragmentations`,
    the file `storage_data` names under `str((name, (slice,)))`, each slice by `safetensors`;
    `common.json`'s fields as `common.KEY`."""
    meta = json.loads((path / "metadata.json").read_text())
    tensors = {}
    for name, item in meta["state_dict_metadata"].items():
        grid = item["axis_fragmentations"]
        full = None
        for chunk in item["chunk"]:
            (file_name,) = {e["file_name"] for e in meta["storage_data"][str((name, tuple(chunk["global_offset"])))]}
            dtype, piece = _safetensors_tensors([path / file_name])[name]
            coords = np.unravel_index(chunk["global_offset"][0], grid) if grid else ()
            where = tuple(slice(int(c) * s, (int(c) + 1) * s) for c, s in zip(coords, chunk["local_shape"]))
            if full is None:
                full = np.zeros(item["global_shape"], dtype=piece.dtype)
            full[where] = piece
        tensors[name] = (dtype, full)
    common = json.loads((path / "common.json").read_text())
    return tensors, {f"common.{k}": v for k, v in common.items()}


OWN_READERS: dict[str, Callable[[Path], Truth]] = {
    "hyperparallel": read_with_stand_ins,
    "torch-dcp": read_with_torch_dcp,
    "hf-sharded": read_with_safetensors_hf,
    "safetensors": read_with_safetensors,
    "torch-save": read_with_torch_load,
    "mindspore-ckpt": read_with_mindspore,
    "mindformers": read_with_mindformers_rules,
}

#: How a format stores a value: the default keeps it a value; MindSpore's `.ckpt` keeps `str`
#: and turns bool/int/float into 0-d tensors (as `save_checkpoint(append_dict=...)` does).
SIDECAR_FORMATS = {"hf-sharded", "safetensors"}  # values in hpckpt's JSON sidecar
MS_SCALARS = {bool: "bool", int: "int64", float: "float32"}


def cannot_hold(fmt, truth: Truth) -> set[str]:
    """What the README says a format cannot hold (to be listed in the report's `skipped`):
    MindSpore's `.ckpt` drops zero-element tensors and holds only str/int/float/bool values."""
    if fmt.name == "mindformers":  # values: common.json's fields only
        return {k for k in truth[1] if not k.startswith("common.")}
    if fmt.name != "mindspore-ckpt":
        return set()
    return ({k for k, (_, a) in truth[0].items() if a.size == 0}
            | {k for k, v in truth[1].items() if type(v) not in (str, *MS_SCALARS)})


#: `max_shard_size` for the writer checks: small, so that hf-sharded writes several shards.
SMALL_SHARDS = 256


def expected_output(fmt, truth: Truth, skipped: set[str]) -> Truth:
    tensors = {k: v for k, v in truth[0].items() if k not in skipped}
    values = {k: v for k, v in truth[1].items() if k not in skipped}
    if fmt.name in SIDECAR_FORMATS:
        values = {k: json_document(v) for k, v in values.items()}
    if fmt.name == "mindspore-ckpt":
        for k in [k for k, v in values.items() if type(v) in MS_SCALARS]:
            v = values.pop(k)
            tensors[k] = (MS_SCALARS[type(v)], np.array(v, dtype=MS_SCALARS[type(v)]))
    return tensors, values


@pytest.mark.parametrize("source", ["fixture", "memory"])
@pytest.mark.parametrize("fmt", WRITERS, ids=WRITER_IDS)
def test_written_output_is_read_back_by_the_formats_own_library(tmp_path, fmt, source):
    assert fmt.name in OWN_READERS, f"writable format {fmt.name!r} has no independent reader in OWN_READERS"
    dst = destination(fmt, tmp_path)
    report = convert(source, fmt, dst, max_shard_size=SMALL_SHARDS)
    truth = truth_of(source)
    skipped = {s["name"] for s in report["skipped"]}
    assert skipped == cannot_hold(fmt, truth), skipped
    want_tensors, want_values = expected_output(fmt, truth, skipped)
    got_tensors, got_values = OWN_READERS[fmt.name](dst)
    assert sorted(got_tensors) == sorted(want_tensors)
    for fqn, (dtype, array) in want_tensors.items():
        assert got_tensors[fqn][0] == dtype, (fqn, got_tensors[fqn][0], dtype)
        assert_bit_equal(got_tensors[fqn][1], array, fqn)
    assert sorted(got_values) == sorted(want_values)
    for fqn, want in want_values.items():
        got = got_values[fqn]
        assert got == want and type(got) is type(want), (fqn, got, want)


def file_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("source", ["fixture", "memory"])
@pytest.mark.parametrize("fmt", WRITERS, ids=WRITER_IDS)
def test_writing_twice_gives_identical_bytes(tmp_path, fmt, source):
    runs = []
    for run in ("first", "second"):
        (tmp_path / run).mkdir()
        convert(source, fmt, destination(fmt, tmp_path / run), max_shard_size=SMALL_SHARDS)
        runs.append(file_hashes(tmp_path / run))
    assert runs[0] and runs[0] == runs[1]


# --- a writer killed mid-way ------------------------------------------------------------------

KILL_AFTER_FIRST_BYTES = textwrap.dedent("""
    import os, signal, sys
    from hpckpt import api

    class KillAfterFirstBytes(api.Progress):
        def start(self, total):
            pass

        def advance(self, n):
            if n > 0:
                os.kill(os.getpid(), signal.SIGKILL)

    src, dst, to = sys.argv[1:]
    kwargs = {}
    if to == "mindformers":  # equal slices only (as `convert` in the test module)
        from hpckpt.api.layouts import layout_spec
        kwargs["layout"] = layout_spec(None, 1, "balanced", None, None, None, None)
    api.convert(src, dst, to, settings=api.WriteSettings(progress=KillAfterFirstBytes()), **kwargs)
    print("not killed")
""")


@pytest.mark.parametrize("fmt", WRITERS, ids=lambda f: f.name)
def test_a_killed_writer_leaves_nothing_valid(tmp_path, fmt):
    dst = destination(fmt, tmp_path)
    argv = [sys.executable, "-c", KILL_AFTER_FIRST_BYTES, str(FIXTURES / WRITE_SOURCE_FIXTURE), str(dst), fmt.name]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, stdout, stderr)
    assert not dst.exists()
    staging = tmp_path / f".{dst.name}.hpckpt-tmp-{proc.pid}"
    assert staging.is_dir(), sorted(os.listdir(tmp_path))
    verified = runner.invoke(app, ["verify", str(staging)])
    assert "Traceback" not in verified.stderr
    inside = [staging / n for n in os.listdir(staging)]  # nor is any file in it a checkpoint
    assert all(runner.invoke(app, ["inspect", str(p)]).exit_code == 4 for p in inside), inside

    convert("fixture", fmt, dst)  # the next run removes the staging directory and succeeds
    assert dst.exists()
    assert [n for n in os.listdir(tmp_path) if ".hpckpt-tmp-" in n] == []
    assert runner.invoke(app, ["verify", str(dst)]).exit_code == 0
    # checked last, so that the next run above is checked for every format
    assert verified.exit_code == 4, (verified.exit_code, verified.stdout, verified.stderr)  # not a checkpoint
