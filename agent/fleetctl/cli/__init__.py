"""The `fleetctl` command line (Typer + Rich): parsing and rendering only, no logic.

Exit codes are Ansible's: 0 all ok; 2 a host failed; 3 a host unreachable; 4 inventory, playbook
or parse error; 5 bad options or a pattern that matches nothing.
"""

from __future__ import annotations

import getpass
import json
import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.exceptions import TyperException
from rich.console import Console
from rich.text import Text

from .. import config
from .. import inventory as inv
from ..errors import EXIT_INTERRUPTED, EXIT_OPTIONS, EXIT_TERMINATED, FleetctlError, UsageError
from ..connection import Settings
from ..engine.fleet import Fleet

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Inspect, patch, deploy kernels to and validate SGLang inference hosts over SSH.")
deploy_app = typer.Typer(no_args_is_help=True, help="Deploy things to hosts.")
app.add_typer(deploy_app, name="deploy")
lab_app = typer.Typer(no_args_is_help=True, help="A local lab fleet: real sshd hosts in network namespaces.")
cache_app = typer.Typer(no_args_is_help=True, help="The hosts' scan caches (kept by inspect, one per install).")
app.add_typer(cache_app, name="cache")
app.add_typer(lab_app, name="lab")
inventory_app = typer.Typer(no_args_is_help=True, help="The inventory, for other tools.")
app.add_typer(inventory_app, name="inventory")
collection_app = typer.Typer(no_args_is_help=True, help="The Ansible collection fleetctl.sglang.")
app.add_typer(collection_app, name="collection")

def _console(stderr: bool = False) -> Console:
    """A Rich console; piped output gets 160 columns (not Rich's 80) unless $COLUMNS says."""
    c = Console(stderr=stderr)
    if not c.is_terminal and "COLUMNS" not in os.environ:
        c = Console(stderr=stderr, width=160)
    return c


out = _console()
err = _console(stderr=True)

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


def _settings(connect_timeout: float, accept_new: bool, ssh_config: str | None,
              connection: str | None = None, ask_become_pass: bool = False) -> Settings:
    if connection is not None and connection not in inv.CONNECTIONS:
        raise UsageError(f"-c {connection}: not a connection fleetctl has ({', '.join(inv.CONNECTIONS)})")
    if connect_timeout <= 0:
        raise UsageError("--connect-timeout must be positive")
    if ssh_config is not None and not os.path.isfile(ssh_config):
        raise UsageError(f"--ssh-config {ssh_config}: no such file")
    return Settings(connect_timeout=connect_timeout, accept_new=accept_new,
                    ssh_config=Path(ssh_config).resolve() if ssh_config else None, connection=connection,
                    become_password=getpass.getpass("BECOME password: ") if ask_become_pass else None)


def _fleet(forks: int, timeout: float, connect_timeout: float, accept_new: bool, json_out: bool,
           ssh_config: str | None = None, run_timeout: float | None = None, connection: str | None = None,
           ask_become_pass: bool = False) -> Fleet:
    settings = _settings(connect_timeout, accept_new, ssh_config, connection, ask_become_pass)
    return Fleet(settings, forks=forks, timeout=timeout, progress=err.is_terminal and not json_out, console=err,
                 run_timeout=run_timeout)


def _select(inventory: str | None, pattern: str, vault_password_file: str | None = None,
            ask_vault_pass: bool = False) -> list[inv.Host]:
    vault = None
    if vault_password_file or ask_vault_pass:
        from ..inventory.sources import Vault
        vault = Vault(vault_password_file, ask_vault_pass)
    return inv.load(inv.resolve_path(inventory), vault).select(pattern)


