"""Hostile pickles: budgets for depth, object count and allocation size, and metadata schema errors.

Every hostile pickle here is built from raw opcodes or by the stock pickler from stand-in
classes, written into a real small checkpoint (HyperParallel `.metadata` / `_rank0_.bytes`,
PyTorch DCP `.metadata` / `__0.metadata`, a torch.save file's `data.pkl`) and never loaded by the
stock unpickler. The CLI cases run in one driver subprocess limited to 4 GiB of address space
(`RLIMIT_AS`), so a budget that stops working shows up as a MemoryError or a crash, not as a
slow test.
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import subprocess
import sys
import types
import zipfile
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hp_reference import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorProperties,
    TensorStorageMetadata,
    dump_hp,
    write_hp,
)

from hpckpt.core import errors
from hpckpt.core.safety import pickle_budget
from hpckpt.core.errors import CorruptMetadataError, UnsafePickleError
from hpckpt.core.safety.pickle_budget import PickleBudget, check_value, parse_budget
from hpckpt.core.safety.unpickle import METADATA, loads

PROTO = b"\x80\x04"


def _str(text: str) -> bytes:
    raw = text.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw


def _global(module: str, name: str) -> bytes:
    return f"c{module}\n{name}\n".encode()


def _long(n: int) -> bytes:
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def deep_lists(n: int) -> bytes:
    """n nested lists by EMPTY_LIST + APPEND: the C unpickler builds these without recursing."""
    return PROTO + b"]" * n + b"a" * (n - 1) + b"."


DEEP = 400_000  # hashing a tuple nested this deep overflows the main thread's 8 MiB stack (about 130,000 do)


def deep_tuple(n: int) -> bytes:
    """The opcodes (no PROTO/STOP) of a tuple nested n deep: hashing it recurses in C."""
    return b")" + b"\x85" * n


def shared_bomb(width: int = 10, levels: int = 9, protocol: int = 4) -> bytes:
    """A list holding the same list `width` times, `levels` deep: 300 bytes, width**levels leaves."""
    value: Any = [0]
    for _ in range(levels):
        value = [value] * width
    return pickle.dumps(value, protocol=protocol)


def reduce(module: str, name: str, *args: bytes) -> bytes:
    return _global(module, name) + b"(" + b"".join(args) + b"tR"


VALUE_PICKLES = {
    "deep-lists": deep_lists(100_000),
    "deep-tuple-key": PROTO + b"}" + deep_tuple(DEEP) + b"Ns.",  # 400 KB; hashing the key needs a big stack
    "cycle": PROTO + b"]\x94h\x00a.",  # a list holding itself
    "shared-bomb": shared_bomb(),
    "range-bomb": PROTO + reduce("builtins", "range", _long(10**12)) + b".",
    "numpy-reconstruct": PROTO + reduce("numpy.core.multiarray", "_reconstruct", _global("numpy", "ndarray"),
                                        _long(3 * 10**9) + b"\x85", b"C\x01b") + b".",
    "numpy-ndarray": PROTO + reduce("numpy", "ndarray", _long(3 * 10**9) + b"\x85") + b".",
    "numpy-object-dtype": PROTO + reduce("numpy", "dtype", _str("O"), b"\x89\x88") + b".",
    "numpy-huge-dtype": PROTO + reduce("numpy", "dtype", _str("V2000000000"), b"\x89\x88") + b".",
    "codec-rot13": PROTO + reduce("_codecs", "encode", _str("abc"), _str("rot13")) + b".",
    "codec-unknown": PROTO + reduce("_codecs", "encode", _str("abc"), _str("no-such-codec")) + b".",
    "bytearray-codec": PROTO + reduce("builtins", "bytearray", _str("abc"), _str("hex")) + b".",
    "memo-index": PROTO + b"Nr" + (10**8).to_bytes(4, "little") + b".",  # 9 bytes asking for a 1.6 GB memo
}


# --------------------------------------------------------------------------------------------
# The budgets, in-process


@pytest.mark.parametrize("name", sorted(VALUE_PICKLES))
def test_each_hostile_value_is_refused(name):
    with pytest.raises(UnsafePickleError) as info:
        loads(VALUE_PICKLES[name], what=name)
    assert info.value.message.startswith(name)


def test_refusals_name_the_budget_and_the_setting():
    with pytest.raises(UnsafePickleError) as info:
        loads(VALUE_PICKLES["range-bomb"], what="x")
    assert "range()" in info.value.message and "range=" in info.value.message
    assert pickle_budget.ENV in info.value.hint
    with pytest.raises(UnsafePickleError) as info:
        loads(VALUE_PICKLES["numpy-reconstruct"], what="x")
    assert "3,000,000,000 bytes" in info.value.message and "alloc=" in info.value.message
    with pytest.raises(UnsafePickleError, match="objects="):
        loads(VALUE_PICKLES["shared-bomb"], what="x")
    with pytest.raises(UnsafePickleError, match="depth="):
        loads(VALUE_PICKLES["deep-lists"], what="x")


def test_only_a_write_s_read_back_of_its_own_output_skips_the_opcode_scan(tmp_path, monkeypatch):
    """The memo-index scan guards every load of a file hpckpt did not just write; a write's
    read-back of its own staged metadata skips it (it costs a save's commit 0.05-0.1 s), and the
    skip ends with the read-back, also when the read-back fails."""
    from hpckpt import api
    from hpckpt.converters import open_index
    from hpckpt.core.geometry.layout import LayoutSpec
    from hpckpt.core.safety import pickle_scan
    from hpckpt.core.safety.unpickle import reading_own_output

    beyond_scan = b"\x80\x02Nr" + (2**21).to_bytes(4, "little") + b"."  # refused by the scan; a 64 MiB memo
    with reading_own_output():
        assert loads(beyond_scan, what="x") is None
    with pytest.raises(UnsafePickleError, match="memo index"):
        loads(beyond_scan, what="x")
    with pytest.raises(ZeroDivisionError), reading_own_output():
        raise ZeroDivisionError
    with pytest.raises(UnsafePickleError, match="memo index"):
        loads(beyond_scan, what="x")

    scanned = []
    real = pickle_scan._scan_opcodes
    monkeypatch.setattr(pickle_scan, "_scan_opcodes", lambda data, *a: (scanned.append(bytes(data)), real(data, *a)))
    source = Path(__file__).resolve().parents[1] / "examples" / "tiny-hp"
    api.reshard(source, tmp_path / "out", LayoutSpec.for_world_size(3))
    written = (tmp_path / "out" / ".metadata").read_bytes()
    assert (source / ".metadata").read_bytes() in scanned and written not in scanned  # the source's, not the output's
    open_index(tmp_path / "out")
    assert written in scanned  # a later reader's is scanned


def test_what_pickle_itself_writes_still_loads():
    plain = {"a": [1, 2.5, "x", b"y", None, True], "t": (1, (2, 3)), "s": {1, 2}, "f": frozenset({3}),
             "r": range(10), "c": complex(1, 2), "o": OrderedDict(k=1), "ba": bytearray(b"z"),
             "sl": slice(1, 5, 2), "nested": [[[[1]]]] * 3}
    for protocol in range(0, pickle.HIGHEST_PROTOCOL + 1):
        assert loads(pickle.dumps(plain, protocol=protocol), what="plain") == plain
    arrays = {"f32": np.arange(6, dtype=np.float32).reshape(2, 3), "i8": np.int64(7), "b": np.bool_(True),
              "rec": np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")]), "dt": np.dtype("float16")}
    for protocol in (2, 4):
        back = loads(pickle.dumps(arrays, protocol=protocol), what="numpy")
        assert back["f32"].tolist() == arrays["f32"].tolist() and back["i8"] == 7 and back["dt"] == np.float16
        assert back["rec"].dtype == arrays["rec"].dtype
    assert loads(pickle.dumps("é".encode("latin1"), protocol=2), what="codecs") == "é".encode("latin1")


def test_object_dtype_arrays_are_refused():
    with pytest.raises(UnsafePickleError, match="object dtype"):
        loads(pickle.dumps(np.array([[1], [2, 3]], dtype=object), protocol=4), what="x")


def test_the_environment_raises_a_budget(monkeypatch):
    deep = deep_lists(150)
    with pytest.raises(UnsafePickleError):
        loads(deep, what="x")
    monkeypatch.setenv(pickle_budget.ENV, "depth=200, objects=2M, alloc=4G, range=1K")
    assert pickle_budget.current_budget() == PickleBudget(depth=200, objects=2 << 20, alloc=4 << 30, range=1024)
    loads(deep, what="x")
    with pytest.raises(UnsafePickleError, match="range=1,024"):
        loads(PROTO + reduce("builtins", "range", _long(2000)) + b".", what="x")


@pytest.mark.parametrize("text", ["depth", "depth=", "depth=-1", "depth=201", "depht=10", "alloc=1X", "objects=0"])
def test_a_wrong_setting_is_a_usage_error(text):
    with pytest.raises(errors.BudgetSettingError) as info:
        parse_budget(text)
    assert info.value.exit_code == 2 and pickle_budget.ENV in info.value.message


def test_the_walker_counts_shared_objects_each_time_and_does_not_recurse():
    budget = PickleBudget(depth=10_000, objects=1000, objects_per_byte=0)
    shared = [0] * 10
    check_value([shared] * 90, 0, budget)  # 1 + 90 + 900 objects
    with pytest.raises(UnsafePickleError, match="objects"):
        check_value([shared] * 100, 0, budget)
    deep: Any = []
    for _ in range(5000):
        deep = [deep]
    check_value(deep, 0, PickleBudget(depth=10_000))  # 5,000 levels: a recursive walk would overflow the stack


def test_the_c_unpickler_builds_and_frees_100000_nested_lists():
    """The C unpickler itself does not recurse: as metadata (not walked) the nesting loads, and
    freeing it and a full collection do not crash (freeing uses the trashcan)."""
    for data in (deep_lists(100_000), PROTO + b"(" * 100_000 + b"l" * 100_000 + b"."):
        value = loads(data, what="deep", kind=METADATA)
        assert isinstance(value, list)
        del value
        gc.collect()


def test_a_deep_tuple_used_as_a_key_is_hashed_on_a_big_stack():
    """A 400,000-deep tuple hashed on the main thread's 8 MiB stack is a crash; as metadata
    (not walked) it loads, as a value it is refused by the depth budget."""
    data = VALUE_PICKLES["deep-tuple-key"]
    assert len(loads(data, what="key", kind=METADATA)) == 1
    with pytest.raises(UnsafePickleError, match="depth="):
        loads(data, what="key")


# --------------------------------------------------------------------------------------------
# Hostile checkpoints on disk


W = np.arange(16, dtype=np.float32).reshape(4, 4)
STEP = pickle.dumps(7, protocol=4)


def hp_checkpoint(root: Path, value: bytes | None = None) -> Path:
    """A sound 2-rank HyperParallel checkpoint (w [4, 4] split by rows), its value `step`."""
    return write_hp(root, {"w": ("torch.float32", (4, 4), [("_rank0_.safetensors", "w", (0, 0), W[:2]),
                                                            ("_rank1_.safetensors", "w", (2, 0), W[2:])])},
                    {"step": ("_rank0_.bytes", value if value is not None else STEP)})


def hp_metadata(**changes: Any) -> Metadata:
    """The metadata `hp_checkpoint` writes, with fields replaced."""
    chunks = [ChunkStorageMetadata((0, 0), (2, 4)), ChunkStorageMetadata((2, 0), (2, 4))]
    tensor = TensorStorageMetadata(TensorProperties("torch.float32"), changes.pop("size", (4, 4)),
                                   changes.pop("chunks", chunks))
    storage = changes.pop("storage", {
        MetadataIndex("w", (0, 0), 0): StorageInfo("_rank0_.safetensors", 0, -1, "w"),
        MetadataIndex("w", (2, 0), 1): StorageInfo("_rank1_.safetensors", 0, -1, "w"),
        MetadataIndex("step"): StorageInfo("_rank0_.bytes", 0, len(STEP)),
    })
    fields = {"state_dict_metadata": {"w": tensor, "step": BytesStorageMetadata()}, "planner_data": None,
              "storage_data": storage, **changes}
    return Metadata(**fields)


def without(obj: Any, name: str) -> Any:
    """`obj` with field `name` gone from its state (what a damaged pickle restores)."""
    object.__delattr__(obj, name)
    return obj


def spliced(data: bytes, placeholder: str, opcodes: bytes) -> bytes:
    """A protocol-2 pickle with the string `placeholder` replaced by other opcodes (no frames to fix)."""
    marker = _str(placeholder)
    assert data.count(marker) == 1
    return data.replace(marker, opcodes)


def hp_protocol2(metadata: Metadata) -> bytes:
    import hp_reference

    with hp_reference.hp_modules():
        return pickle.dumps(metadata, protocol=2)


def deep_list_opcodes(n: int) -> bytes:
    return b"]" * n + b"a" * (n - 1)


def hp_metadata_cases() -> dict[str, bytes]:
    bomb_chunk = ChunkStorageMetadata((0, 0), (4, 4))
    bombed = TensorStorageMetadata(TensorProperties("torch.float32"), (4, 4), [bomb_chunk] * 100_000)
    bomb = Metadata({f"t{i}": bombed for i in range(2000)}, None, {})
    duplicated = {MetadataIndex("w", (0, 0), 0): StorageInfo("_rank0_.safetensors", 0, -1, "w"),
                  MetadataIndex("w", (0, 0), 1): StorageInfo("_rank1_.safetensors", 0, -1, "w"),
                  MetadataIndex("step"): StorageInfo("_rank0_.bytes", 0, len(STEP))}
    return {
        "state-dict-none": dump_hp(hp_metadata(state_dict_metadata=None)),
        "offsets-none": dump_hp(hp_metadata(chunks=[ChunkStorageMetadata(None, (2, 4)),
                                                    ChunkStorageMetadata((2, 0), (2, 4))])),
        "sizes-abc": dump_hp(hp_metadata(chunks=[ChunkStorageMetadata((0, 0), "abc"),
                                                 ChunkStorageMetadata((2, 0), (2, 4))])),
        "chunk-without-sizes": dump_hp(hp_metadata(chunks=[without(ChunkStorageMetadata((0, 0), (2, 4)), "sizes"),
                                                           ChunkStorageMetadata((2, 0), (2, 4))])),
        "chunk-not-a-chunk": dump_hp(hp_metadata(chunks=[None, ChunkStorageMetadata((2, 0), (2, 4))])),
        "storage-not-info": dump_hp(hp_metadata(storage={MetadataIndex("w", (0, 0), 0): "_rank0_.safetensors"})),
        "info-without-path": dump_hp(hp_metadata(storage={
            **hp_metadata().storage_data,
            MetadataIndex("w", (0, 0), 0): without(StorageInfo("_rank0_.safetensors", 0, -1, "w"), "relative_path")})),
        "size-negative": dump_hp(hp_metadata(size=(-4, 4))),
        "size-not-int": dump_hp(hp_metadata(size=("4", 4))),
        "size-none": dump_hp(hp_metadata(size=None)),
        "size-overflows-int64": dump_hp(hp_metadata(size=(1 << 40, 1 << 40))),
        "size-bytes-overflow": dump_hp(hp_metadata(size=(1 << 62,))),
        "duplicate-storage-keys": dump_hp(hp_metadata(chunks=[ChunkStorageMetadata((0, 0), (2, 4)),
                                                              ChunkStorageMetadata((0, 0), (4, 4))],
                                                      storage=duplicated)),
        "chunk-list-bomb": dump_hp(bomb),
        "version-deep": spliced(hp_protocol2(hp_metadata(version="PLACEHOLDER")), "PLACEHOLDER",
                                deep_list_opcodes(100_000)),
        "fqn-deep-tuple": spliced(hp_protocol2(hp_metadata(state_dict_metadata={"PLACEHOLDER": BytesStorageMetadata()})),
                                  "PLACEHOLDER", deep_tuple(DEEP)),
        "path-deep-tuple": spliced(hp_protocol2(hp_metadata(storage={
            **hp_metadata().storage_data, MetadataIndex("w", (0, 0), 0): StorageInfo("PLACEHOLDER", 0, -1, "w")})),
            "PLACEHOLDER", deep_tuple(DEEP)),
        "numpy-bomb-in-metadata": spliced(hp_protocol2(hp_metadata(planner_data="PLACEHOLDER")), "PLACEHOLDER",
                                          VALUE_PICKLES["numpy-ndarray"][2:-1]),
    }


# PyTorch DCP stand-ins, pickled under torch's module paths (torch is not needed to write them).
DCP = "torch.distributed.checkpoint.metadata"


@dataclass
class DcpChunk:
    offsets: Any
    sizes: Any


@dataclass
class DcpTensor:
    properties: Any
    size: Any
    chunks: list = field(default_factory=list)


@dataclass
class DcpProperties:
    dtype: Any = None


@dataclass(frozen=True)
class DcpIndex:
    fqn: Any
    offset: Any = None
    index: Any = None


@dataclass
class DcpInfo:
    relative_path: Any
    offset: int
    length: int


@dataclass
class DcpMetadata:
    state_dict_metadata: Any
    planner_data: Any = None
    storage_data: Any = None
    version: Any = "1.0.0"


_DCP_NAMES = {DcpChunk: (DCP, "ChunkStorageMetadata"), DcpTensor: (DCP, "TensorStorageMetadata"),
              DcpProperties: (DCP, "TensorProperties"), DcpIndex: (DCP, "MetadataIndex"),
              DcpMetadata: (DCP, "Metadata"), DcpInfo: ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}


class TorchGlobal:
    """Pickles as the global `torch.<name>` (a torch dtype), through the throw-away torch module."""

    def __init__(self, name: str):
        self.name, self.__module__ = name, "torch"

    def __reduce__(self) -> str:
        return self.name


FLOAT32 = TorchGlobal("float32")


def dump_dcp(metadata: DcpMetadata) -> bytes:
    """The stand-ins pickled (protocol 2: no frames, so opcodes can be spliced in) as torch's
    classes, through throw-away modules that replace any real ones during the dump."""
    names = {"torch", "torch.distributed", "torch.distributed.checkpoint", *(m for m, _ in _DCP_NAMES.values())}
    saved = {name: sys.modules.get(name) for name in names}
    originals = {cls: (cls.__module__, cls.__qualname__) for cls in _DCP_NAMES}
    try:
        for name in names:
            sys.modules[name] = types.ModuleType(name)
        sys.modules["torch"].float32 = FLOAT32
        for cls, (module, name) in _DCP_NAMES.items():
            setattr(sys.modules[module], name, cls)
            cls.__module__, cls.__qualname__ = module, name
        return pickle.dumps(metadata, protocol=2)
    finally:
        for cls, (module, name) in originals.items():
            cls.__module__, cls.__qualname__ = module, name
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def dcp_metadata(**changes: Any) -> DcpMetadata:
    chunks = changes.pop("chunks", [DcpChunk((0, 0), (4, 4))])
    tensor = DcpTensor(DcpProperties(FLOAT32), changes.pop("size", (4, 4)), chunks)
    storage = changes.pop("storage", {DcpIndex("w", (0, 0), 0): DcpInfo("__0_0.distcp", 0, 64)})
    return DcpMetadata(**{"state_dict_metadata": {"w": tensor}, "storage_data": storage, **changes})


def dcp_cases() -> dict[str, bytes]:
    return {
        "state-dict-none": dump_dcp(DcpMetadata(None, None, {})),
        "offsets-none": dump_dcp(dcp_metadata(chunks=[DcpChunk(None, (4, 4))])),
        "size-abc": dump_dcp(dcp_metadata(size="abc")),
        "storage-not-info": dump_dcp(dcp_metadata(storage={DcpIndex("w", (0, 0), 0): 5})),
        "fqn-deep-tuple": spliced(dump_dcp(DcpMetadata({"PLACEHOLDER": DcpTensor(None, ())}, None, {})),
                                  "PLACEHOLDER", deep_tuple(DEEP)),
        "offset-deep-tuple": spliced(dump_dcp(dcp_metadata(storage={
            DcpIndex("w", ("PLACEHOLDER",), 0): DcpInfo("__0_0.distcp", 0, 64)})), "PLACEHOLDER", deep_tuple(DEEP)),
    }


def torch_save_file(path: Path, data_pkl: bytes, storages: dict[str, bytes] | None = None) -> Path:
    """A torch.save zip (stored members, `archive/` prefix) around a hand-made data.pkl."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", data_pkl)
        zf.writestr("archive/byteorder", "little")
        for key, raw in (storages or {}).items():
            zf.writestr(f"archive/data/{key}", raw)
        zf.writestr("archive/version", "3\n")
    return path


