"""What a pickle declares, read from its opcodes without running it: the memo indices and
lengths a small pickle names (checked before the C unpickler allocates them), and the globals a
file's first bytes name (how a reader recognises a pickle format).
"""

from __future__ import annotations

import io
import pathlib
import pickle
from typing import Any, BinaryIO


from hpckpt.core.errors import CorruptMetadataError, HpckptError, UnsafePickleError



SCAN_BYTES = 1 << 20  # scanned before loading (its speed: docs/design-figures.md)


def _arguments() -> dict[int, tuple[int, int, str]]:
    """Opcode byte -> (layout of its argument, size, name). Layouts: 0 none, 1 `size` bytes, 2 a
    `size`-byte little-endian length then that many bytes, 3 `size` newline-ended lines."""
    import pickletools

    lengths = {pickletools.TAKEN_FROM_ARGUMENT1: 1, pickletools.TAKEN_FROM_ARGUMENT4: 4,
               pickletools.TAKEN_FROM_ARGUMENT4U: 4, pickletools.TAKEN_FROM_ARGUMENT8U: 8}
    table = {}
    for op in pickletools.opcodes:
        arg, code, name = op.arg, op.code.encode("latin-1")[0], op.name.lower()
        if arg is None:
            table[code] = (0, 0, name)
        elif op.name in ("GLOBAL", "INST"):
            table[code] = (3, 2, name)
        elif arg.n >= 0:
            table[code] = (1, arg.n, name)
        elif arg.n == pickletools.UP_TO_NEWLINE:
            table[code] = (3, 1, name)
        else:
            table[code] = (2, lengths[arg.n], name)
    return table


_ARGUMENTS: dict[int, tuple[int, int, str]] = {}
_PUT, _BINPUT, _LONG_BINPUT, _STOP = b"p"[0], b"q"[0], b"r"[0], b"."[0]


def _scan(file: BinaryIO, nbytes: int) -> None:
    """Refuse what a pickle's opcodes declare beyond what its bytes can honestly need, before the
    C unpickler acts on it (pickles above SCAN_BYTES, large metadata where a scan would cost
    seconds, are not scanned; the `hpckpt` process bounds their load's memory, `_memory_cap`):

    - a memo index no honest pickle of this size uses: the unpickler grows its memo to twice the
      largest index it is told to store at, 16 bytes an entry (a 6-byte `LONG_BINPUT 10**8` asks
      for 1.6 GB); an honest index counts the objects stored before, fewer than the bytes (allowed:
      2 x the bytes or 2^20, a memo of at most 64 MiB for a pickle of SCAN_BYTES);
    - a length (of bytes, a string, a long integer, a frame) past the pickle's end: the
      unpickler allocates what a BYTEARRAY8 declares before it finds the bytes missing.

    Raises:
        UnsafePickleError: a memo index larger than the pickle.
        pickle.UnpicklingError: the opcodes do not parse (reported by the callers as corrupt).
    """
    if not isinstance(file, io.BytesIO) or not 0 < nbytes <= SCAN_BYTES:
        return
    if not _ARGUMENTS:
        _ARGUMENTS.update(_arguments())
    start = file.tell()
    _scan_opcodes(file.getvalue(), start, max(2 * nbytes, 1 << 20))  # getvalue() shares the bytes


def _scan_opcodes(data: bytes, at: int, memo_limit: int) -> None:
    table, end, index = _ARGUMENTS, len(data), None
    while at < end:
        code = data[at]
        layout = table.get(code)
        if layout is None:
            raise pickle.UnpicklingError(f"malformed pickle (no opcode {code:#04x} at byte {at})")
        kind, size, name = layout
        at += 1
        if kind == 1:
            if code == _BINPUT or code == _LONG_BINPUT:
                index = int.from_bytes(data[at:at + size], "little")
            at += size
        elif kind == 2:
            length = int.from_bytes(data[at:at + size], "little")
            if at + size + length > end:
                raise pickle.UnpicklingError(f"malformed pickle (a {name} declares {length:,} bytes, "
                                             f"{max(0, end - at - size):,} remain)")
            at += size + length
        elif kind == 3:
            start = at
            for _ in range(size):
                at = data.find(b"\n", at) + 1
                if at == 0:
                    raise pickle.UnpicklingError("malformed pickle (a line argument without its newline)")
            if code == _PUT:
                try:
                    index = int(data[start:at - 1])
                except ValueError:
                    raise pickle.UnpicklingError(f"malformed pickle (PUT {data[start:at - 1][:20]!r})") from None
        elif code == _STOP:
            return
        if at > end:
            raise pickle.UnpicklingError(f"malformed pickle (the argument of a {name} runs past the end)")
        if index is not None:
            if index > memo_limit:
                raise UnsafePickleError(f"refusing a memo index of {index:,} in a pickle of {end:,} bytes "
                                        "(it would make the unpickler allocate a memo that large)")
            index = None
    raise pickle.UnpicklingError("malformed pickle (no STOP opcode)")



SNIFF_BYTES = 4096  # the first global of a metadata pickle lies within its first ~100 bytes


def sniff_head(path: "pathlib.Path") -> bytes:
    """The first bytes of a metadata file, enough to tell whose classes it pickles."""
    from hpckpt.core.safety import input_files

    try:
        with input_files.open_file(path, "metadata file") as f:
            return f.read(SNIFF_BYTES)
    except (OSError, HpckptError):
        return b""


def pickle_globals(data: bytes, limit: int = 64) -> set[tuple[str, str]]:
    """Return the (module, name) pairs a pickle refers to, without unpickling it.

    Pure Python, so meant for small pickles and prefixes. Stops after `limit` globals, which
    is plenty: class references are memoised after first use.
    """
    import pickletools

    found: set[tuple[str, str]] = set()
    recent: list[str] = []  # strings pushed since the last global (STACK_GLOBAL takes two)
    memo: dict[int, Any] = {}
    last: Any = None  # what the previous opcode pushed, for MEMOIZE
    try:
        for opcode, arg, _pos in pickletools.genops(data):
            name = opcode.name
            pushed: Any = None
            if name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
                pushed = arg
            elif name == "MEMOIZE":
                memo[len(memo)] = last
                continue
            elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
                memo[int(arg)] = last
                continue
            elif name in ("BINGET", "LONG_BINGET", "GET"):
                pushed = memo.get(int(arg))
            elif name == "GLOBAL":
                module, _, attr = arg.partition(" ")
                found.add((module, attr))
            elif name == "STACK_GLOBAL" and len(recent) >= 2:
                found.add((recent[-2], recent[-1]))
                recent.clear()
            if isinstance(pushed, str):
                recent.append(pushed)
            last = pushed
            if len(found) >= limit:
                break
    except (ValueError, EOFError, UnicodeDecodeError) as exc:
        raise CorruptMetadataError(f"not a valid pickle ({exc})") from exc
    return found
