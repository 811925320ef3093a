"""The manifest: one sidecar that says what a checkpoint holds and how to prove it intact.

Every checkpoint or file hpckpt writes gets one (offline commands, `hpckpt.dist` saves, `hpckpt
checksum` for checkpoints others wrote): `.hpckpt-manifest.jsonl` inside a checkpoint directory,
`NAME.hpckpt-manifest.jsonl` beside a single file. It is JSON Lines, so it runs no code and a
reader takes only the part it needs:

- line 1, the header: `{"hpckpt_manifest": 1, "digest": "xxh3-128", "written_by", "command",
  "format", "world_size", ["mesh", "placements"], "source", "metadata": {name:
  {"bytes", "digest"}}, "files": {name: {"bytes", "digest", "boxes"}}, ["index"]}` (no time:
  the same command writes the same bytes). `source` is
  what the output was made from: its path and format, and its manifest's digest when it had one
  (else its metadata files' digests). `index` is the listing `inspect` prints (tensors, values,
  files: `converters.index_cache`'s snapshot), so a large checkpoint is listed without
  unpickling its metadata; it is believed only while every metadata file still has the size and
  digest the header records.
- then one line per data file: `{"file": name, "boxes": [[fqn, offsets, sizes, [[at, nbytes],
  ...], digest], ...]}`: every stored box, where its bytes are in the file and their digest.

Digests are XXH3-128 (`core.io.digest`, which also defines a file's digest). Neither HyperParallel's
loader nor PyTorch's reads the file; both ignore it (tested).
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpckpt import __version__
from hpckpt.core.errors import CorruptMetadataError
from hpckpt.core.io import digest
from hpckpt.core.safety import input_files
from hpckpt.core.storage.urls import as_path, lexists

NAME = ".hpckpt-manifest.jsonl"
SUFFIX = ".hpckpt-manifest.jsonl"
SCHEMA = 1
MAX_LINE_BYTES = 1 << 30  # a file's box line: ~100 bytes a box
#: what the running command was started as; the CLI sets it (`hpckpt reshard ...`), a library
#: call leaves the Python command line
COMMAND: list[str] | None = None


@dataclass(frozen=True, slots=True)
class BoxDigest:
    """One stored box: its tensor, where it lies in the tensor and in its file, and its digest."""

    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    extents: tuple[tuple[int, int], ...]
    digest: str


@dataclass(frozen=True)
class FileDigest:
    """One data file: its size, digest and stored boxes."""

    name: str
    size: int
    digest: str
    boxes: tuple[BoxDigest, ...] = ()


def path_of(checkpoint: Path) -> Path:
    """Where the manifest of `checkpoint` (a directory, or a single file) is."""
    checkpoint = as_path(checkpoint)
    return checkpoint / NAME if checkpoint.is_dir() else checkpoint.with_name(checkpoint.name + SUFFIX)


def sidecar_name(file_name: str) -> str:
    return file_name + SUFFIX


def command_line() -> str:
    if COMMAND is not None:
        return shlex.join(COMMAND)
    return shlex.join([Path(sys.executable).name, *sys.argv])


def summaries(files: Sequence[FileDigest]) -> list[tuple[str, int, str, int]]:
    """What the header says of each data file: name, size, digest and number of boxes."""
    return [(f.name, f.size, f.digest, len(f.boxes)) for f in files]


def header(*, format_name: str, world_size: int | None, files: Sequence[tuple[str, int, str, int]],
           metadata: Sequence[tuple[str, bytes]], source: dict | None = None, layout: dict | None = None,
           index: dict | None = None, command: str | None = None) -> dict:
    """The header line's document; `files` as `summaries` gives them."""
    doc: dict[str, Any] = {"hpckpt_manifest": SCHEMA, "digest": digest.ALGORITHM,
                           "written_by": f"hpckpt {__version__}", "command": command or command_line(),
                           "format": format_name, "world_size": world_size}
    doc.update(layout or {})
    doc["source"] = source
    doc["metadata"] = {name: {"bytes": len(data), "digest": digest.of(data)} for name, data in metadata}
    doc["files"] = {name: {"bytes": size, "digest": hexdigest, "boxes": boxes}
                    for name, size, hexdigest, boxes in sorted(files)}
    if index is not None:
        doc["index"] = index
    return doc


