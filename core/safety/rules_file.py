"""Rules files: read one TOML file and check its tables, the same way for every kind of rules.

The layout rules (`--layout-rules`, `core.geometry.layout.rules`) and the name rules (`--name-rules`,
`converters.naming.rules`) are both small TOML files written by hand. Both are read here so they
fail alike: a missing file raises `PathNotFoundError` (exit 3), anything else wrong with it the
`RulesFileError` subclass the caller passes (exit 2), with the file named in the message.
"""

from __future__ import annotations

from pathlib import Path

from hpckpt.core.errors import PathNotFoundError, RulesFileError


def read_rules_text(path: str | Path, what: str, error: type[RulesFileError]) -> str:
    """Read a rules file as UTF-8 (as TOML requires), so its parser sees text or nothing.

    Args:
        path: the file.
        what: what the file is, for the message ("name-rules file").
        error: the error to raise when the file cannot be read.

    Raises:
        PathNotFoundError: the file does not exist (or is not a file).
        RulesFileError: `error`, when the file is unreadable or not UTF-8.
    """
    p = Path(path)
    if not p.is_file():
        raise PathNotFoundError(f"{p}: no such file")
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{p}: cannot read the {what} ({exc})") from None


def parse_rules_toml(text: str, where: str, error: type[RulesFileError]) -> dict:
    """Parse the TOML text of a rules file, so a syntax error names the file (`where`).

    Raises:
        RulesFileError: `error`, when the text is not valid TOML.
    """
    import tomllib

    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{where}: not valid TOML ({exc})") from None


def load_rules_toml(path: str | Path, what: str, error: type[RulesFileError]) -> dict:
    """Read and parse a rules file in one step (see `read_rules_text`, `parse_rules_toml`).

    Raises:
        PathNotFoundError: the file does not exist.
        RulesFileError: `error`, when the file is unreadable, not UTF-8 or not TOML.
    """
    return parse_rules_toml(read_rules_text(path, what, error), str(Path(path)), error)


def check_table_keys(table: object, allowed: set[str], where: str, error: type[Exception]) -> None:
    """Refuse a table with keys outside `allowed`, so a misspelt key does not pass silently.

    Raises:
        Exception: `error` (a `RulesFileError` subclass for rules files), when `table` is not a
            table or has an unknown key.
    """
    if not isinstance(table, dict):
        raise error(f"{where}: expected a table")
    unknown = set(table) - allowed
    if unknown:
        raise error(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
