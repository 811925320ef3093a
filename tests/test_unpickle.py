"""The restricted unpickler (`hpckpt.core.safety.unpickle`) and the metadata writer (`dumps_metadata`).

Reading: every real HyperParallel `.metadata` loads, agrees with an independent reader, maps the
current and legacy HyperParallel classes to `hpckpt.core.codecs.hyperparallel_metadata`, maps `torch.Size`/torch dtypes
without importing torch, and refuses any other callable before anything runs (each refusal is
checked against a marker file the payload would create, and the same payload is shown to run
under the stock unpickler). Writing: `dumps_metadata` output is protocol 4, names only
HyperParallel's modules, and loads with every field set into independent stand-ins of
HyperParallel's classes (field lists copied from the format spec, section 3.2).
"""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import pickletools
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _util import FIXTURE_NAMES, FIXTURES
from hp_reference import (
    HP_CLASSES,
    HP_META,
    HP_STORAGE,
    LEGACY_META,
    LEGACY_STORAGE,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
    hp_modules,
)

from hpckpt.core import dtypes
from hpckpt.core.codecs import hyperparallel_metadata as hm
from hpckpt.core.errors import CorruptMetadataError, UnsafePickleError
from hpckpt.core.safety.allow_list import safe_global
from hpckpt.core.safety.pickle_scan import pickle_globals
from hpckpt.core.safety.unpickle import loads

# --------------------------------------------------------------------------------------------
# A plain reader into the independent stand-ins of HyperParallel's classes (from `hp_reference`).

STAND_INS = {module: {c.__name__: c for c in classes} for module, classes in HP_CLASSES.items()}
STAND_INS[LEGACY_META] = STAND_INS[HP_META]
STAND_INS[LEGACY_STORAGE] = STAND_INS[HP_STORAGE]


class StandInUnpickler(pickle.Unpickler):
    """What a HyperParallel-compatible reader does (spec 3.7): HP names -> own classes, Size -> tuple."""

    def find_class(self, module, name):
        if module in STAND_INS and name in STAND_INS[module]:
            return STAND_INS[module][name]
        if (module, name) == ("torch", "Size"):
            return tuple
        raise pickle.UnpicklingError(f"stand-in reader refuses {module}.{name}")


def stand_in_load(data: bytes) -> Any:
    return StandInUnpickler(io.BytesIO(data)).load()


def metadata_files() -> list[Path]:
    files = []
    for name in FIXTURE_NAMES:
        root = FIXTURES / name
        if not root.is_dir():
            continue  # the autouse check in conftest fails the tests and names what is missing
        files += sorted(p for p in root.iterdir() if p.name == ".metadata" or p.name.endswith(".metadata")
                        or (p.name.startswith(".rank") and p.name.endswith("_metadata")))
    return files


METADATA_FILES = metadata_files()


def file_id(path: Path) -> str:
    return f"{path.parent.name}/{path.name}"


def summary(md: Any) -> dict:
    """Everything a reader uses from a Metadata, as plain data (works for ours and the stand-ins)."""
    tensors, values = {}, []
    for fqn, item in md.state_dict_metadata.items():
        if type(item).__name__ == "TensorStorageMetadata":
            tensors[fqn] = (item.properties.dtype, tuple(item.size),
                            [(tuple(c.offsets), tuple(c.sizes)) for c in item.chunks])
        else:
            assert type(item).__name__ == "BytesStorageMetadata", type(item)
            values.append(fqn)
    storage = sorted(
        ((k.fqn, tuple(k.offset), k.index), (v.relative_path, v.offset, v.length, getattr(v, "tensor_key", None)))
        for k, v in md.storage_data.items()
    )
    return {"tensors": tensors, "values": sorted(values), "storage": storage, "planner_data": md.planner_data,
            "version": md.__dict__.get("version", "1.0")}


# --------------------------------------------------------------------------------------------
# Reading real metadata


def test_fixture_metadata_files_are_all_found():
    assert len(METADATA_FILES) == 13  # 4 x .metadata, 0-3.metadata, 0.metadata, .rank0-3_metadata
    assert {p.parent.name for p in METADATA_FILES} == set(FIXTURE_NAMES)