@app.command()
def inspect(pattern: Pattern, inventory: InventoryOpt = None, vault_password_file: VaultPasswordFile = None,
    ask_vault_pass: AskVaultPass = False, ask_become_pass: AskBecomePass = False, json_out: JsonOut = False,
            forks: Forks = 64, timeout: Timeout = config.INSPECT_TIMEOUT_S,
            connect_timeout: ConnectTimeout = config.CONNECT_TIMEOUT_S,
            accept_new: AcceptNew = False, ssh_config: SshConfig = None, connection: ConnectionOpt = None,
             run_timeout: RunTimeout = None,
            no_cache: Annotated[bool, typer.Option("--no-cache", help=(
                "Rescan every source file; the hosts' scan caches are neither read nor written."))] = False) -> None:
    """Inspect hosts: interpreter, SGLang, torch/CUDA, GPUs, servers, allocator call sites."""
    from functools import partial

    from ..engine.fleet import exit_code
    from ..engine.gather import inspect_job
    from .report import inspect_document, render_inspect

    hosts = _select(inventory, pattern, vault_password_file, ask_vault_pass)
    with _fleet(forks, timeout, connect_timeout, accept_new, json_out, ssh_config, run_timeout, connection,
                ask_become_pass) as fleet:
        results = fleet.run(hosts, partial(inspect_job, cache=not no_cache), "inspect")
    if json_out:
        sys.stdout.write(json.dumps(inspect_document(results), indent=1) + "\n")
    else:
        _render(results, render_inspect)
    raise typer.Exit(exit_code(results))


@app.command()
def hosts(pattern: Pattern, inventory: InventoryOpt = None, vault_password_file: VaultPasswordFile = None,
          ask_vault_pass: AskVaultPass = False, json_out: JsonOut = False,
          connect_timeout: ConnectTimeout = config.CONNECT_TIMEOUT_S, ssh_config: SshConfig = None,
          connection: ConnectionOpt = None) -> None:
    """Show how each host would be reached, without connecting: connection kind, address, port,
    user, identity files, jump chain, known_hosts files and the lines that apply (from ssh -G)."""
    from ..errors import EXIT_PARSE
    from ..connection.describe import describe
    from .report import render_hosts

    selected = _select(inventory, pattern, vault_password_file, ask_vault_pass)
    settings = _settings(connect_timeout, False, ssh_config, connection)
    docs = [describe(h, settings) for h in selected]
    if json_out:
        _print_json({"hosts": docs})
    else:
        render_hosts(docs, out)
    raise typer.Exit(EXIT_PARSE if any(d["error"] for d in docs) else 0)


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
JobTimeout = Annotated[Optional[float], typer.Option("--timeout",
                       help="Seconds for each host's whole job (default: health timeout + 300).")]
PlaybooksDir = Annotated[Optional[str], typer.Option("--playbooks-dir", envvar="FLEETCTL_PLAYBOOKS_DIR", help=(
    "Directory of playbooks to find PLAYBOOK in (default: the ones fleetctl ships); "
    "else $FLEETCTL_PLAYBOOKS_DIR."))]
KernelsDir = Annotated[Optional[str], typer.Option("--kernels-dir", envvar="FLEETCTL_KERNELS_DIR", help=(
    "Directory of kernel packages to find NAME in (default: the ones fleetctl ships); "
    "else $FLEETCTL_KERNELS_DIR."))]


def _smoke_opts(port, health_timeout, repeat, latency_tolerance=1.25, allow_token_drift=False, latency_slack=None):
    from ..engine.validate import SmokeOptions

    for bad, msg in ((repeat < 1, f"--repeat must be at least 1, not {repeat}"),
                     (health_timeout <= 0, f"--health-timeout must be positive, not {health_timeout:g}"),
                     (latency_tolerance < 1.0, f"--latency-tolerance must be at least 1, not {latency_tolerance:g}"),
                     (latency_slack is not None and latency_slack < 0,
                      f"--latency-slack must not be negative, not {latency_slack}")):
        if bad:
            raise UsageError(msg)
    return SmokeOptions(port=port, health_timeout=health_timeout, repeat=repeat,
                        latency_tolerance=latency_tolerance, allow_token_drift=allow_token_drift,
                        latency_slack_s=latency_slack)


def _positive(**values) -> None:
    """Refuse options that must be positive when given (`--timeout 0` means nothing)."""
    for name, v in values.items():
        if v is not None and v <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, not {v:g}")


def _confirm(what: str, yes: bool) -> None:
    """Ask before changing hosts: --yes skips; without a terminal nothing changes (exit 5)."""
    if yes:
        return
    if not sys.stdin.isatty():
        raise UsageError(f"nothing changed: there is no terminal to ask 'OK to {what}?'; pass --yes to go ahead")
    if not typer.confirm(f"{what}?", default=False, err=True):
        err.print("nothing changed")
        raise typer.Exit(0)


