"""Telling a URL from a local path, and turning command-line text into either."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Union

from hpckpt.core.errors import UsageError

if TYPE_CHECKING:
    from hpckpt.core.storage.object_path import ObjectPath

#: The schemes hpckpt reads and writes (obstore's names; `s3a` is Hadoop's spelling of `s3`).
SCHEMES = ("s3", "s3a", "gs", "az", "abfs", "abfss")
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.S)


def is_url(text: object) -> bool:
    """True for `scheme://...` text (or an `ObjectPath`), whatever the scheme."""
    from hpckpt.core.storage.object_path import ObjectPath

    return isinstance(text, ObjectPath) or (isinstance(text, str) and _URL.match(text) is not None)


def split_url(text: str) -> tuple[str, str, str]:
    """`(scheme, bucket, key)` of `scheme://bucket/key` (the key without leading or trailing `/`).

    Raises:
        UsageError: a scheme hpckpt does not know, or no bucket.
    """
    match = _URL.match(text)
    if match is None:
        raise UsageError(f"{text!r} is not a URL")
    scheme, rest = match.group(1).lower(), match.group(2)
    if scheme not in SCHEMES:
        raise UsageError(f"{text!r}: hpckpt reads and writes {', '.join(s + '://' for s in SCHEMES)} URLs "
                         f"and local paths, not {scheme}://")
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise UsageError(f"{text!r} names no bucket")
    return ("s3" if scheme == "s3a" else scheme), bucket, key.strip("/")


Location = Union[Path, "ObjectPath"]


def as_path(value: "str | Path | ObjectPath") -> Location:
    """A command-line path or URL as a `Path` or an `ObjectPath` (a URL is connected to its store);
    a `Path` or `ObjectPath` as itself. Library code that would normalise its argument with
    `Path(...)` calls this instead."""
    from hpckpt.core.storage.object_path import ObjectPath

    if isinstance(value, (Path, ObjectPath)):
        return value
    if is_url(value):
        from hpckpt.core.storage.object_store import connect

        scheme, bucket, key = split_url(value)
        return ObjectPath(connect(scheme, bucket), key)
    return Path(value)


def lexists(path: "Path | ObjectPath") -> bool:
    """`os.path.lexists` (a broken symlink exists), or for an object whether the store has it."""
    return path.exists() if not isinstance(path, Path) else os.path.lexists(path)
