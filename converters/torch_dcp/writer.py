"""PyTorch DCP laid out as torch 2.13 writes it: `__{rank}_0.distcp` files and `.metadata`.

A `.distcp` file is a concatenation of torch.save archives, one per stored item (a tensor chunk,
or a non-tensor value), each what `torch.save(obj)` writes; a value goes into the file of the
rank the plan gives it (rank 0's in a conversion; in a running job, that of a rank holding it,
as each PyTorch rank writes its own). The plan's replicas are stored once, as HyperParallel and
PyTorch's de-dup do. Every archive's position follows from the plan, so `.metadata` (which gives
each item's byte range) is known for every rank, also in a fan-out run that writes only some.
The world size and layout written are in the manifest `core.io.write` adds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hpckpt.converters.base import WriterOptions
from hpckpt.converters.torch_dcp.metadata_pickle import StoredItem, dumps_torch_metadata
from hpckpt.core.codecs.pickle_builder import loadable_values, torch_loadable
from hpckpt.core.codecs.torch_archive import TorchArchive
from hpckpt.core.geometry.plan import Plan
from hpckpt.core.io.output import Extent, FileLayout, Finished, OutputLayout, Placement

METADATA_NAME = ".metadata"


def distcp_name(rank: int) -> str:
    return f"__{rank}_0.distcp"


def value_archive(fqn: str, value: Any) -> bytes:
    """One value's whole record, as `torch.save(value)` writes it (what a running job's rank
    stores for its values; `TorchDcpWriter(payloads=...)`).

    Raises:
        TypeError: a torch.save record written without torch cannot hold the value.
    """
    data, _note, why = torch_loadable(value, fqn)
    if why is not None:
        raise TypeError(why)
    archive = TorchArchive("archive", root="single")
    archive.add_value(fqn, data)
    archive.layout(0)
    out = bytearray(archive.size)
    for at, piece in (*archive.fixed, *archive.finish({})):
        out[at:at + len(piece)] = piece
    return bytes(out)


class TorchDcpWriter:
    """`FormatWriter` of PyTorch DCP (call order in `converters.base`)."""

    def __init__(self, options: WriterOptions, value_lengths: Mapping[str, int] | None = None,
                 payloads: Mapping[str, bytes] | None = None):
        """`payloads`: values this process made records of already (`value_archive`);
        `value_lengths`: the record sizes of values other processes write (a running job's ranks
        each write their own, into their own file). `layout` is then given only the others."""
        self._plan: Plan | None = None
        self._items: list[StoredItem] = []
        self._values: list[str] = []  # the values the archives hold, in plan order
        self._archives: dict[str, list[tuple[str, TorchArchive]]] = {}  # file -> (checksum id, archive)
        self._given: dict[str, bytes] = dict(payloads or {})
        self._lengths: dict[str, int] = dict(value_lengths or {})

    def _ranks(self, plan: Plan) -> list[int]:
        return sorted(set(plan.storing_ranks) | {v.rank for v in plan.values})

    def layout(self, plan: Plan, values: Mapping[str, Any]) -> OutputLayout:
        self._plan, self._items, self._archives = plan, [], {}
        files = []
        ready = self._given.keys() | self._lengths.keys()
        kept, skipped, converted = loadable_values((v.fqn, values[v.fqn]) for v in plan.values if v.fqn not in ready)
        loadable = dict(kept)
        self._values = [v.fqn for v in plan.values if v.fqn in ready or v.fqn in loadable]
        values_of: dict[int, list[str]] = {}
        for v in plan.values:
            values_of.setdefault(v.rank, []).append(v.fqn)
        for rank in self._ranks(plan):
            name, position, produce = distcp_name(rank), 0, rank in plan.producing
            fixed, boxes, archives = [], [], []
            for tensor, planned in plan.by_rank.get(rank, []):
                archive = TorchArchive("archive", root="single")
                key = archive.add_tensor(tensor.fqn, tensor.dtype, planned.box.sizes)
                archive.layout(position)
                if produce:
                    crc_id = f"{name}:{position}"
                    at, nbytes = archive.tensor_extent(key)
                    fixed += archive.fixed
                    boxes.append(Placement(tensor, planned, (Extent(at, nbytes),), crc_id))
                    archives.append((crc_id, archive))
                self._items.append(StoredItem(tensor.fqn, planned.box.offsets, planned.index, name, position, archive.size))
                position += archive.size
            for fqn in values_of.get(rank, ()):
                if fqn in self._given or fqn in self._lengths:  # a record made already, here or elsewhere
                    record = self._given.get(fqn)
                    size = len(record) if record is not None else self._lengths[fqn]
                    if produce and record is not None:
                        fixed.append((position, record))
                elif fqn in loadable:
                    archive = TorchArchive("archive", root="single")
                    archive.add_value(fqn, loadable[fqn])
                    archive.layout(position)
                    if produce:
                        fixed += archive.fixed
                        archives.append(("", archive))
                    size = archive.size
                else:
                    continue  # skipped, with its reason
                self._items.append(StoredItem(fqn, None, None, name, position, size))
                position += size
            if produce:
                self._archives[name] = archives
                files.append(FileLayout(name, position, tuple(fixed), tuple(boxes)))
        return OutputLayout(tuple(files), tuple(skipped), tuple(converted))

    def stored_items(self) -> list[StoredItem]:
        """Where `layout` put each item: file, byte offset and length (what torch's `.metadata`
        records of it)."""
        return list(self._items)

    def expected_files(self, plan: Plan) -> list[str]:
        return [distcp_name(rank) for rank in self._ranks(plan) if rank in plan.producing]

    def finish(self, crcs: Mapping[str, int]) -> Finished:
        plan = self._plan
        assert plan is not None, "layout() first"
        patches = []
        for name, archives in self._archives.items():
            for crc_id, archive in archives:
                keys = archive.tensor_keys()
                patches += [(name, at, data) for at, data in archive.finish({k: crcs[crc_id] for k in keys})]
        tensors = {t.fqn: (t.dtype, tuple(t.shape), [(b.box.offsets, b.box.sizes) for b in t.boxes])
                   for t in plan.tensors}
        stored = {t.fqn for t in plan.tensors} | set(self._values)  # values it could not hold are not listed
        nesting = {k: v for k, v in plan.nesting.items() if k in stored}
        metadata = ((METADATA_NAME, dumps_torch_metadata(tensors, self._values, self._items, nesting or None)),)
        return Finished(tuple(patches), metadata)  # the world size and layout go into the manifest
