"""`read_stock_columns` (core/codecs/hyperparallel_metadata_stock_read.py) reads the `.metadata`
the stock pickler writes (HyperParallel's own writer) into the same index the unpickler's path
gives, or gives None; never another index, and never one where the unpickler's path fails.
Compared on HyperParallel's own files, on generated ones (batches of over 1,000 chunks and
entries, every shape the columns tests draw) and on mutated and crafted ones."""

from __future__ import annotations

import contextlib
import struct

import numpy as np
import pytest
from _util import FIXTURES
from hypothesis import given, settings
from hypothesis import strategies as st
from test_metadata_columns import _both, _plan, _plan_of_chunks
from test_metadata_columns_read import _index_of_columns, _tables, mutated
from test_metadata_columns_read import _slow_or_error as _slow

from hpckpt.core.codecs import hyperparallel_metadata_stock_read as stock
from hp_reference import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorProperties,
    TensorStorageMetadata,
    dump_hp,
)

from hpckpt.core.codecs.hyperparallel_metadata import dumps_metadata
from hpckpt.core.codecs.hyperparallel_metadata_stock_read import read_stock_columns
from hpckpt.core.errors import HpckptError
from hpckpt.core.safety.unpickle import METADATA, loads


@contextlib.contextmanager
def _halves(on: bool):
    """Within, with `on`: every pass the reader may split in two (the records, the scan for
    objects) is split, at any size and core count; the default splits only large files."""
    saved = stock.HALVES_FROM, stock._two_cores
    if on:
        stock.HALVES_FROM, stock._two_cores = 1, lambda: True
    try:
        yield
    finally:
        stock.HALVES_FROM, stock._two_cores = saved


def _fast(data: bytes, halves: bool = False):
    """The index through `read_stock_columns` (None: not taken), or the error building it gave;
    `halves`: every pass split in two, on two threads."""
    with _halves(halves):
        columns = read_stock_columns(data)
    if columns is None:
        return None
    try:
        return _index_of_columns(columns)
    except HpckptError as exc:
        return f"error: {exc}"


def _same_or_none(data: bytes, *, taken: bool = False, halves: bool = False):
    fast = _fast(data, halves)
    if taken:
        assert fast is not None, "not taken"
    if fast is not None:  # (an error building the index, two chunks' boxes clashing: the same one)
        assert fast == _slow(data)
    return fast


@pytest.mark.parametrize("halves", [False, True])
@pytest.mark.parametrize("name", ["m0-torch-4rank", "m0-torch-4rank-async", "legacy-torch-4rank",
                                  "m0-mindspore-1rank"])
def test_hyperparallel_s_own_files_read_as_the_unpickler_reads_them(name, halves):
    """MindSpore's writer keys storage_data with the chunks' own offsets tuples and shares one
    tuple among chunks (memo references into other records and the skeleton): resolved too,
    and alike with every pass in two halves on two threads."""
    assert _same_or_none((FIXTURES / name / ".metadata").read_bytes(), taken=True, halves=halves)[0]


@pytest.mark.parametrize("dedup,ragged,framework", [("balanced", True, "torch"), ("lowest-rank", False, "mindspore"),
                                                      ("none", True, "torch")])
def test_a_plan_written_by_the_stock_pickler_reads_as_the_unpickler_reads(dedup, ragged, framework):
    """Uneven, replicated, 0-d, 3-D, 5-D and empty tensors, values, key paths; every replica
    stored (dedup "none": chunks at equal offsets share one storage_data key, the value stored
    last for them all). In two halves too: records of 0 to 5 dimensions, so one half's columns
    of tuple items are narrower than the other's."""
    data = _both(_plan(dedup, ragged), framework)[0]
    fast = _same_or_none(data, taken=True)
    assert fast[0] and fast[1] and fast[3][0]
    assert _same_or_none(data, taken=True, halves=True) == fast


def test_batches_of_a_thousand_chunks_and_entries_read_as_the_unpickler_reads():
    """1,030 ranks: each chunk list and storage_data written in batches of 1,000 (MARK ...
    APPENDS/SETITEMS), the records in 64 KiB frames cut anywhere between opcodes."""
    data = _both(_plan_of_chunks(1030), "torch")[0]
    assert data.count(b"\x95") > 10
    fast = _same_or_none(data, taken=True)
    assert sum(entry[3] for entry in fast[0].values()) > 24 * 1030
    assert _same_or_none(data, taken=True, halves=True) == fast


