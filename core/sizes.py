"""Byte counts as people read them: one formatter for messages, tables and progress lines."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, whole bytes below 1 KiB, TiB the largest unit)."""
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} TiB"
