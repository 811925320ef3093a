"""Fuzz targets of every parser hpckpt has (issue 13): one per input file kind, driven by
hypothesis in `tests/test_fuzz_parsers.py` (bounded, in CI) and `bench/fuzz_parsers.py` (longer).

A target takes bytes, writes them in place of one file of a valid sample checkpoint (the other
files stay valid) and calls the entry points hpckpt itself uses on it: the parser of that file
directly (safetensors header, the safe unpickler, the torch.save zip reader, the `.ckpt` walk,
the JSON readers), then `open_index` on the checkpoint, the chunk lists, `validate` (what `verify`
does: every chunk located, every value decoded, every data file checked) and a read of a small
box of each tensor, so that lazy parsing is reached too. The file's bytes are restored after.

An outcome is fine when the call returns or raises an `HpckptError` whose exit code is a
documented one (`core.errors.ERROR_CLASSES`); any other exception, more than `CPU_SECONDS` of
CPU, more than `WALL_SECONDS` of wall clock, or more than `MEMORY_HEADROOM` of new address space
(RLIMIT_AS, lowered around each call) is a `FuzzFailure`.

Inputs are mutations of valid seeds (bit flips, byte and integer-field replacements, varints,
truncations, insertions, deletions, duplicated ranges, numbers in JSON text, zip record fields)
and, where structure pays, generated from the format: safetensors headers with random entries,
pickles of random opcode programs, `.ckpt` streams of random Values, JSON documents of the index
and sidecar shapes, HyperParallel metadata objects with one field replaced.

    python tests/fuzz_targets.py build DIR            # the samples (imports torch and mindspore
                                                      # in subprocesses: truncation_driver.py)
    python tests/fuzz_targets.py replay DIR TARGET REL FILE   # one input, as the fuzzer ran it
"""

from __future__ import annotations

import json
import pickle
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from hpckpt.core.errors import ERROR_CLASSES, HpckptError
from hpckpt.core.codecs.mindspore_ckpt.wire import _varint as encode_varint

DOCUMENTED = frozenset(cls.exit_code for cls in ERROR_CLASSES)
CPU_SECONDS = 2.0  # CPU, not wall clock: the CI machine's two cores are busy with other tests
WALL_SECONDS = 10.0  # a call still running then is a hang (SIGALRM stops it)
#: Address space a call may add. Above 2 GiB because `input_files.read_small` asks `FileIO.read` for
#: up to the metadata limit (2 GiB) in one call, which reserves that much, even for a 2 KB file.
MEMORY_HEADROOM = 3 << 30
MAX_TENSORS_READ = 4


class FuzzFailure(AssertionError):
    """An input made a parser fail in an undocumented way (the message says how)."""


class _Timeout(BaseException):
    """Raised by SIGALRM; a BaseException so that no `except Exception` in hpckpt swallows it."""


# --- running one input -------------------------------------------------------------------------


def _address_space() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return None


def _on_alarm(signum, frame):
    raise _Timeout()


def guarded(call: Callable[[], Any], what: str) -> str:
    """Run `call` under the time and memory bounds; return "ok" or the documented error's kind.

    Raises:
        FuzzFailure: an undocumented exception, or a bound exceeded.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    used = _address_space()
    cap = None if used is None else used + MEMORY_HEADROOM
    capped = cap is not None and all(limit == resource.RLIM_INFINITY or cap < limit for limit in (soft, hard))
    if capped:
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    alarm = threading.current_thread() is threading.main_thread()
    if alarm:
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, WALL_SECONDS)
    cpu = time.process_time()
    outcome = "ok"
    try:
        call()
    except _Timeout:
        raise FuzzFailure(f"{what}: still running after {WALL_SECONDS} s (a hang)") from None
    except HpckptError as exc:
        if exc.exit_code not in DOCUMENTED:
            raise FuzzFailure(f"{what}: {type(exc).__name__} with exit code {exc.exit_code}, not a documented one: "
                              f"{exc.message}") from exc
        outcome = exc.kind
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - the point of the exercise
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-6:])
        raise FuzzFailure(f"{what}: undocumented {type(exc).__name__}: {str(exc)[:300]}\n{tb}") from None
    finally:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        if capped:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    seconds = time.process_time() - cpu
    if seconds > CPU_SECONDS:
        raise FuzzFailure(f"{what}: took {seconds:.2f} s of CPU (more than {CPU_SECONDS} s)")
    return outcome


def run_input(root: Path, target: Target, rel: str, data: bytes) -> str:
    """Write `data` in place of `root/rel`, run `target` on it, restore the file; the outcome."""
    path = root / rel
    original = path.read_bytes()
    path.write_bytes(data)
    try:
        return guarded(lambda: target.entry(path), f"{target.name} on {rel} ({len(data)} bytes)")
    finally:
        path.write_bytes(original)


# --- what a target calls -------------------------------------------------------------------------


def _small_box(shape: tuple[int, ...]):
    """At most 4 x 4 x 4 elements at the origin: reading it touches real bytes, never allocates much."""
    from hpckpt.core.geometry.box import Box

    return Box((0,) * len(shape), tuple(min(n, 4) if i < 3 else min(n, 1) for i, n in enumerate(shape)))


def check_checkpoint(path: Path) -> None:
    """What the commands do with a checkpoint: open its index, list its chunks, validate it (as
    `verify` does), read a small box of a few tensors and the writer's record."""
    from hpckpt.converters import hpckpt_json, open_index
    from hpckpt.core.io.read import read_box
    from hpckpt.core.safety.validate import validate

    index = open_index(path)
    for entry in index.tensors.values():
        _ = entry.n_chunks, entry.nbytes
        entry.chunk_arrays()
        entry.chunk_files()
    validate(index)
    for entry in list(index.tensors.values())[:MAX_TENSORS_READ]:
        if entry.dtype.refusal is None:
            read_box(index, entry, _small_box(entry.shape))
    hpckpt_json.problems(index, None)


