"""`read_columns` (core/codecs/hyperparallel_metadata_columns_read.py) reads the `.metadata` the
columns writer writes into the same index the unpickler's path gives (tensors, chunk boxes,
files, keys, values, planner data, version), frames split anywhere the writer may split them;
and for anything else, another writer's pickle or any mutation of the writer's bytes, it either
gives that same index or None (never an index the unpickler would not give)."""

from __future__ import annotations

import pickletools
import string

import numpy as np
import pytest
from _util import FIXTURES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_metadata_columns import _both, _plan

import hpckpt.core.codecs.hyperparallel_metadata_columns as columns_writer
from hpckpt.converters.hyperparallel.reader import _ColumnSource, _Source
from hpckpt.core.codecs.hyperparallel_metadata_columns import TensorColumns, ValueColumns, dumps_metadata_columns
from hpckpt.core.codecs.hyperparallel_metadata_columns_read import read_columns
from hpckpt.core.errors import HpckptError
from hpckpt.core.safety.unpickle import METADATA, loads


def _index(data: bytes, fast: bool):
    """What the reader's index holds, through `read_columns` (fast) or the safe unpickler."""
    if fast:
        columns = read_columns(data)
        return None if columns is None else _index_of_columns(columns)
    metadata = loads(data, what="m", kind=METADATA)
    source = _Source(metadata, "m")
    return _index_of(source, (metadata.planner_data, metadata.version,
                              {v.relative_path for v in metadata.storage_data.values()}))


def _index_of_columns(columns):
    return _index_of(_ColumnSource(columns, "m"), (columns.planner_data, columns.version, columns.data_files()))


def _index_of(source, extra):
    tensors, values, replicas = {}, {}, []
    source.merge_into(tensors, values, replicas)
    out = {}
    for fqn, entry in tensors.items():
        offsets, sizes = entry.chunk_arrays()
        files = entry.chunk_files()
        some = entry.chunk_files([i for i in range(entry.n_chunks) if i % 2])
        chunks = [(c.box.offsets, c.box.sizes, c.file, c.key) for c in entry.chunks]
        out[fqn] = (str(entry.dtype), entry.dtype_spelling, entry.shape, entry.n_chunks, offsets.tolist(),
                    sizes.tolist(), files, some, chunks)
    return out, {f: (v.file, v.offset, v.length) for f, v in values.items()}, replicas, extra


@pytest.mark.parametrize("dedup,ragged,framework", [("balanced", True, "torch"), ("lowest-rank", False, "mindspore"),
                                                      ("none", True, "torch")])
@pytest.mark.parametrize("frame_bytes", [1 << 20, 1])
def test_a_plan_written_from_columns_reads_as_the_unpickler_reads(dedup, ragged, framework, frame_bytes, monkeypatch):
    """Plans with uneven, replicated, 0-d, 3-D, 5-D and empty tensors, values, key paths, a
    rank holding several chunks of one tensor (renamed keys), every replica stored (dedup
    "none": chunks at equal offsets share one storage_data key, the last one's file for all);
    `frame_bytes` 1 puts a frame boundary at every place the writer may put one."""
    monkeypatch.setattr(columns_writer, "FRAME_BYTES", frame_bytes)
    data = _both(_plan(dedup, ragged), framework)[1]
    fast = _index(data, fast=True)
    assert fast is not None, "the columns writer's own output was not recognised"
    assert fast == _index(data, fast=False)
    assert fast[0] and fast[1] and fast[3][0], "the plan lost its tensors, values or key paths"


