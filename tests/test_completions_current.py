"""The committed completions/ files are exactly what the current CLI generates."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _util import REPO

FILES = {"bash": "hpckpt.bash", "zsh": "_hpckpt", "fish": "hpckpt.fish"}


@pytest.mark.parametrize("shell", sorted(FILES))
def test_completion_file_matches_cli(shell):
    generated = subprocess.run(
        [sys.executable, "-m", "hpckpt", "completion", shell], check=True, capture_output=True, text=True
    ).stdout
    committed = (REPO / "completions" / FILES[shell]).read_text()
    assert generated == committed, (
        f"completions/{FILES[shell]} is stale: run `hpckpt completion {shell} > completions/{FILES[shell]}`"
    )


def test_bash_completion_offers_every_command():
    script = REPO / "completions" / "hpckpt.bash"
    out = subprocess.run(
        ["bash", "--norc", "-c",
         f'source "{script}"; COMP_WORDS=(hpckpt ""); COMP_CWORD=1; COMP_LINE="hpckpt "; COMP_POINT=7; '
         '_hpckpt_complete; printf "%s\\n" "${COMPREPLY[@]}"'],
        check=True, capture_output=True, text=True,
    ).stdout.split()
    assert {"inspect", "verify", "env", "completion"} <= set(out)
