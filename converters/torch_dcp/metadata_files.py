"""Which metadata files make up a PyTorch DCP checkpoint, and reading one of them safely.

A save with collectives writes one `.metadata` for every rank. `dcp.save(...,
use_collectives=False)` (torch 2.13) has no coordinator: each rank writes `__{rank}.metadata`
listing only its own items (its shards, its own copy of replicated tensors and values) and
`__{rank}_{i}.distcp` data files, and no `.metadata`. Such a checkpoint is read as the union of
every rank's metadata; a rank whose metadata is missing would silently lose its shards, so it
is refused. When both kinds exist, `.metadata` is read, as in torch's own reader, but never
silently: the rank-local files are read too (`cross_check`). If every entry they list is in
`.metadata` alike (same kind, dtype and shape, its chunks among `.metadata`'s, at the same file
and bytes), they are a consistent subset and the index carries a warning; otherwise the two
describe different saves (a stale file, two saves into one directory) and reading either would
be a guess: `CorruptMetadataError` (exit 6). HyperParallel's `.metadata` + `{rank}.metadata`
are checked the same way.
"""

from __future__ import annotations

import re
from pathlib import Path

from hpckpt.core.codecs.torch_dcp_metadata import Metadata, check_dcp_metadata
from hpckpt.core.errors import (
    CorruptMetadataError,
    MissingFileError,
    NotACheckpointError,
    PathNotFoundError,
)
from hpckpt.core.safety import input_files
from hpckpt.core.safety.allow_list import safe_global
from hpckpt.core.safety.pickle_scan import sniff_head
from hpckpt.core.safety.unpickle import METADATA, loads
from hpckpt.core.storage.urls import lexists

GLOBAL = ".metadata"
_DCP_MODULE = b"torch.distributed.checkpoint."
RANK_LOCAL = re.compile(r"^__(\d+)\.metadata$")
RANK_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


def is_dcp_pickle(head: bytes) -> bool:
    """True when the pickle opens with a torch.distributed.checkpoint class (even if truncated later)."""
    return _DCP_MODULE in head


def rank_local_files(root: Path) -> list[tuple[int, str]]:
    """`(rank, name)` of every `__{rank}.metadata` in `root`, by rank."""
    try:
        children = list(root.iterdir())
    except OSError:
        return []
    found = [(int(m.group(1)), c.name) for c in children if (m := RANK_LOCAL.match(c.name))]
    for _, name in found:  # a FIFO would block the sniff that reads it: refused unopened
        input_files.check_regular(root / name, "metadata file")
    return sorted(found)


def sniff(root: Path) -> bool:
    """A directory with a DCP `.metadata`, or with rank-local metadata whose first file is DCP's."""
    if (root / GLOBAL).is_file():
        return is_dcp_pickle(sniff_head(root / GLOBAL))
    ranked = rank_local_files(root) if root.is_dir() else []
    return bool(ranked) and is_dcp_pickle(sniff_head(root / ranked[0][1]))


def index_entries(tensors, values) -> dict[str, tuple]:
    """What `cross_check` compares: name -> ("tensor", dtype, shape, chunks) or ("value", file,
    offset, length); `tensors` are `TensorEntry`s, `values` `ValueEntry`s."""
    entries: dict[str, tuple] = {fqn: ("value", v.file, v.offset, v.length) for fqn, v in values.items()}
    for fqn, t in tensors.items():
        chunks = frozenset((c.box.offsets, c.box.sizes, c.file, c.key) for c in t.chunks)
        entries[fqn] = ("tensor", str(t.dtype), tuple(t.shape), chunks)
    return entries


def cross_check(root: Path, global_entries: dict[str, tuple], local_entries: dict[str, tuple],
                local_names: list[str]) -> str:
    """The warning to carry when the rank-local metadata is a consistent subset of `.metadata`.

    Raises:
        CorruptMetadataError: an entry of the rank-local files is absent from `.metadata` or
            described otherwise there.
    """
    listed = ", ".join(local_names[:3]) + (f" (+{len(local_names) - 3} more)" if len(local_names) > 3 else "")
    for fqn, local in local_entries.items():
        known = global_entries.get(fqn)
        if known is None:
            why = "it is absent from .metadata"
        elif known[:3] != local[:3] or (local[0] == "value" and known != local):
            why = f"{_describe(known)} in .metadata, {_describe(local)} in the rank-local files"
        elif local[0] == "tensor" and not local[3] <= known[3]:
            why = "the rank-local files place chunks that .metadata does not list (other boxes, files or bytes)"
        else:
            continue
        raise CorruptMetadataError(
            f"{root}: .metadata and the rank-local metadata {listed} disagree on {fqn!r}: {why}",
            hint="two saves into one directory, or a stale metadata file: keep the files of one save only",
        )
    return (f"both .metadata and rank-local metadata ({listed}) are present: .metadata is read; the rank-local "
            "files agree with it (a consistent subset)")


def _describe(entry: tuple) -> str:
    return f"a tensor {entry[1]} {list(entry[2])}" if entry[0] == "tensor" else f"a value in {entry[1]} at {entry[2]}"


def metadata_names(root: Path) -> list[str]:
    """The metadata files to read: `[".metadata"]`, else every rank's `__{rank}.metadata`.

    Raises:
        PathNotFoundError, NotACheckpointError: no checkpoint directory, or no metadata at all.
        MissingFileError: a rank's metadata is missing while other ranks' (or its data files) exist.
    """
    if not root.exists():
        raise PathNotFoundError(f"{root}: no such file or directory")
    if not root.is_dir():
        raise NotACheckpointError(f"{root}: a PyTorch DCP checkpoint is a directory")
    if (root / GLOBAL).is_file():
        return [GLOBAL]
    ranked = rank_local_files(root)
    if not ranked:
        raise NotACheckpointError(f"{root}: no {GLOBAL} file, not a PyTorch DCP checkpoint")
    _check_every_rank(root, {rank for rank, _ in ranked})
    return [name for _, name in ranked]


def _check_every_rank(root: Path, have: set[int]) -> None:
    """Every rank from 0 to the highest one seen (in metadata or data file names) has metadata."""
    with_data = {int(m.group(1)) for c in root.iterdir() if (m := RANK_FILE.match(c.name))}
    missing = sorted(set(range(max(have | with_data) + 1)) - have)
    if not missing:
        return
    described = ", ".join(f"__{r}.metadata" + (f" (rank {r} wrote data files)" if r in with_data else "")
                          for r in missing)
    raise MissingFileError(
        f"{root}: rank-local PyTorch DCP checkpoint lacks {described}; "
        f"found metadata of rank(s) {', '.join(map(str, sorted(have)))}",
        hint="every rank of a use_collectives=False save writes its own __{rank}.metadata last: an interrupted save?",
    )


def load_metadata(root: Path, name: str) -> Metadata:
    """Read and safely unpickle one metadata file, checking it has the shape of DCP metadata."""
    path = root / name
    if not lexists(path):
        raise NotACheckpointError(f"{root}: no {name} file, not a PyTorch DCP checkpoint")
    data = input_files.read_small(path, "metadata file", input_files.metadata_limit())
    metadata = loads(data, what=str(path), resolver=safe_global, kind=METADATA)
    if not isinstance(metadata, Metadata):
        raise CorruptMetadataError(f"{path}: holds {type(metadata).__name__}, not DCP Metadata")
    check_dcp_metadata(metadata, len(data), str(path))
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(metadata.storage_data, dict):
        raise CorruptMetadataError(f"{path}: state_dict_metadata or storage_data is missing")
    return metadata
