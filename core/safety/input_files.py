"""Opening a checkpoint's files: regular files only, metadata read only up to a size, JSON only
up to a depth. Every reader opens its files through here, so a hostile checkpoint cannot hang a
command, exhaust its memory or crash its parser.

What is refused, and with which error (`core.errors`), decided by the file's role:

- A path that does not exist, cannot be opened (permissions, I/O error), or is not a regular file
  (a FIFO, a socket, a character or block device, a directory, a symlink to nothing):
  `MissingFileError` (exit 8, "missing or unreadable"), whatever the file's role, so that every
  command (and `verify`, which checks data files before reading them) gives the same code. The
  message names the path and what is there instead ("is a FIFO, not a data file"). It is checked
  with `stat` *before* opening (opening a FIFO blocks, opening a device can have side effects),
  then again with `fstat` on the descriptor (the path may have been replaced in between; it is
  opened `O_NONBLOCK`, so that even then nothing blocks).
- A metadata, index or sidecar file larger than its limit (below), checked before a byte is
  read: `CorruptMetadataError` (exit 6; a safetensors header over its limit is `CorruptDataError`,
  exit 9, in `core.codecs.safetensors_io`). A sparse 8 GiB `.metadata` is refused at once, not read.
- JSON nested deeper than `MAX_JSON_DEPTH` (a values sidecar: `MAX_SIDECAR_DEPTH`), found by a
  scan of the bytes before parsing (`json_depth`: C-speed passes, no recursion; the stdlib parser
  would recurse until `RecursionError`), and any other JSON error: the caller's
  error (`CorruptMetadataError` for an index or sidecar, `CorruptDataError` for a header).

An object in a store (`core.storage.ObjectPath`) passes the same checks against the store's
listing (a prefix with objects under it is a directory), and is read by ranged GETs
(`core.storage.readers`).

A symlink is followed (the checks apply to its target); one that leaves the checkpoint is
refused by `core.paths.resolve_inside` (exit 12) wherever the metadata names the path.

Size limits (bytes). Metadata pickles grow with the chunk count (~160 bytes a chunk; 640,000
chunks are ~100 MB), so their limit is generous and can be raised with `HPCKPT_MAX_METADATA_BYTES`;
the others are fixed by what the format allows or what hpckpt itself writes.
"""

from __future__ import annotations

import json
import io
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from hpckpt.core.errors import CorruptMetadataError, HpckptError, MissingFileError
from hpckpt.core.storage.object_path import is_object
from hpckpt.core.storage.readers import Handle, ObjectReader

#: A `.metadata` / `{rank}.metadata` / `__{rank}.metadata` pickle (env `HPCKPT_MAX_METADATA_BYTES`).
MAX_METADATA_BYTES = 2 << 30
#: A Hugging Face `*.index.json` (a weight_map of ~100 bytes a tensor: 2.5 million tensors).
MAX_INDEX_BYTES = 256 << 20
#: A values sidecar (`NAME.values.json`, `values.json`); hpckpt writes small values only.
MAX_SIDECAR_BYTES = 64 << 20
#: The deepest JSON nesting accepted in a safetensors header or an index (they need 3).
MAX_JSON_DEPTH = 64
#: ... and in a values sidecar, whose values hpckpt nests up to `core.json_values.MAX_DEPTH` (200).
MAX_SIDECAR_DEPTH = 256

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"))
_NOT_BRACKET_OR_QUOTE = bytes(b for b in range(256) if b not in b'[]{}"')
_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]], _STEP[[ord("]"), ord("}")]] = 1, -1


def metadata_limit() -> int:
    """`MAX_METADATA_BYTES`, or `HPCKPT_MAX_METADATA_BYTES` when set (a number of bytes, at most 2^62).

    Raises:
        RulesFileError: the setting is not such a number (a usage error, exit 2).
    """
    raw = os.environ.get("HPCKPT_MAX_METADATA_BYTES", "").strip()
    if not raw:
        return MAX_METADATA_BYTES
    if not (raw.isascii() and raw.isdigit()) or not 0 < int(raw) <= 2**62:
        from hpckpt.core.errors import RulesFileError

        raise RulesFileError(f"HPCKPT_MAX_METADATA_BYTES={raw!r} is not a number of bytes between 1 and 2^62")
    return int(raw)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def check_regular(path: Path, what: str, error: type[HpckptError] | None = None) -> os.stat_result:
    """`stat` `path` (following symlinks) and refuse anything but a regular file, unopened.

    Raises:
        MissingFileError: `path` does not exist (or is a symlink to nothing) or cannot be stat'ed.
        `error` (default MissingFileError): not a regular file.
    """
    if is_object(path):
        return _check_object(path, what, error)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise MissingFileError(f"{path}: is a symlink to nothing (its target does not exist)") from None
        raise MissingFileError(f"{path}: file not found") from None
    except OSError as exc:
        raise MissingFileError(f"{path}: cannot be read ({exc.strerror})") from None
    _require_regular(path, st, what, error)
    return st


def _require_regular(path: Path, st: os.stat_result, what: str, error: type[HpckptError] | None) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise (error or MissingFileError)(f"{path}: is {_kind(st.st_mode)}, not a {what}")


def _check_object(path, what: str, error: type[HpckptError] | None):
    """An object exists when the store lists it; a prefix with objects under it is a directory."""
    try:
        return path.stat() if path.is_file() else _not_object(path, what, error)
    except FileNotFoundError:
        raise MissingFileError(f"{path}: file not found") from None