@app.command()
def validate(pattern: Pattern, inventory: InventoryOpt = None, vault_password_file: VaultPasswordFile = None,
    ask_vault_pass: AskVaultPass = False, ask_become_pass: AskBecomePass = False, json_out: JsonOut = False,
             port: Port = config.DEFAULT_SGLANG_PORT, health_timeout: HealthTimeout = config.HEALTH_TIMEOUT_S,
             repeat: Repeat = 3, forks: Forks = 64, timeout: JobTimeout = None,
             connect_timeout: ConnectTimeout = config.CONNECT_TIMEOUT_S,
             accept_new: AcceptNew = False, ssh_config: SshConfig = None, connection: ConnectionOpt = None,
             run_timeout: RunTimeout = None, install: InstallOpt = None) -> None:
    """Smoke decode on each host itself: wait for /health, 16 greedy tokens, median latency."""
    from .report import render_validate
    from ..engine.validate import validate_job

    opts = _smoke_opts(port, health_timeout, repeat)
    _positive(timeout=timeout)
    hosts = _select(inventory, pattern, vault_password_file, ask_vault_pass)
    with _fleet(forks, timeout or config.smoke_job_timeout(health_timeout), connect_timeout, accept_new, json_out,
                ssh_config, run_timeout, connection,
                ask_become_pass) as fleet:
        results = fleet.run(hosts, validate_job(opts, install), "validate")
    _finish(results, json_out, render_validate)


@app.command()
def apply(playbook: Annotated[str, typer.Argument(help="Playbook name (see --playbooks-dir) or a path to a .yaml file.")],
          pattern: Pattern, inventory: InventoryOpt = None, vault_password_file: VaultPasswordFile = None,
    ask_vault_pass: AskVaultPass = False, ask_become_pass: AskBecomePass = False, json_out: JsonOut = False,
          check: Annotated[bool, typer.Option("--check", help="Check mode: report, change nothing.")] = False,
          diff: Annotated[bool, typer.Option("--diff", help="Print unified diffs, identical ones coalesced.")] = False,
          serial: Annotated[Optional[str], typer.Option("--serial", help="Rolling batches: N, P% or a list 1,25%,100%.")] = None,
          max_fail_percentage: Annotated[float, typer.Option("--max-fail-percentage",
                                         help="Stop the rollout when a batch fails more than this.")] = 0.0,
          yes: Yes = False, port: Port = config.DEFAULT_SGLANG_PORT,
          health_timeout: HealthTimeout = config.HEALTH_TIMEOUT_S, repeat: Repeat = 3,
          latency_tolerance: LatencyTolerance = 1.25, latency_slack: LatencySlack = None,
          allow_token_drift: AllowDrift = False, forks: Forks = 64, timeout: JobTimeout = None,
          connect_timeout: ConnectTimeout = config.CONNECT_TIMEOUT_S,
          accept_new: AcceptNew = False, ssh_config: SshConfig = None, connection: ConnectionOpt = None,
          run_timeout: RunTimeout = None, playbooks_dir: PlaybooksDir = None,
          install: InstallOpt = None,
          export_patch: Annotated[Optional[Path], typer.Option("--export-patch", help=(
              "Write the plan as checked patch files into DIR (one per SGLang version and pre-image set) "
              "for image builds; implies --check."))] = None,
          pristine_dir: Annotated[Optional[Path], typer.Option("--pristine-dir", help=(
              "Release wheels (sglang-VERSION-*.whl) to check exported patches against, instead of the "
              "wheel cache."))] = None) -> None:
    """Apply a playbook: plan, check mode and diff, rolling batches, validation gate, rollback.

    A check pass always comes first; only the hosts it finds to change are then applied, in
    --serial batches (so a canary batch is made of hosts that really change)."""
    from ..engine.apply import ApplyOptions, check_then_apply
    from ..paths import find_playbook
    from ..engine.playbook import load_playbook
    from .report import render_apply, render_handlers, text

    if not 0 <= max_fail_percentage <= 100:
        raise UsageError("--max-fail-percentage must be between 0 and 100")
    _positive(timeout=timeout)
    pb = load_playbook(find_playbook(playbook, playbooks_dir))
    if pristine_dir is not None and export_patch is None:
        raise UsageError("--pristine-dir goes with --export-patch")
    check = check or export_patch is not None
    opts = ApplyOptions(check=check, export=export_patch is not None, install=install, serial=serial, max_fail_percentage=max_fail_percentage,
                        smoke=_smoke_opts(port, health_timeout, repeat, latency_tolerance,
                                          allow_token_drift, latency_slack))
    hosts = _select(inventory, pattern, vault_password_file, ask_vault_pass)

    def confirm(plan_results, to_change) -> None:
        if not json_out:
            render_apply(plan_results, out, diff=True, check=True, title="plan (nothing is changed yet)")
            render_handlers(plan_results, out)
        _confirm(f"apply {pb.name} to {len(to_change)} host(s)", yes)

    with _fleet(forks, timeout or config.smoke_job_timeout(health_timeout), connect_timeout, accept_new, json_out,
                ssh_config, run_timeout, connection,
                ask_become_pass) as fleet:
        outcome = check_then_apply(fleet, hosts, pb, opts, confirm, check_timeout=timeout)
    if outcome.nothing_to_change:
        err.print("nothing to change")
    cid = outcome.change_id
    patches = []
    if export_patch is not None:
        from ..engine.patches import write_patches
        patches = [str(p) for p in write_patches(outcome.results, pb.name, export_patch, pristine_dir)]
        for r in outcome.results:
            r.data.pop("texts", None)

    def render(rs, console):
        render_apply(rs, console, diff=diff and check, check=check)  # an apply showed its diffs above
        for p in patches:
            console.print(text(f"patch written: {p}"))

    extra = {"patches": patches} if export_patch is not None else {}
    _finish(outcome.results, json_out, render, change_id=cid, check=check, **extra)


