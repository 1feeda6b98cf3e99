"""`fleetctl lab`: a local lab fleet of real sshd hosts in network namespaces. The only module
that imports fleetctl.lab (a demo wing, not part of working on real hosts), and only when a lab
command runs."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from .console import err, out

app = typer.Typer(no_args_is_help=True, help="A local lab fleet: real sshd hosts in network namespaces.")

LabId = Annotated[int, typer.Option("--lab-id", help="Lab number (own subnet and state dir).")]


@app.command("up")
def lab_up(hosts: Annotated[Optional[int], typer.Option("--hosts", help="Number of hosts.")] = None,
           releases: Annotated[str, typer.Option("--releases", help="SGLang releases, comma-separated.")]
           = "0.4.6.post5,0.5.2,0.5.10,0.5.23",
           with_server: Annotated[bool, typer.Option("--with-server",
                                  help="Start the SGLang stand-in server on each host.")] = False,
           lab_id: LabId = 0) -> None:
    """Start the lab: one real sshd per network namespace, each with a real SGLang release; its
    Host blocks go to <state dir>/ssh_config, Included (one marked line) by ~/.ssh/config. Each
    step is printed on stderr as it starts, with the files it edits outside the state dir."""
    from .. import lab

    def say(line: str) -> None:
        err.print(f"lab {lab_id}: {line}", markup=False, highlight=False, soft_wrap=True)

    path = lab.lab_up(hosts, [r.strip() for r in releases.split(",") if r.strip()],
                      with_server=with_server, lab_id=lab_id, say=say)
    say(f"{lab.user_ssh_config()}: Include line for lab {lab_id} added")
    lab.add_ssh_config_include(lab.user_ssh_config(), lab_id)
    typer.echo(str(path))


@app.command("down")
def lab_down(lab_id: LabId = 0) -> None:
    """Stop the lab and remove every namespace, link and process it made, and its Include line
    in ~/.ssh/config."""
    from .. import lab

    lab.lab_down(lab_id=lab_id)
    lab.remove_ssh_config_include(lab.user_ssh_config(), lab_id)


@app.command("status")
def lab_status(lab_id: LabId = 0) -> None:
    """Show the lab's hosts, addresses, releases, sshd state and faults."""
    from .. import lab
    from ..report.text import table

    rows = lab.lab_status(lab_id=lab_id)
    for r in rows:
        f = r.pop("faults", {})
        r["faults"] = ", ".join(k if v is True else f"{k}={v}" for k, v in f.items() if v) or "none"
    cols = list(rows[0].keys()) if rows else ["host"]
    table(f"fleetctl lab {lab_id}", cols, [[r.get(c) for c in cols] for r in rows], out)


@app.command("inventory")
def lab_inventory(lab_id: LabId = 0) -> None:
    """Print the lab inventory's path (last line)."""
    from .. import lab

    typer.echo(str(lab.inventory_path(lab_id=lab_id)))


@app.command("fault")
def lab_fault(host: str, kind: Annotated[str, typer.Argument(
        help="delay MS | down | up | freeze | thaw | rekey | unrekey | sshd-kill | hang | unhang; the stand-in server's "
             "behaviours: contention MS | fail-every N | slow-attention MS | hot-expert LAYER:EXPERT | behave")],
              arg: Annotated[Optional[str], typer.Argument(help="MS for delay, contention and slow-attention, N for "
                                                           "fail-every (0 clears); LAYER:EXPERT for hot-expert "
                                                           "(off clears)")] = None,
              at_restart: Annotated[bool, typer.Option(
                  "--at-restart", help="A behaviour only from the stand-in's next start (e.g. an apply's restart "
                                       "handler), not at once.")] = False,
              lab_id: LabId = 0) -> None:
    """Inject or clear a fault on one lab host, or set its stand-in server's behaviour."""
    from .. import lab

    lab.lab_fault(host, kind, arg, lab_id=lab_id, at_restart=at_restart)
