"""A catalogue of hostile and damaged checkpoints, one small case per way of breaking a reader.

Each case writes one checkpoint (of any format) into an empty directory of its own and names the
exit codes every command may give for it (`codes`; `inspect_ok`: `inspect` reads metadata only,
so a case whose damage is in the data may also exit 0 there). `build_all(root)` writes every case
and a `manifest.json`; `tests/hostile_driver.py` runs the commands on them and
`tests/test_hostile_inputs.py` judges the results.

Everything is written by independent writers: the `safetensors` library, `hp_reference` (stock
pickle of stand-in classes), torch's own `torch.save` and `torch.distributed.checkpoint`, raw
protobuf and zip bytes from `struct` and `zipfile`, hand-assembled pickle opcodes. Nothing here
uses hpckpt's writers.

Run as a script to build the catalogue: `python tests/hostile_catalogue.py DIR`.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import struct
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from hp_reference import MetadataIndex, dump_hp, hp_modules, write_hp  # noqa: E402 (after the path)

SPARSE_BYTES = 8 << 30
FORGED_NAME = "w\n\x1b[31merror: forged\r"
DEEP = 100_000  # nesting levels of the deep JSON and pickle cases


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[Path], Path]  # writes into an empty directory, returns the path to give commands
    codes: frozenset[int]
    inspect_ok: bool = False


CASES: dict[str, Case] = {}


def case(name: str, codes: set[int] | frozenset[int], build: Callable[[Path], Path], inspect_ok: bool = False) -> None:
    assert name not in CASES, name
    CASES[name] = Case(name, build, frozenset(codes), inspect_ok)


# --- samples ------------------------------------------------------------------------------------


def st_sample(path: Path, tensors: dict | None = None, metadata: dict | None = None) -> Path:
    """A safetensors file written by the safetensors library."""
    from safetensors.numpy import save_file

    tensors = tensors or {"a": np.arange(12, dtype=np.float32).reshape(4, 3), "b": np.arange(5, dtype=np.int64),
                          "c": np.ones((2, 2), dtype=np.float16)}
    save_file(tensors, str(path), metadata=metadata)
    return path


def st_raw(path: Path, header: bytes | dict, data: bytes = b"", length: int | None = None) -> Path:
    """A safetensors file from raw parts: 8-byte length (default: the header's), header, data."""
    raw = json.dumps(header).encode() if isinstance(header, dict) else header
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def header_length(path: Path) -> int:
    return struct.unpack("<Q", path.read_bytes()[:8])[0]


def hp_sample(root: Path) -> Path:
    """A two-rank HyperParallel checkpoint: `w` split by rows, `b` whole, a value `step`."""
    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    return write_hp(root, {
        "w": ("torch.float32", (4, 3), [("_rank0_.safetensors", "w", (0, 0), w[:2]),
                                        ("_rank1_.safetensors", "w", (2, 0), w[2:])]),
        "b": ("torch.int64", (5,), [("_rank0_.safetensors", "b", (0,), np.arange(5, dtype=np.int64))]),
    }, values={"step": ("_rank0_.bytes", pickle.dumps(7, protocol=4))})


def hp_metadata(root: Path):
    with hp_modules():
        return pickle.loads((root / ".metadata").read_bytes())


def hp_with(mutate: Callable) -> Callable[[Path], Path]:
    """A builder: the HyperParallel sample with its Metadata changed by `mutate(metadata, root)`."""
    def build(d: Path) -> Path:
        root = hp_sample(d / "ckpt")
        metadata = hp_metadata(root)
        mutate(metadata, root)
        (root / ".metadata").write_bytes(dump_hp(metadata))
        return root
    return build


def hp_spliced(place: Callable, opcodes: bytes) -> Callable[[Path], Path]:
    """A builder: the sample's `.metadata` with raw pickle `opcodes` where `place(metadata)` put a
    placeholder string (the memo after it is kept, so later references still resolve)."""
    marker = "HOSTILE-PLACEHOLDER"

    def build(d: Path) -> Path:
        root = hp_sample(d / "ckpt")
        metadata = hp_metadata(root)
        place(metadata, marker)
        with hp_modules():  # protocol 2: no frames, whose lengths the splice would break
            raw = pickle.dumps(metadata, protocol=2)
        encoded = b"X" + struct.pack("<I", len(marker)) + marker.encode()
        assert raw.count(encoded) == 1
        (root / ".metadata").write_bytes(raw.replace(encoded, opcodes))
        return root
    return build


def hf_sample(root: Path, index: dict | bytes | None = None) -> Path:
    """Two shards written by safetensors and an index as transformers writes it."""
    root.mkdir(parents=True)
    st_sample(root / "model-00001-of-00002.safetensors", {"a": np.arange(6, dtype=np.float32)})
    st_sample(root / "model-00002-of-00002.safetensors", {"b": np.arange(4, dtype=np.int32)})
    if index is None:
        index = {"metadata": {"total_size": 40}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                                 "b": "model-00002-of-00002.safetensors"}}
    data = index if isinstance(index, bytes) else (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
    (root / "model.safetensors.index.json").write_bytes(data)
    return root


def torch_state():
    import torch

    return {"w": torch.arange(12, dtype=torch.float32).reshape(4, 3), "b": torch.arange(5), "cfg": {"lr": 0.5}}


def pt_sample(path: Path, state=None) -> Path:
    import torch

    torch.save(torch_state() if state is None else state, path)
    return path


def dcp_sample(root: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    state = torch_state()
    state["step"] = 3
    dcp.save(state, checkpoint_id=str(root), no_dist=True)
    return root


def dcp_with(mutate: Callable) -> Callable[[Path], Path]:
    """A builder: the PyTorch DCP sample with its Metadata (unpickled with torch) changed."""
    def build(d: Path) -> Path:
        root = dcp_sample(d / "dcp")
        metadata = pickle.loads((root / ".metadata").read_bytes())
        mutate(metadata, root)
        (root / ".metadata").write_bytes(pickle.dumps(metadata))
        return root
    return build


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def pb(number: int, payload: bytes | int) -> bytes:
    """One protobuf field: a varint (int payload) or length-delimited (bytes payload)."""
    if isinstance(payload, int):
        return varint(number << 3) + varint(payload)
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def ckpt_value(tag: str, dims: list[int], tensor_type: str, content: bytes) -> bytes:
    """One MindSpore Checkpoint Value (Checkpoint.value = 1: tag = 1, tensor = 2 {dims = 1,
    tensor_type = 2, tensor_content = 3}), from checkpoint.proto."""
    tensor = b"".join(pb(1, d) for d in dims) + pb(2, tensor_type.encode()) + pb(3, content)
    return pb(1, pb(1, tag.encode()) + pb(2, tensor))


def ckpt_sample(path: Path, extra: bytes = b"") -> Path:
    w = np.arange(12, dtype=np.float32).tobytes()
    path.write_bytes(ckpt_value("w", [4, 3], "Float32", w) + ckpt_value("b", [5], "Int64",
                                                                       np.arange(5, dtype=np.int64).tobytes()) + extra)
    return path


def truncated(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(at)


def sparse(path: Path, prefix: bytes = b"") -> None:
    """`prefix`, then zeros to 8 GiB, with no block allocated for them."""
    path.write_bytes(prefix)
    os.truncate(path, SPARSE_BYTES)


def rezip(path: Path, change: Callable[[str, bytes], bytes | None]) -> None:
    """Rewrite a zip archive's members through `change(name, data)` (None drops a member)."""
    with zipfile.ZipFile(path) as zf:
        members = [(i.filename, zf.read(i)) for i in zf.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for name, data in members:
            new = change(name, data)
            if new is not None:
                zf.writestr(name, new)


def outside_target(d: Path) -> Path:
    """A file outside the case's checkpoint (but in the case's directory)."""
    target = d / "outside.safetensors"
    st_sample(target)
    return target


# --- raw pickle opcodes -------------------------------------------------------------------------


def deep_list_opcodes(depth: int) -> bytes:
    """A list nested `depth` deep: `depth` EMPTY_LISTs then `depth - 1` APPENDs (no memo)."""
    return b"]" * depth + b"a" * (depth - 1)


def shared_bomb_opcodes(levels: int = 40, width: int = 10) -> bytes:
    """A list of `width` references to a list of `width` references ... `levels` deep: a few
    hundred bytes that expand to width**levels leaves when walked as a tree."""
    memo = 90_000
    put = lambda i: b"r" + struct.pack("<I", memo + i) + b"0"
    get = lambda i: b"j" + struct.pack("<I", memo + i)
    out = b"]" + put(0)  # EMPTY_LIST
    for level in range(1, levels + 1):
        out += b"](" + get(level - 1) * width + b"e" + put(level)  # MARK, ..., APPENDS
    return out + get(levels)


def _set(obj, name: str, value) -> None:
    """Set a field, frozen dataclass or not (the stand-ins are as frozen as HyperParallel's)."""
    object.__setattr__(obj, name, value)


class Reduce:
    """A pickle stand-in that pickles as `func(*args)` (the stock pickler writes the global)."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


# --- safetensors single file ----------------------------------------------------------------------


def _truncation_cases() -> None:
    def st_cut(where: str) -> Callable[[Path], Path]:
        def build(d: Path) -> Path:
            path = st_sample(d / "t.safetensors")
            n, size = header_length(path), path.stat().st_size
            at = {"0": 0, "1": 1, "7": 7, "8": 8, "9": 9, "hdr-1": 8 + n - 1, "hdr": 8 + n, "hdr+1": 8 + n + 1,
                  "mid": (8 + n + size) // 2, "last": size - 1}[where]
            truncated(path, at)
            return path
        return build

    for where in ("0", "1", "7", "8", "9", "hdr-1", "hdr", "hdr+1", "mid", "last"):
        case(f"safetensors-truncated-at-{where}", {9}, st_cut(where))

    def hp_cut(file: str, where: str) -> Callable[[Path], Path]:
        def build(d: Path) -> Path:
            root = hp_sample(d / "ckpt")
            path = root / file
            size = path.stat().st_size
            hdr = 8 + header_length(path) if file.endswith(".safetensors") else size // 2
            truncated(path, {"0": 0, "1": 1, "8": 8, "hdr": hdr, "mid": size // 2, "last": size - 1}[where])
            return root
        return build

    for where in ("0", "1", "8", "mid", "last"):
        case(f"hp-metadata-truncated-at-{where}", {5, 6}, hp_cut(".metadata", where))
    for where in ("0", "8", "hdr", "mid", "last"):
        case(f"hp-data-truncated-at-{where}", {9}, hp_cut("_rank1_.safetensors", where), inspect_ok=True)
    for where in ("0", "last"):
        case(f"hp-value-file-truncated-at-{where}", {9}, hp_cut("_rank0_.bytes", where), inspect_ok=True)

    def index_cut(where: str) -> Callable[[Path], Path]:
        def build(d: Path) -> Path:
            root = hf_sample(d / "hf")
            path = root / "model.safetensors.index.json"
            size = path.stat().st_size
            truncated(path, {"0": 0, "1": 1, "mid": size // 2, "last": size - 2}[where])
            return root
        return build

    for where in ("0", "1", "mid", "last"):
        case(f"hf-index-truncated-at-{where}", {6}, index_cut(where))

    def pt_cut(where: str) -> Callable[[Path], Path]:
        def build(d: Path) -> Path:
            path = pt_sample(d / "s.pt")
            size = path.stat().st_size
            truncated(path, {"0": 0, "1": 1, "7": 7, "8": 8, "30": 30, "mid": size // 2, "last": size - 1}[where])
            return path
        return build

    for where in ("0", "1", "7", "8", "30", "mid", "last"):
        case(f"torch-save-truncated-at-{where}", {4, 9}, pt_cut(where))

    def ckpt_cut(where: str) -> Callable[[Path], Path]:
        def build(d: Path) -> Path:
            path = ckpt_sample(d / "m.ckpt")
            size = path.stat().st_size
            truncated(path, {"0": 0, "1": 1, "2": 2, "9": 9, "mid": size // 2, "last": size - 1}[where])
            return path
        return build

    for where in ("0", "1", "2", "9", "mid", "last"):
        case(f"ckpt-truncated-at-{where}", {4, 9}, ckpt_cut(where))

    def dcp_cut(file: str, where: str) -> Callable[[Path], Path]:
        def build(d: Path) -> Path:
            root = dcp_sample(d / "dcp")
            path = root / file
            size = path.stat().st_size
            truncated(path, {"0": 0, "1": 1, "mid": size // 2, "last": size - 1}[where])
            return root
        return build

    for where in ("0", "1", "mid", "last"):
        case(f"dcp-metadata-truncated-at-{where}", {5, 6}, dcp_cut(".metadata", where))
    for where in ("0", "mid", "last"):
        case(f"dcp-data-truncated-at-{where}", {9}, dcp_cut("__0_0.distcp", where), inspect_ok=True)


# --- lying safetensors headers ------------------------------------------------------------------


def _safetensors_cases() -> None:
    f32 = lambda n: np.zeros(n, dtype=np.float32).tobytes()

    def raw(header, data=b"", length=None) -> Callable[[Path], Path]:
        return lambda d: st_raw(d / "t.safetensors", header, data, length)

    entry = lambda begin, end, shape=(2,), dtype="F32": {"dtype": dtype, "shape": list(shape),
                                                         "data_offsets": [begin, end]}
    case("st-header-length-u64-max", {9}, raw({"a": entry(0, 8)}, f32(2), length=2**64 - 1))
    case("st-header-length-2-63", {9}, raw({"a": entry(0, 8)}, f32(2), length=2**63))
    case("st-header-length-past-end", {9}, raw({"a": entry(0, 8)}, f32(2), length=10_000))
    case("st-header-length-over-100MB", {9}, raw({"a": entry(0, 8)}, f32(2), length=100 * 1024 * 1024 + 1))
    case("st-header-length-zero", {9}, raw(b"", f32(2)))
    case("st-offsets-past-end", {9}, raw({"a": entry(0, 8), "b": entry(8, 16)}, f32(2)))
    case("st-offsets-overlap", {9}, raw({"a": entry(0, 8), "b": entry(4, 12)}, f32(3)))
    case("st-offsets-reversed", {9}, raw({"a": entry(8, 0)}, f32(2)))
    case("st-offsets-negative", {9}, raw({"a": entry(-8, 0)}, f32(2)))
    case("st-offsets-float", {9}, raw({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8.0]}}, f32(2)))
    case("st-offsets-strings", {9}, raw({"a": {"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}}, f32(2)))
    case("st-offsets-three", {9}, raw({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4, 8]}}, f32(2)))
    case("st-offsets-null", {9}, raw({"a": {"dtype": "F32", "shape": [2], "data_offsets": None}}, f32(2)))
    case("st-shape-negative", {9}, raw({"a": entry(0, 8, (-2,))}, f32(2)))
    case("st-shape-not-ints", {9}, raw({"a": entry(0, 8, ("2",))}, f32(2)))
    case("st-shape-null", {9}, raw({"a": {"dtype": "F32", "shape": None, "data_offsets": [0, 8]}}, f32(2)))
    case("st-shape-product-overflows", {9}, raw({"a": entry(0, 8, (2**62, 2**62, 2**62))}, f32(2)))
    case("st-shape-huge-10-12-elements", {9}, raw({"a": entry(0, 4 * 10**12, (10**12,))}, f32(2)))
    case("st-shape-huge-exact-offsets-no-data", {9}, raw({"a": entry(0, 4 * 10**12, (10**6, 10**6))}))
    case("st-dtype-unknown", {5, 9}, raw({"a": entry(0, 8, dtype="X9")}, f32(2)))
    case("st-dtype-not-string", {5, 9}, raw({"a": {"dtype": 7, "shape": [2], "data_offsets": [0, 8]}}, f32(2)))
    case("st-entry-not-object", {9}, raw({"a": [1, 2, 3]}, f32(2)))
    case("st-header-is-a-list", {9}, raw(b'[{"dtype": "F32"}]', f32(2)))
    case("st-header-not-utf8", {9}, raw(b'{"\xff\xfe": 1}', f32(2)))
    case("st-header-bom", {9}, raw(b'\xef\xbb\xbf{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}',
                                   f32(2)))
    case("st-header-utf16", {9}, raw(json.dumps({"a": entry(0, 8)}).encode("utf-16"), f32(2)))
    case("st-header-nul-bytes", {9}, raw(b"\x00" * 32, f32(2)))
    case("st-header-not-json", {9}, raw(b"{not json at all}", f32(2)))
    case("st-header-deep-json", {9}, raw(b'{"a": ' + b"[" * DEEP + b"]" * DEEP + b"}", f32(2)))
    case("st-header-deep-json-unclosed", {9}, raw(b"{" + b'"a":{' * DEEP, f32(2)))
    case("st-header-deep-object-in-shape", {9}, raw(b'{"a": {"dtype": "F32", "shape": ' + b"[" * 5000 + b"]" * 5000
                                                     + b', "data_offsets": [0, 8]}}', f32(2)))
    case("st-metadata-not-strings", {9}, raw({"__metadata__": {"k": [1, 2]}, "a": entry(0, 8)}, f32(2)))
    case("st-metadata-deep-sharding-info", {6, 9}, raw({"__metadata__": {"DCP_SHARDING_INFO": "[" * DEEP},
                                                        "a": entry(0, 8)}, f32(2)))
    case("st-metadata-sharding-info-not-json", {6, 9}, raw({"__metadata__": {"DCP_SHARDING_INFO": "{oops"},
                                                            "a": entry(0, 8)}, f32(2)))
    case("st-hole-between-tensors", {9}, raw({"a": entry(0, 8), "b": entry(12, 20)}, f32(5)))
    case("st-trailing-bytes", {9}, raw({"a": entry(0, 8)}, f32(3)))
    ms_crc = lambda crc: raw({"__metadata__": {"format": "ms", "crc_num": crc}, "a": entry(0, 8)}, f32(2))
    case("st-ms-crc-wrong", {9}, ms_crc("12345"), inspect_ok=True)
    case("st-ms-crc-not-a-number", {9}, ms_crc("abc"), inspect_ok=True)
    case("st-brackets-inside-strings-ok", {0}, raw({"__metadata__": {"note": "[" * 1000 + "{" * 1000},
                                                    "a": entry(0, 8)}, f32(2)))
    case("st-forged-name", {0}, lambda d: st_sample(d / "t.safetensors", {FORGED_NAME: np.zeros(2, np.float32)}))
    case("st-forged-metadata-value", {0}, lambda d: st_sample(d / "t.safetensors", {"a": np.zeros(2, np.float32)},
                                                              {"author": "\x1b[2J\x1b[31merror: forged\nhint: x"}))


def put_special(path: Path, kind: str | None) -> bool:
    """Put a FIFO, a directory or a symlink to /dev/zero where the file `path` is (or would be);
    False for any other `kind` (the caller's own damage)."""
    if kind not in ("fifo", "dir", "dev-zero"):
        return False
    if os.path.lexists(path):
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    return True


# --- sidecars and Hugging Face indexes ------------------------------------------------------------


def _sidecar(content: bytes | None = None, special: str | None = None) -> Callable[[Path], Path]:
    def build(d: Path) -> Path:
        path = st_sample(d / "t.safetensors")
        sidecar = d / "t.values.json"
        if put_special(sidecar, special):
            pass
        elif special == "sparse":
            sparse(sidecar, b'{"x": {"type": "int", "value": 1}')
        else:
            sidecar.write_bytes(content)
        return path
    return build


def _sidecar_cases() -> None:
    case("sidecar-deep-json", {6}, _sidecar(b'{"x": {"type": "list", "value": ' + b"[" * DEEP + b"]" * DEEP + b"}}"))
    case("sidecar-not-json", {6}, _sidecar(b'{"x": '))
    case("sidecar-not-object", {6}, _sidecar(b"[1, 2]"))
    case("sidecar-entry-not-object", {6}, _sidecar(b'{"x": 3}'))
    case("sidecar-bad-base64", {6}, _sidecar(b'{"x": {"type": "bytes", "value": {"base64": "abc"}}}'), inspect_ok=True)
    case("sidecar-fifo", {8}, _sidecar(special="fifo"))
    case("sidecar-directory", {8}, _sidecar(special="dir"))
    case("sidecar-sparse-8GiB", {6}, _sidecar(special="sparse"))
    case("sidecar-forged-name", {0}, _sidecar(json.dumps({FORGED_NAME: {"type": "int", "value": 1}}).encode()))

    def index(content: dict | bytes | None = None, special: str | None = None, after=None) -> Callable[[Path], Path]:
        def build(d: Path) -> Path:
            root = hf_sample(d / "hf", content)
            path = root / "model.safetensors.index.json"
            if special == "sparse":
                sparse(path, path.read_bytes()[:-3])
            else:
                put_special(path, special)
            if after:
                after(root, d)
            return root
        return build

    wm = lambda **m: {"metadata": {}, "weight_map": m}
    case("hf-index-deep-json", {6}, index(b'{"weight_map": ' + b"{" * 1 + b'"a":' + b"[" * DEEP + b"]" * DEEP + b"}}"))
    case("hf-index-deep-json-unclosed", {6}, index(b'{"weight_map": ' + b"[" * DEEP))
    case("hf-index-not-json", {6}, index(b"{weight_map}"))
    case("hf-index-no-weight-map", {6}, index({"metadata": {}}))
    case("hf-index-weight-map-list", {6}, index({"weight_map": ["a"]}))
    case("hf-index-weight-map-int-value", {6}, index(wm(a=3)))
    case("hf-index-weight-map-null-value", {6}, index(wm(a=None)))
    case("hf-index-names-missing-shard", {8}, index(wm(a="model-00001-of-00002.safetensors", b="gone.safetensors")))
    case("hf-index-names-absent-tensor", {6}, index(wm(a="model-00001-of-00002.safetensors",
                                                       zz="model-00002-of-00002.safetensors")))
    case("hf-index-parent-path", {12}, index(wm(a="../outside.safetensors")))
    case("hf-index-absolute-path", {12}, index(wm(a="/etc/hostname")))
    case("hf-index-empty-path", {12, 6}, index(wm(a="")))
    case("hf-index-fifo", {8}, index(special="fifo"))
    case("hf-index-directory", {8}, index(special="dir"))
    case("hf-index-dev-zero", {8}, index(special="dev-zero"))
    case("hf-index-sparse-8GiB", {6}, index(special="sparse"))

    def shard_fifo(root: Path, d: Path) -> None:
        (root / "model-00002-of-00002.safetensors").unlink()
        os.mkfifo(root / "model-00002-of-00002.safetensors")

    def shard_dir(root: Path, d: Path) -> None:
        (root / "model-00002-of-00002.safetensors").unlink()
        (root / "model-00002-of-00002.safetensors").mkdir()

    def shard_link_outside(root: Path, d: Path) -> None:
        (root / "model-00002-of-00002.safetensors").unlink()
        st_sample(d / "elsewhere.safetensors", {"b": np.arange(4, dtype=np.int32)})
        (root / "model-00002-of-00002.safetensors").symlink_to(d / "elsewhere.safetensors")

    def shard_link_inside(root: Path, d: Path) -> None:
        (root / "real").mkdir()
        os.rename(root / "model-00002-of-00002.safetensors", root / "real" / "shard2.safetensors")
        (root / "model-00002-of-00002.safetensors").symlink_to("real/shard2.safetensors")

    def shard_dev_zero(root: Path, d: Path) -> None:
        (root / "model-00002-of-00002.safetensors").unlink()
        (root / "model-00002-of-00002.safetensors").symlink_to("/dev/zero")

    case("hf-shard-fifo", {8}, index(after=shard_fifo))
    case("hf-shard-directory", {8}, index(after=shard_dir))
    case("hf-shard-symlink-outside", {12}, index(after=shard_link_outside))
    case("hf-shard-symlink-inside-ok", {0}, index(after=shard_link_inside))
    case("hf-shard-symlink-dev-zero", {12}, index(after=shard_dev_zero))


# --- HyperParallel metadata -----------------------------------------------------------------------


def _set_path(path: str, which: str = "w"):
    def mutate(metadata, root: Path) -> None:
        for key, info in metadata.storage_data.items():
            if key.fqn == which:
                info.relative_path = path
    return mutate


def _replace_file(file: str, how: str, root_level: bool = False):
    """The HyperParallel sample with `file` replaced by a FIFO, directory, socket or symlink."""
    def build(d: Path) -> Path:
        root = hp_sample(d / "ckpt")
        path = root / file
        if path.exists():
            path.unlink()
        if how == "fifo":
            os.mkfifo(path)
        elif how == "dir":
            path.mkdir()
        elif how == "socket":
            s = socket.socket(socket.AF_UNIX)
            s.bind(str(path))
            s.close()
        elif how == "dev-zero":
            path.symlink_to("/dev/zero")
        elif how == "dangling":
            path.symlink_to("nowhere.safetensors")
        elif how == "loop":
            path.symlink_to(path.name)
        return root
    return build


def _hp_special_cases() -> None:
    for how in ("fifo", "dir", "socket", "dangling", "loop"):
        case(f"hp-data-file-{how}", {8}, _replace_file("_rank1_.safetensors", how), inspect_ok=True)
        case(f"hp-metadata-{how}", {8}, _replace_file(".metadata", how))
    case("hp-data-file-dev-zero", {12}, _replace_file("_rank1_.safetensors", "dev-zero"), inspect_ok=True)
    case("hp-metadata-dev-zero", {12}, _replace_file(".metadata", "dev-zero"))  # a symlink leaving the checkpoint
    case("hp-value-file-fifo", {8}, _replace_file("_rank0_.bytes", "fifo"), inspect_ok=True)

    def rank_local(kind: str) -> Callable[[Path], Path]:
        def build(d: Path) -> Path:
            root = hp_sample(d / "ckpt")
            if kind == "fifo":
                (root / ".metadata").rename(root / "0.metadata")
                os.mkfifo(root / "1.metadata")
            elif kind == "subset":  # rank 1's own view: only the chunk it saved
                metadata = hp_metadata(root)
                metadata.state_dict_metadata = {"w": metadata.state_dict_metadata["w"]}
                keep = {k: v for k, v in metadata.storage_data.items() if v.relative_path == "_rank1_.safetensors"}
                metadata.storage_data = keep
                _set(metadata.state_dict_metadata["w"], "chunks", [metadata.state_dict_metadata["w"].chunks[1]])
                (root / "1.metadata").write_bytes(dump_hp(metadata))
            elif kind == "disagree":  # a stale rank-local file of another save: other shape
                metadata = hp_metadata(root)
                _set(metadata.state_dict_metadata["w"], "size", (8, 3))
                (root / "0.metadata").write_bytes(dump_hp(metadata))
            elif kind == "extra":  # names a tensor the global file does not have
                metadata = hp_metadata(root)
                metadata.state_dict_metadata["ghost"] = metadata.state_dict_metadata.pop("b")
                for key in list(metadata.storage_data):
                    if key.fqn == "b":
                        info = metadata.storage_data.pop(key)
                        metadata.storage_data[MetadataIndex("ghost", key.offset, key.index)] = info
                        info.tensor_key = "b"
                (root / "0.metadata").write_bytes(dump_hp(metadata))
            return root
        return build

    case("hp-rank-local-fifo", {8}, rank_local("fifo"))
    case("hp-global-and-rank-local-subset-ok", {0}, rank_local("subset"))
    case("hp-global-and-rank-local-disagree", {6}, rank_local("disagree"))
    case("hp-global-and-rank-local-extra-tensor", {6}, rank_local("extra"))

    def sparse_metadata(d: Path) -> Path:
        root = hp_sample(d / "ckpt")
        sparse(root / ".metadata", (root / ".metadata").read_bytes())
        return root

    case("hp-metadata-sparse-8GiB", {6}, sparse_metadata)

    def sparse_data(d: Path) -> Path:
        root = hp_sample(d / "ckpt")
        path = root / "_rank1_.safetensors"
        os.truncate(path, SPARSE_BYTES)
        return root

    case("hp-data-file-sparse-8GiB", {9}, sparse_data, inspect_ok=True)

    def link(target: str, outside: bool) -> Callable[[Path], Path]:
        def build(d: Path) -> Path:
            root = hp_sample(d / "ckpt")
            path = root / "_rank1_.safetensors"
            if outside:
                os.rename(path, d / "elsewhere.safetensors")
                path.symlink_to(d / "elsewhere.safetensors")
            else:
                (root / "sub").mkdir()
                os.rename(path, root / "sub" / target)
                path.symlink_to(f"sub/{target}")
            return root
        return build

    case("hp-data-symlink-outside", {12}, link("", True), inspect_ok=True)
    case("hp-data-symlink-inside-ok", {0}, link("r1.safetensors", False))


def _hp_metadata_cases() -> None:
    case("hp-path-parent", {12}, hp_with(_set_path("../outside.safetensors")), inspect_ok=True)
    case("hp-path-deep-parent", {12}, hp_with(_set_path("a/../../../../../../etc/hostname")), inspect_ok=True)
    case("hp-path-absolute", {12}, hp_with(_set_path("/etc/hostname")), inspect_ok=True)
    case("hp-path-empty", {6, 12}, hp_with(_set_path("")), inspect_ok=True)
    case("hp-path-none", {6}, hp_with(_set_path(None)))
    case("hp-path-int", {6}, hp_with(_set_path(42)))
    case("hp-path-through-a-file", {8}, hp_with(_set_path("_rank0_.bytes/x.safetensors")), inspect_ok=True)
    case("hp-value-path-parent", {12}, hp_with(_set_path("../x.bytes", "step")), inspect_ok=True)

    def value_range(offset, length):
        def mutate(metadata, root):
            for key, info in metadata.storage_data.items():
                if key.fqn == "step":
                    info.offset, info.length = offset, length
        return mutate

    case("hp-value-past-end", {9}, hp_with(value_range(0, 10**6)), inspect_ok=True)
    case("hp-value-huge-length", {9}, hp_with(value_range(0, 10**15)), inspect_ok=True)
    case("hp-value-negative-offset", {6, 9}, hp_with(value_range(-5, 3)), inspect_ok=True)
    case("hp-value-offset-string", {6}, hp_with(value_range("0", 3)))

    def tensor(**changes):
        def mutate(metadata, root):
            item = metadata.state_dict_metadata["w"]
            for name, value in changes.items():
                if name == "dtype":
                    _set(item.properties, "dtype", value)
                elif name == "chunk_sizes":
                    _set(item.chunks[0], "sizes", value)
                elif name == "chunk_offsets":
                    _set(item.chunks[0], "offsets", value)
                else:
                    _set(item, name, value)
        return mutate

    case("hp-shape-none", {6}, hp_with(tensor(size=None)))
    case("hp-shape-strings", {6}, hp_with(tensor(size=("4", "x"))))
    case("hp-shape-negative", {6, 11}, hp_with(tensor(size=(-4, 3))))
    case("hp-shape-overflow", {6, 10, 11}, hp_with(tensor(size=(2**62, 2**62, 2**62))))
    case("hp-shape-huge-10-12", {6, 10, 11}, hp_with(tensor(size=(10**12,))))
    case("hp-shape-range-10-12", {6, 7}, hp_with(tensor(size=range(10**12))))
    case("hp-shape-many-dims", {6, 10, 11}, hp_with(tensor(size=(1,) * 100_000)))
    case("hp-dtype-none", {5, 6}, hp_with(tensor(dtype=None)))
    case("hp-dtype-int", {5, 6}, hp_with(tensor(dtype=42)))
    case("hp-dtype-unknown", {5}, hp_with(tensor(dtype="torch.float128")))
    case("hp-chunks-none", {6}, hp_with(tensor(chunks=None)))
    case("hp-chunks-int", {6}, hp_with(tensor(chunks=3)))
    case("hp-chunk-sizes-none", {6}, hp_with(tensor(chunk_sizes=None)))
    case("hp-chunk-sizes-overflow", {6, 10, 11}, hp_with(tensor(chunk_sizes=(2**62, 2**62))), inspect_ok=True)
    case("hp-chunk-offsets-negative", {6, 11}, hp_with(tensor(chunk_offsets=(-2, 0))), inspect_ok=True)
    case("hp-chunk-outside-tensor", {6, 11}, hp_with(tensor(chunk_offsets=(3, 0))), inspect_ok=True)

    def top(**changes):
        def mutate(metadata, root):
            for name, value in changes.items():
                _set(metadata, name, value)
        return mutate

    case("hp-storage-data-none", {6}, hp_with(top(storage_data=None)))
    case("hp-storage-data-list", {6}, hp_with(top(storage_data=[1, 2])))
    case("hp-state-dict-list", {6}, hp_with(top(state_dict_metadata=[1])))
    case("hp-state-dict-none", {6}, hp_with(top(state_dict_metadata=None)))
    case("hp-planner-data-int", {0, 6}, hp_with(top(planner_data=5)))
    case("hp-entry-of-wrong-type", {6}, hp_with(lambda m, r: m.state_dict_metadata.__setitem__("x", "oops")))
    case("hp-forged-name", {0}, hp_with(_rename("w", FORGED_NAME)))
    case("hp-forged-file-name", {8}, hp_with(_set_path("\x1b[31mforged\n.safetensors")), inspect_ok=True)

    # hostile pickles (the unpickler's budgets and the metadata's schema checks)
    planner = lambda m, marker: _set(m, "planner_data", marker)
    case("hp-pickle-deep-list-as-planner-data", {0, 6}, hp_spliced(planner, deep_list_opcodes(DEEP)))
    case("hp-pickle-deep-list-in-shape", {6}, hp_spliced(lambda m, k: _set(m.state_dict_metadata["w"], "size", k),
                                                          deep_list_opcodes(DEEP)))
    case("hp-pickle-shared-reference-bomb", {0, 6}, hp_spliced(planner, shared_bomb_opcodes()))
    case("hp-pickle-bomb-as-shape", {6}, hp_spliced(lambda m, k: _set(m.state_dict_metadata["w"], "size", k),
                                                     shared_bomb_opcodes()))
    case("hp-pickle-truncated-opcode-stream", {6}, hp_spliced(planner, b"]" * 10))
    case("hp-pickle-numpy-3e9-array", {6, 7}, hp_with(tensor(size=Reduce(_np_reconstruct(), np.ndarray,
                                                                          (3 * 10**9,), b"b"))))
    case("hp-pickle-codecs-unknown-codec", {6, 7}, hp_with(tensor(size=Reduce(_codecs_encode(), "x", "no-such-codec"))))
    case("hp-pickle-os-system", {7}, hp_with(tensor(size=Reduce(os.system, "true"))))
    case("hp-pickle-huge-bytes-length", {6}, hp_spliced(planner, b"\x8e" + struct.pack("<Q", 2**62)))
    case("hp-pickle-huge-memo-index", {6}, hp_spliced(planner, b"j" + struct.pack("<I", 2**31)))


def _np_reconstruct():
    from numpy.core.multiarray import _reconstruct

    return _reconstruct


def _codecs_encode():
    import _codecs

    return _codecs.encode


def _rename(old: str, new: str):
    def mutate(metadata, root):
        metadata.state_dict_metadata[new] = metadata.state_dict_metadata.pop(old)
        for key in list(metadata.storage_data):
            if key.fqn == old:
                metadata.storage_data[MetadataIndex(new, key.offset, key.index)] = metadata.storage_data.pop(key)
        if isinstance(metadata.planner_data, dict):
            metadata.planner_data[new] = (new,)
            metadata.planner_data.pop(old, None)
    return mutate


# --- torch.save, PyTorch DCP, MindSpore ------------------------------------------------------------


def _pt_member(change: Callable[[bytes], bytes], member: str = "data.pkl") -> Callable[[Path], Path]:
    def build(d: Path) -> Path:
        path = pt_sample(d / "s.pt")
        rezip(path, lambda name, data: change(data) if name.endswith("/" + member) else data)
        return path
    return build


def _pt_patch(offset_of: Callable[[bytes], int], value: bytes) -> Callable[[Path], Path]:
    def build(d: Path) -> Path:
        path = pt_sample(d / "s.pt")
        rezip(path, lambda name, data: data)  # the stdlib writes no zip64 record that would override the patch
        raw = bytearray(path.read_bytes())
        at = offset_of(bytes(raw))
        raw[at:at + len(value)] = value
        path.write_bytes(bytes(raw))
        return path
    return build


def _eocd(raw: bytes) -> int:
    return raw.rindex(b"PK\x05\x06")


def _torch_cases() -> None:
    case("pt-data-pkl-deep-list", {7, 9}, _pt_member(lambda data: b"\x80\x02" + deep_list_opcodes(DEEP) + b"."))
    case("pt-data-pkl-bomb", {0, 7, 9}, _pt_member(lambda data: b"\x80\x02}q\x00X\x01\x00\x00\x00vq\x01"
                                                 + shared_bomb_opcodes() + b"s."))
    case("pt-data-pkl-garbage", {9}, _pt_member(lambda data: b"\x80\x02garbage"))
    case("pt-data-pkl-empty", {9}, _pt_member(lambda data: b""))
    case("pt-data-pkl-os-system", {7}, _pt_member(lambda data: b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00trueq\x00\x85R."))
    case("pt-data-pkl-codecs-unknown", {7, 9}, _pt_member(
        lambda data: b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00xX\x05\x00\x00\x00nope!\x86R."))
    case("pt-storage-missing", {9}, lambda d: _pt_drop_storage(d))
    case("pt-byteorder-big", {9}, _pt_member(lambda data: b"big", "byteorder"))
    case("pt-central-directory-offset-past-end", {9}, _pt_patch(lambda raw: _eocd(raw) + 16, struct.pack("<I", 2**31)))
    case("pt-central-directory-size-huge", {9}, _pt_patch(lambda raw: _eocd(raw) + 12, struct.pack("<I", 2**31)))
    case("pt-entry-count-huge", {0, 9}, _pt_patch(lambda raw: _eocd(raw) + 8, struct.pack("<HH", 65535, 65535)))
    case("pt-local-header-name-length-huge", {4, 9}, _pt_patch(lambda raw: 26, struct.pack("<H", 65535)))
    case("pt-local-header-extra-length-huge", {9}, _pt_patch(lambda raw: 28, struct.pack("<H", 65535)))
    case("pt-local-header-size-lies", {0, 9}, _pt_patch(lambda raw: 18, struct.pack("<II", 2**31, 2**31)))
    case("pt-compressed-member", {9}, lambda d: _pt_deflated(d))
    case("pt-huge-shape", {6, 9, 10}, lambda d: pt_sample(d / "s.pt", {"w": _huge_view()}))
    case("pt-forged-name", {0}, lambda d: pt_sample(d / "s.pt", _forged_state()))

    def sparse_pt(d: Path) -> Path:
        path = pt_sample(d / "s.pt")
        os.truncate(path, SPARSE_BYTES)
        return path

    case("pt-sparse-8GiB", {9}, sparse_pt)

    def dcp_path(relative: str):
        def mutate(metadata, root):
            for info in metadata.storage_data.values():
                info.relative_path = relative
        return mutate

    def dcp_offsets(offset, length):
        def mutate(metadata, root):
            for info in metadata.storage_data.values():
                info.offset, info.length = offset, length
        return mutate

    case("dcp-path-parent", {12}, dcp_with(dcp_path("../x.distcp")))
    case("dcp-path-absolute", {12}, dcp_with(dcp_path("/etc/hostname")))
    case("dcp-range-past-end", {9}, dcp_with(dcp_offsets(0, 10**9)), inspect_ok=True)
    case("dcp-range-negative", {6, 9}, dcp_with(dcp_offsets(-10, 5)), inspect_ok=True)
    case("dcp-range-none", {6, 9}, dcp_with(dcp_offsets(None, None)), inspect_ok=True)
    case("dcp-storage-data-none", {6}, dcp_with(lambda m, r: setattr(m, "storage_data", None)))
    case("dcp-state-dict-list", {6}, dcp_with(lambda m, r: setattr(m, "state_dict_metadata", [])))

    def dcp_special(how: str) -> Callable[[Path], Path]:
        def build(d: Path) -> Path:
            root = dcp_sample(d / "dcp")
            if how == "metadata-fifo":
                (root / ".metadata").unlink()
                os.mkfifo(root / ".metadata")
            elif how == "data-fifo":
                (root / "__0_0.distcp").unlink()
                os.mkfifo(root / "__0_0.distcp")
            elif how == "data-dir":
                (root / "__0_0.distcp").unlink()
                (root / "__0_0.distcp").mkdir()
            elif how == "metadata-sparse":
                sparse(root / ".metadata", (root / ".metadata").read_bytes())
            elif how == "rank-local-subset":
                (root / "__0.metadata").write_bytes((root / ".metadata").read_bytes())
            elif how == "rank-local-disagree":
                metadata = pickle.loads((root / ".metadata").read_bytes())
                metadata.state_dict_metadata.pop("b")
                (root / "__0.metadata").write_bytes((root / ".metadata").read_bytes())
                (root / ".metadata").write_bytes(pickle.dumps(metadata))
            elif how == "rank-local-fifo":
                os.mkfifo(root / "__1.metadata")
            return root
        return build

    case("dcp-metadata-fifo", {8}, dcp_special("metadata-fifo"))
    case("dcp-metadata-sparse-8GiB", {6}, dcp_special("metadata-sparse"))
    case("dcp-data-fifo", {8}, dcp_special("data-fifo"), inspect_ok=True)
    case("dcp-data-directory", {8}, dcp_special("data-dir"), inspect_ok=True)
    case("dcp-global-and-rank-local-agree-ok", {0}, dcp_special("rank-local-subset"))
    case("dcp-global-and-rank-local-disagree", {6}, dcp_special("rank-local-disagree"))
    case("dcp-rank-local-fifo", {8}, dcp_special("rank-local-fifo"))

    # MindSpore .ckpt
    w = np.arange(12, dtype=np.float32).tobytes()
    ck = lambda data: (lambda d: _write(d / "m.ckpt", data))
    case("ckpt-value-length-past-end", {9}, ck(varint(1 << 3 | 2) + varint(10**9) + b"\x0a\x01w"))
    case("ckpt-content-length-past-end", {9}, ck(pb(1, pb(1, b"w") + pb(2, pb(1, 3) + pb(2, b"Float32")
                                                                      + varint(3 << 3 | 2) + varint(10**12)))))
    case("ckpt-varint-too-long", {9}, ck(b"\x0a" + b"\xff" * 11))
    case("ckpt-group-wire-type", {4, 9}, ck(b"\x0b" * 1000))
    case("ckpt-deep-nested-unknown-field", {9}, ck(pb(1, pb(1, b"w") + pb(2, _nested(3000)))))
    case("ckpt-deep-nested-ok-skipped", {0}, ck(pb(1, pb(1, b"w") + pb(2, pb(1, 4) + pb(1, 3) + pb(2, b"Float32")
                                                                       + pb(3, w) + _nested(3000)))))
    case("ckpt-dims-overflow", {9, 10}, ck(ckpt_value("w", [2**62, 2**62], "Float32", w)))
    case("ckpt-dims-negative", {9, 10}, ck(ckpt_value("w", [(1 << 64) - 4, 3], "Float32", w)))
    case("ckpt-dims-too-many", {9}, ck(ckpt_value("w", [1] * 100, "Float32", w[:4])))
    case("ckpt-dims-disagree-with-content", {9, 10}, ck(ckpt_value("w", [5, 3], "Float32", w)))
    case("ckpt-type-unknown", {5, 9}, ck(ckpt_value("w", [4, 3], "Float128", w)))
    case("ckpt-tag-huge", {9}, ck(pb(1, varint(1 << 3 | 2) + varint(10**8))))
    case("ckpt-tag-not-utf8", {9}, ck(pb(1, pb(1, b"\xff\xfe") + pb(2, pb(1, 12) + pb(2, b"Float32") + pb(3, w)))))
    case("ckpt-crc-wrong", {9}, lambda d: ckpt_sample(d / "m.ckpt", b"crc_num" + (12345).to_bytes(10, "big")),
         inspect_ok=True)
    case("ckpt-forged-tag", {0}, ck(ckpt_value(FORGED_NAME, [4, 3], "Float32", w)))

    def sparse_ckpt(d: Path) -> Path:
        path = ckpt_sample(d / "m.ckpt")
        os.truncate(path, SPARSE_BYTES)
        return path

    case("ckpt-sparse-8GiB", {9}, sparse_ckpt)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _nested(depth: int) -> bytes:
    """An unknown length-delimited field (number 9) nested `depth` deep."""
    out = b""
    for _ in range(depth):
        out = pb(9, out)
    return out


def _huge_view():
    import torch

    t = torch.zeros(4)
    return torch.as_strided(t, (2**31, 2**31), (0, 0))


def _forged_state():
    import torch

    return {FORGED_NAME: torch.zeros(3), "cfg": {"\x1b]0;title\x07": 1}}


def _pt_drop_storage(d: Path) -> Path:
    path = pt_sample(d / "s.pt")
    rezip(path, lambda name, data: None if "/data/" in name else data)
    return path


def _pt_deflated(d: Path) -> Path:
    path = pt_sample(d / "s.pt")
    with zipfile.ZipFile(path) as zf:
        members = [(i.filename, zf.read(i)) for i in zf.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members:
            zf.writestr(name, data)
    return path


def bin_sample(root: Path, index: dict | bytes | None = None) -> Path:
    """`save_pretrained(safe_serialization=False)`'s layout: torch.save shards and their index."""
    import torch

    root.mkdir(parents=True)
    torch.save({"a": torch.arange(6.0)}, root / "pytorch_model-00001-of-00002.bin")
    torch.save({"b": torch.arange(4)}, root / "pytorch_model-00002-of-00002.bin")
    if index is None:
        index = {"metadata": {"total_size": 56}, "weight_map": {"a": "pytorch_model-00001-of-00002.bin",
                                                                 "b": "pytorch_model-00002-of-00002.bin"}}
    data = index if isinstance(index, bytes) else json.dumps(index, indent=2).encode()
    (root / "pytorch_model.bin.index.json").write_bytes(data)
    return root


def _bin_cases() -> None:
    def bin_case(index=None, shard: str | None = None) -> Callable[[Path], Path]:
        def build(d: Path) -> Path:
            root = bin_sample(d / "bin", index)
            path = root / "pytorch_model-00002-of-00002.bin"
            if put_special(path, shard):
                pass
            elif shard == "truncated":
                truncated(path, path.stat().st_size // 2)
            elif shard == "safetensors":
                path.unlink()
                st_sample(path, {"b": np.arange(4)})
            elif shard == "index-sparse":
                sparse(root / "pytorch_model.bin.index.json", b'{"weight_map": {')
            return root
        return build

    wm = lambda **m: {"weight_map": m}
    case("bin-index-deep-json", {6}, bin_case(b'{"weight_map": ' + b"[" * DEEP))
    case("bin-index-not-json", {6}, bin_case(b"\x00\x01"))
    case("bin-index-parent-path", {12}, bin_case(wm(a="../x.bin")))
    case("bin-index-absolute-path", {12}, bin_case(wm(a="/etc/hostname")))
    case("bin-index-missing-shard", {8}, bin_case(wm(a="pytorch_model-00001-of-00002.bin", b="gone.bin")))
    case("bin-index-sparse-8GiB", {6}, bin_case(shard="index-sparse"))
    case("bin-shard-fifo", {8}, bin_case(shard="fifo"))
    case("bin-shard-directory", {8}, bin_case(shard="dir"))
    case("bin-shard-truncated", {6, 9}, bin_case(shard="truncated"))
    case("bin-shard-not-torch-save", {6}, bin_case(shard="safetensors"))


# --- the command line's own path ------------------------------------------------------------------


def _argument_cases() -> None:
    def fifo(d: Path) -> Path:
        os.mkfifo(d / "x.safetensors")
        return d / "x.safetensors"

    def dev_zero(d: Path) -> Path:
        (d / "z.safetensors").symlink_to("/dev/zero")
        return d / "z.safetensors"

    def dir_named(d: Path) -> Path:
        (d / "ckpt" / "model.safetensors").mkdir(parents=True)
        return d / "ckpt"

    def rank_dir(d: Path) -> Path:
        root = hp_sample(d / "ckpt")
        (root / "_rank0_.safetensors").unlink()
        (root / "_rank0_.safetensors").mkdir()
        return root

    def file_as_dir(d: Path) -> Path:
        st_sample(d / "f.safetensors")
        return d / "f.safetensors" / "inner"

    def metadata_of_ckpt_dir(d: Path) -> Path:
        root = hp_sample(d / "ckpt")
        (root / "_rank1_.safetensors").unlink()
        os.mkfifo(root / "_rank1_.safetensors")
        return root / ".metadata"

    def empty_dir(d: Path) -> Path:
        (d / "empty").mkdir()
        return d / "empty"

    def zero_byte_ckpt(d: Path) -> Path:
        (d / "m.ckpt").write_bytes(b"")
        return d / "m.ckpt"

    case("arg-fifo", {4, 8}, fifo)
    case("arg-symlink-dev-zero", {4, 8}, dev_zero)
    case("arg-directory-named-safetensors", {4, 8}, dir_named)
    case("arg-rank-file-is-directory", {8}, rank_dir, inspect_ok=True)
    case("arg-file-as-directory", {3}, file_as_dir)
    case("arg-metadata-path-with-fifo-data", {8}, metadata_of_ckpt_dir, inspect_ok=True)
    case("arg-empty-directory", {4}, empty_dir)
    case("arg-zero-byte-ckpt", {4}, zero_byte_ckpt)


def _review_cases() -> None:
    """What a red-team review of the first version found."""
    def root_not_metadata(d: Path) -> Path:  # names HyperParallel's Metadata class, then holds a dict
        root = hp_sample(d / "ckpt")
        module, name = b"hyper_parallel.core.distributed_checkpoint.metadata", b"Metadata"
        (root / ".metadata").write_bytes(b"\x80\x04\x8c" + bytes([len(module)]) + module + b"\x8c" + bytes([len(name)])
                                         + name + b"\x930}.")
        return root

    def version(metadata, root) -> None:
        metadata.version = "1.0\x1b[31mRED\x1b]0;title\x07[bold red]MARKUP[/]\nForged: line"

    def metadata_outside(d: Path) -> Path:
        root = hp_sample(d / "ckpt")
        (root / ".metadata").rename(d / "outside.metadata")
        (root / ".metadata").symlink_to(d / "outside.metadata")
        return root

    case("hp-root-is-a-dict", {6}, root_not_metadata)
    case("hp-relative-path-nul", {12}, hp_with(_set_path("_rank0_\x00.safetensors")), inspect_ok=True)
    case("hp-relative-path-5000-chars", {12}, hp_with(_set_path("a" * 5000)), inspect_ok=True)
    case("hp-version-with-escapes", {0, 5, 6}, hp_with(version))
    case("hp-metadata-symlink-outside", {12}, metadata_outside)


# --- memory: pickles of at most 1 MiB that ask for gigabytes ------------------------------------------
#
# Each shape below is a value-pushing run of protocol-2 opcodes; `_memory_cases` puts it into a
# torch.save `data.pkl`, a HyperParallel `.bytes` value and a HyperParallel `.metadata`
# (as its planner_data). tests/test_hostile_inputs.py asserts every command's peak resident
# memory on every case. Memo indices start at MEMO, clear of the host pickle's own.

MEMO = 200_000
MIB = 1 << 20


def _g(module: str, name: str) -> bytes:
    return f"c{module}\n{name}\n".encode()


def _put(i: int) -> bytes:
    return b"r" + struct.pack("<I", MEMO + i) + b"0"  # LONG_BINPUT, POP


def _get(i: int) -> bytes:
    return b"j" + struct.pack("<I", MEMO + i)  # LONG_BINGET


def _unicode(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _binbytes(data: bytes) -> bytes:
    return b"B" + struct.pack("<I", len(data)) + data


def _int(n: int) -> bytes:
    return b"J" + struct.pack("<i", n)


def repeated_calls(func: bytes, arg: bytes, times: int) -> bytes:
    """A list of `times` results of `func(arg)`, the callable and the argument memoised once: a
    few bytes a call, each call allocating what the argument's size says."""
    return func + _put(0) + arg + _put(1) + b"](" + (_get(0) + _get(1) + b"\x85R") * times + b"e"


def _list_of_ints(n: int) -> bytes:
    return b"](" + _int(1 << 20) * n + b"e"


def numpy_build_text(times: int, chars: int) -> bytes:
    """`times` arrays, each given the same memoised text as its data (numpy copies text)."""
    state = b"(K\x01J" + struct.pack("<i", chars) + b"\x85" + _get(2) + b"\x89" + _get(3) + b"t"
    return (_g("numpy.core.multiarray", "_reconstruct") + _put(0) + _g("numpy", "ndarray") + _put(1)
            + _g("numpy", "dtype") + _unicode("u1") + b"\x85R" + _put(2) + _unicode("x" * chars) + _put(3)
            + b"](" + (_get(0) + _get(1) + b"K\x00\x85C\x01b\x87R" + state + b"b") * times + b"e")


def shared_bomb_to(size: int) -> bytes:
    """`shared_bomb_opcodes` padded with a string to `size` bytes: the object budget grows with
    a pickle's size, so a bomb this large is allowed the most objects a walk must count."""
    bomb = b"(" + shared_bomb_opcodes() + _unicode("p" * (size - 400)) + b"t"
    return bomb


MEMORY_SHAPES: dict[str, bytes] = {
    # the shape: 200 bytes calling list(range(4,000,000)) 25 times over one memoised range
    "list-of-range-x25": repeated_calls(_g("__builtin__", "list"), _g("__builtin__", "range") + _put(9)
                                        + _get(9) + _int(4_000_000) + b"\x85R", 25),
    "frozenset-of-range-x8": repeated_calls(_g("__builtin__", "frozenset"), _g("__builtin__", "range") + _put(9)
                                            + _get(9) + _int(4_000_000) + b"\x85R", 8),
    "tuple-of-list-x4000": repeated_calls(_g("__builtin__", "tuple"), _list_of_ints(40_000), 4000),
    "bytearray-of-bytes-x4000": repeated_calls(_g("__builtin__", "bytearray"), _binbytes(b"b" * (256 << 10)), 4000),
    "codecs-encode-x4000": _g("_codecs", "encode") + _put(0) + _unicode("c" * (256 << 10)) + _put(1)
                           + _unicode("latin1") + _put(2) + b"](" + (_get(0) + _get(1) + _get(2) + b"\x86R") * 4000
                           + b"e",
    "path-of-text-x4000": repeated_calls(_g("pathlib", "PosixPath"), _unicode("d" * (256 << 10)), 4000),
    "numpy-scalar-1GiB-x4": repeated_calls(_g("numpy.core.multiarray", "scalar"), _g("numpy", "dtype")
                                           + _unicode("V1073741824") + b"\x85R", 4),
    "numpy-ndarray-128MiB-x16": _g("numpy", "ndarray") + _put(0) + b"(J" + struct.pack("<i", 128 << 20) + b"\x85"
                                + _g("numpy", "dtype") + _unicode("u1") + b"\x85Rt" + _put(1)
                                + b"](" + (_get(0) + _get(1) + b"R") * 16 + b"e",
    "numpy-build-text-x3000": numpy_build_text(3000, 256 << 10),
    "memo-index-2e9-at-1MiB": _unicode("m" * (MIB - 4096)) + b"r" + struct.pack("<I", 2_000_000_000),
    "bytes8-length-2e15-at-1MiB": _unicode("l" * (MIB - 4096)) + b"0\x8e" + struct.pack("<Q", 2 * 10**15),
    "shared-bomb-at-1MiB": shared_bomb_to(MIB - 4096),
    "deep-list-500000": deep_list_opcodes(500_000),
}


def _pt_with_value(shape: bytes) -> Callable[[Path], Path]:
    return _pt_member(lambda data: b"\x80\x02}q\x00X\x01\x00\x00\x00vq\x01" + shape + b"s.")


def _hp_value(shape: bytes) -> Callable[[Path], Path]:
    def build(d: Path) -> Path:
        w = np.arange(12, dtype=np.float32).reshape(4, 3)
        return write_hp(d / "ckpt", {"w": ("torch.float32", (4, 3), [("_rank0_.safetensors", "w", (0, 0), w)])},
                        values={"step": ("_rank0_.bytes", b"\x80\x02" + shape + b".")})
    return build


def _dcp_spliced(opcodes: bytes) -> Callable[[Path], Path]:
    """A builder: the PyTorch DCP sample's `.metadata` (protocol 2) with raw pickle `opcodes` as
    its planner_data."""
    marker = "HOSTILE-PLACEHOLDER"

    def build(d: Path) -> Path:
        root = dcp_sample(d / "dcp")
        metadata = pickle.loads((root / ".metadata").read_bytes())
        metadata.planner_data = marker
        raw = pickle.dumps(metadata, protocol=2)
        encoded = b"X" + struct.pack("<I", len(marker)) + marker.encode()
        assert raw.count(encoded) == 1
        (root / ".metadata").write_bytes(raw.replace(encoded, opcodes))
        return root
    return build


def _memory_cases() -> None:
    planner = lambda m, marker: _set(m, "planner_data", marker)
    metadata = ("list-of-range-x25", "bytearray-of-bytes-x4000", "path-of-text-x4000", "numpy-build-text-x3000",
                "memo-index-2e9-at-1MiB")
    for name, shape in MEMORY_SHAPES.items():
        assert len(shape) < MIB - 1024, (name, len(shape))
        case(f"mem-pt-{name}", {6, 7, 9}, _pt_with_value(shape))
        case(f"mem-hp-value-{name}", {6, 7, 9}, _hp_value(shape), inspect_ok=True)
        if name in metadata:
            case(f"mem-hp-metadata-{name}", {6, 7}, hp_spliced(planner, shape))
            case(f"mem-dcp-metadata-{name}", {6, 7}, _dcp_spliced(shape))
    # MindSpore .ckpt: one tag repeated (a tensor split into pieces) declaring 1 GiB in 4-byte pieces
    piece = ckpt_value("w", [1 << 28], "Float32", b"\0" * 4)
    case("mem-ckpt-one-tag-x1000-declaring-1GiB", {9}, lambda d: _write(d / "m.ckpt", piece * 1000))


for _add in (_truncation_cases, _safetensors_cases, _sidecar_cases, _hp_special_cases, _hp_metadata_cases,
             _torch_cases, _bin_cases, _argument_cases, _review_cases, _memory_cases):
    _add()


def build_all(root: Path, names: list[str] | None = None) -> dict[str, dict]:
    """Write every case (or `names`) under `root/NAME/` and `root/manifest.json`; return the manifest."""
    manifest = {}
    for name in names or list(CASES):
        spec = CASES[name]
        directory = root / name
        directory.mkdir(parents=True)
        path = spec.build(directory)
        manifest[name] = {"path": str(path), "dir": str(directory), "codes": sorted(spec.codes),
                          "inspect_ok": spec.inspect_ok}
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


if __name__ == "__main__":
    out = build_all(Path(sys.argv[1]), sys.argv[2:] or None)
    print(f"{len(out)} cases in {sys.argv[1]}")