@settings(max_examples=60, deadline=None)
@given(columns=_tables(), halves=st.booleans())
def test_any_table_pickled_by_the_stock_pickler_reads_as_the_unpickler_reads(columns, halves):
    """Every table the columns tests draw (0-5 dims, chunks anywhere in the 4-byte range or at
    equal offsets, keys, values, planner data), loaded and pickled again as HyperParallel does."""
    data = dumps_metadata(loads(columns, what="m", kind=METADATA))
    _same_or_none(data, halves=halves)


def _sample() -> bytes:
    return _both(_plan("balanced", True))[0]


_SAMPLES = [_sample(), (FIXTURES / "m0-mindspore-1rank" / ".metadata").read_bytes()]  # (the second shares tuples)


@settings(max_examples=400, deadline=None)
@given(which=st.sampled_from([0, 1]), at=st.integers(0, 1 << 20), kind=st.sampled_from(["byte", "delete", "repeat", "bit"]),
       value=st.integers(0, 255), length=st.integers(1, 40), halves=st.booleans())
def test_a_mutated_file_reads_as_the_unpickler_reads_it_or_not_at_all(which, at, kind, value, length, halves):
    sample = _SAMPLES[which]
    data = mutated(sample, at % len(sample), kind, value, length)
    fast = _fast(data, halves)
    if isinstance(fast, str):  # the index refused a field: so must the unpickler's path
        assert str(_slow(data)).startswith("error"), fast
    elif fast is not None:
        assert fast == _slow(data)


def _chunks_file(n: int = 6, shared: bool = False) -> bytes:
    """One tensor of `n` row chunks, stored by two ranks (files pushed inside the records), by
    the stock pickler; `shared`: the keys' offsets are the chunks' own tuples."""
    chunks = [ChunkStorageMetadata((i, 0), tuple([1, 4])) for i in range(n)]  # (each its own tuples)
    state = {"w": TensorStorageMetadata(TensorProperties("torch.float32"), (n, 4), chunks)}
    storage = {MetadataIndex("w", c.offsets if shared else tuple(list(c.offsets)), i):
               StorageInfo(f"_rank{i % 2}_.safetensors", 16 * i, 16, "w") for i, c in enumerate(chunks)}
    return dump_hp(Metadata(state, {"w": ("w",)}, storage))


def test_what_the_records_leave_to_the_skeleton_is_checked():
    """Crafted files the walk and the assembly must refuse, each read by the unpickler alike or
    refused by it: a reference from the skeleton to a record's memo entry that is not a string,
    a storage key's offsets that are not its chunk's, two entries for one chunk, a frame cut
    inside an opcode, trailing bytes."""
    good = _chunks_file()
    assert _same_or_none(good, taken=True)
    reader = stock._StockReader(good, "m")
    reader.read()
    assert {kind for kind, *_ in reader.entered} == {stock._CHUNK, stock._STORAGE}, "no runs of records entered"
    # the keys sharing the chunks' tuples (as MindSpore's writer does): resolved, the same index
    shared = _chunks_file(shared=True)
    assert shared.count(b"K\x03K\x00\x86") == 1 and _same_or_none(shared, taken=True)
    # a key's offsets changed: (3, 0) -> (2, 0), the storage entry is then another chunk's
    at = good.index(b"K\x03K\x00\x86", good.index(b"storage_data"))
    moved = good[:at] + b"K\x02" + good[at + 2:]
    assert read_stock_columns(moved) is None
    assert _slow(moved) != _slow(good) or str(_slow(moved)).startswith("error")
    # an index changed: two entries for chunk 1
    index_at = good.index(b"K\x03u", at)  # chunk 3's index, after its offsets
    twice = good[:index_at] + b"K\x01" + good[index_at + 2:]
    assert read_stock_columns(twice) is None
    # trailing bytes after the STOP
    assert read_stock_columns(good + b"N") is None
    # the frame made one byte longer, the pickle's first opcode inside it then one byte off
    framed = bytearray(good)
    assert framed[2] == 0x95
    framed[3:11] = struct.pack("<Q", struct.unpack("<Q", framed[3:11])[0] + 1)
    assert read_stock_columns(bytes(framed)) is None