def file_line(f: FileDigest) -> bytes:
    boxes = [[b.fqn, list(b.offsets), list(b.sizes), [list(e) for e in b.extents], b.digest] for b in f.boxes]
    return _line({"file": f.name, "boxes": boxes})


def encode(doc: dict, files: Sequence[FileDigest]) -> bytes:
    """The whole manifest: header, then a line per data file, by name."""
    return b"".join([_line(doc), *(file_line(f) for f in sorted(files, key=lambda f: f.name))])


def _line(doc: dict) -> bytes:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode() + b"\n"


# -- reading ----------------------------------------------------------------------------------


@dataclass
class Manifest:
    """A manifest's header, read and type-checked; the file lines are read on demand."""

    path: Path
    header: dict

    @property
    def files(self) -> dict[str, dict]:
        return self.header["files"]

    @property
    def metadata(self) -> dict[str, dict]:
        return self.header["metadata"]

    def file_digests(self) -> Iterator[FileDigest]:
        """Every data file's line, checked, in file order; one line in memory at a time.

        Raises:
            CorruptMetadataError: a line is not JSON or not a file's boxes, or names a file the
                header does not list, or the lines and the header disagree.
        """
        seen = set()
        with input_files.open_file(self.path, "manifest") as f:
            f.readline(input_files.metadata_limit() + 1)
            for number, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=2):
                if len(raw) > MAX_LINE_BYTES:
                    raise self._bad(f"line {number} is longer than {MAX_LINE_BYTES} bytes")
                doc = input_files.load_json(raw, f"{self.path}: line {number}")
                entry = self._file_entry(doc, number)
                if entry.name in seen:
                    raise self._bad(f"line {number}: file {entry.name!r} is listed twice")
                seen.add(entry.name)
                yield entry
        missing = [name for name in self.files if name not in seen]
        if missing:
            raise self._bad(f"no box line for {missing[0]!r}" + (f" and {len(missing) - 1} more file(s)" if len(missing) > 1 else ""))

    def _file_entry(self, doc: Any, number: int) -> FileDigest:
        if not isinstance(doc, dict) or not isinstance(doc.get("file"), str) or not isinstance(doc.get("boxes"), list):
            raise self._bad(f"line {number} is not a file's boxes")
        name = doc["file"]
        info = self.files.get(name)
        if info is None:
            raise self._bad(f"line {number} names file {name!r}, which the header does not list")
        boxes = []
        for i, box in enumerate(doc["boxes"]):
            if not (isinstance(box, list) and len(box) == 5 and isinstance(box[0], str) and _ints(box[1])
                    and _ints(box[2]) and len(box[1]) == len(box[2]) and isinstance(box[3], list)
                    and all(isinstance(e, list) and len(e) == 2 and _ints(e) for e in box[3])
                    and _is_digest(box[4])):
                raise self._bad(f"line {number} ({name}): box {i} is not [fqn, offsets, sizes, extents, digest]")
            boxes.append(BoxDigest(box[0], tuple(box[1]), tuple(box[2]), tuple(tuple(e) for e in box[3]), box[4]))
        if len(boxes) != info["boxes"]:
            raise self._bad(f"line {number} ({name}) lists {len(boxes)} boxes, the header {info['boxes']}")
        return FileDigest(name, info["bytes"], info["digest"], tuple(boxes))

    def _bad(self, problem: str) -> CorruptMetadataError:
        return CorruptMetadataError(f"{self.path}: {problem}", hint="the manifest is damaged: `hpckpt checksum "
                                    "--force` writes a new one (after `hpckpt verify --deep` without it)")

    def mismatch(self, root: Path, metadata_files: Sequence[str] | None = None) -> str | None:
        """Why the manifest does not describe `root`'s metadata now (None when it does): each
        metadata file it names has its size and digest, and (given) no other metadata file is there."""
        if metadata_files is not None:
            present = sorted(set(metadata_files) - {NAME})
            if sorted(self.metadata) != present:
                return f"it names metadata files {sorted(self.metadata)}, the checkpoint has {present}"
        for name, info in self.metadata.items():
            path = root / name
            try:
                size = path.stat().st_size
            except OSError:
                return f"{name} is missing"
            if size != info["bytes"]:
                return f"it was written with another {name} ({info['bytes']} bytes, now {size}; saved into since?)"
            try:
                with input_files.open_file(path, "metadata file") as f:
                    got = _digest_of_file(f)
            except OSError as exc:
                return f"{name} cannot be read ({exc.strerror})"
            if got != info["digest"]:
                return f"{name} has changed since the manifest was written (its digest differs)"
        return None


