"""Format adapters and format detection: `detect(path)` finds the adapter, `open_index` reads.

The order of `ADAPTERS` matters: the first whose `sniff` answers True wins, so the more specific
formats come first.
"""

from __future__ import annotations

from pathlib import Path

from hpckpt.converters.base import FormatAdapter
from hpckpt.converters.hf_sharded import HfShardedAdapter
from hpckpt.converters.hyperparallel_dcp import HyperParallelAdapter
from hpckpt.converters.mindspore_ckpt import MindSporeCkptAdapter
from hpckpt.converters.safetensors_file import SafetensorsFileAdapter
from hpckpt.converters.torch_dcp import TorchDcpAdapter
from hpckpt.converters.torch_save_file import TorchSaveAdapter
from hpckpt.core.errors import CorruptMetadataError, NotACheckpointError, PathNotFoundError, UnknownFormatError
from hpckpt.core.index import CheckpointIndex
from hpckpt.core.unpickle import SNIFF_BYTES, pickle_globals, sniff_head

ADAPTERS: tuple[FormatAdapter, ...] = (
    HyperParallelAdapter(),
    TorchDcpAdapter(),
    HfShardedAdapter(),
    MindSporeCkptAdapter(),
    SafetensorsFileAdapter(),
    TorchSaveAdapter(),
)


def recognised() -> str:
    return ", ".join(a.name for a in ADAPTERS)


def detect(path: Path) -> FormatAdapter:
    """Return the adapter for `path`.

    Raises:
        PathNotFoundError: `path` does not exist.
        UnknownFormatError: `path` has a metadata file of a format hpckpt does not read.
        NotACheckpointError: nothing at `path` looks like a checkpoint.
    """
    if not path.exists():
        raise PathNotFoundError(f"{path}: no such file or directory")
    for adapter in ADAPTERS:
        if adapter.sniff(path):
            return adapter
    if path.is_dir() and (path / ".metadata").is_file():
        _refuse_unreadable_metadata(path / ".metadata")
        raise UnknownFormatError(
            f"{path}/.metadata is neither HyperParallel nor PyTorch DCP metadata",
            hint=f"hpckpt reads: {recognised()}",
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
    path = Path(path)
    if path.is_file() and path.name.endswith("metadata"):
        path = path.parent  # `hpckpt inspect ckpt/.metadata` means the checkpoint directory
    adapter = detect(path)
    if use_cache and isinstance(adapter, HyperParallelAdapter):
        return adapter.read_index(path, use_cache=True)
    return adapter.read_index(path)