def _documented(call: Callable[[], Any]) -> None:
    """Run one parser call whose documented errors are expected: the checkpoint's turn comes next."""
    try:
        call()
    except HpckptError as exc:
        if exc.exit_code not in DOCUMENTED:
            raise


def safetensors_target(path: Path) -> None:
    """The header parser, then the file alone and the directory it is part of (HF shards, a
    HyperParallel rank file, a file with its sidecar)."""
    from hpckpt.core.codecs import safetensors_io

    safetensors_io.is_safetensors(path)
    _documented(lambda: safetensors_io.read_header(path, strict=False))
    _documented(lambda: safetensors_io.read_header(path))
    _documented(lambda: check_checkpoint(path))
    check_checkpoint(path.parent)


def pickle_target(path: Path) -> None:
    """The safe unpickler on its own, as a value (`.bytes`) and as metadata, and the global scan."""
    from hpckpt.core.safety import pickle_scan, unpickle

    data = path.read_bytes()
    for kind in (unpickle.VALUE, unpickle.METADATA):
        _documented(lambda kind=kind: unpickle.loads(data, what="fuzzed pickle", kind=kind))
    _documented(lambda: pickle_scan.pickle_globals(data))


def directory_target(path: Path) -> None:
    """A metadata or data file of a directory checkpoint."""
    check_checkpoint(path.parent)


def torch_save_target(path: Path) -> None:
    """The zip directory scan and the record reader, then the file as a checkpoint (and the HF
    directory of `.bin` shards it is one of)."""
    from hpckpt.core.codecs import torch_zip
    from hpckpt.core.codecs import zip_directory

    torch_zip.is_zip_record(path)
    _documented(lambda: zip_directory.records_with_storages(path, [(0, path.stat().st_size)]))
    _documented(lambda: torch_zip.load_record(path))
    if any(path.parent.glob("*.index.json")):
        _documented(lambda: check_checkpoint(path))
        check_checkpoint(path.parent)
    else:
        check_checkpoint(path)


def ckpt_target(path: Path) -> None:
    from hpckpt.core.codecs import mindspore_ckpt

    mindspore_ckpt.sniff(path.read_bytes()[:4096], path.stat().st_size)

    def walk() -> None:
        found = mindspore_ckpt.scan(path)
        for string in list(found.strings.values())[:4]:
            mindspore_ckpt.read_string(path, string)
        mindspore_ckpt.verify_crc(path)

    _documented(walk)
    check_checkpoint(path)


def hf_index_target(path: Path) -> None:
    from hpckpt.converters.hf_sharded import read_weight_map

    _documented(lambda: read_weight_map(path, "fuzzed index"))
    check_checkpoint(path.parent)


def sidecar_target(path: Path) -> None:
    from hpckpt.converters import values_sidecar

    def decode() -> None:
        for item in values_sidecar.read(path).values():
            values_sidecar.decode_one(item)

    _documented(decode)
    owner = values_sidecar.owner_of(path.name)
    check_checkpoint(path.parent / owner if owner else path.parent)


def manifest_target(path: Path) -> None:
    """A manifest in place of the one hpckpt wrote: its reader (header and every box line), the
    listing `inspect` takes from it, the record's world size, and `verify --deep` against it."""
    from hpckpt import api
    from hpckpt.core.commit import manifest

    def read() -> None:
        found = manifest.read(path)
        if found is not None:
            for entry in found.file_digests():
                _ = entry.boxes
    _documented(read)
    ckpt = path.parent if path.name == manifest.NAME else path.with_name(path.name.removesuffix(manifest.SUFFIX))
    _documented(lambda: api.inspect(ckpt))
    _documented(lambda: api.verify(ckpt, deep=True, jobs=1))
    check_checkpoint(ckpt)


# --- the samples ---------------------------------------------------------------------------------

#: Fixtures copied into the samples, under these names (without their `expected.*` files).
HP_FIXTURES = {"hp-ms1": "m0-mindspore-1rank", "hp-ms1-nodist": "m0-mindspore-1rank-noDist",
               "hp-t4": "m0-torch-4rank", "hp-t4-async": "m0-torch-4rank-async",
               "hp-legacy": "legacy-torch-4rank", "hp-legacy-rl": "legacy-torch-4rank-rankLocal"}