def tensor_pickle(size: bytes, stride: bytes = b"K\x01\x85") -> bytes:
    """`{"w": _rebuild_tensor_v2(<float storage '0' of 4 elements>, 0, size, stride, False, OrderedDict())}`."""
    pid = b"(" + _str("storage") + _global("torch", "FloatStorage") + _str("0") + _str("cpu") + b"K\x04tQ"
    rebuild = reduce("torch._utils", "_rebuild_tensor_v2", pid, b"K\x00", size, stride, b"\x89",
                     reduce("collections", "OrderedDict"))
    return b"\x80\x02}" + _str("w") + rebuild + b"s."


TORCH_SAVE_CASES = {  # name -> (data.pkl, exit code)
    "sizes-abc": (tensor_pickle(_str("abc")), CorruptMetadataError.exit_code),
    "sizes-none": (tensor_pickle(b"N"), CorruptMetadataError.exit_code),
    "sizes-negative": (tensor_pickle(b"J\xfc\xff\xff\xff\x85"), CorruptMetadataError.exit_code),
    "deep-lists": (b"\x80\x02}" + _str("v") + deep_lists(100_000)[2:-1] + b"s.", UnsafePickleError.exit_code),
    "shared-bomb": (b"\x80\x02}" + _str("v") + shared_bomb(protocol=2)[2:-1] + b"s.",
                    UnsafePickleError.exit_code),
    "range-bomb": (b"\x80\x02}" + _str("v") + reduce("builtins", "range", _long(10**12)) + b"s.",
                   UnsafePickleError.exit_code),
}