@pytest.mark.parametrize("path", METADATA_FILES, ids=file_id)
def test_every_fixture_metadata_loads_and_agrees_with_an_independent_reader(path):
    data = path.read_bytes()
    md = loads(data, what=str(path))
    assert type(md) is hm.Metadata
    assert isinstance(md.state_dict_metadata, dict) and md.state_dict_metadata
    assert isinstance(md.storage_data, dict) and md.storage_data
    assert summary(md) == summary(stand_in_load(data))
    for item in md.state_dict_metadata.values():
        if isinstance(item, hm.TensorStorageMetadata):
            assert type(item.size) is tuple  # torch.Size became a plain tuple
            assert all(type(c) is hm.ChunkStorageMetadata for c in item.chunks)
            assert type(item.properties) is hm.TensorProperties and isinstance(item.properties.dtype, str)
        else:
            assert type(item) is hm.BytesStorageMetadata
    for key, info in md.storage_data.items():
        assert (type(key), type(info)) == (hm.MetadataIndex, hm.StorageInfo)


@pytest.mark.parametrize("module", [HP_META, LEGACY_META])
@pytest.mark.parametrize("name", ["Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
                                  "BytesStorageMetadata", "MetadataIndex"])
def test_current_and_legacy_metadata_class_paths_map_to_ours(module, name):
    assert safe_global(module, name) is getattr(hm, name)


@pytest.mark.parametrize("module", [HP_STORAGE, LEGACY_STORAGE])
def test_current_and_legacy_storage_info_map_to_ours(module):
    assert safe_global(module, "StorageInfo") is hm.StorageInfo


@pytest.mark.parametrize(("name", "module"), [("legacy-torch-4rank", LEGACY_META), ("m0-torch-4rank", HP_META)])
def test_fixture_pickles_use_the_expected_module_paths(name, module):
    data = (FIXTURES / name / ".metadata").read_bytes()
    found = pickle_globals(data)
    assert (module, "Metadata") in found
    other = LEGACY_META if module == HP_META else HP_META
    assert not any(m == other for m, _ in found)
    assert ("torch", "Size") in found  # torch-written: shapes are torch.Size
    md = loads(data, what=name)
    assert type(md) is hm.Metadata


def test_legacy_storage_info_without_tensor_key_reads_as_none():
    md = loads((FIXTURES / "legacy-torch-4rank" / ".metadata").read_bytes(), what="legacy")
    infos = list(md.storage_data.values())
    assert all("tensor_key" not in vars(info) for info in infos)  # the legacy class had no such field
    assert all(info.tensor_key is None for info in infos)


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32", "float64", "int8", "int64", "bool", "uint8",
                                  "float8_e4m3fn", "float8_e5m2", "complex64"])
def test_torch_dtype_globals_map_to_our_dtypes(name):
    assert safe_global("torch", name) is dtypes.dtype(name)
    size = safe_global("torch", "Size")((2, 3))  # a tuple, its allocation charged first (core.pickle_budget)
    assert type(size) is tuple and size == (2, 3)


TORCH_WRITER = """
import pickle, sys, torch
obj = {
    "size": torch.Size([2, 3]),
    "empty": torch.Size([]),
    "bf16": torch.bfloat16,
    "dtypes": [torch.float32, torch.float16, torch.int64, torch.bool, torch.uint8, torch.float8_e4m3fn],
}
sys.stdout.buffer.write(pickle.dumps(obj, protocol=4))
"""

TORCH_FREE_LOADER = """
import json, sys
from hpckpt.core.safety.unpickle import loads
from hpckpt.core import dtypes
obj = loads(open(sys.argv[1], "rb").read(), what="torch-written")
fixture = loads(open(sys.argv[2], "rb").read(), what="fixture")
sizes = {type(t.size).__name__ for t in fixture.state_dict_metadata.values() if hasattr(t, "size")}
print(json.dumps({
    "size": [type(obj["size"]).__name__, list(obj["size"])],
    "empty": [type(obj["empty"]).__name__, list(obj["empty"])],
    "bf16": [type(obj["bf16"]).__name__, obj["bf16"].name, obj["bf16"] is dtypes.dtype("bfloat16")],
    "dtypes": [[type(d).__name__, d.name] for d in obj["dtypes"]],
    "fixture_sizes": sorted(sizes),
    "torch_modules": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
}))
"""


