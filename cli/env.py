"""`hpckpt env`: what a bug report needs, without importing the frameworks unless installed."""

from __future__ import annotations

import platform
import sys

import typer

from hpckpt import __version__
from hpckpt.cli._errors import handles_errors
from hpckpt.cli._option_groups import expand_options

_PACKAGES = ("numpy", "safetensors", "typer", "rich", "obstore", "torch", "mindspore")


def _installed(name: str) -> str:
    import importlib.metadata  # here, not at import: it would slow every command's start-up

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment() -> dict[str, str]:
    info = {
        "hpckpt": __version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "machine": platform.machine(),
    }
    info.update({name: _installed(name) for name in _PACKAGES})
    return info


@handles_errors
@expand_options
def env(
) -> None:
    """Print versions of hpckpt, Python, its dependencies and the platform, for bug reports."""
    from hpckpt.cli import _output

    info = environment()
    if _output.json_mode():
        from hpckpt.api.reports import envelope

        _output.emit_json({**envelope("env"), **info})
        return
    width = max(map(len, info))
    for key, value in info.items():
        typer.echo(f"{key:<{width}}  {value}")