def _not_object(path, what: str, error: type[HpckptError] | None):
    if path.is_dir():
        raise (error or MissingFileError)(f"{path}: is a directory, not a {what}")
    raise MissingFileError(f"{path}: file not found")


def open_handle(path: Path, what: str = "data file", error: type[HpckptError] | None = None) -> Handle:
    """`open_fd`, or for an object an `ObjectReader` (`core.storage.readers`): read either with
    `read_at`, close it with `close_handle`."""
    if is_object(path):
        _check_object(path, what, error)
        return ObjectReader(path, path.store.info(path.key))
    return open_fd(path, what, error)


def open_fd(path: Path, what: str = "data file", error: type[HpckptError] | None = None) -> int:
    """A read-only descriptor of the regular file `path` (checked before and after opening)."""
    check_regular(path, what, error)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise MissingFileError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise (error or MissingFileError)(f"{path}: is a directory, not a {what}") from None
    except OSError as exc:
        raise MissingFileError(f"{path}: cannot be read ({exc.strerror})") from None
    try:
        _require_regular(path, os.fstat(fd), what, error)  # replaced between stat and open?
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(path: Path, what: str = "data file", error: type[HpckptError] | None = None) -> BinaryIO:
    """`open_fd` as a buffered binary file object (close it, or use it in a `with`); an object's is
    read by ranged GETs of 64 KiB (a large read in one GET of its size)."""
    if is_object(path):
        from hpckpt.core.storage.readers import ObjectFile

        return io.BufferedReader(ObjectFile(open_handle(path, what, error)), buffer_size=64 << 10)
    return os.fdopen(open_fd(path, what, error), "rb")


def read_small(path: Path, what: str, limit: int, error: type[HpckptError] | None = None) -> bytes:
    """The whole of a metadata, index or sidecar file, refused unread when larger than `limit`.

    Raises:
        MissingFileError: missing or unreadable.
        CorruptMetadataError (`error`): larger than `limit`.
    """
    error = error or CorruptMetadataError
    if is_object(path):
        return _read_small_object(path, what, limit, error)
    fd = open_fd(path, what)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise error(f"{path}: {size} bytes, larger than any plausible {what} (limit {limit} bytes)",
                        hint="raise HPCKPT_MAX_METADATA_BYTES if it is real" if limit == metadata_limit() else None)
        # One buffer of the size fstat gave (no list of blocks joined: that held the metadata twice,
        # +31 MiB at 1,024 ranks), then whatever it grew by meanwhile, up to the limit.
        raw = io.FileIO(fd, "rb", closefd=False)
        data = raw.read(size + 1)
        # short reads (over 2 GiB), or it grew; in pieces, so as not to reserve `limit` bytes for a small file
        while more := raw.read(min(limit + 1 - len(data), 64 << 20)):
            data += more
            if len(data) > limit:
                raise error(f"{path}: grew past the {limit}-byte limit of a {what} while being read")
        return data
    except OSError as exc:
        raise MissingFileError(f"{path}: cannot be read ({exc.strerror})") from None
    finally:
        os.close(fd)


def _read_small_object(path, what: str, limit: int, error: type[HpckptError]) -> bytes:
    reader = open_handle(path, what)
    if reader.size > limit:
        raise error(f"{path}: {reader.size} bytes, larger than any plausible {what} (limit {limit} bytes)",
                    hint="raise HPCKPT_MAX_METADATA_BYTES if it is real" if limit == metadata_limit() else None)
    data = bytearray(reader.size)
    got = reader.read_into(memoryview(data), 0) if reader.size else 0
    if got != reader.size:
        raise error(f"{path}: {got} of its {reader.size} bytes could be read (changed while being read?)")
    return bytes(data)


def json_depth(data: bytes | str) -> int:
    """The deepest bracket nesting of a JSON text, brackets inside strings not counted, with no
    recursion: escaped backslashes and quotes are dropped, then all but quotes and brackets; what
    follows an odd number of quotes is inside a string; numpy sums the rest (+1 open, -1 close)."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    kept = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_BRACKET_OR_QUOTE)
    codes = np.frombuffer(kept, dtype=np.uint8)
    quote = codes == ord('"')
    outside = ~quote & ((np.cumsum(quote, dtype=np.int64) & 1) == 0)
    steps = _STEP[codes[outside]]
    return max(0, int(steps.cumsum(dtype=np.int64).max())) if steps.size else 0


def load_json(data: bytes | str, what: str, error: type[HpckptError] = CorruptMetadataError,
              max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse JSON, refusing nesting deeper than `max_depth` before the parser sees it.

    Raises:
        `error`: not UTF-8, not JSON, or nested too deep (message prefixed with `what`).
    """
    try:
        depth = json_depth(data)
        if depth > max_depth:
            raise error(f"{what}: JSON nested {depth} levels deep (more than {max_depth}): not a real one")
        return json.loads(data if isinstance(data, str) else bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, UnicodeEncodeError) as exc:
        raise error(f"{what}: not UTF-8 text ({exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise error(f"{what}: not valid JSON ({exc})") from None
    except (RecursionError, ValueError, MemoryError) as exc:
        raise error(f"{what}: not valid JSON ({type(exc).__name__})") from None
