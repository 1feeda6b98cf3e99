"""The command line's shared options, each declared once, and what they become: the inventory's
hosts, the connection `Settings` and the `Fleet` that works on them.

Every fleet command (one that connects to hosts through a Fleet) takes the same dozen options;
`fleet_command` gives them to it as one `FleetOptions`, and to Typer as real parameters of the
command's signature (Typer reads a command's options from `inspect.signature`).
"""

from __future__ import annotations

import getpass
import inspect
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Callable, Optional, get_type_hints

import typer

from .. import config
from .. import inventory as inv
from ..connection import Settings
from ..engine.fleet import Fleet
from ..errors import UsageError
from .console import err

Pattern = Annotated[str, typer.Argument(help="Host pattern: name, group, glob, all, a:b, a:&b, a:!b.")]
InventoryOpt = Annotated[Optional[str], typer.Option("-i", "--inventory",
                         help=("Inventory: an Ansible YAML file, or (with the ansible extra installed) any "
                               "source ansible-inventory reads (INI, directory, script, plugin); else "
                               "$FLEETCTL_INVENTORY, else ./hosts.yaml."))]
VaultPasswordFile = Annotated[Optional[str], typer.Option(
    "--vault-password-file", envvar="ANSIBLE_VAULT_PASSWORD_FILE",
    help="Vault password file (or script), as Ansible's; needs the ansible extra. Else $ANSIBLE_VAULT_PASSWORD_FILE.")]
AskVaultPass = Annotated[bool, typer.Option("--ask-vault-pass", help="Ask for the vault password; needs the ansible extra.")]
AskBecomePass = Annotated[bool, typer.Option("--ask-become-pass", "-K", help=(
    "Ask for the sudo password of hosts with ansible_become that set no ansible_become_password."))]
Forks = Annotated[int, typer.Option("--forks", "-f", help="Hosts worked on at once.")]
Timeout = Annotated[float, typer.Option("--timeout", help="Seconds for each host's whole job.")]
JobTimeout = Annotated[Optional[float], typer.Option("--timeout",
                       help="Seconds for each host's whole job (default: health timeout + 300).")]
ConnectTimeout = Annotated[float, typer.Option("--connect-timeout",
                           help="Seconds for TCP connect, banner, key exchange and auth.")]
