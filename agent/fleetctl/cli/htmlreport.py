"""`fleetctl report -o fleet.html`: the HTML fleet report (report/html.py), written from the run history
alone (history.store): no host is contacted, and the command is not itself recorded."""

from __future__ import annotations

import os
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import UsageError
from ..history.store import Store
from .console import err
from .history import age_s
from .options import HistoryOpt
from ..report.text import text

app = typer.Typer()
# The runs a report shows without --runs: the newest ones (the page of a long history would be
# too large for a browser).
DEFAULT_RUNS = 200


def write_private(path: Path, content: str) -> None:
    """Write `content` (UTF-8; a lone surrogate, from an undecodable file name, as \\udcNN) to
    `path`. A regular file, or a new one, is replaced atomically (a temporary file beside it, then
    a rename), mode 0600: the report holds host names, addresses, paths and diffs, as the history
    file does. A path that exists and is not a regular file (/dev/stdout, a FIFO, a terminal) is
    written through, never replaced. Raises UsageError (exit 5) naming the path when it cannot be
    written, and for a symbolic link to a regular file (replacing it would drop the link; writing
    through it would write where the link points): give the target itself."""
    try:
        if path.is_symlink() and path.is_file():
            raise UsageError(f"cannot write the report to {path}: {path} is a symbolic link (to "
                             f"{os.readlink(path)}); give the file itself")
        if path.exists() and not stat.S_ISREG(path.stat().st_mode):
            with open(path, "w", encoding="utf-8", errors="backslashreplace") as f:
                f.write(content)
            return
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as f:
                f.write(content)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        raise UsageError(f"cannot write the report to {path}: {e}") from None


@app.command("report")
def report(output: Annotated[Path, typer.Option("-o", "--output", metavar="FILE", help=(
               "The HTML file to write (replaced if it exists; a device or FIFO is written through; "
               "-: standard output)."))],
           since: Annotated[Optional[str], typer.Option("--since", metavar="AGE", help=(
               "Only runs started within AGE: 7d, 12h, 30m (default: any age, up to --runs)."))] = None,
           runs: Annotated[int, typer.Option("--runs", metavar="N", min=0, help=(
               f"Show the newest N runs (default {DEFAULT_RUNS}; 0: all)."))] = DEFAULT_RUNS,
           history: HistoryOpt = None) -> None:
    """Write one self-contained HTML fleet report from the run history (no host is contacted): the
    fleet overview (each host's SGLang installs, applied changes, active kernels, drift and last
    validation, from the latest run that read each), a timeline of the changes, and each run (the
    newest --runs) with its hosts, gate checks, load-gate charts and diffs. It loads nothing from
    the network and needs no script."""
    from ..report.html import render  # with report's renderers: loaded only for this command

    cutoff = time.time() - age_s(since, "--since") if since is not None else None
    store = Store.open(history, readonly=True)
    try:
        recorded = store.runs(since=cutoff)
    finally:
        store.close()
    shown = recorded[-runs:] if runs else recorded
    page = render(shown, time.time(), since, str(store.path), total=len(recorded))
    if str(output) == "-":
        sys.stdout.buffer.write(page.encode("utf-8", "backslashreplace"))
        sys.stdout.flush()
    else:
        write_private(output, page)
    err.print(text(f"report written: {'standard output' if str(output) == '-' else output} ({len(shown)} run(s), "
                   f"{len({h.host for r in shown for h in r.hosts})} host(s), from {store.path})"),
              highlight=False, soft_wrap=True)
