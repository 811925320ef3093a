"""Where output goes: results on stdout (human tables or one JSON document), the rest on stderr.

One state for the whole run, set by the output options wherever they are given (before the
command or after it): `--json`, `--quiet`, `--no-progress`, `--debug`. The tables are
`cli._tables`, the progress display `cli._progress`.
"""

from __future__ import annotations

import sys
from typing import Any

from hpckpt.core.sizes import human_bytes  # noqa: F401 (the commands format sizes through _output)

_state: dict[str, Any] = {}


def reset(command: str | None = None, **flags: bool) -> None:
    """Start a run: every flag off but those given (the options before the command)."""
    _state.clear()
    _state.update(json=False, quiet=False, no_progress=False, debug=False, command=command, warnings=[],
                  emitted=False)
    configure(**flags)


def configure(**flags: bool) -> None:
    """Turn on the flags given as true (an option after the command adds to those before it)."""
    if not _state:
        reset()
    for key, value in flags.items():
        if value:
            _state[key] = True


def debug() -> bool:
    """--debug: a failure shows its traceback (cli._errors reads it)."""
    return bool(_state.get("debug"))


def json_mode() -> bool:
    return bool(_state.get("json"))


def quiet() -> bool:
    return bool(_state.get("quiet"))


def command_name() -> str | None:
    return _state.get("command")


def progress_wanted() -> bool:
    """Progress is drawn on a terminal only, and not with --quiet or --no-progress."""
    return not quiet() and not _state.get("no_progress") and sys.stderr.isatty()


def emit_json(document: Any) -> None:
    """Print the run's one JSON document on stdout (key order as docs/commands.md documents it); the
    warnings the command line itself printed join the document's."""
    if isinstance(document, dict) and "warnings" in document:
        document["warnings"] = [*document["warnings"],
                                *(w for w in _state.get("warnings", []) if w not in document["warnings"])]
    _state["emitted"] = True
    sys.stdout.write(pretty_json(document) + "\n")
    sys.stdout.flush()


def pretty_json(document: Any) -> str:
    """JSON with each top-level key on its own line and each element of a top-level list on its
    own line, every element in compact form: as easy to read as `indent=2` for what commands
    print, and encoded by json's C encoder (`indent` takes its pure-Python one, many times slower
    on a large listing: docs/design-figures.md)."""
    import json  # here: not on every command's start-up

    def dumps(value: Any) -> str:
        return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))

    if not isinstance(document, dict) or not document:
        return dumps(document)
    lines = []
    for key, value in document.items():
        if isinstance(value, list) and value:
            body = "[\n    " + ",\n    ".join(map(dumps, value)) + "\n  ]"
        else:
            body = dumps(value)
        lines.append(f"  {dumps(key)}: {body}")
    return "{\n" + ",\n".join(lines) + "\n}"


def emitted() -> bool:
    """True once this run printed its JSON document (an error then adds none)."""
    return bool(_state.get("emitted"))


def recorded_warnings() -> list[str]:
    return list(_state.get("warnings", []))


def warn(message: str) -> None:
    """One `warning:` line on stderr, whatever the flags (also in --json mode: stdout holds only
    the document, which lists it under `warnings`)."""
    _state.setdefault("warnings", []).append(message)
    sys.stderr.write(f"warning: {printable(message)}\n")
    sys.stderr.flush()


def note(text: str) -> None:
    """An informational line on stderr (where a run keeps its logs, ...); --quiet leaves it out."""
    if not quiet():
        sys.stderr.write(f"{printable(text)}\n")
        sys.stderr.flush()


def result_line(text: str) -> None:
    """A writing command's one-line summary on stdout; --quiet leaves it out (the exit code says)."""
    if not quiet():
        print(printable(text))


def printable(name: str) -> str:
    """A name from a checkpoint, safe on a terminal: control and other unprintable characters
    escaped (`\\x1b`, `\\u202e`), so a hostile name cannot rewrite the line it is printed on."""
    if name.isprintable():
        return name
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in name)


def warn_skipped(report) -> None:
    """What was not written, or written in another kind, must not go unnoticed: a line per reason,
    naming every entry it applies to."""
    for key, what in (("skipped", "not written"), ("converted", "converted")):
        by_reason: dict[str, list[str]] = {}
        for entry in report.get(key) or []:
            by_reason.setdefault(entry["reason"], []).append(printable(entry["name"]))
        for reason, names in by_reason.items():
            _print_warning(f"{what} ({reason}): {', '.join(names)}")
    # the source reader's notes (a file holding pieces of larger tensors), the layout's (a
    # placement that does not fit every tensor it applies to) and the destination's (MindFormers'
    # tracker), the last two saying so themselves
    for note in report.get("warnings") or []:
        _print_warning(note if note.startswith(("layout: ", "destination: ")) else f"source: {note}")


def _print_warning(message: str) -> None:
    """A warning the report lists already: printed, not recorded a second time."""
    sys.stderr.write(f"warning: {printable(message)}\n")
    sys.stderr.flush()


def stdout_console():
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False)


def stderr_console():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def rate(report) -> str:
    """A write's copy rate in the CLI's one unit convention (binary: GiB/s, or MiB/s and KiB/s
    for the small outputs whose rate would print as 0.00 GiB/s)."""
    seconds = report["seconds"] or 0
    per_second = report["bytes_written"] / seconds if seconds > 0 else 0
    if per_second >= 2**30:
        return f"{per_second / 2**30:.2f} GiB/s"
    return f"{human_bytes(int(per_second))}/s"
