"""`hpckpt.dist` with MindSpore tensors in one process: it writes what HyperParallel's MindSpore
platform writes (the fixture `m0-mindspore-1rank`, written by HyperParallel's own code under
MindSpore 2.10), and what it writes loads back into MindSpore and torch tensors bit-exactly.

Compared field by field, not byte by byte: HyperParallel orders its metadata entries and
MindSpore its safetensors entries in their own ways, which no reader depends on; everything a
reader uses (names, dtype strings, shapes and their Python types, chunk boxes, storage keys,
file names, value pickles, the safetensors `__metadata__`, every tensor's bytes) must be equal.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from _util import FIXTURES, MANIFEST, assert_manifest_matches, expected_tensors, expected_values

mindspore = pytest.importorskip("mindspore")  # a test dependency: the README's test command installs it

import hpckpt.dist as hdist  # noqa: E402
from hpckpt.converters.hyperparallel.reader import _read_pickle  # noqa: E402
from hpckpt.core.codecs.hyperparallel_metadata import BytesStorageMetadata  # noqa: E402
from hpckpt.dist.frameworks import mindspore_tensors as ms_side  # noqa: E402

FIXTURE = FIXTURES / "m0-mindspore-1rank"


def _metadata_fields(root: Path) -> dict:
    md = _read_pickle(root, ".metadata")
    entries = {}
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):
            entries[fqn] = "bytes"
        else:
            entries[fqn] = (item.properties.dtype, item.properties.requires_grad, type(item.size).__name__,
                            tuple(item.size), [(type(c.sizes).__name__, tuple(c.offsets), tuple(c.sizes))
                                               for c in item.chunks])
    storage = {(k.fqn, tuple(k.offset), k.index): (v.relative_path, v.offset, v.length, v.tensor_key)
               for k, v in md.storage_data.items()}
    return {"entries": entries, "storage": storage, "planner": md.planner_data, "version": md.version}


def _safetensors_fields(path: Path) -> tuple[dict, dict]:
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", None)
    body = data[8 + n:]
    return meta, {k: (v["dtype"], v["shape"], body[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in header.items()}


def _ms_state(fixture: Path) -> dict:
    """Zero MindSpore Parameters of the fixture's tensors, nested as its planner data says."""
    from hpckpt.converters import open_index
    from hpckpt.dist.jobs.states import empty_state
    from hpckpt.core.geometry.layout import LayoutSpec

    state, _pieces = empty_state(open_index(fixture), LayoutSpec.for_world_size(1), 0, "mindspore")
    return state


def test_a_mindspore_save_writes_what_hyperparallels_mindspore_platform_writes(tmp_path):
    state = _ms_state(FIXTURE)
    loaded = hdist.load(state, FIXTURE)
    assert loaded.read_amplification == 1.0 and not loaded.missing
    saved = hdist.save(state, tmp_path / "ck")
    assert saved.committed and saved.plan_cache in ("miss", "off")
    ours, theirs = tmp_path / "ck", FIXTURE
    assert_manifest_matches(ours)  # hpckpt's own sidecar, which HyperParallel does not write
    assert sorted(p.name for p in ours.iterdir() if p.name != MANIFEST) == \
        sorted(p.name for p in theirs.iterdir() if not p.name.startswith("expected"))
    assert _metadata_fields(ours) == _metadata_fields(theirs)
    assert _safetensors_fields(ours / "_rank0_.safetensors") == _safetensors_fields(theirs / "_rank0_.safetensors")
    assert (ours / "_rank0_.bytes").read_bytes() == (theirs / "_rank0_.bytes").read_bytes()
    dtypes = {e[0] for e in _metadata_fields(ours)["entries"].values() if e != "bytes"}
    assert dtypes == {"Float32", "BFloat16", "Float16", "Int64", "Int32", "Bool"}


def test_a_mindspore_checkpoint_loads_into_torch_and_back_bit_exactly(tmp_path):
    import torch

    state = _ms_state(FIXTURE)
    hdist.load(state, FIXTURE)
    hdist.save(state, tmp_path / "ms")
    expected, values = expected_tensors(FIXTURE), expected_values(FIXTURE)
    from hpckpt.converters import open_index
    from hpckpt.dist.jobs.states import empty_state
    from hpckpt.core.geometry.layout import LayoutSpec
    from hpckpt.dist.flatten import flatten

    torch_state, pieces = empty_state(open_index(tmp_path / "ms"), LayoutSpec.for_world_size(1), 0, "torch")
    hdist.load(torch_state, tmp_path / "ms")
    from hpckpt.dist.frameworks import torch_tensors

    for fqn, s in pieces:
        got = torch_tensors.to_numpy(s.local, copy=False)
        assert np.array_equal(np.ascontiguousarray(got).view(np.uint8), np.ascontiguousarray(expected[fqn]).view(np.uint8)), fqn
    flat, _ = flatten(torch_state, lambda v: isinstance(v, (torch.Tensor, hdist.Sharded)))
    for fqn, doc in values.items():
        assert type(flat[fqn]).__name__ == doc["type"] and (list(flat[fqn]) if doc["type"] == "tuple" else flat[fqn]) == doc["value"], fqn
    # and back: the torch-written checkpoint (torch dtype strings) into MindSpore Parameters
    hdist.save(torch_state, tmp_path / "pt")
    back = _ms_state(tmp_path / "pt")
    hdist.load(back, tmp_path / "pt")
    flat_back, _ = flatten(back, ms_side.is_tensor)
    for fqn, arr in expected.items():
        local = flat_back[fqn].local if isinstance(flat_back[fqn], hdist.Sharded) else flat_back[fqn]
        got = ms_side.to_numpy(local, copy=False)
        assert np.array_equal(np.ascontiguousarray(got).view(np.uint8), np.ascontiguousarray(arr).view(np.uint8)), fqn
