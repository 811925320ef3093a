"""One list of exit codes (`hpckpt.core.errors.EXIT_CODES`): every code the code can return is in
it, and the table in the docs is generated from it."""

from __future__ import annotations

import re
import signal

from _util import REPO

from hpckpt.cli._errors import INTERNAL_ERROR, INTERRUPTED
from hpckpt.cli.diff import DIFFER
from hpckpt.core import errors

BEGIN, END = "<!-- exit-codes: begin (generated from hpckpt.core.errors.EXIT_CODES) -->", "<!-- exit-codes: end -->"


def every_subclass(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from every_subclass(sub)


def test_every_code_the_code_returns_is_listed():
    listed = {code: row for row in errors.EXIT_CODES for code in row.codes}
    assert len(listed) == sum(len(row.codes) for row in errors.EXIT_CODES), "a code listed twice"
    for cls in (errors.HpckptError, *every_subclass(errors.HpckptError)):
        assert cls.exit_code in listed, (cls.__name__, cls.exit_code)
    for cls in errors.ERROR_CLASSES:  # their kind is the row's (what --json error documents say)
        assert listed[cls.exit_code].kind == cls.kind, cls.__name__
    for code in (0, INTERNAL_ERROR, INTERRUPTED, DIFFER, 2):
        assert code in listed, code
    for signum in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):  # InterruptedRunError: 128 + the signal
        assert errors.InterruptedRunError(signum).exit_code in listed
    assert listed[INTERRUPTED].kind == "interrupted" and listed[DIFFER].kind == "differ"


def test_the_docs_table_is_generated_from_the_list():
    pages = [p for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))] if BEGIN in p.read_text()]
    assert len(pages) == 1, f"one page carries the table between {BEGIN!r} and {END!r}: {pages}"
    text = pages[0].read_text()
    found = re.search(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), text, re.S)
    assert found, f"{pages[0]}: no {END!r} after the table"
    assert found.group(1) == errors.exit_code_table(), (
        f"{pages[0].name}'s exit-code table is stale: replace it with the output of "
        "`python -c 'from hpckpt.core.errors import exit_code_table; print(exit_code_table(), end=\"\")'`")
