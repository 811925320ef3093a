"""The mapping shown to the user: the `--dry-run` table and the `--json` form."""

from __future__ import annotations

from hpckpt.converters.naming.entries import Derived, Mapped
from hpckpt.converters.naming.mapping import NameMapping


def _transform(entry: Mapped | Derived) -> str:
    if isinstance(entry, Derived):
        return f"{entry.kind} {entry.dtype.name}{list(entry.shape)}"
    parts = []
    if entry.transpose:
        parts.append(f"transpose{list(entry.transpose)}")
    if entry.dtype:
        parts.append(f"-> {entry.dtype.name}")
    return " ".join(parts)


def render_mapping(mapping: NameMapping) -> list[str]:
    """The `--dry-run` table as plain lines: source, destination, transform, rule; then the
    derived tensors, the ambiguous names and a summary."""
    rows = [("SOURCE", "DESTINATION", "TRANSFORM", "RULE")]
    for e in mapping.entries.values():
        dest = e.destination if e.destination is not None else f"({e.note or 'dropped'})"
        rule = e.rule or "(unmapped, kept)"
        rows.append((e.source, dest, _transform(e), f"{rule}; {e.note}" if e.note and e.destination else rule))
    for d in mapping.derived:
        src = ", ".join(d.sources) if len(d.sources) <= 2 else f"{d.sources[0]} and {len(d.sources) - 1} more"
        rows.append((f"<- {src or '(no source)'}", d.destination, _transform(d), d.rule))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3] for r in rows]
    lines = [line.rstrip() for line in lines]
    for name, why in mapping.ambiguous.items():
        lines.append(f"ambiguous: {name}: {why}")
    renamed = sum(1 for e in mapping.entries.values() if e.destination not in (None, e.source))
    lines.append(f"{len(mapping.entries)} source names: {renamed} renamed, {len(mapping.dropped)} not written, "
                 f"{len(mapping.unmapped)} unmapped (kept), {len(mapping.ambiguous)} ambiguous; "
                 f"{len(mapping.derived)} derived; preset {mapping.preset or 'none'}")
    return lines


def mapping_json(mapping: NameMapping) -> dict:
    """The mapping as JSON-able data (for `--json`); dtypes by canonical name."""
    return {
        "preset": mapping.preset,
        "entries": [
            {"source": e.source, "destination": e.destination,
             "transpose": list(e.transpose) if e.transpose else None,
             "dtype": e.dtype.name if e.dtype else None, "rule": e.rule, "note": e.note}
            for e in mapping.entries.values()
        ],
        "derived": [
            {"destination": d.destination, "sources": list(d.sources), "kind": d.kind,
             "dtype": d.dtype.name, "shape": list(d.shape), "rule": d.rule}
            for d in mapping.derived
        ],
        "unmapped": list(mapping.unmapped),
        "ambiguous": dict(mapping.ambiguous),
        "dropped": list(mapping.dropped),
    }
