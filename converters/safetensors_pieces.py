"""What a safetensors file's `__metadata__` says beyond its tensors: pieces and the user's keys.

PyTorch's `HuggingFaceStorageWriter` (torch.distributed.checkpoint) writes, from every rank, files
`shard-{rank+1:05d}-model-{i:05d}-of-{n:05d}.safetensors` whose tensors are that rank's pieces; where
each piece lies in its tensor is only in `__metadata__["DCP_SHARDING_INFO"]`, a JSON object
`{fqn: {"saved_offsets": [...]}}` (with `"DCP_VERSION": "1.0"`, `"format": "pt"`). No file records
a global shape: torch's own reader takes the extent of the pieces, and so does hpckpt. Reading such
a piece as if it were the whole tensor would be silently wrong, so a file read on its own says so.

Every other `__metadata__` key is the user's (`{"author": ...}`) and is carried to safetensors and
Hugging Face outputs; the keys that describe the source file's own storage are not.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from hpckpt.core.codecs.safetensors_io import SafetensorsHeader
from hpckpt.core.errors import CorruptMetadataError
from hpckpt.core.safety import input_files

SHARDING_KEY = "DCP_SHARDING_INFO"
#: Keys that describe the file they are in (its pieces, its framework flavour, its CRC): never carried.
STORAGE_KEYS = frozenset({SHARDING_KEY, "DCP_VERSION", "format", "crc_num", "remove_redundancy"})
#: torch's per-rank file name (`_hf_utils.SHARDED_FILE_NAME`): `shard-00002-model-00001-of-00001.safetensors`.
PER_RANK_FILE = re.compile(r"^shard-(\d{5})-model-\d{5}-of-\d{5}\.safetensors$")
HF_SHARD_FILE = re.compile(r"^.*-(\d+)-of-(\d+)\.safetensors$")  # model-00001-of-00002.safetensors
HP_RANK_FILE = re.compile(r"^_rank\d+_\.safetensors$")
RAGGED_KEY = ".__dcp_chunk_"


def saved_offsets(header: SafetensorsHeader) -> dict[str, tuple[int, ...]] | None:
    """Each tensor's offsets in its global tensor, from `DCP_SHARDING_INFO` (None: not there).

    Raises:
        CorruptMetadataError: the key is there but does not give every tensor valid offsets.
    """
    raw = header.metadata.get(SHARDING_KEY)
    if raw is None:
        return None
    where = f"{header.path}: __metadata__ {SHARDING_KEY}"
    doc = input_files.load_json(raw, where)
    if not isinstance(doc, dict):
        raise CorruptMetadataError(f"{where} is not a JSON object")
    out = {}
    for key, info in header.entries.items():
        offsets = doc.get(key, {}).get("saved_offsets") if isinstance(doc.get(key), dict) else None
        if (not isinstance(offsets, list) or len(offsets) != len(info.shape)
                or not all(type(o) is int and o >= 0 for o in offsets)):
            raise CorruptMetadataError(f"{where} gives tensor {key!r} no valid saved_offsets "
                                       f"({len(info.shape)} non-negative integers)")
        out[key] = tuple(offsets)
    return out


def carried_metadata(headers: Iterable[SafetensorsHeader]) -> tuple[dict[str, str], list[str], list[str]]:
    """The user's `__metadata__` keys of all `headers`, a note on them and warnings: a key whose
    value differs between files is not carried (which file's would be right?)."""
    seen: dict[str, str] = {}
    conflicting: set[str] = set()
    for header in headers:
        for key, value in header.metadata.items():
            if key in STORAGE_KEYS:
                continue
            if seen.setdefault(key, value) != value:
                conflicting.add(key)
    carried = {k: v for k, v in sorted(seen.items()) if k not in conflicting}
    notes, warnings = [], []
    if carried:
        notes.append(f"safetensors __metadata__ keys {', '.join(carried)}: carried to safetensors and hf outputs "
                     "(hpckpt's own keys win), not to other formats")
    if conflicting:
        warnings.append(f"safetensors __metadata__ keys {', '.join(sorted(conflicting))} differ between files: "
                        "not carried")
    return carried, notes, warnings


def single_file_notes(header: SafetensorsHeader) -> list[str]:
    """What a file read on its own shows of being one piece of a larger checkpoint."""
    name = header.path.name
    notes = []
    offsets = saved_offsets(header) or {}
    moved = {k: o for k, o in offsets.items() if any(o)}
    per_rank = PER_RANK_FILE.match(name)
    if moved or per_rank:
        example = next(iter(moved.items()), None)
        what = (f"{len(moved)} tensor(s) are pieces of larger tensors, e.g. {example[0]} at offsets {list(example[1])}"
                if example else "its tensors may be pieces of larger tensors even at offsets 0")
        notes.append(f"{name}: one rank's file of torch.distributed.checkpoint's HuggingFaceStorageWriter "
                     f"({SHARDING_KEY}): {what}; read here as the stored pieces, not the whole tensors: "
                     "read the directory holding every rank's shard-*.safetensors file, or consolidate it "
                     "(`hpckpt consolidate DIR`, or torch's consolidate_safetensors_files)")
    ragged = sorted(k for k in header.entries if RAGGED_KEY in k)
    if ragged:
        notes.append(f"{name}: {len(ragged)} key(s) like {ragged[0]} are pieces of HyperParallel ragged tensors")
    shard = HF_SHARD_FILE.match(name)
    if shard and int(shard.group(2)) > 1:
        index = header.path.parent / "model.safetensors.index.json"
        notes.append(f"{name}: shard {int(shard.group(1))} of {int(shard.group(2))} of a Hugging Face checkpoint, "
                     "read on its own: the other shards' tensors are not in it"
                     + ("" if index.is_file() else " (and model.safetensors.index.json, which lists them, is missing)"))
    if HP_RANK_FILE.match(name):
        metadata = (header.path.parent / ".metadata").is_file()
        notes.append(f"{name}: named like one rank's file of a HyperParallel checkpoint: its tensors may be "
                     "pieces of larger tensors; read the checkpoint directory"
                     + (f" {header.path.parent} (it has a .metadata)" if metadata else ""))
    return notes
