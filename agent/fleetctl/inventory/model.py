"""What an inventory says: its hosts, their groups and vars, as fleetctl's Host and Inventory.

Whichever source the vars come from (the YAML reader, yamlfile; ansible-inventory, sources), they
arrive merged in Ansible's precedence, each with the "file:line" it was set at (LocatedVars).
`build` renders the vars fleetctl reads (templates), vault values among them decrypted, checks
each against what fleetctl needs of it (a port number, a plain string, one of config.CONNECTIONS) and
makes the Hosts, whose properties are the only readers of those vars by name.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

from .. import config
from ..errors import InventoryError
from ..probes import redact
from . import patterns
from .templates import Templar, Vaulted, as_bool, is_template, needed

# Vars given as a command-line fragment (Ansible's ssh connection, ssh_common_args /
# ssh_extra_args; become_flags): split as a shell would, so a quoting mistake is found at load.
_ARGS_VARS = (*(n for v in config.CONNECTION_VARS if v.type == "args" for n in v.names), "ansible_become_flags")
_PORT_VARS = tuple(n for v in config.CONNECTION_VARS if v.type == "port" for n in v.names)
# Become (privilege escalation) vars, as Ansible's sudo become plugin reads them
# (ansible/plugins/become/sudo.py: become_user, become_exe, become_flags, become_pass and its aliases).
_BECOME_PASSWORD_VARS = ("ansible_become_password", "ansible_become_pass", "ansible_sudo_pass")
_BECOME_STR_VARS = ("ansible_become_user", "ansible_become_exe", "ansible_become_flags", "ansible_become_method",
                    *_BECOME_PASSWORD_VARS)
# The only become method fleetctl runs (Ansible's default).
BECOME_METHODS = ("sudo",)
_STR_VARS = (*(n for v in config.CONNECTION_VARS if v.type is str for n in v.names),
             "ansible_python_interpreter", "ansible_connection", *_ARGS_VARS, *_BECOME_STR_VARS,
             *(v.name for v in config.HOST_VARS if v.type is str))
# How an error ends when a vault value or file is met and no secret was given.
NO_SECRET = "no vault secret was given: run with --vault-password-file FILE or --ask-vault-pass"
# Turns a vault value into its plain text: (ciphertext, var name, "file:line") -> text.
Decrypt = Optional[Callable[[Vaulted, str, str], str]]
# ansible_python_interpreter values that ask Ansible to discover the interpreter.
_AUTO_INTERPRETERS = ("auto", "auto_silent", "auto_legacy", "auto_legacy_silent")
# The vars that name the interpreter (Host.python), checked at load by split_interpreter.
_INTERPRETER_VARS = ("ansible_python_interpreter", config.PYTHON.name)


def split_interpreter(value: str) -> tuple[str, tuple[str, ...]]:
    """(interpreter, its options) of an ansible_python_interpreter / fleetctl_python value, as
    Ansible reads one (shlex-split: ansible/ansible PR #16247; `/usr/bin/env NAME`: PR #15638):
    the interpreter is an absolute path, or a name (no slash) the host's PATH resolves at each
    start as env would (probes.command), after `[/usr/bin/]env` when the value starts with it;
    the other words are given to it after fleetctl's own `-I -S` (so none can undo them) and
    before `-c PROBE`, unread, as Ansible passes them. Raises ValueError, saying how to write it,
    for a value that does not split, names no interpreter, gives env options or NAME=VALUE
    settings, or is a relative path."""
    try:
        words = shlex.split(value)
    except ValueError as e:
        raise ValueError(f"the interpreter {value!r} cannot be split as a shell would: {e}") from None
    if words and os.path.basename(words[0]) == "env":
        words = words[1:]
        if words and (words[0].startswith("-") or "=" in words[0]):
            raise ValueError(f"the interpreter {value!r}: after env only the interpreter's name is read, "
                             "with its options (no env options or NAME=VALUE settings): e.g. /usr/bin/env python3")
    if not words:
        raise ValueError(f"the interpreter {value!r} names no interpreter: give its absolute path or "
                         "`/usr/bin/env python3`")
    python, options = words[0], tuple(words[1:])
    if python.startswith("-"):
        raise ValueError(f"the interpreter {value!r} starts with an option, not an interpreter: give its "
                         "absolute path or `/usr/bin/env python3` first")
    if not python.startswith("/") and "/" in python:
        raise ValueError(f"the interpreter {python!r} is a relative path: give an absolute path, or a name "
                         "looked up on the host's PATH (python3, /usr/bin/env python3)")
    return python, options


def _last(values: Mapping[str, Any], *names: str) -> Any:
    """The value of the last of `names` that is set, as Ansible picks among a connection
    option's variable aliases (ansible/config/manager.py, _loop_entries)."""
    found = None
    for name in names:
        if values.get(name) is not None:
            found = values[name]
    return found


@dataclass(frozen=True)
class Host:
    """One inventory host.

    `vars` are merged as Ansible does: groups sorted by (depth from `all`,
    ansible_group_priority, name), each overriding the one before, then group_vars/ files in
    the same order, then the host's own vars (from every place it is listed, later ones
    winning), then host_vars/<name>. The vars fleetctl reads (`templates.needed`) are
    templated, vault values among them decrypted; every other var is kept as the inventory wrote
    it (templates unrendered, `!unsafe` as Unsafe, `!vault` as Vaulted). `groups` holds every
    group the host is in, transitively, `all` first, in the order of Inventory.groups. `where`
    maps each var to the "file:line" the value in `vars` was set at (empty for a Host not read
    from an inventory file: the collection's, from Ansible's task vars), for errors that name it.
    """

    name: str
    vars: Mapping[str, Any] = field(compare=False, repr=False)  # may hold a decrypted become password
    groups: tuple[str, ...]
    where: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}), compare=False, repr=False)

    @property
    def address(self) -> str:
        """Where to connect: ansible_host (or the older ansible_ssh_host), else the name."""
        return str(_last(self.vars, *config.ADDRESS.names) or self.name)

    @property
    def port(self) -> int | None:
        """SSH port from ansible_port (or ansible_ssh_port, or a `name:port` key); None: ssh_config's."""
        port = _last(self.vars, *config.PORT.names)
        return None if port is None else int(port)

    @property
    def user(self) -> str | None:
        """SSH user from ansible_user (or ansible_ssh_user); None: ssh_config's."""
        return _last(self.vars, *config.USER.names)

    @property
    def key_file(self) -> str | None:
        """ansible_ssh_private_key_file (or ansible_private_key_file), `~` expanded; None: none set."""
        path = _last(self.vars, *config.KEY_FILE.names)
        return os.path.expanduser(path) if path else None

    @property
    def ssh_common_args(self) -> tuple[str, ...]:
        """ansible_ssh_common_args, templated and split as a shell would (shlex; checked at load):
        extra arguments for every ssh, scp and sftp command line of Ansible's ssh connection, where
        Ansible users name a bastion (`-o ProxyCommand=...`, `-o ProxyJump=...`, `-J`, `-F FILE`;
        Ansible FAQ, jump hosts). () when unset."""
        return tuple(shlex.split(self.vars.get(config.SSH_COMMON_ARGS.name) or ""))

    @property
    def ssh_extra_args(self) -> tuple[str, ...]:
        """ansible_ssh_extra_args, templated and split as a shell would (checked at load): extra
        arguments for the ssh command line only (Ansible's ssh connection, ssh_extra_args). ()
        when unset."""
        return tuple(shlex.split(self.vars.get(config.SSH_EXTRA_ARGS.name) or ""))

    @property
    def become(self) -> bool:
        """ansible_become: run every command as become_user through sudo (Ansible's `bool`
        reading of yes/true/on/1; checked at load). Default False."""
        return bool(self.vars.get("ansible_become", False))

    @property
    def become_user(self) -> str:
        """ansible_become_user: the user sudo runs commands as (`sudo -u`), default root."""
        return self.vars.get("ansible_become_user") or "root"

    @property
    def become_exe(self) -> str:
        """ansible_become_exe as written (a string, checked at load): the sudo program, "" when
        unset (sudo); connection/command.py become_exe reads it, and refuses one that is not sudo."""
        return self.vars.get("ansible_become_exe") or ""

    @property
    def become_flags(self) -> tuple[str, ...]:
        """ansible_become_flags, split as a shell would (checked at load): extra sudo options
        placed before fleetctl's `-S -p MARKER -u USER`, read and checked when a command starts
        (connection/command.py sudo_flags). () when unset (fleetctl never adds Ansible's default
        `-H -S -n`: it gives -S itself and answers the prompt)."""
        return tuple(shlex.split(self.vars.get("ansible_become_flags") or ""))

    @property
    def become_password(self) -> str | None:
        """The sudo password: ansible_become_password (or ansible_become_pass, ansible_sudo_pass;
        the last set wins), templated and vault-decrypted at load. None: not set."""
        password = _last(self.vars, *reversed(_BECOME_PASSWORD_VARS))
        return None if password is None else str(password)

    @property
    def connection(self) -> str:
        """How to reach the host: ansible_connection (one of config.CONNECTIONS, checked at load),
        default paramiko."""
        return self.vars.get("ansible_connection") or "paramiko"

    @property
    def python(self) -> str | None:
        """Interpreter to use: ansible_python_interpreter unless unset or `auto*`, else
        fleetctl_python; None means fleetctl looks for the one that runs SGLang."""
        python = self.vars.get("ansible_python_interpreter")
        if python is None or python in _AUTO_INTERPRETERS:
            python = self.vars.get(config.PYTHON.name)
        return python

    @property
    def interpreter(self) -> tuple[str, tuple[str, ...]] | None:
        """`python` as (interpreter, its options) (split_interpreter: an absolute path or a name
        the host's PATH resolves, as `/usr/bin/env NAME` does); None: not set. Raises
        InventoryError naming the host for a value split_interpreter refuses (checked at load
        for an inventory file's hosts)."""
        python = self.python
        if python is None:
            return None
        try:
            return split_interpreter(python)
        except ValueError as e:
            raise InventoryError(f"host {self.name}: {e}") from None

    # fleetctl's own vars (config.HOST_VARS); nothing else reads them by name.

    @property
    def restart_cmd(self) -> str | None:
        """fleetctl_restart_cmd: the shell command that restarts SGLang; None: not set."""
        return self.vars.get(config.RESTART_CMD.name) or None

    @property
    def sglang_port(self) -> int | None:
        """fleetctl_sglang_port: the port the smoke decode talks to; None: use discovered servers."""
        port = self.vars.get(config.SGLANG_PORT.name)
        return None if port is None else int(port)

    @property
    def sglang_host(self) -> str:
        """fleetctl_sglang_host: that server's address on the host, default 127.0.0.1."""
        return str(self.vars.get(config.SGLANG_HOST.name, config.DEFAULT_SGLANG_HOST))

    @property
    def smoke_cmd(self) -> str | None:
        """fleetctl_smoke_cmd: an offline smoke command run on the host; None: not set."""
        return self.vars.get(config.SMOKE_CMD.name)

    @property
    def latency_slack(self) -> float:
        """fleetctl_latency_slack: seconds added to the latency gate's ratio (default 0)."""
        return float(self.vars.get(config.LATENCY_SLACK.name, 0.0))

    @property
    def sglang_api_key(self) -> str | None:
        """fleetctl_sglang_api_key: the SGLang server's API key for the smoke decode (a secret:
        it travels on the probe's stdin and is never printed); None: not set."""
        key = self.vars.get(config.SGLANG_API_KEY.name)
        return None if key is None else str(key)

    @property
    def unprivileged_user(self) -> str | None:
        """fleetctl_unprivileged_user: the account an install's code runs as when neither a server
        of it nor its owner gives one (probes/runas.py account); None: nobody. Raises
        InventoryError naming the host when it names root."""
        user = self.vars.get(config.UNPRIVILEGED_USER.name)
        if user is not None and str(user) in ("root", "0"):
            raise InventoryError(f"host {self.name}: {config.UNPRIVILEGED_USER.name} is root: fleetctl never runs an "
                                 "install's code as root; name an unprivileged account (default nobody)")
        return None if user is None else str(user)

    @property
    def server_user(self) -> str | None:
        """fleetctl_server_user: the account SGLang servers run as (probes/facts/targets.py
        owner_refusal: other processes get no request and no API key); None: not set."""
        user = self.vars.get(config.SERVER_USER.name)
        return None if user is None else str(user)

    @property
    def pd_router(self) -> str | None:
        """fleetctl_pd_router: "http://ADDRESS:PORT" of the PD router in front of this host's PD
        workers (probes/traffic/smoke.py); None: not set. Raises InventoryError naming the host
        and the fix for any other shape (the probe also refuses an ADDRESS not of the host)."""
        url = self.vars.get(config.PD_ROUTER.name)
        if url is None:
            return None
        m = re.fullmatch(r"http://(\[[0-9A-Fa-f:.]+\]|[0-9A-Za-z.-]+):([0-9]{1,5})/?", str(url))
        if m is None or not 0 < int(m.group(2)) < 65536:
            raise InventoryError(f"host {self.name}: {config.PD_ROUTER.name} {str(url)[:200]!r} is not "
                                 "http://ADDRESS:PORT (the PD router on this host, e.g. http://127.0.0.1:8100)")
        return str(url).rstrip("/")

    @property
    def container_exec(self) -> str | None:
        """fleetctl_container_exec: how containers are entered (connection.command.CONTAINER_EXECS);
        None: the runtime's own CLI when it is on the host, else nsenter."""
        return self.vars.get(config.CONTAINER_EXEC.name) or None

    @property
    def shared_tree(self) -> bool:
        """fleetctl_shared_tree: true lets a change write a package tree on a network file
        system (NFS, CIFS, Ceph, Lustre, GPFS, FUSE), which every host mounting it then sees."""
        return self.vars.get(config.SHARED_TREE.name) is True