# Found where chunks become boxes to read or verify, not by inspect's layout pass over the chunk
# arrays (a check there would cost planning 6%: `core.codecs.hyperparallel_metadata.check_shared_starts`).
CHECKED_WHEN_READ = ("duplicate-storage-keys",)
RANK_LOCAL_TOO = ("state-dict-none", "offsets-none")  # also as a rank-local `__0.metadata`


def build_cli_cases(tmp: Path) -> list[dict]:
    """Every hostile checkpoint, with the exit codes inspect, verify and reshard must give."""
    cases = [{"name": "control", "path": str(hp_checkpoint(tmp / "control")), "codes": [0, 0, 0]}]
    for name, data in VALUE_PICKLES.items():  # a value: inspect lists it (its error shown), verify/reshard refuse
        path = hp_checkpoint(tmp / f"value-{name}", data)
        cases.append({"name": f"value-{name}", "path": str(path), "codes": [0, 7, 7]})
    for name, data in hp_metadata_cases().items():
        path = hp_checkpoint(tmp / f"hp-{name}")
        (path / ".metadata").write_bytes(data)
        code = UnsafePickleError.exit_code if name.startswith("numpy") else CorruptMetadataError.exit_code
        codes = [0, code, code] if name in CHECKED_WHEN_READ else [code] * 3
        cases.append({"name": f"hp-{name}", "path": str(path), "codes": codes})
    for name, data in dcp_cases().items():
        for file in (".metadata", "__0.metadata") if name in RANK_LOCAL_TOO else (".metadata",):
            path = tmp / f"dcp-{name}{file.replace('.', '-')}"
            path.mkdir()
            (path / "__0_0.distcp").write_bytes(b"\0" * 64)
            (path / file).write_bytes(data)
            cases.append({"name": f"dcp-{name}{file}", "path": str(path), "codes": [6] * 3})
    for name, (data, code) in TORCH_SAVE_CASES.items():
        path = torch_save_file(tmp / f"torch-{name}.pt", data, {"0": b"\0" * 16})
        cases.append({"name": f"torch-save-{name}", "path": str(path), "codes": [code] * 3})
    return cases


