"""PyTorch DCP checkpoints written by real torch.distributed.checkpoint, read back through hpckpt."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _util import read_location, torch_bytes

from hpckpt.converters.torch_dcp import TorchDcpReader
from hpckpt.core.errors import (
    CorruptDataError,
    CorruptMetadataError,
    EntryMismatchError,
    MissingFileError,
    NotACheckpointError,
    PathNotFoundError,
    UnknownFormatError,
    UnsafePathError,
    UnsafePickleError,
)
from hpckpt.core.index import CheckpointIndex, TensorEntry

DIST_SCRIPT = Path(__file__).parent / "dist_scripts" / "torch_dcp_save.py"


def assemble(index: CheckpointIndex, entry: TensorEntry) -> np.ndarray:
    """Rebuild a full tensor from its chunks via the locator, and check every element is covered."""
    out = np.zeros(entry.shape, dtype=entry.dtype.np)
    covered = np.zeros(entry.shape, dtype=bool)
    for chunk in entry.chunks:
        assert chunk.box.inside(entry.shape), (entry.fqn, chunk.box)
        part = read_location(index.locate(chunk, entry))
        out[chunk.box.slices()] = part.reshape(chunk.box.sizes)
        covered[chunk.box.slices()] = True
    assert covered.all(), f"{entry.fqn}: chunks leave elements uncovered"
    return out


def assert_tensor_equal(arr: np.ndarray, t: torch.Tensor) -> None:
    assert arr.shape == tuple(t.shape)
    assert arr.tobytes() == torch_bytes(t)
    if t.dtype == torch.bfloat16:
        np.testing.assert_array_equal(arr, t.view(torch.int16).numpy().view(np.uint16))


def flatten(tree: dict, prefix: str = "") -> dict:
    """DCP's fqn scheme for nested dicts: keys joined with dots."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def assert_value_equal(got, want) -> None:
    assert type(got) is type(want), (got, want)
    assert got == want
    if isinstance(want, (list, tuple)):
        for g, w in zip(got, want):
            assert_value_equal(g, w)


# --- single process ------------------------------------------------------------------------------


def single_state() -> dict:
    g = torch.Generator().manual_seed(7)
    base = torch.randn(3, 4, generator=g)
    return {
        "model": {
            "w": torch.randn(4, 3, generator=g),
            "bf": torch.randn(3, 2, generator=g).to(torch.bfloat16),
            "h": torch.randn(5, generator=g).half(),
            "ids": torch.arange(-2, 4, dtype=torch.int64),
            "scale": torch.tensor(0.75),
            "empty": torch.empty(0, 3),
            "transposed": base.t(),
            "layer": {"bias": torch.randn(2, generator=g)},
        },
        "step": 42,
        "lr": 3e-4,
        "name": "run-a",
        "milestones": [10, 20, 30],
        "mixed": [1, "two", 3.0],
    }


@pytest.fixture(scope="module")
def single_ckpt(tmp_path_factory) -> tuple[Path, dict]:
    import torch.distributed.checkpoint as dcp

    path = tmp_path_factory.mktemp("dcp_single") / "ckpt"
    state = single_state()
    dcp.save(state, checkpoint_id=path, no_dist=True)
    return path, flatten(state)


def test_single_process_index(single_ckpt):
    path, flat = single_ckpt
    adapter = TorchDcpReader()
    assert adapter.sniff(path)
    index = adapter.read_index(path)
    assert index.format == "torch-dcp" and index.framework == "torch"
    assert index.format_version == "1.0.0"
    assert index.world_size == 1
    assert index.data_files == ["__0_0.distcp"]
    assert index.metadata_files == [".metadata"]
    tensors = {k for k, v in flat.items() if isinstance(v, torch.Tensor)}
    assert set(index.tensors) == tensors
    assert set(index.values) == set(flat) - tensors
    for fqn in tensors:
        entry = index.tensors[fqn]
        assert entry.dtype.torch == str(flat[fqn].dtype)
        assert entry.shape == tuple(flat[fqn].shape)


