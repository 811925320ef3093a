"""Telling a `.ckpt` (or an encrypted one) from other files by its first bytes."""

from __future__ import annotations

ENCRYPTION_MAGICS = {0x7F3A5ED8: "AES-GCM", 0x7F3A5ED9: "AES-CBC", 0x7F3A5EDA: "SM4-CBC"}
_MAGIC_FAMILY = 0x7F3A5ED8  # the low 3 bits name the mode; the rest is MindSpore's cipher magic


def encryption_mode(head: bytes) -> str | None:
    """The cipher of an encrypted MindSpore file from its first 4 bytes, else None."""
    if len(head) < 4:
        return None
    magic = int.from_bytes(head[:4], "little")
    if magic & ~7 != _MAGIC_FAMILY & ~7:
        return None
    return ENCRYPTION_MAGICS.get(magic, "unknown mode")


def sniff(head: bytes, file_size: int) -> str:
    """Classify a file's first bytes: "value" (starts with a plausible Checkpoint Value),
    "encrypted", "short" (all bytes so far fit, but the head ends first) or "no"."""
    if encryption_mode(head):
        return "encrypted"
    try:
        return "value" if _sniff_value(head, file_size) else "no"
    except _Short:
        return "short"


class _Short(Exception):
    """The head ended before the sniff could decide."""


def _head_varint(head: bytes, pos: int) -> tuple[int, int]:
    result, shift = 0, 0
    while True:
        if pos >= len(head):
            raise _Short
        byte = head[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            return -1, pos


def _sniff_value(head: bytes, file_size: int) -> bool:
    """Field 1 (Value) whose length fits the file, opening with a UTF-8 tag, then a tensor or
    maptensor field whose length fits the Value."""
    if not head:
        raise _Short
    if head[0] != 0x0A:
        return False
    value_len, pos = _head_varint(head, 1)
    if value_len < 0 or pos + value_len > file_size:
        return False
    end = pos + value_len
    if pos >= len(head):
        raise _Short
    if head[pos] != 0x0A:
        return False
    tag_len, pos = _head_varint(head, pos + 1)
    if tag_len < 0 or pos + tag_len > end:
        return False
    if pos + tag_len > len(head):
        raise _Short
    try:
        head[pos:pos + tag_len].decode("utf-8")
    except UnicodeDecodeError:
        return False
    pos += tag_len
    if pos >= len(head):
        raise _Short
    if head[pos] not in (0x12, 0x1A):
        return False
    body_len, pos = _head_varint(head, pos + 1)
    return 0 <= body_len and pos + body_len == end
