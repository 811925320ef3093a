"""Content digests: XXH3-128 of every stored box and of every data file, as the manifest records them.

Why XXH3-128: it is the fastest of the digests measured on this project's machines, several
times faster than SHA-256, BLAKE3 or CRC-32 on one core (docs/design-figures.md,
`bench/bench_manifest_cost.py`), so computing it while the bytes are written costs a few percent
of the write; its 128 bits make an accidental match of damaged data
(2^-128) impossible in practice. It is not cryptographic: it proves a copy intact, not that nobody
forged it (signing manifests is a later issue). The `xxhash` package releases the GIL, so files
are hashed in parallel on the engine's workers.

A box's digest is XXH3-128 of its stored bytes, in file order over its extents (C order for
every box hpckpt writes). A file's digest is made of its *segments*, so that a writer that
fills boxes in any order and patches headers afterwards knows it without reading the file back:

    XXH3-128( b"hpckpt-file-1\\n" || for each segment in offset order: u64le(nbytes) || digest(16 bytes) )

The segments are the file's stored boxes (a box sits at its first extent) and every maximal run
of the other bytes (headers, records, padding), each hashed with XXH3-128. A file without boxes
is one segment, and an empty file none.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash

from hpckpt.core.storage.readers import Handle, read_at

ALGORITHM = "xxh3-128"
DIGEST_BYTES = 16
_FILE_PREFIX = b"hpckpt-file-1\n"
SCAN_BLOCK = 8 * 1024 * 1024  # read size of a scan: one reused buffer per file being scanned


def new():
    """A streaming hasher (`update(bytes)`, `digest()`, `hexdigest()`)."""
    return xxhash.xxh3_128()


def of(data) -> str:
    """The hex digest of `data` (bytes, bytearray or a contiguous memoryview)."""
    return xxhash.xxh3_128_hexdigest(data)


def file_digest(segments: Iterable[tuple[int, int, str]]) -> str:
    """The file digest from its segments `(offset, nbytes, hex digest)`, in any order."""
    h = new()
    h.update(_FILE_PREFIX)
    for _offset, nbytes, hexdigest in sorted(segments):
        h.update(struct.pack("<Q", nbytes) + bytes.fromhex(hexdigest))
    return h.hexdigest()


def gaps(size: int, extents: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The `(offset, nbytes)` runs of `[0, size)` that no extent covers, in order.

    Raises:
        ValueError: extents overlap, or one ends past `size`.
    """
    out, at = [], 0
    for offset, nbytes in sorted(e for e in extents if e[1] > 0):
        if offset < at or offset + nbytes > size:
            raise ValueError(f"extent [{offset}, {offset + nbytes}) overlaps another or ends past {size}")
        if offset > at:
            out.append((at, offset - at))
        at = offset + nbytes
    if at < size:
        out.append((at, size - at))
    return out


def gap_digests(size: int, extents: Sequence[tuple[int, int]], writes: Sequence[tuple[int, bytes]]) -> list[tuple[int, int, str]]:
    """The segments of a file's bytes outside its boxes, computed from what a writer put there:
    `writes` `(offset, bytes)` in the order they were written (fixed bytes, then patches over
    them); every other byte is zero (the file was created at its size). No byte is read back."""
    out = []
    by_start = sorted(range(len(writes)), key=lambda i: writes[i][0])
    active: list[int] = []  # writes that began before the current gap and may reach into it
    j = 0
    for offset, nbytes in gaps(size, extents):
        end = offset + nbytes
        while j < len(by_start) and writes[by_start[j]][0] < end:
            active.append(by_start[j])
            j += 1
        active = [i for i in active if writes[i][0] + len(writes[i][1]) > offset]
        run = bytearray(nbytes)
        for i in sorted(active):  # in write order: a patch lands over the fixed bytes it patches
            at, data = writes[i]
            lo, hi = max(at, offset), min(at + len(data), end)
            if lo < hi:
                run[lo - offset:hi - offset] = data[lo - at:hi - at]
        out.append((offset, nbytes, of(run)))
    return out


@dataclass(frozen=True)
class FileDigests:
    """What hashing one file gave: its size and digest, and each listed box's digest (by position)."""

    size: int
    digest: str
    boxes: tuple[str, ...]


class ScanError(Exception):
    """A file shorter than its boxes, or boxes that overlap (raised by `scan_file`)."""


def scan_file(fd: Handle, size: int, boxes: Sequence[Sequence[tuple[int, int]]], progress=None) -> FileDigests:
    """Read a file front to back once, in `SCAN_BLOCK` reads, and hash its boxes (each a list of
    `(offset, nbytes)` extents) and its segments.

    Raises:
        ScanError: boxes overlap or end past `size`; the file ends before `size` bytes.
    """
    pieces = sorted((offset, nbytes, i) for i, extents in enumerate(boxes) for offset, nbytes in extents if nbytes)
    try:
        holes = gaps(size, ((o, n) for o, n, _ in pieces))
    except ValueError as exc:
        raise ScanError(str(exc)) from None
    runs = sorted([(o, n, i) for o, n, i in pieces] + [(o, n, -1 - k) for k, (o, n) in enumerate(holes)])
    hashers = [new() for _ in boxes]
    gap_hashers = [new() for _ in holes]
    buffer = bytearray(min(SCAN_BLOCK, max(size, 1)))
    view = memoryview(buffer)
    block_start, block_len = 0, 0
    for offset, nbytes, who in runs:
        target = hashers[who] if who >= 0 else gap_hashers[-1 - who]
        done = 0
        while done < nbytes:
            at = offset + done
            if not block_start <= at < block_start + block_len:
                block_start, block_len = at, _read_block(fd, view, at, size)
                if progress is not None:
                    progress(block_len)
            n = min(nbytes - done, block_start + block_len - at)
            target.update(view[at - block_start:at - block_start + n])
            done += n
    digests = tuple(h.hexdigest() for h in hashers)
    segments = [(o, n, gap_hashers[k].hexdigest()) for k, (o, n) in enumerate(holes)]
    segments += box_segments(list(zip(boxes, digests)))
    return FileDigests(size, file_digest(segments), digests)


def _read_block(fd: Handle, view: memoryview, at: int, size: int) -> int:
    want = min(len(view), size - at)
    got = 0
    while got < want:
        n = read_at(fd, view[got:want], at + got)
        if n <= 0:
            raise ScanError(f"the file ends at byte {at + got}, {size - at - got} bytes before its recorded size")
        got += n
    return got


def box_segments(boxes: Sequence[tuple[Sequence[tuple[int, int]], str]]) -> list[tuple[int, int, str]]:
    """The segments of stored boxes `(extents, hex digest)` (empty boxes add none)."""
    out = []
    for extents, hexdigest in boxes:
        live = [(o, n) for o, n in extents if n]
        if live:
            out.append((live[0][0], sum(n for _, n in live), hexdigest))
    return out
