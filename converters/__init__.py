"""The format registry: every format hpckpt reads or writes, by the one name every command uses.

`FORMATS` is the only list of formats. Its order is the detection order (the first reader whose
`sniff` answers True wins, so the more specific formats come first). A format's `name` is what
`inspect` reports, what `convert --to` and `consolidate --format` take, and what the docs say;
its `aliases` are accepted on the command line too (`hp`, `pt`, `ms`, `hf`).
"""

from __future__ import annotations

from pathlib import Path

from hpckpt.converters.base import Format
from hpckpt.converters.hf_sharded import HfShardedReader, HfShardedWriter
from hpckpt.converters.hf_torch_bin import HfTorchBinReader
from hpckpt.converters.hyperparallel.reader import HyperParallelReader
from hpckpt.converters.hyperparallel.writer import HyperParallelWriter
from hpckpt.converters.mindformers import MindFormersReader, MindFormersWriter, update_tracker
from hpckpt.converters.mindspore_ckpt import MindSporeCkptReader, MindSporeCkptWriter
from hpckpt.converters.safetensors_file import SafetensorsFileReader, SafetensorsWriter
from hpckpt.converters.torch_dcp import TorchDcpReader, TorchDcpWriter
from hpckpt.converters.torch_dcp.metadata_files import rank_local_files
from hpckpt.converters.torch_save_file import TorchSaveFileWriter, TorchSaveReader
from hpckpt.core.commit.leftovers import FRAGMENT_DIR, leftover, missing_with_leftovers
from hpckpt.core.errors import (
    CorruptMetadataError,
    NotACheckpointError,
    PathNotFoundError,
    UnknownFormatError,
)
from hpckpt.core.index import CheckpointIndex
from hpckpt.core.safety.pickle_scan import SNIFF_BYTES, pickle_globals, sniff_head
from hpckpt.core.storage.urls import as_path

_HP_READER = HyperParallelReader()

FORMATS: tuple[Format, ...] = (
    Format("hyperparallel", "HyperParallel DCP (.metadata + _rank{r}_.safetensors/.bytes)", ("hp",),
           _HP_READER, HyperParallelWriter, "dir"),
    Format("hyperparallel-legacy", "HyperParallel DCP, legacy layout (read only)", (), None, None, "dir"),
    Format("torch-dcp", "PyTorch Distributed Checkpoint (.metadata + __{rank}_{i}.distcp)", (),
           TorchDcpReader(), TorchDcpWriter, "dir"),
    Format("mindformers", "MindFormers Checkpoint 2.0 (iteration_N/ with metadata.json, common.json, "
           "*-model-/-opt-*.safetensors)", ("mf",), MindFormersReader(), MindFormersWriter, "dir",
           every_replica=True, after_commit=update_tracker),
    Format("hf-sharded", "Hugging Face sharded safetensors (model.safetensors.index.json + shards)", ("hf",),
           HfShardedReader(), HfShardedWriter, "dir", whole_tensors=True),
    Format("hf-torch-bin", "Hugging Face torch weights (pytorch_model.bin.index.json + .bin shards; read only)", (),
           HfTorchBinReader(), None, "dir"),
    Format("mindspore-ckpt", "one MindSpore .ckpt file", ("ms", "ckpt"),
           MindSporeCkptReader(), MindSporeCkptWriter, "file", whole_tensors=True, extensions=(".ckpt",)),
    Format("safetensors", "one safetensors file", (), SafetensorsFileReader(), SafetensorsWriter, "file",
           whole_tensors=True, extensions=(".safetensors",)),
    Format("torch-save", "a torch.save file (.pt, .pth, .bin; zip format)", ("pt",),
           TorchSaveReader(), TorchSaveFileWriter, "file", whole_tensors=True, extensions=(".pt", ".pth", ".bin")),
)

#: The old spelling `consolidate --format dcp` (HyperParallel); accepted with a warning, since
#: "dcp" alone does not say whose DCP.
DEPRECATED_ALIASES = {"dcp": "hyperparallel"}
_BY_NAME = {name: f for f in FORMATS for name in (f.name, *f.aliases)}


def writable() -> tuple[Format, ...]:
    return tuple(f for f in FORMATS if f.writer is not None)


def format_named(name: str) -> Format:
    """The format a name or alias stands for.

    Raises:
        ValueError: no such writable or readable format (the message lists them).
    """
    found = _BY_NAME.get(DEPRECATED_ALIASES.get(name, name))
    if found is None:
        listed = ", ".join(f"{f.name} ({', '.join(f.aliases)})" if f.aliases else f.name for f in writable())
        raise ValueError(f"unknown format {name!r}: choose one of {listed}")
    return found