def build_samples(root: Path) -> Path:
    """Every sample checkpoint under `root` (created): torch DCP, torch.save, safetensors and HF
    written by torch and safetensors, `.ckpt` by MindSpore (subprocesses of
    `truncation_driver.py`), HyperParallel fixtures, `examples/tiny-hp` and a consolidated
    safetensors file with its values sidecar (hpckpt's own writer: only hpckpt writes sidecars)."""
    from _util import FIXTURES, REPO

    root.mkdir(parents=True, exist_ok=True)
    driver = HERE / "truncation_driver.py"
    builds = [subprocess.Popen([sys.executable, str(driver), mode, str(root)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for mode in ("build-torch", "build-mindspore")]
    for name, fixture in HP_FIXTURES.items():
        (root / name).mkdir()
        for f in (FIXTURES / fixture).iterdir():
            if not f.name.startswith("expected."):
                shutil.copy2(f, root / name / f.name)
    shutil.copytree(REPO / "examples" / "tiny-hp", root / "hp-tiny")
    legacy = root / "hp-tiny-legacy"  # as hpckpt wrote it before the manifest: a `.hpckpt.json` record
    shutil.copytree(root / "hp-tiny", legacy)
    (legacy / ".hpckpt-manifest.jsonl").unlink()
    from hpckpt.converters import hpckpt_json

    name, data = hpckpt_json.record("hyperparallel", 2, [(".metadata", (legacy / ".metadata").read_bytes())], [2], "S0")
    (legacy / name).write_bytes(data)
    from hpckpt import api

    (root / "st").mkdir()
    api.consolidate(root / "hp-ms1", root / "st" / "model.safetensors")
    (root / "pickles").mkdir()
    for i, build in enumerate(builds):
        _out, err = build.communicate(timeout=300)
        if i == 1 and build.returncode != 0 and "No module named 'mindspore'" in err:
            from hostile_catalogue import ckpt_sample

            (root / "ms").mkdir(exist_ok=True)
            ckpt_sample(root / "ms" / "net.ckpt")
        elif build.returncode != 0:
            raise RuntimeError(f"building the samples failed:\n{err[-3000:]}")
    with zipfile.ZipFile(root / "pt" / "state.pt") as zf:  # the pickle inside a torch.save record
        name = next(n for n in zf.namelist() if n.endswith("/data.pkl"))
        (root / "pickles" / "data.pkl").write_bytes(zf.read(name))
    for f in root.rglob("*"):
        if f.is_file():
            f.chmod(0o600)  # MindSpore saves read-only; the targets write in place
    return root


def pickle_seeds(root: Path) -> list[str]:
    """Every pickle of the samples: HyperParallel and DCP metadata, `.bytes` values, data.pkl."""
    found = sorted(str(p.relative_to(root)) for p in root.rglob("*")
                   if p.is_file() and (p.name.endswith("metadata") or p.suffix in (".bytes", ".pkl")))
    return [rel for rel in found if not rel.startswith("pickles/")] + ["pickles/data.pkl"]


# --- mutations -----------------------------------------------------------------------------------

INTERESTING = (0, 1, 2, 7, 8, 0x7F, 0x80, 0xFF, 0x100, 0x7FFF, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000,
               0xFFFFFFFF, 1 << 32, (1 << 63) - 1, 1 << 63, (1 << 64) - 1)
NUMBERS = (b"0", b"-1", b"1", b"8", b"4294967296", b"9223372036854775807", b"18446744073709551616",
           b"1e400", b"-0", b"0.5", b"99999999999999999999999999", b"true", b"null", b"\"7\"")
_NUMBER = re.compile(rb"-?\d+")
_ZIP_FIELDS = {  # signature -> (offset, width) of its integer fields
    b"PK\x03\x04": ((4, 2), (6, 2), (8, 2), (14, 4), (18, 4), (22, 4), (26, 2), (28, 2)),
    b"PK\x01\x02": ((6, 2), (8, 2), (10, 2), (16, 4), (20, 4), (24, 4), (28, 2), (30, 2), (32, 2), (42, 4)),
    b"PK\x05\x06": ((4, 2), (6, 2), (8, 2), (10, 2), (12, 4), (16, 4), (20, 2)),
    b"PK\x06\x06": ((4, 8), (24, 8), (32, 8), (40, 8), (48, 8)),
    b"PK\x06\x07": ((4, 4), (8, 8), (16, 4)),
    b"PK\x07\x08": ((4, 4), (8, 4), (12, 4)),
}


def _varint(n: int) -> bytes:
    """A protobuf varint of up to 70 bits (ten bytes, longer than any real one: a hostile field)."""
    return encode_varint(n & ((1 << 70) - 1))


def _interesting(draw, data: bytearray) -> int:
    return draw(st.one_of(st.sampled_from(INTERESTING + (len(data), len(data) + 1, len(data) - 1)),
                          st.integers(0, (1 << 64) - 1)))


def _flip(draw, data: bytearray) -> bytearray:
    at = draw(st.integers(0, len(data) - 1))
    data[at] ^= 1 << draw(st.integers(0, 7))
    return data


def _replace_byte(draw, data: bytearray) -> bytearray:
    at = draw(st.integers(0, len(data) - 1))
    data[at] = draw(st.one_of(st.sampled_from(b"\x00\xff\x7f\x80{}[]\",:0 "), st.integers(0, 255)))
    return data


def _int_field(draw, data: bytearray) -> bytearray:
    width = draw(st.sampled_from((1, 2, 4, 8)))
    at = draw(st.integers(0, max(0, len(data) - width)))
    value = _interesting(draw, data) & ((1 << (8 * width)) - 1)
    data[at:at + width] = value.to_bytes(width, draw(st.sampled_from(("little", "big"))))
    return data


def _varint_field(draw, data: bytearray) -> bytearray:
    """Replace the varint starting at a position (a protobuf length, tag or dim) by another."""
    at = draw(st.integers(0, len(data) - 1))
    end = at
    while end < len(data) and data[end] & 0x80 and end - at < 10:
        end += 1
    data[at:end + 1] = _varint(_interesting(draw, data))
    return data


def _truncate(draw, data: bytearray) -> bytearray:
    return data[:draw(st.integers(0, len(data) - 1))]


def _insert(draw, data: bytearray) -> bytearray:
    at = draw(st.integers(0, len(data)))
    data[at:at] = draw(st.binary(min_size=1, max_size=32))
    return data


def _delete(draw, data: bytearray) -> bytearray:
    at = draw(st.integers(0, len(data) - 1))
    del data[at:at + draw(st.integers(1, 64))]
    return data


def _duplicate(draw, data: bytearray) -> bytearray:
    start = draw(st.integers(0, len(data) - 1))
    piece = data[start:start + draw(st.integers(1, 256))]
    at = draw(st.integers(0, len(data)))
    data[at:at] = piece * draw(st.integers(1, 4))
    return data


def _json_number(draw, data: bytearray) -> bytearray:
    """Replace one number of a JSON text (a shape, an offset, a length) by an odd one."""
    found = list(_NUMBER.finditer(data))
    if not found:
        return _replace_byte(draw, data)
    match = found[draw(st.integers(0, len(found) - 1))]
    data[match.start():match.end()] = draw(st.sampled_from(NUMBERS))
    return data


def _zip_field(draw, data: bytearray) -> bytearray:
    """Replace one integer field of a zip record (sizes, offsets, name lengths, counts, CRC)."""
    starts = [m.start() for sig in _ZIP_FIELDS for m in re.finditer(re.escape(sig), bytes(data))]
    if not starts:
        return _int_field(draw, data)
    at = sorted(starts)[draw(st.integers(0, len(starts) - 1))]
    offset, width = draw(st.sampled_from(_ZIP_FIELDS[bytes(data[at:at + 4])]))
    if at + offset + width > len(data):
        return data
    value = _interesting(draw, data) & ((1 << (8 * width)) - 1)
    data[at + offset:at + offset + width] = value.to_bytes(width, "little")
    return data


GENERIC = (_flip, _replace_byte, _int_field, _truncate, _insert, _delete, _duplicate)
OPS = {"binary": GENERIC + (_varint_field,), "json": GENERIC + (_json_number,),
       "safetensors": GENERIC + (_json_number,), "zip": GENERIC + (_zip_field,), "protobuf": GENERIC + (_varint_field,)}


class Seeds(dict):
    """Seed bytes by path; a short repr, since hypothesis prints the strategies it reports on."""

    def __repr__(self) -> str:
        return f"Seeds({sorted(self)})"


@st.composite
def mutated(draw, seeds: Seeds, ops: tuple) -> tuple[str, bytes]:
    """One seed (by path) with 1 to 4 mutations; shrinks toward the first seed, a bit flip at 0."""
    rel = draw(st.sampled_from(sorted(seeds)))
    data = bytearray(seeds[rel])
    for _ in range(draw(st.integers(1, 4))):
        if not data:
            data = bytearray(draw(st.binary(min_size=1, max_size=16)))
            continue
        data = draw(st.sampled_from(ops))(draw, data)
    return rel, bytes(data)


# --- structure-aware generation ------------------------------------------------------------------

SAFETENSORS_DTYPES = ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64",
                      "BOOL", "F8_E4M3", "F8_E5M2", "F4", "F6_E2M3", "C64", "X9", "", "f32")
_dims = st.one_of(st.integers(0, 6), st.sampled_from((-1, 1 << 31, 1 << 62, 1 << 64)))
_odd_json = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=False), st.text(max_size=4),
                      st.lists(st.integers(-2, 3), max_size=3))