@app.command()
def rollback(args: Annotated[list[str], typer.Argument(help="CHANGE-ID HOSTS, or HOSTS with --last.")],
             last: Annotated[bool, typer.Option("--last", help="Roll back each host's last applied change.")] = False,
             force: Annotated[bool, typer.Option("--force", help="Restore even files changed since the apply.")] = False,
             inventory: InventoryOpt = None, vault_password_file: VaultPasswordFile = None,
    ask_vault_pass: AskVaultPass = False, ask_become_pass: AskBecomePass = False, json_out: JsonOut = False, yes: Yes = False,
             forks: Forks = 64, timeout: Timeout = config.ROLLBACK_TIMEOUT_S,
             connect_timeout: ConnectTimeout = config.CONNECT_TIMEOUT_S,
             accept_new: AcceptNew = False, ssh_config: SshConfig = None, connection: ConnectionOpt = None,
             run_timeout: RunTimeout = None, install: InstallOpt = None) -> None:
    """Restore the files of a change byte-identical (sha256 checked against the ledger)."""
    from ..engine.changes import rollback_job
    from .report import render_rollback

    if len(args) != (1 if last else 2):
        raise UsageError("usage: fleetctl rollback CHANGE-ID HOSTS, or fleetctl rollback --last HOSTS")
    if install and not last and install.startswith("host:"):
        raise UsageError("--install goes with --last, or names a container install (a CHANGE-ID already names "
                         "its host install; a container's ledger is inside it)")
    change_id, pattern = (None, args[0]) if last else (args[0], args[1])
    hosts = _select(inventory, pattern, vault_password_file, ask_vault_pass)
    _confirm(f"roll back {change_id or 'the last change'} on {len(hosts)} host(s)", yes)
    with _fleet(forks, timeout, connect_timeout, accept_new, json_out, ssh_config, run_timeout, connection,
                ask_become_pass) as fleet:
        results = fleet.run(hosts, rollback_job(change_id, force, install=install), "rollback")
    _finish(results, json_out, render_rollback)