def test_other_pickles_are_left_to_the_unpickler():
    """The stock pickler's `.metadata` of the same plan, HyperParallel's own, a cut or a longer
    file give None."""
    assert read_columns(_both(_plan("balanced", True))[0]) is None
    for name in ("m0-torch-4rank", "m0-mindspore-1rank", "legacy-torch-4rank"):
        assert read_columns((FIXTURES / name / ".metadata").read_bytes()) is None, name
    data = _both(_plan("balanced", True))[1]
    for cut in (0, 1, 2, 11, len(data) // 2, len(data) - 1):
        assert read_columns(data[:cut]) is None, cut
    assert read_columns(data + b"\x00") is None


_NAME = st.text(string.ascii_letters + "._é\u0394", min_size=0, max_size=12)


@st.composite
def _tables(draw):
    """Tensors of 0-5 dims with 0-5 chunks (anywhere in the 4-byte range, or near 0: chunks at
    equal offsets, of equal or other sizes), keys that are the name, another name or empty;
    values; planner data; a version."""
    names = draw(st.lists(_NAME, min_size=1, max_size=7, unique=True))
    n_values = draw(st.integers(0, min(2, len(names) - 1)))
    world = draw(st.integers(1, 4))
    tensors = []
    for fqn in names[n_values:]:
        ndim = draw(st.integers(0, 5))
        shape = tuple(draw(st.lists(st.integers(0, 2**12), min_size=ndim, max_size=ndim)))  # (bytes fit int64)
        n = draw(st.integers(0, 5)) if ndim else draw(st.integers(0, 1))
        value = st.integers(0, 2**31 - 1) if draw(st.booleans()) else st.integers(0, 2)  # small: equal boxes
        rows = draw(st.lists(st.tuples(*[value] * (2 * ndim)), min_size=n, max_size=n))
        offsets = np.array([r[:ndim] for r in rows], np.int64).reshape(n, ndim)
        sizes = np.array([r[ndim:] for r in rows], np.int64).reshape(n, ndim)
        keys = draw(st.none() | st.lists(st.sampled_from([fqn, "", "k.0"]), min_size=n, max_size=n))
        ranks = np.array(draw(st.lists(st.integers(0, world - 1), min_size=n, max_size=n)), np.int64)
        tensors.append(TensorColumns(fqn, draw(st.sampled_from(["torch.float32", "BFloat16", "torch.int8"])), shape,
                                     offsets, sizes, ranks, np.arange(n), keys))
    values = [ValueColumns(fqn, f"_rank{draw(st.integers(0, world - 1))}_.bytes", draw(st.integers(0, 2**40)),
                           draw(st.integers(0, 300))) for fqn in names[:n_values]]
    planner = draw(st.none() | st.dictionaries(_NAME, st.tuples(_NAME, st.integers(-5, 2**40)), max_size=3))
    version = draw(st.sampled_from(["1.0", "2.0", ""]))
    files = [f"_rank{r}_.safetensors" for r in range(world)]
    return dumps_metadata_columns(tensors, values, files, planner_data=planner, version=version)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=_tables(), frame_bytes=st.sampled_from([1 << 20, 1, 40]))
def test_any_table_written_from_columns_reads_as_the_unpickler_reads(data, frame_bytes):
    columns_writer.FRAME_BYTES = frame_bytes
    try:
        fast = _fast_or_error(data)
    finally:
        columns_writer.FRAME_BYTES = 1 << 20
    assert fast is not None, "the columns writer's own output was not recognised"
    assert fast == _slow_or_error(data)


def _fast_or_error(data: bytes):
    try:
        return _index(data, fast=True)
    except HpckptError as exc:
        return f"error: {exc}"


def _slow_or_error(data: bytes):
    try:
        return _index(data, fast=False)
    except (HpckptError, RecursionError) as exc:
        return f"error: {exc}"


def mutated(sample: bytes, at: int, kind: str, value: int, length: int) -> bytes:
    """`sample` with a byte set, a bit flipped, or `length` bytes deleted or repeated, at `at`."""
    data = bytearray(sample)
    if kind == "byte":
        data[at] = value
    elif kind == "bit":
        data[at] ^= 1 << (value % 8)
    elif kind == "delete":
        del data[at:at + length]
    else:
        data[at:at] = data[at:at + length]
    return bytes(data)


_SAMPLE = _both(_plan("balanced", True))[1]
#: Where the sample has a BININT or a memo reference: their bytes are values, which a mutation
#: there changes while keeping the shape (so the recogniser accepts it and must agree).
_ARGUMENTS = [i + 1 for i, op in enumerate(_SAMPLE) if op in (0x4A, 0x6A)]
#: The bytes of the sample's strings (names, files, keys): changed, the shape stays.
_TEXT = [pos + 5 + k for op, arg, pos in pickletools.genops(_SAMPLE) if op.name == "BINUNICODE"
         for k in range(len(arg.encode("utf-8", "surrogatepass")))]


@settings(max_examples=500, deadline=None)
@given(at=st.integers(0, len(_SAMPLE) - 1), kind=st.sampled_from(["byte", "delete", "repeat", "bit", "argument", "text"]),
       value=st.integers(0, 255), length=st.integers(1, 40), argument=st.sampled_from(_ARGUMENTS),
       text=st.sampled_from(_TEXT))
def test_a_mutated_file_reads_as_the_unpickler_reads_it_or_not_at_all(at, kind, value, length, argument, text):
    """A byte set, a bit flipped, a range deleted or repeated, anywhere, or an integer's or a
    memo reference's or a string's bytes changed: `read_columns` gives the unpickler's index or None, never
    another one (and never where the unpickler fails)."""
    data = bytearray(_SAMPLE)
    if kind == "argument":
        data[argument + at % 2] = value  # its low bytes: a small memo index stays in the memo
    elif kind == "text":
        data[text] = 0x21 + value % 94  # printable ASCII: still UTF-8
    data = bytes(data) if kind in ("argument", "text") else mutated(_SAMPLE, at, kind, value, length)
    try:
        fast = _index(data, fast=True)
    except HpckptError as exc:  # the index refused a field (a dtype, a shape): so must the unpickler's path
        assert str(_slow_or_error(data)).startswith("error"), f"refused what the unpickler's path reads: {exc}"
        return
    if fast is not None:
        assert fast == _slow_or_error(data)