@st.composite
def safetensors_files(draw) -> bytes:
    """A header of random entries (dtypes, shapes, offsets mostly plausible, sometimes not),
    random `__metadata__`, a data buffer of about the size the entries claim."""
    header: dict[str, Any] = {}
    position = 0
    for i in range(draw(st.integers(0, 4))):
        dtype = draw(st.sampled_from(SAFETENSORS_DTYPES))
        shape = draw(st.lists(_dims, max_size=4))
        size = {"F64": 8, "I64": 8, "U64": 8, "C64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
                "I16": 2, "U16": 2}.get(dtype, 1)
        nbytes = size
        for n in shape:
            nbytes *= max(n, 0)
        nbytes = min(nbytes, 1 << 40)
        begin = draw(st.sampled_from((position, position, position + 1, 0, -1)))
        end = draw(st.sampled_from((begin + nbytes, begin + nbytes, begin + nbytes + 1, begin)))
        entry: dict[str, Any] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
        if draw(st.integers(0, 7)) == 0:
            entry[draw(st.sampled_from(("dtype", "shape", "data_offsets")))] = draw(_odd_json)
        header[draw(st.sampled_from(("w", "b", "x.y", "", "__metadata__", f"t{i}")))] = entry
        position = max(position, end if isinstance(end, int) else 0)
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(st.sampled_from(("format", "w", "crc_num", "DCP_SHARDING_INFO")),
                                                      st.one_of(st.sampled_from(("pt", "ms", "Int4", "{}", "[0]")),
                                                                _odd_json), max_size=3))
    raw = json.dumps(header).encode()
    raw += b" " * draw(st.integers(0, 7))
    length = draw(st.sampled_from((len(raw), len(raw), len(raw) + 1, len(raw) - 1, 0, 1 << 40)))
    data = bytes(min(max(position, 0), 4096) + draw(st.integers(-2, 2)) % 3)
    return struct.pack("<Q", length & ((1 << 64) - 1)) + raw + data


