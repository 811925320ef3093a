"""PyTorch DCP's `.metadata`, pickled opcode by opcode as torch 2.13 writes it, without torch.

It is a pickle of `torch.distributed.checkpoint.metadata` classes: every tensor's dtype, global
shape and chunk boxes, every value's marker, and the byte range of each stored item's archive
in its `.distcp` file (`_StorageInfo`). `torch.distributed.checkpoint.load` and
`dcp_to_torch_save` read it.
"""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass
from typing import Any, Callable

from hpckpt.core.codecs.pickle_builder import PickleBuilder
from hpckpt.core.dtypes import DType

_METADATA = "torch.distributed.checkpoint.metadata"
_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
VERSION = "1.0.0"  # Metadata.version torch 2.13 writes


@dataclass(frozen=True)
class StoredItem:
    """One archive in a `.distcp` file: a chunk of `fqn` at `offsets` (None for a value)."""

    fqn: str
    offsets: tuple[int, ...] | None
    index: int | None
    file: str
    offset: int
    length: int


class _MetadataPickle(PickleBuilder):
    """The opcodes of torch's `.metadata`: dataclass instances as NEWOBJ + BUILD of their fields."""

    def instance(self, module: str, name: str, fields: list[tuple[str, Callable[[], None]]]) -> None:
        self.global_(module, name)
        self.body += pickle.EMPTY_TUPLE + pickle.NEWOBJ
        if fields:
            self.body += pickle.EMPTY_DICT + pickle.MARK
            for key, emit in fields:
                self.const(key)
                emit()
            self.body += pickle.SETITEMS + pickle.BUILD

    def size(self, values: tuple[int, ...]) -> None:
        """`torch.Size((...))`."""
        self.call("torch", "Size", [tuple(values)], lambda t: self.tuple_of(t, self.integer))

    def properties(self, dtype: DType) -> None:
        """TensorProperties: torch pickles its state as a 5-tuple (dtype, layout, requires_grad,
        memory_format, pin_memory)."""
        self.global_(_METADATA, "TensorProperties")
        self.body += pickle.EMPTY_TUPLE + pickle.NEWOBJ + pickle.MARK
        self.global_("torch", dtype.name)
        self.call("torch.serialization", "_get_layout", ["torch.strided"], self.const)
        self.body += pickle.NEWFALSE
        self.call(_METADATA, "_MEM_FORMAT_ENCODING", [0], self.integer)
        self.body += pickle.NEWFALSE + pickle.TUPLE + pickle.BUILD

    def string_dict(self, items: list[tuple[str, Callable[[], None]]]) -> None:
        self.body += pickle.EMPTY_DICT
        if items:
            self.body += pickle.MARK
            for key, emit in items:
                self.string(key)
                emit()
            self.body += pickle.SETITEMS


def dumps_torch_metadata(tensors: dict[str, tuple[DType, tuple[int, ...], list[tuple[tuple, tuple]]]],
                         values: list[str], items: list[StoredItem], planner_data: Any) -> bytes:
    """The `.metadata` pickle: `tensors` maps fqn -> (dtype, global shape, chunk boxes in index
    order); `values` are the non-tensor entries; `items` every stored archive."""
    p = _MetadataPickle()
    state: list[tuple[str, Callable[[], None]]] = []
    for fqn, (dtype, shape, chunks) in tensors.items():
        def tensor(dtype=dtype, shape=shape, chunks=chunks) -> None:
            p.instance(_METADATA, "TensorStorageMetadata", [
                ("properties", lambda: p.properties(dtype)),
                ("size", lambda: p.size(shape)),
                ("chunks", lambda: _list(p, [lambda o=o, s=s: p.instance(_METADATA, "ChunkStorageMetadata", [
                    ("offsets", lambda: p.size(o)), ("sizes", lambda: p.size(s))]) for o, s in chunks])),
            ])
        state.append((fqn, tensor))
    for fqn in values:
        state.append((fqn, lambda: p.instance(_METADATA, "BytesStorageMetadata", [])))
    storage = []
    for item in items:
        def key(item=item) -> None:
            p.instance(_METADATA, "MetadataIndex", [
                ("fqn", lambda: p.string(item.fqn)),
                ("offset", (lambda: p.size(item.offsets)) if item.offsets is not None else (lambda: p._none(None))),
                ("index", (lambda: p.integer(item.index)) if item.index is not None else (lambda: p._none(None))),
            ])

        def info(item=item) -> None:
            p.instance(_FILESYSTEM, "_StorageInfo", [
                ("relative_path", lambda: p.const(item.file)),
                ("offset", lambda: p.integer(item.offset)),
                ("length", lambda: p.integer(item.length)),
            ])
        storage.append((key, info))
    mappings = planner_data if isinstance(planner_data, dict) else {}
    names = [*tensors, *values]
    save_id = hashlib.sha256("\0".join(names).encode()).hexdigest()[:32]
    p.instance(_METADATA, "Metadata", [
        ("state_dict_metadata", lambda: p.string_dict(state)),
        ("planner_data", lambda: p.string_dict([
            (fqn, lambda fqn=fqn: p.tuple_of(_path(mappings, fqn), lambda k: p.value(k, fqn))) for fqn in names])),
        ("storage_data", lambda: _dict_of(p, storage)),
        ("storage_meta", lambda: p.instance(_METADATA, "StorageMeta", [
            ("checkpoint_id", lambda: p._none(None)),
            ("save_id", lambda: p.string(f"{save_id[:8]}-{save_id[8:12]}-{save_id[12:16]}-{save_id[16:20]}-{save_id[20:32]}")),
            ("load_id", lambda: p._none(None)),
            ("modules", lambda: _list(p, [])),
        ])),
        ("version", lambda: p.string(VERSION)),
    ])
    return pickle.PROTO + b"\x02" + bytes(p.body) + pickle.STOP


def _path(mappings: dict, fqn: str) -> tuple:
    """The key path of `fqn` in the nested state dict (torch's planner_data); flat when unknown."""
    path = mappings.get(fqn)
    return tuple(path) if isinstance(path, (tuple, list)) and path else (fqn,)


def _list(p: PickleBuilder, emits: list[Callable[[], None]]) -> None:
    p.body += pickle.EMPTY_LIST
    if emits:
        p.body += pickle.MARK
        for emit in emits:
            emit()
        p.body += pickle.APPENDS


def _dict_of(p: PickleBuilder, pairs: list[tuple[Callable[[], None], Callable[[], None]]]) -> None:
    p.body += pickle.EMPTY_DICT
    if pairs:
        p.body += pickle.MARK
        for key, value in pairs:
            key()
            value()
        p.body += pickle.SETITEMS
