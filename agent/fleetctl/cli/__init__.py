"""The `fleetctl` command line (Typer + Rich): parsing and rendering only, no logic.

The commands live by what they are: fleet (working on hosts), ansible (inventory export,
collection build) and lab (the lab fleet); their shared options are options'. This module wires
them into one app and runs it.

Exit codes are Ansible's: 0 all ok; 2 a host failed; 3 a host unreachable; 4 inventory, playbook
or parse error; 5 bad options or a pattern that matches nothing.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
import threading
from typing import Annotated

import typer
from typer.exceptions import TyperException
from rich.text import Text

from .. import __version__
from ..errors import EXIT_INTERRUPTED, EXIT_OPTIONS, EXIT_TERMINATED, FleetctlError
from ..history import record
from ..limits import raise_open_files
from . import ansible, fleet, history, htmlreport, lab, signals
from .console import err

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Inspect, patch, deploy kernels to and validate SGLang inference hosts over SSH.")
app.add_typer(fleet.app)
app.add_typer(fleet.deploy_app, name="deploy")
app.add_typer(fleet.cache_app, name="cache")
app.add_typer(lab.app, name="lab")
app.add_typer(history.app, name="history")
app.add_typer(htmlreport.app)
app.add_typer(ansible.inventory_app, name="inventory")
app.add_typer(ansible.collection_app, name="collection")

def _version(show: bool) -> None:
    """--version: fleetctl's version and the Python it runs on, then exit 0."""
    if show:
        sys.stdout.write(f"fleetctl {__version__} (Python {platform.python_version()})\n")
        raise typer.Exit(0)


@app.callback()
def root(verbose: Annotated[int, typer.Option("--verbose", "-v", count=True, show_default=False, help=(
             "Before the command: -v shows on stderr what each host is dialled as (address, port, user, "
             "connection kind, proxy, identity files) and each connection phase's time; -vv also what "
             "ssh -G resolved. Never secrets."))] = 0,
         version: Annotated[bool, typer.Option("--version", "-V", callback=_version, is_eager=True,
                                               help="Print fleetctl's version and exit.")] = False) -> None:
    """Inspect, patch, deploy kernels to and validate SGLang inference hosts over SSH."""
    if verbose:
        _trace_connections(logging.INFO if verbose == 1 else logging.DEBUG)


def _trace_connections(level: int) -> None:
    """Show the connection layer's log records (connection.trace) at `level` and above on stderr,
    one plain line each."""
    from ..connection.trace import log

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("fleetctl: %(message)s"))
    log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False


def main() -> None:
    """Console entry point: maps errors to Ansible's exit codes (command-line usage errors -> 5;
    SIGTERM as Ctrl-C, exit 143), and records the run's end with that code in the run history
    (history.record; 1 for an uncaught exception, as Python exits)."""
    signals.install()
    raise_open_files()  # a fleet of hundreds of hosts needs more than a default 1024 (limits.py)
    code = 1
    try:
        code = _run()
    finally:
        record.end(code)
    if code in (EXIT_INTERRUPTED, EXIT_TERMINATED) and abandoned_threads():
        # A second Ctrl-C left hosts in progress (engine.fleet.Fleet._abandon): their threads may
        # wait on a connect for its whole timeout, and Python would join them at exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def abandoned_threads() -> list[threading.Thread]:
    """The threads but the main one that are alive and not daemons (a fleet's workers left
    running by a second Ctrl-C): the ones Python's exit would wait for."""
    return [t for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive() and not t.daemon]


def _run() -> int:
    """Run the app; its exit code."""
    try:
        code = app(standalone_mode=False)
    except TyperException as e:  # Typer's own click: usage errors, bad parameters, no arguments
        if hasattr(e, "show"):
            e.show()
        return EXIT_OPTIONS
    except (typer.Abort, KeyboardInterrupt):
        err.print("aborted")
        return signals.exit_code(EXIT_INTERRUPTED)
    except FleetctlError as e:
        from ..report.text import text

        err.print(Text.assemble(("error:", "bold red"), " ", text(e)), highlight=False, soft_wrap=True)
        return e.exit_code
    code = code if isinstance(code, int) else 0
    return signals.exit_code(code)