def _digest_of_file(f) -> str:
    h = digest.new()
    for block in iter(lambda: f.read(digest.SCAN_BLOCK), b""):
        h.update(block)
    return h.hexdigest()


def _ints(values: Any) -> bool:
    return isinstance(values, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)


def _is_digest(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 2 * digest.DIGEST_BYTES and all(c in "0123456789abcdef" for c in value)


def read(path: Path) -> Manifest | None:
    """The manifest at `path` (see `path_of`), its header checked; None when there is none.

    Raises:
        CorruptMetadataError: it is not a manifest, or its header is malformed.
    """
    if not lexists(path):
        return None
    limit = input_files.metadata_limit()
    with input_files.open_file(path, "manifest", CorruptMetadataError) as f:
        first = f.readline(limit + 1)
    if len(first) > limit:
        raise CorruptMetadataError(f"{path}: the manifest's header is longer than {limit} bytes")
    doc = input_files.load_json(first, f"{path}: manifest header")
    manifest = Manifest(as_path(path), doc if isinstance(doc, dict) else {})
    problem = _header_problem(manifest.header)
    if problem is not None:
        raise manifest._bad(problem)
    return manifest


def _header_problem(doc: dict) -> str | None:
    if doc.get("hpckpt_manifest") != SCHEMA:
        return f"not an hpckpt manifest of schema {SCHEMA} (hpckpt_manifest: {doc.get('hpckpt_manifest')!r})"
    if doc.get("digest") != digest.ALGORITHM:
        return f"digest {doc.get('digest')!r} is not {digest.ALGORITHM!r}"
    if not isinstance(doc.get("format"), str):
        return "it has no format"
    ws = doc.get("world_size")
    if ws is not None and not (isinstance(ws, int) and not isinstance(ws, bool) and ws >= 1):
        return f"world_size {ws!r} is not a positive integer"
    for key in ("metadata", "files"):
        table = doc.get(key)
        if not isinstance(table, dict):
            return f"its {key!r} is not a map of file names"
        for name, info in table.items():
            if not (isinstance(info, dict) and _ints([info.get("bytes")]) and _is_digest(info.get("digest"))
                    and (key == "metadata" or _ints([info.get("boxes")]))):
                return f"{key} entry {name!r} is not {{bytes, digest{', boxes' if key == 'files' else ''}}}"
            if name.startswith("/") or ".." in Path(name).parts:
                return f"{key} entry {name!r} leaves the checkpoint"
    if "index" in doc and not isinstance(doc["index"], dict):
        return "its 'index' is not an object"
    return None


def source_identity(path: Path | None, format_name: str | None, metadata_files: Sequence[str] = ()) -> dict | None:
    """What a command read from: its path and format, and its manifest's digest when it has one,
    else the digests of its metadata files (small; data files are not read for this)."""
    if path is None:
        return None
    path = as_path(path)
    out: dict[str, Any] = {"path": str(path), "format": format_name}
    sidecar = path_of(path)
    try:
        if sidecar.is_file():
            with input_files.open_file(sidecar, "manifest") as f:
                out["manifest"] = _digest_of_file(f)
            return out
        root = path if path.is_dir() else path.parent
        files = {}
        for name in metadata_files:
            with input_files.open_file(root / name, "metadata file") as f:
                files[name] = _digest_of_file(f)
        if files:
            out["metadata"] = files
        elif path.is_file():
            st = path.stat()
            out["bytes"], out["mtime"] = st.st_size, int(st.st_mtime)
    except OSError:
        pass  # an identity is a record, never a reason to fail a write
    return out
