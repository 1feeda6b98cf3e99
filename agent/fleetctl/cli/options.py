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
from ..errors import PatternError, UsageError
from ..history import record
from .console import err

Pattern = Annotated[str, typer.Argument(help="Host pattern: name, group, glob, all, a:b, a:&b, a:!b.")]
InventoryOpt = Annotated[Optional[str], typer.Option("-i", "--inventory",
                         help=("Inventory: an Ansible YAML file, a host list as Ansible's (`-i host1,host2,`: "
                               "a comma, and no such file), or (with the ansible extra installed) any "
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
HistoryOpt = Annotated[Optional[str], typer.Option("--history", envvar="FLEETCTL_HISTORY", metavar="PATH", help=(
    "The run history file (fleetctl history): PATH, else $FLEETCTL_HISTORY, else "
    "${XDG_STATE_HOME:-~/.local/state}/fleetctl/history.sqlite."))]
NoHistory = Annotated[bool, typer.Option("--no-history", help="Do not record this run in the run history.")]
# Ansible's habits (ansible-playbook(1)), with Ansible's meaning: -u and -b are command-line values,
# under every inventory var; -e extra vars, over all of them (inventory.CommandLineVars); -l
# narrows the pattern's hosts; `-i a,b,` is a host list (inventory.is_host_list).
UserOpt = Annotated[Optional[str], typer.Option("-u", "--user", help=(
    "Connect as this user where the inventory sets no ansible_user (Ansible's -u)."))]
BecomeOpt = Annotated[bool, typer.Option("-b", "--become", help=(
    "Run as root through sudo where the inventory sets no ansible_become (Ansible's -b)."))]
LimitOpt = Annotated[Optional[str], typer.Option("-l", "--limit", metavar="PATTERN", help=(
    "Only the hosts that the host pattern also selects (Ansible's --limit)."))]
ExtraVarsOpt = Annotated[Optional[list[str]], typer.Option("-e", "--extra-vars", metavar="K=V|@FILE|JSON", help=(
    "Vars for every host over the inventory's (Ansible's -e, which always wins): key=value words, @FILE "
    "(YAML or JSON) or a JSON mapping; repeatable, later ones win."))]

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
NoValidate = Annotated[bool, typer.Option("--no-validate", help=(
    "Change hosts without validating the change (no smoke, load or route gate), also where processes "
    "that are no server fleetctl identifies use the install (else refused); recorded in the history and "
    "the host's ledger as \"validation: skipped by --no-validate\"."))]
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

# inspect --allocator-replay and its trace (probes/traffic/allocreplay.py; DEFAULTS there for what is not given)
AllocatorReplay = Annotated[bool, typer.Option("--allocator-replay", help=(
    "Replay each install's own KV allocator on the host's CPU (its torch; no server touched) through a seeded "
    "continuous-batching trace, with need_sort False and True: how fragmented prefill allocations get."))]
ReplayPool = Annotated[Optional[int], typer.Option("--pool", help=(
    "Replay: KV slots in the pool (default: the server's max_total_num_tokens, else 65536)."))]
ReplayConcurrency = Annotated[Optional[int], typer.Option("--concurrency", help="Replay: requests running at once (16).")]
ReplayInput = Annotated[Optional[str], typer.Option("--input", metavar="A:B", help=(
    "Replay: prompt lengths, uniform from A to B tokens (64:2048)."))]
ReplayOutput = Annotated[Optional[str], typer.Option("--output", metavar="A:B", help=(
    "Replay: output lengths, uniform from A to B tokens (16:1024)."))]
ReplayAborts = Annotated[Optional[float], typer.Option("--aborts", help=(
    "Replay: share of requests aborted after 1-8 output tokens (0.1)."))]
ReplaySeed = Annotated[Optional[int], typer.Option("--seed", help="Replay: the trace's random seed (0).")]
ReplayRequests = Annotated[Optional[int], typer.Option("--requests", help="Replay: requests in the trace (800).")]


def replay_trace(allocator_replay: bool, pool: int | None, concurrency: int | None, input_range: str | None,
                 output_range: str | None, aborts: float | None, seed: int | None,
                 requests: int | None) -> dict | None:
    """The allocator replay's trace parameters the options give ({pool (None: the server's),
    concurrency, input [A, B], output [A, B], aborts, seed, requests}: None for one not given,
    the probe's DEFAULTS then), or None without --allocator-replay. Raises UsageError (exit 5)
    for a range that is not A:B, a value out of range (probes/allocreplay.check_trace), or a
    trace option given without --allocator-replay."""
    from ..probes.traffic import allocreplay

    given = {"pool": pool, "concurrency": concurrency, "input": input_range, "output": output_range,
             "aborts": aborts, "seed": seed, "requests": requests}
    if not allocator_replay:
        named = [f"--{k}" for k, v in given.items() if v is not None]
        if named:
            raise UsageError(f"{', '.join(named)}: only with --allocator-replay")
        return None
    for k in ("input", "output"):
        if given[k] is not None:
            lo, sep, hi = given[k].partition(":")
            if not (sep and lo.strip().isdigit() and hi.strip().isdigit()):
                raise UsageError(f"--{k} {given[k]}: want A:B, two whole numbers of tokens (e.g. 64:2048)")
            given[k] = [int(lo), int(hi)]
    why = allocreplay.check_trace(dict(allocreplay.DEFAULTS, **{k: v for k, v in given.items() if v is not None}),
                                  pool_known=pool is not None)
    if why:
        raise UsageError(why)
    return given

# Validation under load (engine/load.py, probes/traffic/load.py): validate --load, and the load gate
# (engine/gates/load.py) of apply and deploy kernel (--gate load[:PROFILE], or a playbook's load step)
# with its tolerances.
LoadOpt = Annotated[Optional[str], typer.Option("--load", metavar="PROFILE", help=(
    "After the smoke decode, run SGLang's own benchmark client (the server's install and interpreter) "
    "against each server: smoke (seconds), steady, or pressure (sized from the server's max_total_num_tokens)."))]
GateOpt = Annotated[Optional[str], typer.Option("--gate", metavar="load[:PROFILE]", help=(
    "Also gate the change on a load run before and after it (SGLang's own benchmark client; "
    "PROFILE smoke, steady or pressure, default the playbook's, else smoke)."))]
LoadConcurrency = Annotated[Optional[int], typer.Option("--load-concurrency", help=(
    "Load: requests in flight (closed loop; default: the profile's; pressure: sized from the KV pool)."))]
LoadPrompts = Annotated[Optional[int], typer.Option("--load-prompts", help=(
    "Load: requests measured (default: the profile's)."))]
LoadInputLen = Annotated[Optional[int], typer.Option("--load-input-len", help=(
    "Load: longest prompt in tokens (lengths from half of it to it; default: the profile's)."))]
LoadOutputLen = Annotated[Optional[int], typer.Option("--load-output-len", help=(
    "Load: longest output in tokens (lengths from half of it to it; default: the profile's)."))]
LoadTimeout = Annotated[Optional[float], typer.Option("--load-timeout", help=(
    "Load: seconds one client run may take before its process group is killed (300)."))]
LoadClient = Annotated[Optional[str], typer.Option("--load-client", metavar="auto|python|rust", help=(
    "Load: SGLang's Python client (sglang.benchmark.serving, else sglang.bench_serving), its Rust one "
    "(0.5.23+), or auto: the Python one, else the Rust one."))]
LoadRepeat = Annotated[Optional[int], typer.Option("--load-repeat", help=(
    "Load gate: baseline runs (2: each tolerance widened to twice their measured spread)."))]
MaxThroughputDrop = Annotated[Optional[float], typer.Option("--max-throughput-drop", help=(
    "Load gate: output throughput may fall by this fraction of the baseline (0.10)."))]
MaxItlRise = Annotated[Optional[float], typer.Option("--max-itl-rise", help=(
    "Load gate: p99 ITL may rise by this fraction of the baseline, plus --itl-slack-ms (0.20)."))]
ItlSlackMs = Annotated[Optional[float], typer.Option("--itl-slack-ms", help=(
    "Load gate: milliseconds added to the p99 ITL limit (2)."))]
MaxTtftRise = Annotated[Optional[float], typer.Option("--max-ttft-rise", help=(
    "Load gate: p99 TTFT may rise by this fraction of the baseline, plus --ttft-slack-ms (0.25)."))]
TtftSlackMs = Annotated[Optional[float], typer.Option("--ttft-slack-ms", help=(
    "Load gate: milliseconds added to the p99 TTFT limit (20)."))]


# The help pages' panels (Typer's rich_help_panel, issue 50): a command's own options and the
# common -i, -l, -e, --json, --yes come first, in the default "Options" panel; the shared ones
# below follow, grouped, so that apply's or deploy's 60 options do not bury the few a run needs.
HELP_PANELS = {
    "Connection": (UserOpt, BecomeOpt, AskBecomePass, ConnectTimeout, AcceptNew, SshConfig, ConnectionOpt, Forks,
                   Timeout, JobTimeout, RunTimeout, VaultPasswordFile, AskVaultPass),
    "Smoke gate": (HealthTimeout, Repeat, Port, LatencyTolerance, LatencySlack, AllowDrift),
    "Load gate": (LoadOpt, GateOpt, LoadConcurrency, LoadPrompts, LoadInputLen, LoadOutputLen, LoadTimeout,
                  LoadClient, LoadRepeat, MaxThroughputDrop, MaxItlRise, ItlSlackMs, MaxTtftRise, TtftSlackMs),
    "Allocator replay": (AllocatorReplay, ReplayPool, ReplayConcurrency, ReplayInput, ReplayOutput, ReplayAborts,
                         ReplaySeed, ReplayRequests),
    "Paths and history": (PlaybooksDir, KernelsDir, HistoryOpt, NoHistory),
}
for _panel, _options in HELP_PANELS.items():
    for _option in _options:
        _option.__metadata__[0].rich_help_panel = _panel


def load_settings(**given) -> dict:
    """The load settings the load options give (engine/load.load_options names; those not
    given left out): `gate` (--gate load[:PROFILE]) or `load` (validate --load PROFILE) gives the
    profile, the others their own setting (concurrency, num_prompts, input_len, output_len,
    timeout_s, client, repeat and the tolerances). Raises UsageError (exit 5) for a --gate other
    than load[:PROFILE] or a value load_options refuses."""
    from ..engine.load import load_options

    gate = given.pop("gate", None)
    settings = {k: v for k, v in given.items() if v is not None}
    if gate is not None:
        kind, sep, profile = gate.partition(":")
        if kind != "load" or (sep and not profile):
            raise UsageError(f"--gate {gate}: want load or load:PROFILE (smoke, steady, pressure)")
        if profile:
            settings["profile"] = profile
    if "load" in settings:
        settings["profile"] = settings.pop("load")
    for k, v in settings.items():
        try:
            load_options({k: v})
        except ValueError as e:
            raise UsageError(f"{LOAD_FLAGS[k]} {v}: {e}") from None
    return settings


# The option that sets each load setting (for messages).
LOAD_FLAGS = {"profile": "--load/--gate", "concurrency": "--load-concurrency", "num_prompts": "--load-prompts",
              "input_len": "--load-input-len", "output_len": "--load-output-len", "timeout_s": "--load-timeout",
              "client": "--load-client", "repeat": "--load-repeat", "max_throughput_drop": "--max-throughput-drop",
              "max_itl_rise": "--max-itl-rise", "itl_slack_ms": "--itl-slack-ms", "max_ttft_rise": "--max-ttft-rise",
              "ttft_slack_ms": "--ttft-slack-ms"}


def command_line_vars(user: str | None = None, become: bool = False,
                      extra_vars: list[str] | None = None) -> inv.CommandLineVars | None:
    """The vars -u (ansible_user), -b (ansible_become: true) and each -e set, as
    inventory.CommandLineVars (None: none given). An -e is @FILE (a YAML or JSON mapping), a
    JSON/YAML mapping written inline (`{...}`), or key=value words (split as a shell would;
    values stay strings, as Ansible's parse_kv keeps them); later ones win. Raises UsageError
    (exit 5) naming the -e and what is wrong (a word without `=`, a file that cannot be read or
    is not a mapping, with its line)."""
    import shlex

    import yaml

    below = {**({"ansible_user": user} if user else {}), **({"ansible_become": True} if become else {})}
    above: dict = {}
    where: dict = {k: f"-{'u' if k == 'ansible_user' else 'b'} (command line)" for k in below}
    for given in extra_vars or []:
        what = f"-e {given}"
        if given.startswith("@"):
            try:
                text = Path(given[1:]).expanduser().read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise UsageError(f"{what}: cannot read {given[1:]}: {getattr(e, 'strerror', None) or e}") from None
            values, what = _mapping(yaml, text, f"{what}: {given[1:]}"), f"-e {given} ({given[1:]})"
        elif given.lstrip().startswith("{"):
            values = _mapping(yaml, given, what)
        else:
            try:
                words = shlex.split(given)
            except ValueError as e:
                raise UsageError(f"{what}: {e}") from None
            bad = [w for w in words if "=" not in w or w.startswith("=")]
            if bad or not words:
                raise UsageError(f"{what}: want key=value words, @FILE or a JSON mapping (not {bad[0] if bad else given!r})")
            values = dict(w.split("=", 1) for w in words)
        above.update(values)
        where.update({k: what for k in values})
    return inv.CommandLineVars(below, above, where) if below or above else None


def _mapping(yaml, text: str, what: str) -> dict:
    """The mapping of str keys YAML (or JSON) `text` holds; UsageError naming `what` (and the line) if not."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise UsageError(f"{what}{f':{mark.line + 1}' if mark else ''}: not YAML or JSON "
                         f"({getattr(e, 'problem', None) or e})") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise UsageError(f"{what}: extra vars are a mapping of names to values, not {type(data).__name__}")
    return data


def load_inventory(inventory: str | None, vault_password_file: str | None = None,
                   ask_vault_pass: bool = False, seen: set[str] | None = None,
                   cli: inv.CommandLineVars | None = None) -> inv.Inventory:
    """The inventory -i names (a host list, inventory.is_host_list; else $FLEETCTL_INVENTORY,
    else ./hosts.yaml), its vault values decrypted with the vault options' password, the
    command line's vars `cli` (command_line_vars) under and over its own; `seen`, when given,
    gets every secret value the load knows (loaded_secrets). Raises InventoryError (exit 4)."""
    from ..inventory.templates import templars

    if inventory and inv.is_host_list(inventory):
        loaded = inv.load_host_list(inventory, cli)
        if seen is not None:
            seen.update(loaded_secrets(loaded, [], []))
        return loaded

    vault = None
    if vault_password_file or ask_vault_pass:
        from ..inventory.sources import Vault

        class Revealing(Vault):
            """The Vault, remembering what it reveals: its password and each decrypted value."""

            def __init__(self, password_file: str | None, ask: bool):
                super().__init__(password_file, ask)
                self.revealed: list[str] = []

            def password(self) -> bytes:
                secret = super().password()
                self.revealed.append(secret.decode("utf-8", "replace"))
                return secret

            def __call__(self, value, name, where):
                text = super().__call__(value, name, where)
                self.revealed.append(text)
                return text

        vault = Revealing(vault_password_file, ask_vault_pass)
    if seen is None:  # (a caller's own templars() block gets the Templar)
        return inv.load(inv.resolve_path(inventory), vault, cli)
    with templars() as made:
        loaded = inv.load(inv.resolve_path(inventory), vault, cli)
    seen.update(loaded_secrets(loaded, made, vault.revealed if vault else []))
    return loaded


def loaded_secrets(loaded: inv.Inventory, made: list, revealed: list[str]) -> set[str]:
    """Every secret value a loaded inventory holds, as text: what its vault revealed (`revealed`:
    the vault password, each decrypted value), the value of each var rendered from a vault value
    or set in a file vault-encrypted whole (the Templars `made` by the load: Templar.from_vault),
    and of each var whose name is a secret's (redact.secret_name: ansible_become_password,
    fleetctl_sglang_api_key). Lists and mappings give their leaves; empty strings and
    booleans none."""
    from ..inventory.templates import Vaulted
    from ..probes import redact

    found = set(revealed)

    def leaves(value) -> None:
        if isinstance(value, dict):
            for v in value.values():
                leaves(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                leaves(v)
        elif isinstance(value, (str, int, float)) and not isinstance(value, (bool, Vaulted)):
            found.add(str(value))

    for host in loaded.hosts.values():
        for name, value in host.vars.items():
            vaulted = any(host.name in t.where and name in t.where[host.name] and t.from_vault(host.name, name)
                          for t in made)
            if vaulted or redact.secret_name(name):
                leaves(value)
    found.discard("")
    return found


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


def limited(loaded: inv.Inventory, pattern: str, limit: str | None) -> list[inv.Host]:
    """The hosts `pattern` selects that the --limit pattern selects too (Ansible's --limit:
    "further limit selected hosts to an additional pattern"), in inventory order. Raises
    PatternError (exit 5) when either matches nothing, or the two have no host in common."""
    hosts = loaded.select(pattern)
    if limit is None:
        return hosts
    allowed = {h.name for h in loaded.select(limit)}
    kept = [h for h in hosts if h.name in allowed]
    if not kept:
        raise PatternError(f"--limit {limit}: none of the {len(hosts)} host(s) of '{pattern}' "
                           f"({', '.join(h.name for h in hosts[:5])}{', ...' if len(hosts) > 5 else ''}) matches it")
    return kept


@dataclass(frozen=True)
class FleetOptions:
    """The options every fleet command takes, as given: where its hosts come from (-i, -l, the
    vault options) and the vars the command line sets on them (-u, -b, -e), -K, --json, and how they are worked on (--forks, --timeout in seconds per
    host's job, None where the command computes it, the connection options, --run-timeout in
    seconds for the whole command), and where the run is recorded (--history PATH, None: the
    default file; --no-history)."""

    inventory: InventoryOpt = None
    limit: LimitOpt = None
    user: UserOpt = None
    become: BecomeOpt = False
    extra_vars: ExtraVarsOpt = None
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
    history: HistoryOpt = None
    no_history: NoHistory = False

    def select(self, pattern: str) -> list[inv.Host]:
        """The inventory's hosts `pattern` matches and --limit, when given, selects too, with
        the vars of -u, -b and -e (the inventory's secret values handed to the run's record:
        loaded_secrets). Raises InventoryError (exit 4), or UsageError / PatternError (exit 5)
        for a pattern or a limit that matches nothing, or a bad -e."""
        seen: set[str] = set()
        loaded = load_inventory(self.inventory, self.vault_password_file, self.ask_vault_pass, seen,
                                command_line_vars(self.user, self.become, self.extra_vars))
        record.secrets(seen)  # the run's record replaces each of them wherever it appears
        return limited(loaded, pattern, self.limit)

    def fleet(self, timeout: float | None = None) -> Fleet:
        """A Fleet with these options; `timeout` (seconds per host's job) replaces --timeout. Its
        progress goes to stderr (progress_mode). The run's record in the
        history starts here (record.begin), once the options are found good. Raises UsageError
        (exit 5)."""
        timeout = self.timeout if timeout is None else timeout
        mode = progress_mode(self.json_out)
        given = settings(self.connect_timeout, self.accept_new, self.ssh_config, self.connection, self.ask_become_pass)
        record.secrets([given.become_password] if given.become_password else [])
        for bad, msg in ((self.forks < 1, "--forks must be at least 1"), (timeout <= 0, "--timeout must be positive"),
                         (self.run_timeout is not None and self.run_timeout <= 0, "--run-timeout must be positive")):
            if bad:
                raise UsageError(msg)
        record.begin()
        return Fleet(given, forks=self.forks, timeout=timeout, progress=mode, console=err,
                     run_timeout=self.run_timeout)


def progress_mode(json_out: bool) -> str | None:
    """How a fleet run shows its hosts' phases on stderr (engine.progress): $FLEETCTL_PROGRESS
    when set ("bar", "lines": a plain line per host and phase, for logs and CI; "none"), else
    a bar on a terminal without --json, else none. Raises UsageError (exit 5) for another value."""
    from ..engine.progress import MODES

    given = os.environ.get("FLEETCTL_PROGRESS", "").strip().lower()
    if not given:
        return "bar" if err.is_terminal and not json_out else None
    if given == "none":
        return None
    if given not in MODES:
        raise UsageError(f"FLEETCTL_PROGRESS={given!r}: give one of {', '.join(MODES)} or none")
    return given


# The FleetOptions fields fleet_command puts after `after` (-i to --json); the rest go before `before`.
_LEADING = ("inventory", "limit", "user", "become", "extra_vars", "vault_password_file", "ask_vault_pass", "ask_become_pass", "json_out")


def fleet_command(timeout: float | None, after: str = "pattern", before: str | None = None) -> Callable:
    """Give a command the FleetOptions: `command(opts, *own)` becomes a function whose signature,
    for Typer, is the command's own parameters with the FleetOptions fields among them (-i to
    --json after the parameter named `after`, --forks to --run-timeout before the one named
    `before`, or last), and which arms the run's record in the history (history.record.arm:
    FleetOptions.fleet begins it; its end is recorded by cli.main) and calls `command` with
    them gathered into `opts`.

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
            if not opts.no_history:  # recorded from FleetOptions.fleet on: usage errors before it are no runs
                record.arm(command.__name__.replace("_", " "), opts.history)  # deploy_kernel: "deploy kernel"
            return command(opts, **given)

        run.__name__, run.__qualname__, run.__module__ = command.__name__, command.__qualname__, command.__module__
        run.__doc__ = command.__doc__
        run.__signature__ = inspect.Signature(params)
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run

    return decorate
