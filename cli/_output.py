"""Where output goes: results on stdout (human tables or one JSON document), the rest on stderr."""

from __future__ import annotations

import json
import sys
from typing import Any


def emit_json(document: Any) -> None:
    """Print one JSON document on stdout (stable key order, as documented in the README)."""
    sys.stdout.write(json.dumps(document, indent=2, ensure_ascii=False) + "\n")


def stdout_console():
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False)


def stderr_console():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