def _referring_file(n: int = 40) -> bytes:
    """Tensors a, b and c of `n` row chunks; the skeleton refers into the runs: planner_data holds
    a chunk's offsets tuple (the record's own object), and a value's storage entry, between a's
    and b's, names a file whose string a's storage records pushed (one object for them all)."""
    paths = [f"_rank{r}_.safetensors" for r in range(2)]
    state, storage, planner = {}, {}, {}
    for name in ("a", "b", "c"):
        chunks = [ChunkStorageMetadata((i, 0), tuple([1, 4])) for i in range(n)]
        state[name] = TensorStorageMetadata(TensorProperties("torch.float32"), (n, 4), chunks)
        planner[name] = chunks[n // 2].offsets
    state["step"] = BytesStorageMetadata()
    for name in ("a", "step", "b", "c"):
        if name == "step":
            storage[MetadataIndex("step")] = StorageInfo(paths[1], 0, 8)
            continue
        for i in range(n):
            storage[MetadataIndex(name, (i, 0), i)] = StorageInfo(paths[i % 2], 16 * i, 16, name)
    return dump_hp(Metadata(state, planner, storage))


@pytest.mark.parametrize("halves", [False, True])
def test_what_the_skeleton_refers_to_in_a_run_is_pushed_again(halves):
    """A run's memo entries are not made in the skeleton, every reference after it renumbered;
    the string and the tuple the skeleton refers to are pushed again by the markers, and what
    comes after them is numbered with them: the same index as the unpickler's."""
    data = _referring_file()
    assert _same_or_none(data, taken=True, halves=halves)
    reader = stock._StockReader(data, "m")
    reader.read()
    assert {type(v) for v in reader.spliced.values()} == {bytes} and len(reader.spliced) >= 2
    assert any(b"_rank" in v for v in reader.spliced.values()), "no file name pushed again"
    assert any(b"_rank" not in v for v in reader.spliced.values()), "no tuple pushed again"


def test_a_frame_cut_inside_a_record_between_its_opcodes_is_read():
    """The records of a long list across 64 KiB frames: every cut between two opcodes of a
    record, checked; one moved by a byte into an opcode is refused."""
    data = _chunks_file(3000)
    cuts = []
    at = 2
    while at < len(data):
        cuts.append(at)
        at += 9 + struct.unpack("<Q", data[at + 1:at + 9])[0]
    assert len(cuts) > 2
    assert _same_or_none(data, taken=True)
    reader = stock._StockReader(data, "m")
    reader.read()
    assert reader.inner_cuts, "no frame cut inside a run of records"


def test_a_marker_cannot_be_forged():
    """The markers are integers offset by a fresh random number each read: an int in the
    skeleton where a chunk was is refused, not taken for a record."""
    chunks = [ChunkStorageMetadata((0, 0), (1, 4)), 2**61]
    state = {"w": TensorStorageMetadata(TensorProperties("torch.float32"), (2, 4), chunks)}
    data = dump_hp(Metadata(state, None, {}))
    assert read_stock_columns(data) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 300), max_size=40), st.lists(st.integers(-3, 310), max_size=40),
       st.sampled_from([0, 1 << 40]))
def test_the_lookups_by_table_answer_as_sorting_and_searching_do(keys, queries, far):
    """`_distinct` and `_find` build a table where the values are small; far ones (what a hostile
    file could name), negative ones and repeated keys go the sorting way; both answer alike."""
    values = np.array(keys + [far] * bool(far), np.int64)
    assert stock._distinct(values).tolist() == np.unique(values).tolist()
    keys_ = np.unique(values)
    asked = np.array(queries + [far, far + 1], np.int64)
    at, hit = stock._find(keys_, asked)
    assert hit.tolist() == np.isin(asked, keys_).tolist()
    assert (keys_[at[hit]] == asked[hit]).all() if len(keys_) else not hit.any()
    repeated = np.sort(np.array(keys + keys[:3], np.int64))
    if len(repeated):
        at, hit = stock._find(repeated, asked)
        assert (repeated[at[hit]] == asked[hit]).all() and hit.tolist() == np.isin(asked, repeated).tolist()


