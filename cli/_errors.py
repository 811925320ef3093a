"""Turn errors into one line on stderr and an exit code; tracebacks only with --debug."""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import typer

from hpckpt.core.errors import HpckptError

INTERNAL_ERROR = 1
INTERRUPTED = 130

_state = {"debug": False}


def set_debug(enabled: bool) -> None:
    _state["debug"] = enabled


def debug_enabled() -> bool:
    return _state["debug"]


def print_error(message: str, hint: str | None = None) -> None:
    """One `error:` line (and maybe one `hint:`): names from a checkpoint inside the message are
    escaped here, so a name holding a newline or terminal codes cannot forge a line."""
    from hpckpt.cli._output import printable

    sys.stderr.write(f"error: {printable(message)}\n")
    if hint:
        sys.stderr.write(f"hint: {printable(hint)}\n")
    sys.stderr.flush()


def handles_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a command so every failure exits with its documented code and one clear line."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except (typer.Exit, typer.Abort, typer.TyperException):
            raise  # typer's own: exits, aborts and usage errors (exit 2)
        except HpckptError as exc:
            if debug_enabled():
                raise
            print_error(exc.message, exc.hint)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            print_error("interrupted")
            raise typer.Exit(INTERRUPTED) from None
        except BrokenPipeError:
            sys.stderr.close()  # the reader went away (`| head`): not an error of ours
            raise typer.Exit(0) from None
        except Exception as exc:  # noqa: BLE001 - the last line of defence
            if debug_enabled():
                raise
            print_error(f"internal error: {type(exc).__name__}: {exc}",
                        "rerun with --debug for the traceback and report it")
            raise typer.Exit(INTERNAL_ERROR) from None

    return wrapper
