"""The `fleetctl` command line (Typer + Rich): parsing and rendering only, no logic.

Exit codes are Ansible's: 0 all ok; 2 a host failed; 3 a host unreachable; 4 inventory, playbook
or parse error; 5 bad options or a pattern that matches nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import click
import typer
from rich.console import Console

from . import inventory as inv
from .errors import EXIT_OPTIONS, FleetctlError, UsageError
from .fleet import Fleet
from .transport import SSHSettings

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Inspect, patch, deploy kernels to and validate SGLang inference hosts over SSH.")
lab_app = typer.Typer(no_args_is_help=True, help="A local lab fleet: real sshd hosts in network namespaces.")
app.add_typer(lab_app, name="lab")

out = Console()
err = Console(stderr=True)

Pattern = Annotated[str, typer.Argument(help="Host pattern: name, group, glob, all, a:b, a:&b, a:!b.")]
InventoryOpt = Annotated[Optional[str], typer.Option("-i", "--inventory",
                         help="Inventory file (else $FLEETCTL_INVENTORY, else ./hosts.yaml).")]
Forks = Annotated[int, typer.Option("--forks", "-f", help="Hosts worked on at once.")]
Timeout = Annotated[float, typer.Option("--timeout", help="Seconds for each host's whole job.")]
ConnectTimeout = Annotated[float, typer.Option("--connect-timeout",
                           help="Seconds for TCP connect, banner, key exchange and auth.")]
AcceptNew = Annotated[bool, typer.Option("--accept-new",
                      help="Store unknown host keys on first use (changed keys are always refused).")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]


def _fleet(forks: int, timeout: float, connect_timeout: float, accept_new: bool, json_out: bool) -> Fleet:
    if connect_timeout <= 0:
        raise UsageError("--connect-timeout must be positive")
    settings = SSHSettings(connect_timeout=connect_timeout, accept_new=accept_new)
    return Fleet(settings, forks=forks, timeout=timeout, progress=err.is_terminal and not json_out, console=err)


def _select(inventory: str | None, pattern: str) -> list[inv.Host]:
    return inv.load(inv.resolve_path(inventory)).select(pattern)


@app.command()
def inspect(pattern: Pattern, inventory: InventoryOpt = None, json_out: JsonOut = False,
            forks: Forks = 64, timeout: Timeout = 60.0, connect_timeout: ConnectTimeout = 10.0,
            accept_new: AcceptNew = False) -> None:
    """Inspect hosts: interpreter, SGLang, torch/CUDA, GPUs, servers, allocator call sites."""
    from .fleet import exit_code
    from .gather import gather
    from .report import inspect_document, render_inspect, render_status_line

    hosts = _select(inventory, pattern)
    with _fleet(forks, timeout, connect_timeout, accept_new, json_out) as fleet:
        results = fleet.run(hosts, gather, "inspect")
    if json_out:
        out.print_json(json.dumps(inspect_document(results)))
    else:
        render_inspect(results, out)
        render_status_line(results, out)
    raise typer.Exit(exit_code(results))


# ---- lab ---------------------------------------------------------------------------------

LabId = Annotated[int, typer.Option("--lab-id", help="Lab number (own subnet and state dir).")]


@lab_app.command("up")
def lab_up(hosts: Annotated[Optional[int], typer.Option("--hosts", help="Number of hosts.")] = None,
           releases: Annotated[str, typer.Option("--releases", help="SGLang releases, comma-separated.")]
           = "0.4.6.post5,0.5.2,0.5.10,0.5.23",
           with_server: Annotated[bool, typer.Option("--with-server",
                                  help="Start the SGLang stand-in server on each host.")] = False,
           lab_id: LabId = 0) -> None:
    """Start the lab: one real sshd per network namespace, each with a real SGLang release."""
    from . import lab

    path = lab.lab_up(hosts, [r.strip() for r in releases.split(",") if r.strip()],
                      with_server=with_server, lab_id=lab_id)
    out.print(str(path))


@lab_app.command("down")
def lab_down(lab_id: LabId = 0) -> None:
    """Stop the lab and remove every namespace, link and process it made."""
    from . import lab

    lab.lab_down(lab_id=lab_id)


@lab_app.command("status")
def lab_status(lab_id: LabId = 0) -> None:
    """Show the lab's hosts, addresses, releases, sshd state and faults."""
    from . import lab
    from .report import table

    rows = lab.lab_status(lab_id=lab_id)
    cols = list(rows[0].keys()) if rows else ["host"]
    table("fleetctl lab", cols, [[r.get(c) for c in cols] for r in rows], out)


@lab_app.command("inventory")
def lab_inventory(lab_id: LabId = 0) -> None:
    """Print the lab inventory's path (last line)."""
    from . import lab

    out.print(str(lab.inventory_path(lab_id=lab_id)))


@lab_app.command("fault")
def lab_fault(host: str, kind: Annotated[str, typer.Argument(
        help="delay MS | down | up | freeze | thaw | rekey | hang | unhang")],
              arg: Annotated[Optional[str], typer.Argument(help="MS for delay")] = None,
              lab_id: LabId = 0) -> None:
    """Inject or clear a fault on one lab host."""
    from . import lab

    lab.lab_fault(host, kind, arg, lab_id=lab_id)


def main() -> None:
    """Console entry point: maps errors to Ansible's exit codes (click's own usage errors -> 5)."""
    try:
        code = app(standalone_mode=False)
    except click.UsageError as e:
        e.show()
        sys.exit(EXIT_OPTIONS)
    except click.Abort:
        err.print("aborted")
        sys.exit(1)
    except FleetctlError as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False)
        sys.exit(e.exit_code)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