def test_single_process_tensors_bit_exact(single_ckpt):
    path, flat = single_ckpt
    index = TorchDcpReader().read_index(path)
    for fqn, entry in index.tensors.items():
        assert_tensor_equal(assemble(index, entry), flat[fqn])


def test_single_process_noncontiguous_is_strided(single_ckpt):
    path, _ = single_ckpt
    index = TorchDcpReader().read_index(path)
    entry = index.tensors["model.transposed"]
    assert index.locate(entry.chunks[0], entry).strides == (1, 4)  # DCP stores the view as is


def test_single_process_values(single_ckpt):
    path, flat = single_ckpt
    index = TorchDcpReader().read_index(path)
    for fqn, entry in index.values.items():
        assert entry.encoding == "torch_save"
        assert_value_equal(index.decode_value(fqn), flat[fqn])


def test_sniff_rejects_other_directories(tmp_path):
    adapter = TorchDcpReader()
    assert not adapter.sniff(tmp_path)
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    assert not adapter.sniff(tmp_path)
    assert not adapter.sniff(tmp_path / "missing")


# --- broken and hostile checkpoints ----------------------------------------------------------------


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_metadata(path: Path, edit) -> None:
    """Change a DCP .metadata with torch's own classes (tests only: the file is our own)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(path)).read_metadata()
    edit(metadata)
    (path / ".metadata").write_bytes(pickle.dumps(metadata, protocol=4))


def storage_info(metadata, fqn: str):
    return next(info for key, info in metadata.storage_data.items() if key.fqn == fqn)


def test_truncated_metadata(single_ckpt, tmp_path):
    path = copy_ckpt(single_ckpt[0], tmp_path / "ckpt")
    meta = path / ".metadata"
    meta.write_bytes(meta.read_bytes()[:300])
    assert TorchDcpReader().sniff(path)
    with pytest.raises(CorruptMetadataError, match=".metadata"):
        TorchDcpReader().read_index(path)


def test_hostile_metadata(single_ckpt, tmp_path):
    path = copy_ckpt(single_ckpt[0], tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(b"cos\nsystem\n(V" + f"touch {marker}".encode() + b"\ntR.")
    with pytest.raises(UnsafePickleError, match="os.system"):
        TorchDcpReader().read_index(path)
    assert not marker.exists()


def test_missing_data_file(single_ckpt, tmp_path):
    path = copy_ckpt(single_ckpt[0], tmp_path / "ckpt")
    (path / "__0_0.distcp").unlink()
    index = TorchDcpReader().read_index(path)  # metadata alone still reads
    entry = index.tensors["model.w"]
    with pytest.raises(MissingFileError) as info:
        index.locate(entry.chunks[0], entry)
    assert "__0_0.distcp" in str(info.value) and "model.w" in str(info.value)
    with pytest.raises(MissingFileError, match="step"):
        index.decode_value("step")


def test_truncated_data_file(single_ckpt, tmp_path):
    path = copy_ckpt(single_ckpt[0], tmp_path / "ckpt")
    data = path / "__0_0.distcp"
    index = TorchDcpReader().read_index(path)
    last = max(index.tensors.values(), key=lambda e: int(e.chunks[0].key.split(":")[0]))
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(CorruptDataError) as info:
        index.locate(last.chunks[0], last)
    assert "__0_0.distcp" in str(info.value) and last.fqn in str(info.value)


def test_corrupt_record(single_ckpt, tmp_path):
    path = copy_ckpt(single_ckpt[0], tmp_path / "ckpt")
    index = TorchDcpReader().read_index(path)
    entry = index.tensors["model.w"]
    offset, length = (int(x) for x in entry.chunks[0].key.split(":"))
    data = bytearray((path / "__0_0.distcp").read_bytes())
    data[offset + length - 22: offset + length] = b"\0" * 22  # wipe the end-of-central-directory
    (path / "__0_0.distcp").write_bytes(bytes(data))
    with pytest.raises(CorruptDataError, match="model.w"):
        index.locate(entry.chunks[0], entry)


def test_path_outside_checkpoint(single_ckpt, tmp_path):
    path = copy_ckpt(single_ckpt[0], tmp_path / "ckpt")
    edit_metadata(path, lambda m: setattr(storage_info(m, "model.w"), "relative_path", "../elsewhere.distcp"))
    with pytest.raises(UnsafePathError, match="model.w"):
        TorchDcpReader().read_index(path)


def test_transformed_item_is_refused(single_ckpt, tmp_path):
    path = copy_ckpt(single_ckpt[0], tmp_path / "ckpt")
    edit_metadata(path, lambda m: setattr(storage_info(m, "model.w"), "transform_descriptors", ["zstd"]))
    index = TorchDcpReader().read_index(path)
    assert index.warnings and "transforms" in index.warnings[0]
    entry = index.tensors["model.w"]
    with pytest.raises(UnknownFormatError, match="model.w"):
        index.locate(entry.chunks[0], entry)
    other = index.tensors["model.h"]
    index.locate(other.chunks[0], other)  # the rest still reads


def test_metadata_disagreeing_with_record(single_ckpt, tmp_path):
    path = copy_ckpt(single_ckpt[0], tmp_path / "ckpt")
    edit_metadata(path, lambda m: setattr(m.state_dict_metadata["model.w"].properties, "dtype", torch.float16))
    index = TorchDcpReader().read_index(path)
    entry = index.tensors["model.w"]
    with pytest.raises(EntryMismatchError, match="model.w"):
        index.locate(entry.chunks[0], entry)


# --- two ranks under torchrun ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def dist_ckpt(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("dcp_dist")
    ckpt, reference = out / "ckpt", out / "reference.pt"
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*launcher, "--standalone", "--nproc-per-node", "2", str(DIST_SCRIPT), str(ckpt), str(reference)],
        env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return ckpt, torch.load(reference, weights_only=True)


@pytest.mark.dist
def test_two_ranks_index(dist_ckpt):
    path, ref = dist_ckpt
    index = TorchDcpReader().read_index(path)
    assert index.world_size == 2
    assert index.data_files == ["__0_0.distcp", "__1_0.distcp"]
    assert set(index.tensors) == set(ref["tensors"])
    assert set(index.values) == {f"extra.{k}" for k in ref["values"]}
    boxes = {fqn: sorted((c.box.offsets, c.box.sizes) for c in e.chunks) for fqn, e in index.tensors.items()}
    assert boxes["rows"] == [((0, 0), (3, 3)), ((3, 0), (2, 3))]  # torch's ceil rule: 3 + 2
    assert boxes["cols"] == [((0, 0), (4, 3)), ((0, 3), (4, 2))]
    assert boxes["bf"] == [((0, 0), (4, 2)), ((4, 0), (3, 2))]
    assert boxes["rep"] == [((0, 0), (2, 3))]  # replicated: saved once
    assert boxes["scalar"] == [((), ())]
    assert ((0, 0), (1, 3)) in boxes["tiny"]


@pytest.mark.dist
def test_two_ranks_tensors_bit_exact(dist_ckpt):
    path, ref = dist_ckpt
    index = TorchDcpReader().read_index(path)
    for fqn, entry in index.tensors.items():
        assert entry.dtype.torch == str(ref["tensors"][fqn].dtype)
        assert_tensor_equal(assemble(index, entry), ref["tensors"][fqn])


@pytest.mark.dist
def test_two_ranks_values(dist_ckpt):
    path, ref = dist_ckpt
    index = TorchDcpReader().read_index(path)
    for key, want in ref["values"].items():
        assert_value_equal(index.decode_value(f"extra.{key}"), want)


def test_not_a_directory(tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    assert not TorchDcpReader().sniff(tmp_path / "file")
    with pytest.raises(NotACheckpointError):
        TorchDcpReader().read_index(tmp_path / "file")
    with pytest.raises(NotACheckpointError):
        TorchDcpReader().read_index(tmp_path)
    with pytest.raises(PathNotFoundError):
        TorchDcpReader().read_index(tmp_path / "missing")