def format_for_extension(path: Path | str) -> Format | None:
    """The single-file format a destination's extension names (`.pt`, `.ckpt`, `.safetensors`)."""
    suffix = as_path(path).suffix.lower()
    return next((f for f in FORMATS if suffix in f.extensions), None)


def recognised() -> str:
    return ", ".join(f.name for f in FORMATS if f.reader is not None)


def detect(path: Path) -> Format:
    """Return the format of the checkpoint at `path`.

    Raises:
        PathNotFoundError: `path` does not exist.
        UnknownFormatError: `path` has a metadata file of a format hpckpt does not read.
        NotACheckpointError: nothing at `path` looks like a checkpoint.
    """
    if not path.exists():
        left = missing_with_leftovers(path)  # a stopped run's staging, its lock
        if left is not None:
            raise PathNotFoundError(*left[:1], hint=left[1])
        raise PathNotFoundError(f"{path}: no such file or directory")
    left = leftover(path)  # a staging directory, a lock file, a sidecar without its file
    if left is not None:
        raise NotACheckpointError(left)
    for fmt in FORMATS:
        if fmt.reader is not None and fmt.reader.sniff(path):
            return fmt
    if path.is_dir() and (path / ".metadata").is_file():
        _refuse_unreadable_metadata(path / ".metadata")
        raise UnknownFormatError(
            f"{path}/.metadata is neither HyperParallel nor PyTorch DCP metadata",
            hint=f"hpckpt reads: {recognised()}",
        )
    rank_local = rank_local_files(path) if path.is_dir() else []  # torch DCP saved without collectives
    if rank_local:
        _refuse_unreadable_metadata(path / rank_local[0][1])
        raise UnknownFormatError(f"{path}/{rank_local[0][1]} is not PyTorch DCP metadata",
                                 hint=f"hpckpt reads: {recognised()}")
    if path.is_dir() and (path / FRAGMENT_DIR).is_dir():
        raise NotACheckpointError(
            f"{path}: a fanned-out reshard whose metadata is not written yet (shares written by "
            "`hpckpt reshard --rank` or `hpckpt run reshard`)",
            hint=f"once every share is there: hpckpt reshard --finalize {path}",
        )
    if path.is_dir() and (any(path.glob("_rank*_.safetensors")) or any(path.glob("__*_*.distcp"))):
        raise NotACheckpointError(
            f"{path}: data files but no metadata file: an interrupted save?",
            hint="a checkpoint is complete only once its .metadata has been written",
        )
    what = "directory" if path.is_dir() else "file"
    raise NotACheckpointError(
        f"{path}: this {what} is not a checkpoint hpckpt recognises",
        hint=f"hpckpt reads: {recognised()}",
    )


def _refuse_unreadable_metadata(metadata: Path) -> None:
    """An empty or truncated `.metadata` is corrupt, not of an unknown format."""
    head = sniff_head(metadata)
    if not head:
        raise CorruptMetadataError(f"{metadata}: empty metadata file")
    if len(head) < SNIFF_BYTES:
        try:
            pickle_globals(head)
        except CorruptMetadataError as exc:
            raise CorruptMetadataError(f"{metadata}: {exc.message}") from None


def open_index(path: Path | str, *, use_cache: bool = False) -> CheckpointIndex:
    """Detect the format of `path` and read its index (metadata only; data is read lazily).

    `use_cache` lets a large HyperParallel index come from its snapshot (converters.index_cache);
    commands that must see the real metadata (verify, anything that writes) leave it off.
    """
    path = as_path(path)
    if path.is_file() and path.name.endswith("metadata"):
        path = path.parent  # `hpckpt inspect ckpt/.metadata` means the checkpoint directory
    fmt = detect(path)
    if use_cache and fmt.reader is _HP_READER:
        return _HP_READER.read_index(path, use_cache=True)
    return fmt.reader.read_index(path)


def _is_own_file(name: str, fmt: str) -> bool:
    """A file hpckpt keeps in a checkpoint directory of format `fmt` (besides the manifest)."""
    from hpckpt.converters import hf_sharded, hpckpt_json

    return name == hpckpt_json.NAME or (name == hf_sharded.SIDECAR_NAME and fmt.startswith("hf-"))


def _register_with_the_commit_room() -> None:
    """core/commit decides what may be replaced and what a killed run left by these (it cannot
    import them: core sits below the converters)."""
    from hpckpt.converters import index_cache, values_sidecar
    from hpckpt.core.commit import formats

    formats.register(formats.FormatKnowledge(
        open_index=open_index, detect=detect, read_sidecar=values_sidecar.read,
        sidecar_owner=values_sidecar.owner_of, sidecars_of=values_sidecar.sidecars_of,
        is_own_file=_is_own_file, cache_dir=index_cache.cache_dir))


_register_with_the_commit_room()