def test_the_skeleton_is_scanned_before_the_c_unpickler_reads_it(monkeypatch):
    """The opcode scan that guards the C unpickler's allocations sees what it unpickles: the
    skeleton (its markers), for a file small enough to be scanned."""
    from hpckpt.core.safety import pickle_scan

    scanned = []
    real = pickle_scan._scan_opcodes
    monkeypatch.setattr(pickle_scan, "_scan_opcodes", lambda data, *a: (scanned.append(bytes(data)), real(data, *a)))
    assert read_stock_columns(_chunks_file()) is not None
    assert any(b"\x8a\x08" in data for data in scanned)


def test_the_stock_path_is_the_reader_s(monkeypatch):
    """The reader reads a `.metadata` HyperParallel wrote through `read_stock_columns` (no object
    per chunk) from STOCK_FROM_BYTES on: the same tensors as the unpickler's path."""
    from hpckpt.converters.hyperparallel import reader as hp_reader

    monkeypatch.setattr(hp_reader, "STOCK_FROM_BYTES", 0)
    calls = []
    original = hp_reader.read_stock_columns
    hp_reader.read_stock_columns = lambda data, where: calls.append(where) or original(data, where)
    try:
        index = hp_reader.HyperParallelReader().read_index(FIXTURES / "m0-torch-4rank")
    finally:
        hp_reader.read_stock_columns = original
    assert calls and index.tensors
    slow = loads((FIXTURES / "m0-torch-4rank" / ".metadata").read_bytes(), what="m", kind=METADATA)
    assert set(index.tensors) == {k for k, v in slow.state_dict_metadata.items()
                                  if type(v).__name__ == "TensorStorageMetadata"}



def _large_stock_checkpoint(root):
    """400 tensors in 4 row chunks on 4 ranks and a value, written as HyperParallel writes them:
    a `.metadata` above STOCK_FROM_BYTES whose keys share the chunks' offsets tuples."""
    import pickle

    import numpy as np
    from hp_reference import write_hp

    rng = np.random.default_rng(0)
    tensors = {}
    for t in range(400):
        w = rng.standard_normal((8, 3)).astype(np.float32)
        tensors[f"layers.{t}.w"] = ("torch.float32", (8, 3), [
            (f"_rank{r}_.safetensors", f"layers.{t}.w", (2 * r, 0), w[2 * r:2 * r + 2]) for r in range(4)])
    return write_hp(root, tensors, values={"step": ("_rank0_.bytes", pickle.dumps(7))})


def test_commands_on_a_large_stock_checkpoint_write_what_the_unpickler_s_path_writes(tmp_path, monkeypatch):
    """inspect, verify, consolidate and reshard read the `.metadata` through `read_stock_columns`
    and give the same report and the same bytes as with it turned off (the unpickler's path)."""
    from hpckpt import api
    from hpckpt.core.geometry.layout import LayoutSpec
    from hpckpt.converters.hyperparallel import reader as hp_reader

    root = _large_stock_checkpoint(tmp_path / "ckpt")
    assert (root / ".metadata").stat().st_size >= hp_reader.STOCK_FROM_BYTES
    calls = []
    original = hp_reader.read_stock_columns
    monkeypatch.setattr(hp_reader, "read_stock_columns", lambda data, where: calls.append(where) or original(data, where))
    outputs = {}
    for way, threshold in (("stock", hp_reader.STOCK_FROM_BYTES), ("unpickler", 1 << 62)):
        monkeypatch.setattr(hp_reader, "STOCK_FROM_BYTES", threshold)
        before = len(calls)
        (tmp_path / way).mkdir()
        report = api.inspect(root, use_cache=False)
        assert api.verify(root).exit_code == 0
        api.consolidate(root, tmp_path / way / "all.safetensors")
        api.reshard(root, tmp_path / way / "three", LayoutSpec.for_world_size(3))
        taken = len(calls) > before and original((root / ".metadata").read_bytes(), "m") is not None
        assert taken == (way == "stock"), way
        files = sorted(p for p in (tmp_path / way).rglob("*") if p.is_file() and "manifest" not in p.name)
        outputs[way] = (report.to_json() if hasattr(report, "to_json") else repr(report),
                        {str(p.relative_to(tmp_path / way)): p.read_bytes() for p in files})
    assert outputs["stock"][1] and outputs["stock"] == outputs["unpickler"]