@app.command()
def recover(pattern: Pattern, inventory: InventoryOpt = None, vault_password_file: VaultPasswordFile = None,
            ask_vault_pass: AskVaultPass = False, ask_become_pass: AskBecomePass = False, json_out: JsonOut = False,
            yes: Yes = False,
            forks: Forks = 64, timeout: Timeout = config.ROLLBACK_TIMEOUT_S,
            connect_timeout: ConnectTimeout = config.CONNECT_TIMEOUT_S,
            accept_new: AcceptNew = False, ssh_config: SshConfig = None, connection: ConnectionOpt = None,
            run_timeout: RunTimeout = None) -> None:
    """Undo the changes a killed run left pending (and restart SGLang where there were any); apply nothing."""
    from ..engine.changes import recover_job
    from .report import render_recover

    hosts = _select(inventory, pattern, vault_password_file, ask_vault_pass)
    _confirm(f"undo pending changes on {len(hosts)} host(s)", yes)
    with _fleet(forks, timeout, connect_timeout, accept_new, json_out, ssh_config, run_timeout, connection,
                ask_become_pass) as fleet:
        results = fleet.run(hosts, recover_job(), "recover")
    _finish(results, json_out, render_recover)


@app.command()
def status(pattern: Pattern, inventory: InventoryOpt = None, vault_password_file: VaultPasswordFile = None,
    ask_vault_pass: AskVaultPass = False, ask_become_pass: AskBecomePass = False, json_out: JsonOut = False,
           forks: Forks = 64, timeout: Timeout = config.STATUS_TIMEOUT_S,
           connect_timeout: ConnectTimeout = config.CONNECT_TIMEOUT_S,
           accept_new: AcceptNew = False, ssh_config: SshConfig = None, connection: ConnectionOpt = None,
             run_timeout: RunTimeout = None, install: InstallOpt = None) -> None:
    """Applied changes per host and drift (reverted changes, files modified outside fleetctl)."""
    from ..engine.changes import status_job
    from .report import render_status

    hosts = _select(inventory, pattern, vault_password_file, ask_vault_pass)
    with _fleet(forks, timeout, connect_timeout, accept_new, json_out, ssh_config, run_timeout, connection,
                ask_become_pass) as fleet:
        results = fleet.run(hosts, status_job(install=install), "status")
    _finish(results, json_out, render_status)


@cache_app.command("clear")
def cache_clear(pattern: Pattern, inventory: InventoryOpt = None, vault_password_file: VaultPasswordFile = None,
                ask_vault_pass: AskVaultPass = False, ask_become_pass: AskBecomePass = False,
                json_out: JsonOut = False, forks: Forks = 64, timeout: Timeout = config.STATUS_TIMEOUT_S,
                connect_timeout: ConnectTimeout = config.CONNECT_TIMEOUT_S, accept_new: AcceptNew = False,
                ssh_config: SshConfig = None, connection: ConnectionOpt = None,
                run_timeout: RunTimeout = None) -> None:
    """Empty each host's scan cache: scans, interpreters' answers, RECORD hashes, compiled probes and
    the interpreter record (the next inspect reads and parses every file again)."""
    from ..engine.gather import cache_clear_job
    from .report import render_cache_clear

    hosts = _select(inventory, pattern, vault_password_file, ask_vault_pass)
    with _fleet(forks, timeout, connect_timeout, accept_new, json_out, ssh_config, run_timeout, connection,
                ask_become_pass) as fleet:
        results = fleet.run(hosts, cache_clear_job, "cache clear")
    _finish(results, json_out, render_cache_clear)