_GLOBALS = ("builtins set", "builtins range", "builtins bytearray", "builtins slice", "builtins complex",
            "builtins getattr", "collections OrderedDict", "torch Size", "torch float32", "torch device",
            "_codecs encode", "numpy dtype", "numpy ndarray", "numpy.core.multiarray _reconstruct",
            "numpy.core.multiarray scalar", "pathlib PosixPath", "datetime datetime", "os system",
            "torch._utils _rebuild_tensor_v2", "torch FloatStorage",
            "hyper_parallel.core.distributed_checkpoint.metadata Metadata",
            "hyper_parallel.core.distributed_checkpoint.metadata TensorStorageMetadata",
            "hyper_parallel.core.distributed_checkpoint.metadata ChunkStorageMetadata",
            "hyper_parallel.core.distributed_checkpoint.metadata MetadataIndex",
            "hyper_parallel.core.distributed_checkpoint.storage StorageInfo",
            "torch.distributed.checkpoint.metadata Metadata",
            "torch.distributed.checkpoint.metadata TensorProperties")
_OPCODE = st.one_of(
    st.sampled_from((pickle.MARK, pickle.EMPTY_LIST, pickle.EMPTY_DICT, pickle.EMPTY_TUPLE, pickle.EMPTY_SET,
                     pickle.APPEND, pickle.APPENDS, pickle.SETITEM, pickle.SETITEMS, pickle.ADDITEMS,
                     pickle.TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3, pickle.LIST, pickle.DICT,
                     pickle.FROZENSET, pickle.REDUCE, pickle.BUILD, pickle.NEWOBJ, pickle.NEWOBJ_EX, pickle.OBJ,
                     pickle.STACK_GLOBAL, pickle.MEMOIZE, pickle.POP, pickle.POP_MARK, pickle.DUP,
                     pickle.NONE, pickle.NEWTRUE, pickle.NEWFALSE, pickle.BINPERSID, pickle.STOP,
                     pickle.READONLY_BUFFER, pickle.NEXT_BUFFER)),
    st.binary(max_size=8).map(lambda b: pickle.BYTEARRAY8 + struct.pack("<Q", len(b)) + b),
    st.integers(-(1 << 31), (1 << 31) - 1).map(lambda n: pickle.BININT + struct.pack("<i", n)),
    st.sampled_from(INTERESTING).map(lambda n: pickle.LONG1 + bytes([8]) + (n & ((1 << 64) - 1)).to_bytes(8, "little")),
    st.binary(max_size=8).map(lambda b: pickle.SHORT_BINBYTES + bytes([len(b)]) + b),
    st.sampled_from(("a", "w", "torch", "Size", "builtins", "range", "utf-8", "latin1", "storage", "cpu")).map(
        lambda s: pickle.SHORT_BINUNICODE + bytes([len(s)]) + s.encode()),
    st.sampled_from(_GLOBALS).map(lambda g: pickle.GLOBAL + g.replace(" ", "\n").encode() + b"\n"),
    st.integers(0, 255).map(lambda n: pickle.BINGET + bytes([n])),
    st.integers(0, 255).map(lambda n: pickle.BINPUT + bytes([n])),
    st.sampled_from((0, 1, 1 << 20, 1 << 30, 0xFFFFFFFF)).map(lambda n: pickle.LONG_BINPUT + struct.pack("<I", n)),
    st.sampled_from((0, 1, 1 << 20, 0xFFFFFFFF)).map(lambda n: pickle.LONG_BINGET + struct.pack("<I", n)),
    st.sampled_from((0, 8, 1 << 40)).map(lambda n: pickle.FRAME + struct.pack("<Q", n)),
    st.sampled_from((0, 1, 1 << 31)).map(lambda n: pickle.BINFLOAT + struct.pack(">d", n)),
)