DRIVER = r"""
import contextlib, io, json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))
from hpckpt.cli.app import run
cases_file, results_file = sys.argv[1:3]
cases, out = json.load(open(cases_file)), []
for case in cases:
    for argv in (["inspect", case["path"]], ["verify", case["path"]],
                 ["reshard", case["path"], "-o", case["path"] + ".out", "--world-size", "2"]):
        stdout, stderr = io.StringIO(), io.StringIO()
        sys.argv = ["hpckpt", *argv]
        start = time.perf_counter()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = run()
        seconds = time.perf_counter() - start
        out.append({"name": case["name"], "command": argv[0], "code": code, "stderr": stderr.getvalue(),
                    "stdout": stdout.getvalue()[-2000:], "seconds": seconds})
json.dump(out, open(results_file, "w"))
"""


def snapshot(path: Path) -> dict[str, bytes]:
    if path.is_file():
        return {path.name: path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory) -> tuple[list[dict], dict[str, dict], dict]:
    tmp = tmp_path_factory.mktemp("hostile")
    cases = build_cli_cases(tmp)
    before = {c["name"]: snapshot(Path(c["path"])) for c in cases}
    (tmp / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "COLUMNS": "200", "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop(pickle_budget.ENV, None)
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(tmp / "cases.json"), str(tmp / "results.json")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {(r["name"], r["command"]): r for r in json.loads((tmp / "results.json").read_text())}
    return cases, results, before


def test_every_hostile_checkpoint_gives_its_documented_exit_code(cli_results):
    cases, results, before = cli_results
    wrong = []
    for case in cases:
        for command, code in zip(("inspect", "verify", "reshard"), case["codes"]):
            result = results[(case["name"], command)]
            if result["code"] != code:
                wrong.append(f"{case['name']} {command}: exit {result['code']}, expected {code}: {result['stderr']}")
    assert not wrong, "\n".join(wrong)


def test_each_failure_is_one_error_line(cli_results):
    cases, results, _ = cli_results
    for result in results.values():
        stderr = result["stderr"]
        assert "Traceback" not in stderr and "internal error" not in stderr, (result["name"], stderr)
        if result["code"] in (6, 7):
            lines = stderr.splitlines()
            assert lines[0].startswith("error: "), (result["name"], stderr)
            assert len(lines) == 1 or (len(lines) == 2 and lines[1].startswith("hint: ")), (result["name"], stderr)


def test_no_destination_is_left_and_no_source_changes(cli_results):
    cases, results, before = cli_results
    for case in cases:
        path = Path(case["path"])
        assert snapshot(path) == before[case["name"]], case["name"]
        out = Path(case["path"] + ".out")
        if case["codes"][2]:
            assert not out.exists() and not list(out.parent.glob(out.name + "*")), case["name"]


def test_errors_name_the_problem(cli_results):
    _, results, _ = cli_results
    expected = {
        ("value-range-bomb", "verify"): "range=", ("value-shared-bomb", "verify"): "objects=",
        ("value-deep-tuple-key", "verify"): "depth=", ("value-numpy-ndarray", "reshard"): "alloc=",
        ("value-codec-unknown", "verify"): "no-such-codec", ("value-memo-index", "reshard"): "memo index",
        ("hp-state-dict-none", "inspect"): "state_dict_metadata", ("hp-size-negative", "inspect"): "size",
        ("hp-storage-not-info", "inspect"): "storage_data", ("hp-info-without-path", "inspect"): "relative_path",
        ("hp-chunk-without-sizes", "reshard"): "'sizes'", ("hp-offsets-none", "verify"): "offsets",
        ("hp-sizes-abc", "verify"): "sizes", ("hp-duplicate-storage-keys", "verify"): "share one storage_data",
        ("hp-chunk-list-bomb", "inspect"): "expansion bomb", ("hp-version-deep", "inspect"): "version",
        ("hp-size-overflows-int64", "inspect"): "int64", ("dcp-storage-not-info.metadata", "inspect"): "storage_data",
        ("torch-save-sizes-abc", "inspect"): "size", ("hp-path-deep-tuple", "inspect"): "relative_path",
        ("hp-fqn-deep-tuple", "verify"): "not a str", ("dcp-offset-deep-tuple.metadata", "reshard"): "offset",
    }
    for key, needle in expected.items():
        said = results[key]["stderr"] + results[key]["stdout"]  # verify lists its findings on stdout
        assert needle in said, (key, said)


def test_a_memo_index_bomb_too_large_to_scan_is_bounded_by_the_command(tmp_path):
    """A 1.1 MiB metadata pickle (above the scanned size) naming memo index 4*10^8 would make the
    C unpickler allocate a 6.4 GB memo; the `hpckpt` process bounds the load's address space, so
    it is refused (exit 7) in well under a second and 200 MB."""
    import subprocess
    import sys

    from hpckpt.core.safety.pickle_scan import SCAN_BYTES

    root = hp_checkpoint(tmp_path / "memo")
    module, pad = b"hyper_parallel.core.distributed_checkpoint.metadata", b"x" * (SCAN_BYTES + (100 << 10))
    data = (PROTO + b"\x8c" + bytes([len(module)]) + module + b"\x8c\x08Metadata\x930" + b"X"
            + len(pad).to_bytes(4, "little") + pad + b"0}r" + (4 * 10**8).to_bytes(4, "little") + b".")
    (root / ".metadata").write_bytes(data)
    # the peak is read inside the child (VmHWM): a child's ru_maxrss keeps its forked parent's peak
    script = ("import re, sys\nfrom hpckpt.cli.app import run\nsys.argv = ['hpckpt', 'inspect', sys.argv[1]]\n"
              "code = run()\npeak = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)\n"
              "print('peak', peak, file=sys.stderr)\nsys.exit(code)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(root)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 7 and "memory" in proc.stderr, proc.stderr
    peak_kib = int(proc.stderr.split("peak ")[1].split()[0])
    assert peak_kib < 200 << 10, f"{peak_kib} KiB"
