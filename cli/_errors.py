"""Turn errors into one line on stderr and an exit code; tracebacks only with --debug."""

from __future__ import annotations

import errno
import functools
import sys
from pathlib import Path
from typing import Any, Callable

import typer

from hpckpt.cli import _output
from hpckpt.core.errors import HpckptError, NoSpaceError

INTERNAL_ERROR = 1
INTERRUPTED = 130


def print_error(message: str, hint: str | None = None, *, kind: str = "internal",
                exit_code: int = INTERNAL_ERROR) -> None:
    """One `error:` line (and maybe one `hint:`): names from a checkpoint inside the message are
    escaped here, so a name holding a newline or terminal codes cannot forge a line. In --json
    mode stdout gets the run's one document too, `"ok": false` with the error in it."""
    sys.stderr.write(f"error: {_output.printable(message)}\n")
    if hint:
        sys.stderr.write(f"hint: {_output.printable(hint)}\n")
    sys.stderr.flush()
    if _output.json_mode() and not _output.emitted():
        from hpckpt.api.reports import error_document

        _output.emit_json(error_document(_output.command_name(), kind, exit_code, message, hint,
                                         _output.recorded_warnings()))


class UsageErrors:
    """Entered on the root context: a usage error (a wrong choice, a missing argument, a bad
    option value) is printed as one `error:` line like every other error, with the JSON document
    in --json mode, and exits 2. click hands a context's resources the exception unwinding it."""

    def __enter__(self) -> "UsageErrors":
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None or getattr(exc, "exit_code", None) != 2 or not callable(getattr(exc, "format_message", None)):
            return
        ctx = getattr(exc, "ctx", None)
        where = f"{ctx.command_path} --help" if ctx is not None else "hpckpt --help"
        print_error(exc.format_message(), f"{where} lists the options and their values", kind="usage", exit_code=2)
        raise typer.Exit(2) from None


def check_settings() -> None:
    """The environment's settings parse, before any work: a wrong one is a usage error of the
    whole command (exit 2), not a finding about each value it would have applied to."""
    import os

    if "HPCKPT_PICKLE_BUDGET" in os.environ:
        from hpckpt.core.safety.pickle_budget import current_budget

        current_budget()
    if "HPCKPT_MAX_METADATA_BYTES" in os.environ:
        from hpckpt.core.safety.input_files import metadata_limit

        metadata_limit()


class UrlText(type(Path())):
    """A URL given where a path is taken (`location`), kept whole in `url`: a `Path` subclass only
    so that typer passes it through; `handles_errors` connects it to its store inside the command,
    where a missing extra or an unknown scheme is reported like any other error."""

    url = ""


def location(text: str) -> Path:
    """typer's parser for checkpoint paths: a plain `Path` would fold `s3://b/k` into `s3:/b/k`."""
    from hpckpt.core.storage.urls import is_url

    if not is_url(text):
        return Path(text)
    path = UrlText(text)
    path.url = text
    return path


def _located(value: Any) -> Any:
    if isinstance(value, UrlText):
        from hpckpt.core.storage.urls import as_path

        return as_path(value.url)
    if isinstance(value, list) and any(isinstance(v, UrlText) for v in value):
        return [_located(v) for v in value]
    return value


def handles_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a command so every failure exits with its documented code and one clear line."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            check_settings()
            kwargs = {name: _located(value) for name, value in kwargs.items()}
            return command(*args, **kwargs)
        except (typer.Exit, typer.Abort, typer.TyperException):
            raise  # typer's own: exits, aborts and usage errors (exit 2)
        except HpckptError as exc:
            if _output.debug():
                raise
            print_error(exc.message, exc.hint, kind=exc.kind, exit_code=exc.exit_code)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:  # SIGINT where the CLI's handler is not installed (cli._signals)
            print_error("interrupted (SIGINT)", kind="interrupted", exit_code=INTERRUPTED)
            raise typer.Exit(INTERRUPTED) from None
        except BrokenPipeError:
            sys.stderr.close()  # the reader went away (`| head`): not an error of ours
            raise typer.Exit(0) from None
        except Exception as exc:  # noqa: BLE001 - the last line of defence
            if _output.debug():
                raise
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):  # a full disk outside the writing path
                print_error(f"no space left on device ({exc.filename or exc.strerror})", kind=NoSpaceError.kind,
                            exit_code=NoSpaceError.exit_code)
                raise typer.Exit(NoSpaceError.exit_code) from None
            print_error(f"internal error: {type(exc).__name__}: {exc}",
                        "rerun with --debug for the traceback and report it")
            raise typer.Exit(INTERNAL_ERROR) from None

    return wrapper