def test_torch_size_and_dtypes_load_without_importing_torch(tmp_path):
    written = subprocess.run([sys.executable, "-c", TORCH_WRITER], capture_output=True, timeout=300)
    assert written.returncode == 0, written.stderr.decode()
    (tmp_path / "torch.pkl").write_bytes(written.stdout)
    assert ("torch", "bfloat16") in pickle_globals(written.stdout) and ("torch", "Size") in pickle_globals(written.stdout)
    fixture = FIXTURES / "m0-torch-4rank" / ".metadata"
    result = subprocess.run([sys.executable, "-c", TORCH_FREE_LOADER, str(tmp_path / "torch.pkl"), str(fixture)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    assert got == {
        "size": ["tuple", [2, 3]],
        "empty": ["tuple", []],
        "bf16": ["DType", "bfloat16", True],
        "dtypes": [["DType", n] for n in ("float32", "float16", "int64", "bool", "uint8", "float8_e4m3fn")],
        "fixture_sizes": ["tuple"],
        "torch_modules": [],
    }


# --------------------------------------------------------------------------------------------
# Forbidden globals: refused by name, nothing runs


def _str(s: str) -> bytes:
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw  # BINUNICODE


def _global(module: str, name: str, stack: bool) -> bytes:
    if stack:  # protocol 4 STACK_GLOBAL
        return _str(module) + _str(name) + b"\x93"
    return b"c" + f"{module}\n{name}\n".encode()  # GLOBAL


def _call(callable_ops: bytes, *args: bytes) -> bytes:
    return callable_ops + b"(" + b"".join(args) + b"tR"  # MARK args TUPLE REDUCE


def payload(target: str, marker: Path, stack: bool) -> bytes:
    """A pickle that, loaded by the stock unpickler, creates `marker` through `target`."""
    m = str(marker)
    g = lambda module, name: _global(module, name, stack)  # noqa: E731
    touch = f"open({m!r}, 'w').close()"
    if target in ("os.system", "posix.system"):
        module, name = target.split(".")
        body = _call(g(module, name), _str(f"touch '{m}'"))
    elif target in ("builtins.eval", "builtins.exec"):
        body = _call(g("builtins", target.split(".")[1]), _str(touch))
    elif target == "subprocess.Popen":
        body = _call(g("subprocess", "Popen"), b"](" + _str("touch") + _str(m) + b"e")  # Popen(["touch", m])
    elif target == "builtins.getattr":  # getattr(import_module("os"), "system")("touch m")
        os_module = _call(g("importlib", "import_module"), _str("os"))
        body = _call(_call(g("builtins", "getattr"), os_module, _str("system")), _str(f"touch '{m}'"))
    elif target == "importlib.import_module":  # os = import_module("os"); getattr(os, "system")(...)
        body = (_call(g("importlib", "import_module"), _str("os")) + b"q\x000"  # BINPUT 0, POP
                + _call(_call(g("builtins", "getattr"), b"h\x00", _str("system")), _str(f"touch '{m}'")))
    else:
        raise AssertionError(target)
    return b"\x80\x04" + body + b"." if stack else b"\x80\x02" + body + b"."


FORBIDDEN = ["os.system", "posix.system", "builtins.eval", "builtins.exec", "subprocess.Popen", "builtins.getattr",
             "importlib.import_module"]


@pytest.mark.parametrize("stack", [False, True], ids=["GLOBAL", "STACK_GLOBAL"])
@pytest.mark.parametrize("target", FORBIDDEN)
def test_forbidden_global_is_refused_by_name_and_nothing_runs(tmp_path, target, stack):
    # Control: the stock unpickler does run the payload.
    control = tmp_path / "control"
    result = pickle.loads(payload(target, control, stack))
    if hasattr(result, "wait"):
        result.wait()
    assert control.exists()

    marker = tmp_path / "marker"
    data = payload(target, marker, stack)
    with pytest.raises(UnsafePickleError) as info:
        loads(data, what="evil.pkl")
    assert f"'{target}'" in info.value.message
    assert info.value.message.startswith("evil.pkl: ")
    assert info.value.exit_code == 7
    assert not marker.exists()


def test_forbidden_global_inside_real_metadata_is_refused(tmp_path):
    marker = tmp_path / "marker"

    class Touch:
        def __reduce__(self):
            import os

            return (os.system, (f"touch '{marker}'",))

    original = stand_in_load((FIXTURES / "m0-mindspore-1rank" / ".metadata").read_bytes())
    original.planner_data["model.embed.weight"] = Touch()
    with hp_modules():
        data = pickle.dumps(original, protocol=4)
    assert (HP_META, "Metadata") in pickle_globals(data)
    with pytest.raises(UnsafePickleError, match=r"posix\.system"):
        loads(data, what=".metadata")
    assert not marker.exists()
    with hp_modules():  # control
        pickle.loads(data)
    assert marker.exists()


@pytest.mark.parametrize(("module", "name"), [
    ("builtins", "open"), ("builtins", "__import__"), ("builtins", "compile"), ("builtins", "setattr"),
    ("os", "remove"), ("shutil", "rmtree"), ("pickle", "loads"), ("numpy", "load"), ("torch", "load"),
    ("torch", "tensor"), ("torch._utils", "_rebuild_tensor_v2"), ("hpckpt.core.safety.unpickle", "loads"),
    ("hyper_parallel.core.distributed_checkpoint.metadata", "os"), ("copyreg", "_reconstructor"),
])
def test_other_callables_are_refused(module, name):
    with pytest.raises(UnsafePickleError, match=f"'{module}.{name}'"):
        loads(b"\x80\x02c" + f"{module}\n{name}\n".encode() + b")R.", what="x")


def test_persistent_ids_are_refused():
    with pytest.raises(UnsafePickleError):
        loads(b"\x80\x02" + _str("storage") + b"Q.", what="x")  # BINPERSID


# --------------------------------------------------------------------------------------------
# Truncated and garbage input


def _frameless(path: Path) -> bytes:
    """The fixture's metadata re-pickled at protocol 2 (no frames), so every prefix stops mid-opcode."""
    with hp_modules():
        return pickle.dumps(stand_in_load(path.read_bytes()), protocol=2)


@pytest.mark.parametrize(("name", "stride"), [("m0-mindspore-1rank", 1), ("m0-torch-4rank", 7), ("legacy-torch-4rank", 5)])
def test_truncation_is_corrupt_metadata(name, stride):
    path = FIXTURES / name / ".metadata"
    for data in (path.read_bytes(), _frameless(path)):
        assert type(loads(data, what="whole")) is hm.Metadata
        wrong = []
        # Every `stride`-th prefix and the last 100, all cut before the final STOP.
        for end in sorted(set(range(0, len(data) - 1, stride)) | set(range(max(0, len(data) - 101), len(data) - 1))):
            try:
                loads(data[:end], what=f"{name}/.metadata")
            except CorruptMetadataError as exc:
                if not exc.message.startswith(f"{name}/.metadata: not a valid pickle"):
                    wrong.append((end, exc.message))
            except Exception as exc:  # noqa: BLE001 - any other outcome is the failure reported
                wrong.append((end, repr(exc)))
            else:
                wrong.append((end, "loaded"))
        assert wrong == []


@pytest.mark.parametrize("data", [b"", b"hello world\n", b"\x80\x04", b"\x80\x04\x95\xff\x00\x00\x00\x00\x00\x00\x00",
                                  json.dumps({"a": 1}).encode(), b"PK\x03\x04" + b"\x00" * 40])
def test_garbage_is_corrupt_metadata(data):
    with pytest.raises(CorruptMetadataError):
        loads(data, what="x")


# --------------------------------------------------------------------------------------------
# dumps_metadata: what HyperParallel will read


class Size(tuple):
    """Like torch.Size: a tuple subclass that must not leak a reference to its module."""


def sample_metadata(plain: bool = False) -> hm.Metadata:
    """Every class and field; shapes given as lists and tuple subclasses unless `plain`."""
    chunk = hm.ChunkStorageMetadata
    if plain:
        Size = tuple  # noqa: N806
        list_ = tuple
    else:
        Size, list_ = globals()["Size"], list
    return hm.Metadata(
        state_dict_metadata={
            "model.w": hm.TensorStorageMetadata(hm.TensorProperties("torch.bfloat16"), Size((4, 6)),
                                                [chunk((0, 0), Size((2, 6))), chunk(list_([2, 0]), list_([2, 6]))]),
            "model.flag": hm.TensorStorageMetadata(hm.TensorProperties("Bool", True, "contiguous_format"), list_([3]),
                                                   [chunk((0,), (3,))]),
            "optimizer.state.0.step": hm.TensorStorageMetadata(hm.TensorProperties("torch.float32"), (), [chunk((), ())]),
            "extra_state.run_name": hm.BytesStorageMetadata(),
        },
        planner_data={"model.w": ("model", "w"), "model.flag": ("model", "flag"),
                      "optimizer.state.0.step": ("optimizer", "state", "0", "step"),
                      "extra_state.run_name": ("extra_state", "run_name")},
        storage_data={
            hm.MetadataIndex("model.w", (0, 0), 0): hm.StorageInfo("_rank0_.safetensors", 0, -1, "model.w"),
            hm.MetadataIndex("model.w", Size((2, 0)), 1): hm.StorageInfo("_rank1_.safetensors", 0, -1, "model.w"),
            hm.MetadataIndex("model.flag", (0,), 0): hm.StorageInfo("_rank0_.safetensors", 0, -1, "model.flag"),
            hm.MetadataIndex("optimizer.state.0.step", (), 0): hm.StorageInfo("_rank0_.safetensors", 0, -1,
                                                                              "optimizer.state.0.step"),
            hm.MetadataIndex("extra_state.run_name"): hm.StorageInfo("_rank0_.bytes", 0, 17),
        },
    )


def globals_of(data: bytes) -> set[tuple[str, str]]:
    """Every global a pickle names, by walking its opcodes (independent of hpckpt.pickle_globals)."""
    found, strings = set(), []
    memo: dict[int, Any] = {}
    last = None
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
            last = arg
        elif op.name == "MEMOIZE":
            memo[len(memo)] = last
        elif op.name in ("BINGET", "LONG_BINGET", "GET"):
            last = memo[int(arg)]
            strings.append(last)
        elif op.name == "GLOBAL":
            found.add(tuple(arg.split(" ", 1)))
        elif op.name == "STACK_GLOBAL":
            found.add((strings[-2], strings[-1]))
    return found


def test_dumps_metadata_round_trips_through_our_loads():
    md = sample_metadata()
    back = loads(hm.dumps_metadata(md), what="dumped")
    assert back == sample_metadata(plain=True)  # lists and tuple subclasses come back as tuples
    assert [k.index for k in back.storage_data] == [k.index for k in md.storage_data]  # index is not in eq
    plain = sample_metadata(plain=True)
    assert loads(hm.dumps_metadata(plain), what="dumped") == plain


def test_dumps_metadata_names_only_hyperparallel_modules():
    data = hm.dumps_metadata(sample_metadata())
    assert globals_of(data) == {
        (HP_META, "Metadata"), (HP_META, "TensorStorageMetadata"), (HP_META, "TensorProperties"),
        (HP_META, "ChunkStorageMetadata"), (HP_META, "BytesStorageMetadata"), (HP_META, "MetadataIndex"),
        (HP_STORAGE, "StorageInfo"),
    }
    assert b"hpckpt" not in data and b"torch." not in data.replace(b"torch.bfloat16", b"").replace(b"torch.float32", b"")
    assert not any("torch" in m or "hpckpt" in m or m == __name__ for m, _ in globals_of(data))


def test_dumps_metadata_is_protocol_4():
    data = hm.dumps_metadata(sample_metadata())
    assert data[:2] == b"\x80\x04"
    assert max(op.proto for op, _, _ in pickletools.genops(data)) <= 4


def test_dumps_metadata_loads_into_hyperparallel_stand_ins_with_every_field_set():
    original = sample_metadata()
    md = stand_in_load(hm.dumps_metadata(original))
    assert type(md) is Metadata

    def fully_set(obj):
        names = {f.name for f in dataclasses.fields(type(obj))}
        assert set(vars(obj)) == names, (type(obj).__name__, vars(obj))

    fully_set(md)
    assert md.version == "1.0" and md.planner_data == original.planner_data
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            fully_set(item)
            fully_set(item.properties)
            assert type(item.size) is tuple and all(type(s) is int for s in item.size)
            for c in item.chunks:
                fully_set(c)
                assert type(c.offsets) is tuple and type(c.sizes) is tuple
        else:
            assert type(item) is BytesStorageMetadata
    for key, info in md.storage_data.items():
        fully_set(key)
        fully_set(info)
        assert type(key.offset) is tuple
    assert summary(md) == summary(original)
    props = md.state_dict_metadata["model.flag"].properties
    assert (props.dtype, props.requires_grad, props.memory_format) == ("Bool", True, "contiguous_format")
    assert md.state_dict_metadata["model.w"].size == (4, 6)
    assert md.state_dict_metadata["model.w"].chunks[1] == ChunkStorageMetadata((2, 0), (2, 6))


@pytest.mark.parametrize("path", METADATA_FILES, ids=file_id)
def test_redumped_fixture_metadata_is_the_same(path):
    md = loads(path.read_bytes(), what=str(path))
    data = hm.dumps_metadata(md)
    again = loads(data, what="re-dumped")
    assert summary(again) == summary(md)
    assert again == md
    assert all(m in (HP_META, HP_STORAGE) for m, _ in globals_of(data))  # legacy paths come out current
    assert summary(stand_in_load(data)) == summary(md)