@dataclass
class Inventory:
    """A loaded inventory: `hosts` in file order, `groups` maps each group (`all` first, then
    `ungrouped` when it has hosts, then groups in file order) to its hosts, transitively."""

    path: Path
    hosts: dict[str, Host]
    groups: dict[str, tuple[str, ...]]

    def select(self, pattern: str) -> list[Host]:
        """The hosts an Ansible host pattern selects, in inventory order (the grammar:
        patterns.select). Raises PatternError (exit 5) when nothing matches, when any one part
        matches nothing, or when a regex, subscript or bracket is invalid."""
        return [self.hosts[name] for name in patterns.select(pattern, self.hosts, self.groups, self.path)]


@dataclass(frozen=True)
class CommandLineVars:
    """Vars the command line sets on every host, where Ansible puts them (its docs, "Using
    variables", Understanding variable precedence: "command line values (for example, -u
    my_user, these are not variables)" come first, under every inventory var, and "extra vars
    (for example, -e "user=my_user") (always win precedence)"): `below` under the inventory's
    vars (-u as ansible_user, -b as ansible_become), `above` over all of them (-e). `where`:
    what each var is reported as set at ("-e (command line)")."""

    below: Mapping[str, Any] = field(default_factory=dict)
    above: Mapping[str, Any] = field(default_factory=dict)
    where: Mapping[str, str] = field(default_factory=dict)

    def layered(self, own: "LocatedVars") -> "LocatedVars":
        """A host's merged inventory vars `own` with `below` under them and `above` over them."""
        merged = LocatedVars()
        for layer in (self.below, own, self.above):
            for name, value in layer.items():
                merged.set(name, value, own.where[name] if layer is own else self.where.get(name, "the command line"))
        return merged


