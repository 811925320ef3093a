"""Static shell completion scripts for bash, zsh and fish.

Typer's own ``--show-completion`` scripts call back into the program on every
TAB, which is slow on HPC login nodes and cannot be reviewed.  Here the click
command tree is walked once (click_tree.py) into a shell-neutral model
(model.py), which one module per shell turns into plain shell code, so the
scripts can be committed under ``completions/`` and checked in tests.
"""

from __future__ import annotations

from typing import Any

from . import bash, fish, zsh
from .click_tree import build
from .click_tree import value_of  # noqa: F401  (public: how a click type is completed)

_RENDERERS = {"bash": bash.render, "zsh": zsh.render, "fish": fish.render}
SHELLS: tuple[str, ...] = tuple(_RENDERERS)


def render(shell: str, command: Any, prog_name: str = "hpckpt") -> str:
    """Return the completion script for `shell` for the click command tree `command`."""
    if shell not in _RENDERERS:
        raise ValueError(f"unsupported shell {shell!r}; expected one of {', '.join(SHELLS)}")
    return _RENDERERS[shell](build(command, (prog_name,)), prog_name)