AcceptNew = Annotated[bool, typer.Option("--accept-new",
                      help="Store unknown host keys on first use (changed keys are always refused).")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
SshConfig = Annotated[Optional[str], typer.Option("--ssh-config", envvar="FLEETCTL_SSH_CONFIG", help=(
    "ssh_config file to read instead of ~/.ssh/config and /etc/ssh/ssh_config (as ssh -F); "
    "else $FLEETCTL_SSH_CONFIG."))]
ConnectionOpt = Annotated[Optional[str], typer.Option("-c", "--connection", help=(
    "Connection kind for hosts whose inventory sets no ansible_connection: paramiko (default), ssh "
    "(the OpenSSH client), local."))]
RunTimeout = Annotated[Optional[float], typer.Option("--run-timeout", help=(
    "Seconds for the whole command: hosts still in progress then fail, the rest are not attempted."))]

HealthTimeout = Annotated[float, typer.Option("--health-timeout", help=(
    "Seconds to wait for /health to answer 200 (after a restart handler: at least its wait_for_health_s)."))]
Repeat = Annotated[int, typer.Option("--repeat", help="Smoke decodes per server; the median latency is kept.")]
Port = Annotated[int, typer.Option("--port", help="Port of discovered servers that give no --port.")]
LatencyTolerance = Annotated[float, typer.Option("--latency-tolerance",
                             help="Allowed ratio of median latency after/before a change.")]
LatencySlack = Annotated[Optional[float], typer.Option("--latency-slack", help=(
    "Extra seconds allowed on top of the latency ratio (default: the host's fleetctl_latency_slack, else 0)."))]
AllowDrift = Annotated[bool, typer.Option("--allow-token-drift",
                       help="Let greedy tokens differ after a change (reported as token drift).")]
InstallOpt = Annotated[Optional[str], typer.Option("--install", help=(
    "The install to work on, by its id from inspect (host:<package_dir>); "
    "default: every install a server runs from."))]
Yes = Annotated[bool, typer.Option("--yes", "-y", help="Change hosts without asking.")]
PlaybooksDir = Annotated[Optional[str], typer.Option("--playbooks-dir", envvar="FLEETCTL_PLAYBOOKS_DIR", help=(
    "Directory of playbooks to find PLAYBOOK in (default: the ones fleetctl ships); "
    "else $FLEETCTL_PLAYBOOKS_DIR."))]
KernelsDir = Annotated[Optional[str], typer.Option("--kernels-dir", envvar="FLEETCTL_KERNELS_DIR", help=(
    "Directory of kernel packages to find NAME in (default: the ones fleetctl ships); "
    "else $FLEETCTL_KERNELS_DIR."))]


def load_inventory(inventory: str | None, vault_password_file: str | None = None,
                   ask_vault_pass: bool = False) -> inv.Inventory:
    """The inventory -i names (else $FLEETCTL_INVENTORY, else ./hosts.yaml), its vault values
    decrypted with the vault options' password. Raises InventoryError (exit 4)."""
    vault = None
    if vault_password_file or ask_vault_pass:
        from ..inventory.sources import Vault
        vault = Vault(vault_password_file, ask_vault_pass)
    return inv.load(inv.resolve_path(inventory), vault)


def settings(connect_timeout: float, accept_new: bool, ssh_config: str | None,
             connection: str | None = None, ask_become_pass: bool = False) -> Settings:
    """The connection Settings the options give (the become password asked for on the terminal
    with --ask-become-pass). Raises UsageError (exit 5) for an unknown -c, a --connect-timeout
    that is not positive or an --ssh-config that is not a file."""
    if connection is not None and connection not in config.CONNECTIONS:
        raise UsageError(f"-c {connection}: not a connection fleetctl has ({', '.join(config.CONNECTIONS)})")
    if connect_timeout <= 0:
        raise UsageError("--connect-timeout must be positive")
    if ssh_config is not None and not os.path.isfile(ssh_config):
        raise UsageError(f"--ssh-config {ssh_config}: no such file")
    return Settings(connect_timeout=connect_timeout, accept_new=accept_new,
                    ssh_config=Path(ssh_config).resolve() if ssh_config else None, connection=connection,
                    become_password=getpass.getpass("BECOME password: ") if ask_become_pass else None)


@dataclass(frozen=True)
class FleetOptions:
    """The options every fleet command takes, as given: where its hosts come from (-i, the
    vault options), -K, --json, and how they are worked on (--forks, --timeout in seconds per
    host's job, None where the command computes it, the connection options, --run-timeout in
    seconds for the whole command)."""

    inventory: InventoryOpt = None
    vault_password_file: VaultPasswordFile = None
    ask_vault_pass: AskVaultPass = False
    ask_become_pass: AskBecomePass = False
    json_out: JsonOut = False
    forks: Forks = 64
    timeout: Optional[float] = None  # declared per command: see fleet_command
    connect_timeout: ConnectTimeout = config.CONNECT_TIMEOUT_S
    accept_new: AcceptNew = False
    ssh_config: SshConfig = None
    connection: ConnectionOpt = None
    run_timeout: RunTimeout = None

    def select(self, pattern: str) -> list[inv.Host]:
        """The inventory's hosts `pattern` matches. Raises InventoryError (exit 4), or UsageError
        (exit 5) for a pattern that matches nothing."""
        return load_inventory(self.inventory, self.vault_password_file, self.ask_vault_pass).select(pattern)

    def fleet(self, timeout: float | None = None) -> Fleet:
        """A Fleet with these options; `timeout` (seconds per host's job) replaces --timeout. Its
        progress goes to stderr, on a terminal and without --json. Raises UsageError (exit 5)."""
        timeout = self.timeout if timeout is None else timeout
        given = settings(self.connect_timeout, self.accept_new, self.ssh_config, self.connection, self.ask_become_pass)
        for bad, msg in ((self.forks < 1, "--forks must be at least 1"), (timeout <= 0, "--timeout must be positive"),
                         (self.run_timeout is not None and self.run_timeout <= 0, "--run-timeout must be positive")):
            if bad:
                raise UsageError(msg)
        return Fleet(given, forks=self.forks, timeout=timeout,
                     progress=err.is_terminal and not self.json_out, console=err, run_timeout=self.run_timeout)


# The FleetOptions fields fleet_command puts after `after` (-i to --json); the rest go before `before`.
_LEADING = ("inventory", "vault_password_file", "ask_vault_pass", "ask_become_pass", "json_out")


def fleet_command(timeout: float | None, after: str = "pattern", before: str | None = None) -> Callable:
    """Give a command the FleetOptions: `command(opts, *own)` becomes a function whose signature,
    for Typer, is the command's own parameters with the FleetOptions fields among them (-i to
    --json after the parameter named `after`, --forks to --run-timeout before the one named
    `before`, or last), and which calls `command` with them gathered into `opts`.

    timeout: the --timeout default in seconds; None where the command computes each job's
    timeout itself (its help then says the default is health timeout + 300).
    Raises TypeError (at import) where `after` or `before` names no parameter of the command.
    """
    declared = get_type_hints(FleetOptions, include_extras=True)
    common = {f.name: inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=declared[f.name],
                                        default=f.default) for f in fields(FleetOptions)}
    common["timeout"] = common["timeout"].replace(annotation=Timeout if timeout is not None else JobTimeout,
                                                  default=timeout)
    leading = [common[n] for n in _LEADING]
    trailing = [p for n, p in common.items() if n not in _LEADING]

    def decorate(command: Callable) -> Callable:
        own = list(inspect.signature(command, eval_str=True).parameters.values())[1:]
        for name in (after, before):
            if name is not None and name not in {p.name for p in own}:
                raise TypeError(f"{command.__name__} has no parameter {name}")
        params = []
        for p in own:
            if p.name == before:
                params += trailing
            params.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY))
            if p.name == after:
                params += leading
        if before is None:
            params += trailing

        def run(**given):
            opts = FleetOptions(**{n: given.pop(n) for n in common})
            return command(opts, **given)

        run.__name__, run.__qualname__, run.__module__ = command.__name__, command.__qualname__, command.__module__
        run.__doc__ = command.__doc__
        run.__signature__ = inspect.Signature(params)
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run

    return decorate