class LocatedVars(dict):
    """Vars, each with `where` it was set ("file:line"), merged layer over layer."""

    def __init__(self):
        super().__init__()
        self.where: dict[str, str] = {}

    def set(self, name: str, value: Any, where: str):
        self[name] = value
        self.where[name] = where

    def merge(self, other: LocatedVars):
        self.update(other)
        self.where.update(other.where)


def build(path: Path, merged: dict[str, LocatedVars], groups: dict[str, tuple[str, ...]],
          decrypt: Decrypt, cli: CommandLineVars | None = None) -> Inventory:
    """The Inventory of `path` whose hosts have the vars `merged` (host -> vars in precedence
    order, with file:line; the command line's `cli` vars under and over them) and whose `groups`
    are Inventory.groups, the vars fleetctl reads templated (templates.Templar), vault values
    among them decrypted by `decrypt`, and checked.
    Raises InventoryError naming the file:line of a value that cannot be rendered, is
    vault-encrypted while `decrypt` is None, or is not what fleetctl needs after rendering."""
    def no_secret(value: Vaulted, name: str, where: str) -> str:
        raise InventoryError(f"{where}: {name} is vault-encrypted and {NO_SECRET}")

    if cli is not None:
        merged = {host: cli.layered(own) for host, own in merged.items()}
    templar = Templar(merged, {h: v.where for h, v in merged.items()}, groups, decrypt or no_secret, path)
    hosts = {}
    for host, raw in merged.items():
        final = dict(raw)
        for name in filter(needed, raw):
            try:
                final[name] = _checked(name, templar.value(host, name))
            except ValueError as e:
                if isinstance(raw[name], Vaulted) or name in _BECOME_PASSWORD_VARS:  # never print a secret
                    raise InventoryError(f"{raw.where[name]}: {name}: the decrypted vault value is not "
                                         "what fleetctl needs here (a port number, or a string)") from None
                if templar.from_vault(host, name):  # nor what a template made of one
                    raise InventoryError(f"{raw.where[name]}: {name}: the value rendered from a vault value is not "
                                         "what fleetctl needs here (a port number, or a string)") from None
                raise InventoryError(f"{raw.where[name]}: {e} (rendered from {raw[name]!r})") from None
        hosts[host] = Host(host, MappingProxyType(final), tuple(g for g in groups if host in groups[g]),
                           MappingProxyType(dict(raw.where)))
    return Inventory(path, hosts, groups)


