"""Byte counts as people read and write them: one formatter for messages, tables and progress
lines, and one parser for the sizes they give (`512MiB`, `5GB`)."""

from __future__ import annotations

import re


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, whole bytes below 1 KiB, TiB the largest unit)."""
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} TiB"


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """`5GB` (decimal, as Hugging Face counts), `512MiB` (binary) or a plain number of bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(text).upper())
    if not match or match.group(2) not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 5GB, 512MiB, 1000000)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


def parse_rate(value: str | int | float) -> float:
    """Bytes per second from a number, or a size with an optional `/s` (`2GiB`, `800MB/s`).

    Raises:
        ValueError: not a rate, or not positive.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        rate = float(value)
    else:
        text = str(value).strip()
        rate = float(parse_size(text[:-2] if text.lower().endswith("/s") else text))
    if not rate > 0:
        raise ValueError(f"not a positive rate: {value!r}")
    return rate