@deploy_app.command("kernel")
def deploy_kernel(name: Annotated[str, typer.Argument(help="Kernel package NAME (see --kernels-dir).")],
                  pattern: Pattern, inventory: InventoryOpt = None, vault_password_file: VaultPasswordFile = None,
    ask_vault_pass: AskVaultPass = False, ask_become_pass: AskBecomePass = False, json_out: JsonOut = False, yes: Yes = False,
                  check: Annotated[bool, typer.Option("--check", help=(
                      "Check mode: preflight and build key per host (would it build, would it activate); "
                      "nothing is uploaded, built or activated."))] = False,
                  max_jobs: Annotated[int, typer.Option("--max-jobs", help="Parallel compile jobs per host.")] = 4,
                  build_timeout: Annotated[float, typer.Option("--build-timeout", help="Seconds for one build.")]
                  = config.BUILD_DEADLINE_S,
                  port: Port = config.DEFAULT_SGLANG_PORT, health_timeout: HealthTimeout = config.HEALTH_TIMEOUT_S,
                  repeat: Repeat = 3, latency_tolerance: LatencyTolerance = 1.25, latency_slack: LatencySlack = None,
                  allow_token_drift: AllowDrift = False, forks: Forks = 64, timeout: JobTimeout = None,
                  connect_timeout: ConnectTimeout = config.CONNECT_TIMEOUT_S, accept_new: AcceptNew = False,
                  ssh_config: SshConfig = None, connection: ConnectionOpt = None, run_timeout: RunTimeout = None,
                  kernels_dir: KernelsDir = None) -> None:
    """Build kernels/NAME on each host for its GPU arch (or CPU), test it against its reference,
    activate it atomically, validate, and switch back on failure."""
    from ..engine.deploy import DeployOptions, run_deploy
    from ..engine.kernelpkg import load_package
    from ..paths import project_dir
    from .report import render_deploy

    if max_jobs < 1:
        raise UsageError(f"--max-jobs must be at least 1, not {max_jobs}")
    _positive(build_timeout=build_timeout, timeout=timeout)
    pkg = load_package(project_dir("kernels", kernels_dir), name)
    opts = DeployOptions(smoke=_smoke_opts(port, health_timeout, repeat, latency_tolerance, allow_token_drift,
                                           latency_slack), max_jobs=max_jobs, build_timeout=build_timeout,
                         check=check)
    hosts = _select(inventory, pattern, vault_password_file, ask_vault_pass)
    if not check:
        _confirm(f"deploy kernel {pkg.name} {pkg.version} to {len(hosts)} host(s)", yes)
    job_timeout = timeout or config.deploy_job_timeout(build_timeout, health_timeout)
    with _fleet(forks, job_timeout, connect_timeout, accept_new, json_out, ssh_config, run_timeout, connection,
                ask_become_pass) as fleet:
        cid, results = run_deploy(fleet, hosts, pkg, opts)

    _finish(results, json_out, render_deploy, change_id=cid, kernel=pkg.name, **({"check": True} if check else {}))


def _finish(results, json_out: bool, render, **doc) -> None:
    """Print the results (one JSON document, or `_render`) and exit with Ansible's code for them."""
    from ..engine.fleet import exit_code

    if json_out:
        _print_json({**doc, "hosts": [r.to_json() for r in results]})
    else:
        _render(results, render, doc.get("change_id"))
    raise typer.Exit(exit_code(results))


def _render(results, render, change_id: str | None = None) -> None:
    """`render(results, out)`, the change id when there is one, and the recap line. A report that
    cannot be rendered is said so in one line; the change id and the recap follow it anyway."""
    from .report import render_lasts, render_status_line, text

    try:
        render(results, out)
        render_lasts(results, out)
    except Exception as e:  # noqa: BLE001 - the change id and the exit code must still be given
        out.print(text(f"the report could not be rendered: {type(e).__name__}: {e}", style="red"))
    if change_id:
        out.print(text(f"change id: {change_id}"))
    render_status_line(results, out)


def _print_json(doc: dict) -> None:
    sys.stdout.write(json.dumps(doc, indent=1, default=str) + "\n")


# ---- lab ---------------------------------------------------------------------------------

LabId = Annotated[int, typer.Option("--lab-id", help="Lab number (own subnet and state dir).")]


@inventory_app.command("export")
def inventory_export(inventory: InventoryOpt = None, vault_password_file: VaultPasswordFile = None,
                     ask_vault_pass: AskVaultPass = False, ssh_config: SshConfig = None,
                     connect_timeout: ConnectTimeout = config.CONNECT_TIMEOUT_S) -> None:
    """Print the inventory (lab hosts included) as Ansible YAML, with the connection details
    ansible-playbook needs (ansible_ssh_private_key_file, ansible_ssh_common_args: -o
    UserKnownHostsFile=...) resolved from the ssh_config fleetctl reads."""
    from ..collection.inventory import export
    from ..errors import ParseError

    vault = None
    if vault_password_file or ask_vault_pass:
        from ..inventory.sources import Vault
        vault = Vault(vault_password_file, ask_vault_pass)
    loaded = inv.load(inv.resolve_path(inventory), vault)
    try:
        sys.stdout.write(export(loaded, _settings(connect_timeout, False, ssh_config)))
    except ValueError as e:
        raise ParseError(str(e)) from None


