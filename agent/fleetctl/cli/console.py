"""The two Rich consoles the commands print to: `out` (stdout: reports) and `err` (stderr:
progress, "nothing changed" and the like, errors)."""

from __future__ import annotations

import os

from rich.console import Console


def _console(stderr: bool = False) -> Console:
    """A Rich console; piped output gets 160 columns (not Rich's 80) unless $COLUMNS says."""
    c = Console(stderr=stderr)
    if not c.is_terminal and "COLUMNS" not in os.environ:
        c = Console(stderr=stderr, width=160)
    return c


out = _console()
err = _console(stderr=True)