def _checked(name: str, data: Any) -> Any:
    """`data` as the inventory var `name` must be for fleetctl: a port number (int), a string
    (a number becomes its text, as Ansible uses it), a shell-splittable args string, or one of
    config.CONNECTIONS. Other vars pass unchanged. Raises ValueError saying what is wrong."""
    if name in _PORT_VARS or (name.startswith("fleetctl_") and name.endswith("_port")):
        ok = isinstance(data, int) and not isinstance(data, bool) or isinstance(data, str) and data.isdigit()
        if not ok or not 0 < int(data) < 65536:
            raise ValueError(f"{name} must be a port number (1-65535), not {data!r}")
        return int(data)
    if name in _STR_VARS:
        if isinstance(data, (int, float)) and not isinstance(data, bool):
            data = str(data)
        if not isinstance(data, str) or isinstance(data, Vaulted):
            got = ("a vault value" if isinstance(data, Vaulted) else
                   f"a {type(data).__name__}" if redact.secret_name(name) else repr(data))
            raise ValueError(f"{name} must be a plain string, not {got}")
    if name == "ansible_become":
        return as_bool(data)
    if name == "ansible_become_method" and data not in BECOME_METHODS:
        raise ValueError(f"ansible_become_method {data!r} is not one fleetctl can use: use "
                         f"{', '.join(BECOME_METHODS)} (or leave it unset)")
    if name == "ansible_connection" and data not in config.CONNECTIONS:
        raise ValueError(f"ansible_connection {data!r} is not one fleetctl can use: "
                         f"use one of {', '.join(config.CONNECTIONS)}")
    if name in _ARGS_VARS:
        try:
            shlex.split(data)
        except ValueError as e:
            raise ValueError(f"{name} {data!r} cannot be split as a shell would: {e}") from None
    if name in _INTERPRETER_VARS and data not in _AUTO_INTERPRETERS:
        try:
            split_interpreter(data)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    return data


def prechecked(name: str, data: Any) -> Any:
    """`data` checked by _checked unless it is a template or a vault value (checked once rendered)."""
    return data if is_template(data) or isinstance(data, Vaulted) else _checked(name, data)