@st.composite
def pickle_programs(draw) -> bytes:
    """A pickle of random opcodes (allow-listed globals and refused ones, memo puts and gets far
    out, frames, reductions), usually ending in STOP."""
    body = b"".join(draw(st.lists(_OPCODE, min_size=1, max_size=40)))
    proto = pickle.PROTO + bytes([draw(st.sampled_from((2, 4, 5)))])
    return proto + body + (pickle.STOP if draw(st.integers(0, 4)) else b"")


@st.composite
def values_pickles(draw) -> bytes:
    """A stock pickle of a random value tree: what an honest `.bytes` holds, nested and shared."""
    leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8), st.binary(max_size=8))
    tree = draw(st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner),
                                                           st.dictionaries(st.text(max_size=4), inner, max_size=3),
                                                           st.frozensets(st.integers(), max_size=3)),
                             max_leaves=20))
    return pickle.dumps(tree, protocol=draw(st.sampled_from((0, 2, 4, 5))))


def _ckpt_value(tag: bytes, fields: bytes) -> bytes:
    value = b"\x0a" + _varint(len(tag)) + tag + b"\x12" + _varint(len(fields)) + fields
    return b"\x0a" + _varint(len(value)) + value


@st.composite
def ckpt_files(draw) -> bytes:
    """A `.ckpt` of random Values: tags repeated (split tensors), dims packed or not and negative,
    known and unknown tensor types, content of about the right size, unknown fields, maptensors,
    sometimes a CRC trailer (right or wrong)."""
    out = b""
    for _ in range(draw(st.integers(1, 4))):
        tag = draw(st.sampled_from((b"w", b"w", b"b", b"", b"\xff", b"run_name")))
        dims = draw(st.lists(st.one_of(st.integers(0, 5), st.sampled_from((-1, 1 << 40, (1 << 64) - 1))), max_size=4))
        kind = draw(st.sampled_from((b"Float32", b"Int64", b"BFloat16", b"Bool", b"str", b"Int4", b"Complex64", b"")))
        size = {b"Float32": 4, b"Int64": 8, b"BFloat16": 2, b"str": 4}.get(kind, 1)
        count = 1
        for d in dims:
            count *= max(d, 0)
        nbytes = min(count * size, 512) + draw(st.sampled_from((0, 0, 1, -1)))
        content = bytes(max(nbytes, 0))
        if draw(st.booleans()):
            fields = b"".join(b"\x08" + _varint(d) for d in dims)
        else:
            packed = b"".join(_varint(d) for d in dims)
            fields = b"\x0a" + _varint(len(packed)) + packed
        fields += b"\x12" + _varint(len(kind)) + kind + b"\x1a" + _varint(len(content)) + content
        if draw(st.integers(0, 5)) == 0:
            fields += draw(st.sampled_from((b"\x20\x01", b"\x2d\x00\x00\x00\x00", b"\x21" + bytes(8), b"\x07")))
        if draw(st.integers(0, 7)) == 0:
            value = b"\x0a" + _varint(len(tag)) + tag + b"\x1a" + _varint(len(fields)) + fields  # a maptensor
            out += b"\x0a" + _varint(len(value)) + value
        else:
            out += _ckpt_value(tag, fields)
    if draw(st.booleans()):
        import zlib

        crc = zlib.crc32(out) ^ draw(st.sampled_from((0, 0, 1)))
        out += b"crc_num" + crc.to_bytes(10, "big")
    return out


_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 65), 1 << 65), st.floats(allow_nan=False),
                       st.text(max_size=6))
json_values = st.recursive(_json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                               st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                           max_leaves=12)


@st.composite
def hf_indexes(draw, shards: tuple[str, ...], keys: tuple[str, ...]) -> bytes:
    """An index with a `weight_map` naming real and other tensors, real, missing, escaping and
    non-string shard files."""
    files = st.one_of(st.sampled_from(shards), st.sampled_from(("../x.safetensors", "/etc/passwd", "", "nope.bin",
                                                                 "model.safetensors.index.json")), _json_leaf)
    weight_map = draw(st.dictionaries(st.one_of(st.sampled_from(keys), st.text(max_size=4)), files, max_size=6))
    document: dict[str, Any] = {"weight_map": weight_map if draw(st.integers(0, 9)) else draw(json_values)}
    if draw(st.booleans()):
        document["metadata"] = draw(st.one_of(st.just({"total_size": draw(st.integers(-1, 1 << 64))}), json_values))
    return json.dumps(document).encode()