def test_the_records_are_what_is_recognised_not_what_is_near_them(monkeypatch):
    """Targeted changes the recogniser must refuse: a negative size, two chunks of a tensor at
    the same offsets, a memo reference from a string to a class, a frame boundary moved inside
    the records."""
    monkeypatch.setattr(columns_writer, "FRAME_BYTES", 1)  # a frame for every part

    def write(offsets, sizes):
        t = TensorColumns("w", "torch.float32", (8, 4), np.array(offsets), np.array(sizes), np.array([0, 1]),
                          np.array([0, 1]))
        return dumps_metadata_columns([t], [], ["_rank0_.safetensors", "_rank1_.safetensors"], planner_data=None,
                                      version="1.0")

    good = write([[0, 0], [4, 0]], [[4, 4], [4, 4]])
    assert read_columns(good) is not None
    assert read_columns(write([[0, 0], [4, 0]], [[4, 4], [4, -4]])) is None
    twice = write([[0, 0], [0, 0]], [[4, 4], [4, 4]])  # one storage_data key: rank 1's file for both
    assert _fast_or_error(twice) == _slow_or_error(twice)
    assert [c[2] for c in _fast_or_error(twice)[0]["w"][-1]] == ["_rank1_.safetensors"] * 2
    # the reference to "torch.float32" made one to memo index 0 (the Metadata class)
    ref = b"j" + _memo_index(good, b"torch.float32").to_bytes(4, "little")
    assert good.count(ref) == 1
    assert read_columns(good.replace(ref, b"j\0\0\0\0")) is None
    # the longest frame (records) made 3 bytes shorter, the next one 3 bytes longer
    frames = _frames(good)
    i = max(range(len(frames) - 1), key=lambda k: frames[k][1])
    (at, length), (next_at, next_length) = frames[i], frames[i + 1]
    moved = bytearray(good)
    moved[next_at + 1:next_at + 9] = (next_length + 3).to_bytes(8, "little")
    moved[next_at + 9:next_at + 9] = moved[next_at - 3:next_at]
    header = moved[next_at:next_at + 9]
    del moved[next_at - 3:next_at + 9]
    moved[next_at - 3:next_at - 3] = header
    moved[at + 1:at + 9] = (length - 3).to_bytes(8, "little")
    assert len(moved) == len(good) and moved != good
    assert read_columns(bytes(moved)) is None


def _frames(data: bytes) -> list[tuple[int, int]]:
    """(position of the FRAME opcode, length) of each frame."""
    out, at = [], 2
    while at < len(data):
        assert data[at] == 0x95
        length = int.from_bytes(data[at + 1:at + 9], "little")
        out.append((at, length))
        at += 9 + length
    return out


def _memo_index(data: bytes, text: bytes) -> int:
    """The memo index the preamble gives the string `text` (it is followed by LONG_BINPUT)."""
    at = data.index(b"X" + len(text).to_bytes(4, "little") + text) + 5 + len(text)
    if data[at] == 0x95:  # a frame starts between them
        at += 9
    assert data[at] == 0x72
    return int.from_bytes(data[at + 1:at + 5], "little")


def _ref(data: bytes, text: bytes) -> bytes:
    return b"j" + _memo_index(data, text).to_bytes(4, "little")


def test_what_the_unpickled_dicts_would_collapse_is_refused():
    """A file the writer never makes but the unpickler reads, where a dict keeps one of two equal
    keys: a tensor or value named twice, a planner_data key given twice, a chunk's file
    reference pointing at a class. Each is refused (the unpickler's path then reads it)."""
    tensors = [TensorColumns(name, "torch.float32", (4,), np.array([[0]]), np.array([[4]]), np.array([0]),
                             np.array([0])) for name in ("a", "b")]
    values = [ValueColumns(name, "_rank0_.bytes", 0, 3) for name in ("u", "v")]
    good = dumps_metadata_columns(tensors, values, ["_rank0_.safetensors"], planner_data={"p": ("x",), "q": ("y",)},
                                  version="1.0")
    assert _fast_or_error(good) == _slow_or_error(good) and read_columns(good) is not None
    crafted = {
        "tensor named twice": good.replace(_ref(good, b"b"), _ref(good, b"a")),
        "value named twice": good.replace(_ref(good, b"v"), _ref(good, b"u")),
        "planner key twice": good.replace(b"X\x01\x00\x00\x00q", b"X\x01\x00\x00\x00p"),
        "file is a class": good.replace(_ref(good, b"_rank0_.safetensors"), b"j\0\0\0\0"),
    }
    for what, data in crafted.items():
        assert data != good, what
        assert read_columns(data) is None, what
        assert not str(_slow_or_error(data)).startswith("error") or what == "file is a class", what
