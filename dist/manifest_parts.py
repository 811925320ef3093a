"""The manifest of a checkpoint many ranks write (`core.commit.manifest`): each rank writes the lines
of its own files beside them, as it hashed them while writing; the coordinator joins them
under one header. No rank's data is read again."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

from hpckpt.converters import index_cache
from hpckpt.core.commit import manifest
from hpckpt.core.commit.durable import write_file
from hpckpt.core.commit.replace import replace_file


def part_name(rank: int) -> str:
    return f".hpckpt-manifest-part-{rank}.jsonl"


def summary_name(rank: int) -> str:
    return f".hpckpt-manifest-files-{rank}.json"


def write_part(directory: Path, rank: int, digests, *, with_summary: bool = False) -> list[list]:
    """Write this rank's box lines beside its files; return what the header says of each file
    (name, size, digest, number of boxes), also written to a file when the coordinator hears
    from the ranks only through the storage (`with_summary`)."""
    ordered = sorted(digests, key=lambda f: f.name)
    write_file(directory / part_name(rank), b"".join(manifest.file_line(f) for f in ordered), False)
    files = [list(s) for s in manifest.summaries(digests)]
    if with_summary:
        write_file(directory / summary_name(rank), json.dumps(files).encode(), False)
    return files


def read_summaries(directory: Path, ranks: int) -> list[tuple]:
    """What `write_part(with_summary=True)` left for the header, every rank's."""
    files = []
    for rank in range(ranks):
        path = directory / summary_name(rank)
        if path.exists():
            files += [tuple(f) for f in json.loads(path.read_text())]
            path.unlink()
    return files


def write_manifest(staging: Path, *, format_name: str, world_size: int, files: Sequence[tuple],
                   metadata: Sequence[tuple[str, bytes]], written) -> None:
    """The header from the ranks' file summaries and the staged output's listing, then each
    rank's part as it wrote it (the parts are removed)."""
    doc = manifest.header(format_name=format_name, world_size=world_size, files=files, metadata=metadata,
                          index=index_cache.snapshot(written))
    parts = [staging / part_name(rank) for rank in range(world_size)]

    def write(out) -> None:
        out.write(manifest.encode(doc, ()))
        for part in parts:
            if part.exists():
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, out, 8 << 20)

    # fsynced; the staging directory is fsynced when the save commits
    replace_file(staging / manifest.NAME, write, fsync=True, aside=staging / f".tmp-{manifest.NAME}", mode=0o666)
    for part in parts:
        part.unlink(missing_ok=True)