@st.composite
def sidecars(draw) -> bytes:
    """A values sidecar: entries of every type the writer uses, values of any JSON."""
    kinds = st.sampled_from(("int", "float", "str", "bool", "tuple", "list", "dict", "bytes", "bytearray", "NoneType",
                             "object", ""))
    special = st.one_of(st.fixed_dictionaries({"base64": st.one_of(st.sampled_from(("AAEC", "!!", "A", "")),
                                                                    _json_leaf)}),
                        st.fixed_dictionaries({"float": st.sampled_from(("nan", "inf", "-inf", "1.5", ""))}))
    entry = st.fixed_dictionaries({"type": kinds, "value": st.one_of(json_values, special)})
    document = draw(st.dictionaries(st.sampled_from(("step", "cfg", "lr", "name", "")), st.one_of(entry, json_values),
                                    max_size=4))
    return json.dumps(document).encode()


@st.composite
def hpckpt_records(draw, metadata_bytes: int) -> bytes:
    """`.hpckpt.json` records: plausible fields, sometimes replaced by other JSON."""
    doc: dict[str, Any] = {"hpckpt": draw(st.sampled_from((1, 0, True, "1", 2))),
                           "written_by": "hpckpt fuzz",
                           "format": draw(st.sampled_from(("hyperparallel", "torch-dcp", "", None))),
                           "world_size": draw(st.one_of(st.integers(-1, 5), st.sampled_from((4096, 1 << 20, 1 << 21)),
                                                        _json_leaf)),
                           "metadata": draw(st.one_of(
                               st.just({".metadata": {"bytes": metadata_bytes, "sha256": "0" * 64}}),
                               st.dictionaries(st.sampled_from((".metadata", "../x", "_rank0_.bytes")),
                                               st.one_of(st.dictionaries(st.sampled_from(("bytes", "sha256")),
                                                                         _json_leaf), _json_leaf), max_size=2)))}
    if draw(st.booleans()):
        doc["mesh"] = draw(st.one_of(st.lists(st.integers(-1, 4), max_size=3), _json_leaf))
        doc["placements"] = draw(st.one_of(st.sampled_from(("S0", "R", "S9", "")), _json_leaf))
    if draw(st.integers(0, 5)) == 0:
        del doc[draw(st.sampled_from(sorted(doc)))]
    return json.dumps(doc).encode()


@st.composite
def hp_metadata_objects(draw, seeds: Seeds, rel: str) -> bytes:
    """The seed's HyperParallel metadata, loaded, with one field somewhere replaced (by another
    field's value, an odd value, or a structure of the wrong class), written as HyperParallel
    writes it: a well-formed pickle whose schema is wrong."""
    from hpckpt.core.codecs import hyperparallel_metadata as hp
    from hpckpt.core.safety import unpickle

    seed = seeds[rel]
    tree = unpickle.loads(seed, what="seed", kind=unpickle.METADATA)
    holders: list[Any] = []  # (object with __dict__, field) or (dict, key) or (list, index)

    def walk(obj: Any, depth: int) -> None:
        if depth > 6:
            return
        if hasattr(obj, "__dict__") and type(obj).__module__.startswith("hpckpt"):
            for name, value in vars(obj).items():
                holders.append((obj, name))
                walk(value, depth + 1)
        elif isinstance(obj, dict):
            for key, value in list(obj.items())[:6]:
                holders.append((obj, key))
                walk(value, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for value in obj[:6]:
                walk(value, depth + 1)

    walk(tree, 0)
    odd = st.one_of(_json_leaf, st.sampled_from((-1, 1 << 63, (1 << 64), (), (0,), (-1, 2), [1, 2, 3], {}, [],
                                                  "torch.float32", "../../etc/passwd", "float99")))
    holder, name = holders[draw(st.integers(0, len(holders) - 1))]
    replacement = draw(st.one_of(odd, st.builds(hp.ChunkStorageMetadata, st.just((0,)), st.just((1,))),
                                 st.builds(hp.StorageInfo, st.sampled_from(("_rank0_.safetensors", "../x", "")),
                                           st.sampled_from((0, -1, 1 << 40)), st.sampled_from((0, 4, -1)))))
    if not isinstance(holder, dict):
        holder.__dict__[name] = replacement  # (a field left out cannot be dumped: byte mutations do that)
    elif draw(st.booleans()):
        holder[name] = replacement
    else:
        holder.pop(name)
    try:
        return hp.dumps_metadata(tree)
    except (HpckptError, TypeError, ValueError, pickle.PicklingError, AttributeError, RecursionError):
        return seed


# --- the targets ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One parser to fuzz: the files it is fed in place of (paths relative to the samples), how
    their mutations are made, the entry point, and extra generators (`root, seeds -> strategy of
    (rel, bytes)`)."""

    name: str
    seeds: Callable[[Path], list[str]]
    ops: str
    entry: Callable[[Path], None]
    generators: tuple[Callable[[Path, dict[str, bytes]], st.SearchStrategy], ...] = ()

    def strategy(self, root: Path) -> st.SearchStrategy:
        seeds = Seeds({rel: (root / rel).read_bytes() for rel in self.seeds(root)})
        made = [mutated(seeds, OPS[self.ops])] + [g(root, seeds) for g in self.generators]
        return st.one_of(*made)


def _at(rel: str, strategy: st.SearchStrategy) -> st.SearchStrategy:
    return strategy.map(lambda data: (rel, data))


def _hf_index_generator(root: Path, seeds: dict[str, bytes]) -> st.SearchStrategy:
    keys = tuple(json.loads(seeds["hf/model.safetensors.index.json"])["weight_map"])
    shards = tuple(sorted(p.name for p in (root / "hf").glob("*.safetensors")))
    return _at("hf/model.safetensors.index.json", hf_indexes(shards, keys))


def _record_generator(root: Path, seeds: dict[str, bytes]) -> st.SearchStrategy:
    return _at("hp-tiny-legacy/.hpckpt.json", hpckpt_records((root / "hp-tiny-legacy" / ".metadata").stat().st_size))


def _manifest_generator(root: Path, seeds: dict[str, bytes]) -> st.SearchStrategy:
    """hp-tiny's manifest with one field of its header, or of one box, replaced by another JSON value."""
    rel = "hp-tiny/.hpckpt-manifest.jsonl"
    header, *lines = seeds[rel].decode().splitlines()
    doc = json.loads(header)
    values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.text(max_size=40),
                          lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=4), max_leaves=8)

    @st.composite
    def edited(draw) -> bytes:
        head, body = dict(doc), list(lines)
        if draw(st.booleans()) or not body:
            head[draw(st.sampled_from(sorted(head) + ["files", "metadata", "index"]))] = draw(values)
        else:
            i = draw(st.integers(0, len(body) - 1))
            line = json.loads(body[i])
            if line["boxes"] and draw(st.booleans()):
                box = line["boxes"][draw(st.integers(0, len(line["boxes"]) - 1))]
                box[draw(st.integers(0, 4))] = draw(values)
            else:
                line[draw(st.sampled_from(["file", "boxes"]))] = draw(values)
            body[i] = json.dumps(line)
        return ("\n".join([json.dumps(head), *body]) + "\n").encode()

    return _at(rel, edited())