@collection_app.command("build")
def collection_build(out: Annotated[Optional[str], typer.Option(
        "--out", help="Put a complete copy in OUT/ansible_collections/fleetctl/sglang (default: generate in place).")]
        = None) -> None:
    """Generate the collection's plugins/module_utils from fleetctl's probes (never committed);
    prints the collection's root."""
    from ..collection import build as collection

    typer.echo(str(collection.build(Path(out) if out else None)))


@lab_app.command("up")
def lab_up(hosts: Annotated[Optional[int], typer.Option("--hosts", help="Number of hosts.")] = None,
           releases: Annotated[str, typer.Option("--releases", help="SGLang releases, comma-separated.")]
           = "0.4.6.post5,0.5.2,0.5.10,0.5.23",
           with_server: Annotated[bool, typer.Option("--with-server",
                                  help="Start the SGLang stand-in server on each host.")] = False,
           lab_id: LabId = 0) -> None:
    """Start the lab: one real sshd per network namespace, each with a real SGLang release; its
    Host blocks go to <state dir>/ssh_config, Included (one marked line) by ~/.ssh/config."""
    from .. import lab

    path = lab.lab_up(hosts, [r.strip() for r in releases.split(",") if r.strip()],
                      with_server=with_server, lab_id=lab_id)
    lab.add_ssh_config_include(lab.user_ssh_config(), lab_id)
    typer.echo(str(path))


@lab_app.command("down")
def lab_down(lab_id: LabId = 0) -> None:
    """Stop the lab and remove every namespace, link and process it made, and its Include line
    in ~/.ssh/config."""
    from .. import lab

    lab.lab_down(lab_id=lab_id)
    lab.remove_ssh_config_include(lab.user_ssh_config(), lab_id)


@lab_app.command("status")
def lab_status(lab_id: LabId = 0) -> None:
    """Show the lab's hosts, addresses, releases, sshd state and faults."""
    from .. import lab
    from .report import table

    rows = lab.lab_status(lab_id=lab_id)
    for r in rows:
        f = r.pop("faults", {})
        r["faults"] = ", ".join(f"{k}={v}" if k == "delay_ms" else k for k, v in f.items() if v) or "none"
    cols = list(rows[0].keys()) if rows else ["host"]
    table(f"fleetctl lab {lab_id}", cols, [[r.get(c) for c in cols] for r in rows], out)


@lab_app.command("inventory")
def lab_inventory(lab_id: LabId = 0) -> None:
    """Print the lab inventory's path (last line)."""
    from .. import lab

    typer.echo(str(lab.inventory_path(lab_id=lab_id)))


@lab_app.command("fault")
def lab_fault(host: str, kind: Annotated[str, typer.Argument(
        help="delay MS | down | up | freeze | thaw | rekey | hang | unhang")],
              arg: Annotated[Optional[str], typer.Argument(help="MS for delay")] = None,
              lab_id: LabId = 0) -> None:
    """Inject or clear a fault on one lab host."""
    from .. import lab

    lab.lab_fault(host, kind, arg, lab_id=lab_id)


_terminated = []  # set by SIGTERM


def _on_sigterm(signum, frame) -> None:
    """SIGTERM (a CI cancel, a service stop) is handled as Ctrl-C: hosts in progress finish,
    none start; the exit status is then 143 instead of 130."""
    _terminated.append(signum)
    raise KeyboardInterrupt


def main() -> None:
    """Console entry point: maps errors to Ansible's exit codes (command-line usage errors -> 5;
    SIGTERM as Ctrl-C, exit 143)."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        code = app(standalone_mode=False)
    except TyperException as e:  # Typer's own click: usage errors, bad parameters, no arguments
        if hasattr(e, "show"):
            e.show()
        sys.exit(EXIT_OPTIONS)
    except (typer.Abort, KeyboardInterrupt):
        err.print("aborted")
        sys.exit(EXIT_TERMINATED if _terminated else EXIT_INTERRUPTED)
    except FleetctlError as e:
        from .report import text

        err.print(Text.assemble(("error:", "bold red"), " ", text(e)), highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    code = code if isinstance(code, int) else 0
    sys.exit(EXIT_TERMINATED if _terminated and code == EXIT_INTERRUPTED else code)