def _hp_objects_generator(root: Path, seeds: dict[str, bytes]) -> st.SearchStrategy:
    return st.sampled_from(sorted(seeds)).flatmap(lambda rel: _at(rel, hp_metadata_objects(seeds, rel)))


def _files(*rels: str) -> Callable[[Path], list[str]]:
    return lambda root: [r for r in rels if (root / r).is_file()]


HP_METADATA = ("hp-ms1/.metadata", "hp-ms1-nodist/0.metadata", "hp-t4/.metadata", "hp-t4-async/.metadata",
               "hp-legacy/.metadata", "hp-legacy-rl/.rank0_metadata", "hp-tiny/.metadata")

TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("safetensors", _files("hf/model-00001-of-00002.safetensors", "hf/model-00002-of-00002.safetensors",
                                 "st/model.safetensors", "hp-ms1/_rank0_.safetensors"),
           "safetensors", safetensors_target,
           (lambda root, seeds: _at("hf/model-00001-of-00002.safetensors", safetensors_files()),)),
    Target("pickle", pickle_seeds, "binary", pickle_target,
           (lambda root, seeds: _at("pickles/data.pkl", pickle_programs()),
            lambda root, seeds: _at("pickles/data.pkl", values_pickles()))),
    Target("hp-metadata", _files(*HP_METADATA), "binary", directory_target, (_hp_objects_generator,)),
    Target("hp-values", _files("hp-ms1/_rank0_.bytes", "hp-t4-async/_rank1_.bytes",
                               "hp-legacy/extra_state.config_rank1.bytes", "hp-tiny/_rank0_.bytes"),
           "binary", directory_target,
           (lambda root, seeds: _at("hp-ms1/_rank0_.bytes", st.one_of(values_pickles(), pickle_programs())),)),
    Target("dcp-metadata", _files("dcp/.metadata"), "binary", directory_target),
    Target("dcp-data", _files("dcp/__0_0.distcp"), "zip", directory_target),
    Target("torch-save", _files("pt/state.pt", "hf-bin/pytorch_model-00001-of-00002.bin"), "zip", torch_save_target),
    Target("ckpt", _files("ms/net.ckpt", "ms-crc/net.ckpt"), "protobuf", ckpt_target,
           (lambda root, seeds: _at("ms/net.ckpt", ckpt_files()),)),
    Target("hf-index", _files("hf/model.safetensors.index.json", "hf-bin/pytorch_model.bin.index.json"), "json",
           hf_index_target, (_hf_index_generator,)),
    Target("values-sidecar", _files("st/model.values.json"), "json", sidecar_target,
           (lambda root, seeds: _at("st/model.values.json", sidecars()),)),
    Target("hpckpt-json", _files("hp-tiny-legacy/.hpckpt.json"), "json", directory_target, (_record_generator,)),
    Target("manifest", _files("hp-tiny/.hpckpt-manifest.jsonl", "st/model.safetensors.hpckpt-manifest.jsonl"), "json",
           manifest_target, (_manifest_generator,)),
)}


def main() -> int:
    if sys.argv[1:2] == ["build"]:
        build_samples(Path(sys.argv[2]))
        return 0
    if sys.argv[1:2] == ["replay"]:
        root, name, rel, file = sys.argv[2:6]
        print(run_input(Path(root), TARGETS[name], rel, Path(file).read_bytes()))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
