"""hosts.yaml -> Host objects: Ansible's YAML inventory format, its vars precedence and host patterns.

The file format is exactly that of Ansible's `yaml` inventory plugin
(ansible/plugins/inventory/yaml.py): top-level keys are groups (`all` among them); a group
is null or a mapping with `hosts` (name -> vars or null), `children` (nested groups) and
`vars`. Host names may carry `:PORT` and `[a:b(:step)]` ranges (numeric or one-letter
alphabetic), as in ansible/parsing/utils/addresses.py and ansible/inventory/helpers.
Vars files in group_vars/ and host_vars/ beside the inventory are read as Ansible's
host_group_vars plugin reads them. Where Ansible only warns (a key other than
hosts/children/vars, a group that is not a mapping, a duplicate key), fleetctl refuses the
file, naming the file and line. Other sources (INI, directories, scripts, plugins) come from
`ansible-inventory` (ansiblesrc). Either way the vars fleetctl reads are templated as Ansible
templates them (invtemplate) and checked once rendered.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import os
import re
import shlex
import string
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from . import sources as ansiblesrc
from .. import config
from ..probes import redact
from ..errors import InventoryError, PatternError
from .templates import Templar, Unsafe, Vaulted, as_bool, is_template, needed

ENV_VAR = "FLEETCTL_INVENTORY"
DEFAULT_PATH = "hosts.yaml"

_GROUP_KEYS = ("hosts", "children", "vars")
_NULL_TAG = "tag:yaml.org,2002:null"
_MERGE_TAG = "tag:yaml.org,2002:merge"
# A host key `name:port` and `[address]:port` (ansible/parsing/utils/addresses.py, 'hostport' and
# 'bracketed_hostport'); the only way to give an IPv6 address a port is the brackets.
_HOSTPORT = re.compile(r"((?:[^:\[\]]|\[[^\]]*\])*):([0-9]+)")
_BRACKETED_HOSTPORT = re.compile(r"\[(.+)\]:([0-9]+)")
# A host name as Ansible's parse_address accepts it: dot-separated labels of word characters and
# '-', not ending in '-' or '_' (ansible/parsing/utils/addresses.py, 'label').
_HOSTNAME = re.compile(r"[\w][\w-]*(?<![_-])(?:\.[\w][\w-]*(?<![_-]))*")
# Connection vars given as a command-line fragment (Ansible's ssh connection, ssh_common_args /
# ssh_extra_args): split as a shell would, so a quoting mistake is found at load.
_ARGS_VARS = ("ansible_ssh_common_args", "ansible_ssh_extra_args", "ansible_become_flags")
# One part of a ':'-separated host pattern, keeping [x:y] brackets whole (ansible/inventory/manager.py).
_PATTERN_PART = re.compile(r"(?:[^\s:\[\]]|\[[^\]]*\])+")
# `pattern[i]`, `pattern[i:j]`, `pattern[i:]` (ansible/inventory/manager.py, PATTERN_WITH_SUBSCRIPT).
_SUBSCRIPT = re.compile(r"(.+)\[(?:(-?[0-9]+)|([0-9]+)[:-]([0-9]*))\]")
_VARS_EXTENSIONS = ("", ".yml", ".yaml", ".json")
# Inventory file suffixes of Ansible's yaml inventory plugin (ansible/plugins/inventory/yaml.py).
_YAML_SUFFIXES = (".yml", ".yaml", ".json")
_PORT_VARS = ("ansible_port", "ansible_ssh_port")
# Become (privilege escalation) vars, as Ansible's sudo become plugin reads them
# (ansible/plugins/become/sudo.py: become_user, become_flags, become_pass and its aliases).
_BECOME_PASSWORD_VARS = ("ansible_become_password", "ansible_become_pass", "ansible_sudo_pass")
_BECOME_STR_VARS = ("ansible_become_user", "ansible_become_flags", "ansible_become_method",
                    *_BECOME_PASSWORD_VARS)
# The only become method fleetctl runs (Ansible's default).
BECOME_METHODS = ("sudo",)
_STR_VARS = ("ansible_host", "ansible_ssh_host", "ansible_user", "ansible_ssh_user",
             "ansible_private_key_file", "ansible_ssh_private_key_file",
             "ansible_python_interpreter", "ansible_connection", *_ARGS_VARS, *_BECOME_STR_VARS,
             *(v.name for v in config.HOST_VARS if v.type is str))
# ansible_connection values fleetctl reaches hosts with (see fleetctl.connection); `ssh` and
# `smart` are Ansible's names for its OpenSSH connection (fleetctl.connection.openssh).
CONNECTIONS = ("paramiko", "paramiko_ssh", "ssh", "smart", "local")
# What an encrypted file starts with (ansible/parsing/vault, b_HEADER).
_VAULT_HEADER = "$ANSIBLE_VAULT"
_NO_SECRET = "no vault secret was given: run with --vault-password-file FILE or --ask-vault-pass"
# Turns a vault value into its plain text: (ciphertext, var name, "file:line") -> text.
Decrypt = Optional[Callable[[Vaulted, str, str], str]]
# ansible_python_interpreter values that ask Ansible to discover the interpreter.
_AUTO_INTERPRETERS = ("auto", "auto_silent", "auto_legacy", "auto_legacy_silent")


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """SafeLoader that also reads Ansible's own tags: `!unsafe` (an Unsafe string, never
    templated) and `!vault` (a Vaulted ciphertext). libyaml's parser where PyYAML has it (the
    same nodes and marks; a 2000-host inventory loads in 0.38 s instead of 1.45 s), else PyYAML's
    own; only the wording of a syntax error differs."""


_Loader.add_constructor("!unsafe", lambda loader, node: Unsafe(loader.construct_scalar(node)))
_Loader.add_constructor("!vault", lambda loader, node: Vaulted(loader.construct_scalar(node)))


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
    winning), then host_vars/<name>. The vars fleetctl reads (`invtemplate.needed`) are
    templated, vault values among them decrypted; every other var is kept as the inventory wrote
    it (templates unrendered, `!unsafe` as Unsafe, `!vault` as Vaulted). `groups` holds every
    group the host is in, transitively, `all` first, in the order of Inventory.groups.
    """

    name: str
    vars: Mapping[str, Any] = field(compare=False, repr=False)  # may hold a decrypted become password
    groups: tuple[str, ...]

    @property
    def address(self) -> str:
        """Where to connect: ansible_host (or the older ansible_ssh_host), else the name."""
        return str(_last(self.vars, "ansible_host", "ansible_ssh_host") or self.name)

    @property
    def port(self) -> int | None:
        """SSH port from ansible_port (or ansible_ssh_port, or a `name:port` key); None: ssh_config's."""
        port = _last(self.vars, *_PORT_VARS)
        return None if port is None else int(port)

    @property
    def user(self) -> str | None:
        """SSH user from ansible_user (or ansible_ssh_user); None: ssh_config's."""
        return _last(self.vars, "ansible_user", "ansible_ssh_user")

    @property
    def key_file(self) -> str | None:
        """ansible_ssh_private_key_file (or ansible_private_key_file), `~` expanded; None: none set."""
        path = _last(self.vars, "ansible_private_key_file", "ansible_ssh_private_key_file")
        return os.path.expanduser(path) if path else None

    @property
    def ssh_common_args(self) -> tuple[str, ...]:
        """ansible_ssh_common_args, templated and split as a shell would (shlex; checked at load):
        extra arguments for every ssh, scp and sftp command line of Ansible's ssh connection, where
        Ansible users name a bastion (`-o ProxyCommand=...`, `-o ProxyJump=...`, `-J`, `-F FILE`;
        Ansible FAQ, jump hosts). () when unset."""
        return tuple(shlex.split(self.vars.get("ansible_ssh_common_args") or ""))

    @property
    def ssh_extra_args(self) -> tuple[str, ...]:
        """ansible_ssh_extra_args, templated and split as a shell would (checked at load): extra
        arguments for the ssh command line only (Ansible's ssh connection, ssh_extra_args). ()
        when unset."""
        return tuple(shlex.split(self.vars.get("ansible_ssh_extra_args") or ""))

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
    def become_flags(self) -> tuple[str, ...]:
        """ansible_become_flags, split as a shell would (checked at load): extra sudo options
        placed before `-u`. () when unset (fleetctl never adds Ansible's default `-H -S -n`:
        it gives -S itself and answers the prompt, see connection/command.py)."""
        return tuple(shlex.split(self.vars.get("ansible_become_flags") or ""))

    @property
    def become_password(self) -> str | None:
        """The sudo password: ansible_become_password (or ansible_become_pass, ansible_sudo_pass;
        the last set wins), templated and vault-decrypted at load. None: not set."""
        password = _last(self.vars, *reversed(_BECOME_PASSWORD_VARS))
        return None if password is None else str(password)

    @property
    def connection(self) -> str:
        """How to reach the host: ansible_connection (one of CONNECTIONS, checked at load),
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
        """The hosts an Ansible host pattern selects, in inventory order.

        `pattern`: names of hosts or groups, `all`, `*`, globs (`gpu-*`, fnmatch), `~regex`
        (re.match), subscripts (`gpu[0]`, `gpu[1:3]`, `gpu[2:]`), joined by `:` or `,` (union),
        `:&` (intersection) and `:!` (exclusion). As in ansible/inventory/manager.py, unions are
        applied first, then intersections, then exclusions; a pattern of only `&`/`!` parts
        starts from `all`. A pattern that is exactly a host or group name is taken whole, so
        names containing ':' can be selected.
        Raises PatternError (exit 5) when nothing matches, when any one part matches nothing
        (Ansible only warns; here a typo must not change which hosts a run touches), or when a
        regex, subscript or bracket is invalid.
        """
        parts = self._split(pattern)
        if not parts:
            raise PatternError(f"empty host pattern {pattern!r}")
        regular = [p for p in parts if p[0] not in "&!"] or ["all"]
        ordered = regular + [p for p in parts if p[0] == "&"] + [p for p in parts if p[0] == "!"]
        selected: dict[str, None] = {}
        for part in ordered:
            if part in self.hosts:
                selected[part] = None
                continue
            matched = self._match(part)
            if not matched:  # stricter than Ansible's warning: a typo must not widen or narrow a run
                raise PatternError(f"{part!r} in host pattern {pattern!r} matches no host in {self.path}; "
                                   f"groups: {', '.join(self.groups)}")
            if part[0] == "!":
                selected = {n: None for n in selected if n not in matched}
            elif part[0] == "&":
                selected = {n: None for n in selected if n in matched}
            else:
                selected.update(dict.fromkeys(matched))
        if not selected:
            raise PatternError(f"host pattern {pattern!r} matches no host in {self.path}; "
                               f"groups: {', '.join(self.groups)}")
        return [host for name, host in self.hosts.items() if name in selected]

    def _split(self, pattern: str) -> list[str]:
        """Split a pattern on ',' then ':' and whitespace, keeping whole names and [x:y] intact."""
        pattern = pattern.strip()
        if pattern in self.hosts or pattern in self.groups:
            return [pattern]
        parts: list[str] = []
        for chunk in pattern.split(","):
            chunk = chunk.strip()
            if chunk in self.hosts or chunk in self.groups:
                parts.append(chunk)
                continue
            found = _PATTERN_PART.findall(chunk)
            if _PATTERN_PART.sub("", chunk).strip(" \t:"):  # a stray '[' or ']' is a typo
                raise PatternError(f"invalid host pattern {chunk!r}: unbalanced brackets")
            parts += found
        return parts

    def _match(self, part: str) -> list[str]:
        """Host names one pattern part (without its &/! prefix) matches, in inventory order."""
        expr = part[1:] if part[0] in "&!" else part
        if not expr:
            raise PatternError(f"empty host pattern after {part!r}")
        if expr == "~":
            raise PatternError(f"empty regular expression in host pattern {part!r}")
        subscript = None if expr[0] == "~" else _SUBSCRIPT.fullmatch(expr)
        if subscript:
            expr = subscript[1]
        try:
            regex = re.compile(expr[1:] if expr[0] == "~" else fnmatch.translate(expr))
        except re.error as e:
            raise PatternError(f"invalid host pattern {part!r}: {e}") from None
        matched: set[str] = set()
        groups = [g for g in self.groups if regex.match(g)]
        for group in groups:
            matched.update(self.groups[group])
        if not groups or expr[0] == "~" or any(c in expr for c in ".?*["):
            matched.update(h for h in self.hosts if regex.match(h))
        names = [h for h in self.hosts if h in matched]
        if subscript:
            index, start, end = subscript[2], subscript[3], subscript[4]
            try:
                if index is not None:
                    names = [names[int(index)]]
                else:
                    names = names[int(start):int(end) + 1] if end else names[int(start):]
            except IndexError:
                raise PatternError(f"no host matches the subscripted pattern {part!r}") from None
        return names


def resolve_path(cli_path: str | None = None) -> Path:
    """The inventory file: `-i PATH` (cli_path), else $FLEETCTL_INVENTORY, else ./hosts.yaml.

    `~` is expanded; a relative path stays relative to the current directory.
    Raises InventoryError (exit 4) when the chosen path does not exist or is neither a file
    nor a directory (an inventory directory is read through ansible-inventory).
    """
    if cli_path:
        path, origin = Path(cli_path), "-i"
    elif os.environ.get(ENV_VAR):
        path, origin = Path(os.environ[ENV_VAR]), f"${ENV_VAR}"
    else:
        path, origin = Path(DEFAULT_PATH), "the default ./hosts.yaml; use -i PATH or $FLEETCTL_INVENTORY"
    path = path.expanduser()
    if not (path.is_file() or path.is_dir()):
        raise InventoryError(f"inventory {path} (from {origin}): "
                             f"{'is not a file or directory' if path.exists() else 'no such file'}")
    return path


def load(path: Path, decrypt: Decrypt = None) -> Inventory:
    """Read an inventory source into an Inventory.

    Ansible's YAML inventory format is read here. Any other source (a directory, an executable
    script starting with `#!`, a plugin configuration with `plugin:`, a file that is not a YAML
    mapping, such as INI) is read through ansible-inventory (ansiblesrc.load_source, given the
    secret when `decrypt` is an ansiblesrc.Vault); without ansible-core that is exit 4 saying
    what to install.
    Either way the vars fleetctl reads are then templated (invtemplate) and vault values among
    them decrypted with `decrypt`.

    Like Ansible's host_group_vars plugin, also reads the vars files beside the inventory:
    group_vars/<group> and host_vars/<host> (no extension, .yml, .yaml, .json, or a directory of
    such files), with Ansible's precedence: inventory group vars < group_vars/all <
    group_vars/<group> < inventory host vars < host_vars/<host>.
    Raises InventoryError (exit 4) "<file>:<line>[:<col>]: <what>" for unreadable or bad YAML
    (line and column from PyYAML's problem_mark), a duplicate key, or a bad structure (a group
    or `hosts` that is not a mapping, an unknown key in a group, a bad host range, a group
    cycle, ansible_port not a port number, a connection var that is not a string), and for a var
    fleetctl reads that cannot be templated (invtemplate) or is vault-encrypted while `decrypt`
    (Vaulted, var name, "file:line" -> plain text) is None.
    """
    path = Path(path)
    if _is_yaml_inventory(path):
        return _parsed(path, _Parser.parse, decrypt)
    hosts, groups = ansiblesrc.load_source(path, decrypt if isinstance(decrypt, ansiblesrc.Vault) else None)
    merged = {}
    for host, values in hosts.items():
        merged[host] = _Vars()
        for name, value in values.items():
            where = f"{path}: host {host} (as ansible-inventory reads it)"
            try:
                merged[host].set(name, _prechecked(name, value), where)
            except ValueError as e:
                raise InventoryError(f"{where}: {e}") from None
    return _inventory(path, merged, groups, decrypt)


def _is_yaml_inventory(path: Path) -> bool:
    """Whether `path` is for the YAML reader: a file with a YAML suffix that is not a plugin
    configuration or a script (a broken one is reported by the YAML reader, with its line), or
    any other file holding a YAML mapping of groups."""
    if not path.is_file():
        return False
    try:
        with path.open("rb") as f:
            if f.read(2) == b"#!" and os.access(path, os.X_OK):
                return False
        root = yaml.compose(path.read_text(encoding="utf-8"), Loader=_Loader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return path.suffix in _YAML_SUFFIXES
    if isinstance(root, MappingNode):
        return not any(isinstance(k, ScalarNode) and k.value == "plugin" for k, _ in root.value)
    return path.suffix in _YAML_SUFFIXES


def _inventory(path: Path, merged: dict[str, _Vars], groups: dict[str, tuple[str, ...]],
               decrypt: Decrypt) -> Inventory:
    """The Inventory of hosts whose vars are `merged` (in precedence order, with file:line), the
    vars fleetctl reads templated and checked. Raises InventoryError naming the file:line of a
    value that cannot be rendered or is not what fleetctl needs after rendering."""
    def no_secret(value: Vaulted, name: str, where: str) -> str:
        raise InventoryError(f"{where}: {name} is vault-encrypted and {_NO_SECRET}")

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
                raise InventoryError(f"{raw.where[name]}: {e} (rendered from {raw[name]!r})") from None
        hosts[host] = Host(host, MappingProxyType(final), tuple(g for g in groups if host in groups[g]))
    return Inventory(path, hosts, groups)


def _parsed(path: Path, use: Callable[[_Parser], Any], decrypt: Decrypt = None) -> Any:
    """Read `path` as YAML (a vault-encrypted file decrypted first) and return `use(parser)`;
    read, YAML and missing-secret errors become InventoryError."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = e.object[:e.start].count(b"\n") + 1
        raise InventoryError(f"{path}:{line}: not UTF-8 text") from None
    except OSError as e:
        raise InventoryError(f"{path}: cannot read: {e.strerror}") from None
    if text.startswith(_VAULT_HEADER):  # a whole file encrypted with ansible-vault
        if decrypt is None:
            raise InventoryError(f"{path}:1: the file is vault-encrypted and {_NO_SECRET}")
        text = decrypt(Vaulted(text), "the file", f"{path}:1")
    parser = None
    try:
        parser = _Parser(path, text, decrypt)
        return use(parser)
    except yaml.reader.ReaderError as e:
        line = text[:e.position].count("\n") + 1
        raise InventoryError(f"{path}:{line}: character #x{e.character:04x} is not allowed in YAML") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        what = e.problem or e.context
        if e.context and e.context_mark and e.problem:
            what += f" ({e.context} at line {e.context_mark.line + 1})"
        raise InventoryError(f"{path}:{mark.line + 1}:{mark.column + 1}: {what}") from None
    except yaml.YAMLError as e:
        raise InventoryError(f"{path}: {e}") from None
    finally:
        if parser is not None:
            parser.yaml.dispose()


def _vars_files(directory: Path) -> list[Path]:
    """Vars files in a group_vars/<name>/ directory, as Ansible's DataLoader lists them:
    sorted, recursive, hidden and `~` backups skipped, extension none/.yml/.yaml/.json."""
    found = []
    for path in sorted(directory.iterdir()):
        if path.name.startswith(".") or path.name.endswith("~"):
            continue
        if path.is_dir() and not path.suffix:
            found += _vars_files(path)
        elif path.is_file() and path.suffix in _VARS_EXTENSIONS:
            found.append(path)
    return found


class _Vars(dict):
    """Vars, each with `where` it was set ("file:line"), merged layer over layer."""

    def __init__(self):
        super().__init__()
        self.where: dict[str, str] = {}

    def set(self, name: str, value: Any, where: str):
        self[name] = value
        self.where[name] = where

    def merge(self, other: _Vars):
        self.update(other)
        self.where.update(other.where)


def _checked(name: str, data: Any) -> Any:
    """`data` as the inventory var `name` must be for fleetctl: a port number (int), a string
    (a number becomes its text, as Ansible uses it), a shell-splittable args string, or one of
    CONNECTIONS. Other vars pass unchanged. Raises ValueError saying what is wrong."""
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
    if name == "ansible_connection" and data not in CONNECTIONS:
        raise ValueError(f"ansible_connection {data!r} is not one fleetctl can use: "
                         f"use one of {', '.join(CONNECTIONS)}")
    if name in _ARGS_VARS:
        try:
            shlex.split(data)
        except ValueError as e:
            raise ValueError(f"{name} {data!r} cannot be split as a shell would: {e}") from None
    return data


def _prechecked(name: str, data: Any) -> Any:
    """`data` checked by _checked unless it is a template or a vault value (checked once rendered)."""
    return data if is_template(data) or isinstance(data, Vaulted) else _checked(name, data)


def _kind(node: Node) -> str:
    """How a YAML node reads in an error message."""
    if isinstance(node, SequenceNode):
        return "a list"
    if isinstance(node, MappingNode):
        return "a mapping"
    return f"the scalar {node.value!r}"


def _is_null(node: Node | None) -> bool:
    return node is None or (isinstance(node, ScalarNode) and node.tag == _NULL_TAG)


def _host_names(entry: str) -> tuple[list[str], int | None]:
    """The host names and port of one host entry, as Ansible's _expand_hostpattern reads it
    (ansible/plugins/inventory/__init__.py with parse_address): `name`, `name:port`, an IPv4 or
    IPv6 address, `[address]:port`, each with `[a:b]` ranges. An entry that is none of those (say
    `db:primary`) is one name, whole. Raises ValueError for a bad range."""
    address, port = entry, None
    for form in (_BRACKETED_HOSTPORT, _HOSTPORT):
        match = form.fullmatch(address)
        if match:
            address, port = match[1], int(match[2])
    if not _is_address(address):
        address, port = entry, None
    return (_expand_range(address) if "[" in address and "]" in address else [address]), port


def _is_address(address: str) -> bool:
    """Whether `address` (ranges expanded) is an IP address or a host name of dot-separated labels."""
    try:
        names = _expand_range(address) if "[" in address else [address]
    except ValueError:
        return False
    for name in names:
        try:
            ipaddress.ip_address(name)
        except ValueError:
            if not _HOSTNAME.fullmatch(name):
                return False
    return True


def _expand_range(name: str) -> list[str]:
    """Expand the first `[beg:end(:step)]` of a host name, recursively (Ansible's
    expand_hostname_range): zero-padded numbers keep their width; one-letter ranges are alphabetic.
    Raises ValueError with the reason."""
    head, _, rest = name.partition("[")
    body, closed, tail = rest.partition("]")
    bounds = body.split(":")
    if not closed or len(bounds) not in (2, 3):
        raise ValueError("a host range is [begin:end] or [begin:end:step]")
    beg, end = bounds[0] or "0", bounds[1]
    step = int(bounds[2]) if len(bounds) == 3 and bounds[2].isdigit() else 1
    if not end:
        raise ValueError("a host range needs an end value")
    if beg in string.ascii_letters and end in string.ascii_letters:
        i, j = string.ascii_letters.index(beg), string.ascii_letters.index(end)
        if i > j:
            raise ValueError("a host range needs begin <= end")
        seq = list(string.ascii_letters[i:j + 1:step])
    elif beg.isdigit() and end.isdigit():
        width = len(beg) if beg.startswith("0") and len(beg) > 1 else 0
        if width and len(end) != width:
            raise ValueError("a zero-padded host range needs begin and end of equal length")
        seq = [str(n).zfill(width) for n in range(int(beg), int(end) + 1, step)]
    else:
        raise ValueError(f"[{body}] is not a numeric or one-letter range")
    names = [head + item + tail for item in seq]
    return [n for name in names for n in (_expand_range(name) if "[" in name else [name])]


class _Parser:
    """Walks the composed YAML node tree (for line numbers) and builds the Inventory."""

    def __init__(self, path: Path, text: str, decrypt: Decrypt = None):
        self.path = path
        self.decrypt = decrypt
        self.yaml = _Loader(text)
        self.host_vars: dict[str, _Vars] = {}  # host -> own vars, file order
        self.group_vars: dict[str, _Vars] = {"all": _Vars()}  # group -> vars, file order
        self.priority: dict[str, int] = {}
        self.members: dict[str, list[str]] = {"all": []}  # group -> hosts listed directly
        self.children: dict[str, dict[str, Node]] = {"all": {}}  # group -> child -> key node

    def fail(self, node: Node, what: str):
        raise InventoryError(f"{self.path}:{node.start_mark.line + 1}: {what}")

    def parse(self) -> Inventory:
        root = self.yaml.get_single_node()
        if _is_null(root) or (isinstance(root, ScalarNode) and not root.value.strip()):
            raise InventoryError(f"{self.path}:1: empty inventory (expected a mapping such as 'all:')")
        if not isinstance(root, MappingNode):
            self.fail(root, f"an inventory is a mapping of groups (such as 'all:'), not {_kind(root)}")
        self.check_duplicates(root, set())
        for name, key, value in self.items(root):
            self.group(name, key, value, None)
        return self.build()

    def vars_file(self) -> _Vars:
        """The vars in a group_vars/ or host_vars/ file (an empty file has none)."""
        root = self.yaml.get_single_node()
        if root is not None:
            self.check_duplicates(root, set())
        return self.vars(root, "a vars file")

    def adjacent_vars(self, kind: str, names) -> dict[str, _Vars]:
        """name -> vars from <inventory dir>/<kind>/ ("group_vars" or "host_vars") for each of `names`."""
        base = self.path.parent / kind
        found: dict[str, _Vars] = {}
        for name in names if base.is_dir() else ():
            files = [base / (name + ext) for ext in _VARS_EXTENSIONS if (base / (name + ext)).is_file()]
            files += _vars_files(base / name) if (base / name).is_dir() else []
            for path in files:
                found.setdefault(name, _Vars()).merge(_parsed(path, _Parser.vars_file, self.decrypt))
        return found

    def check_duplicates(self, node: Node, seen: set[int]):
        """Refuse a mapping that has the same key twice (PyYAML would keep the last silently)."""
        if id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, MappingNode):
            lines: dict[tuple[str, str], int] = {}
            for key, value in node.value:
                if isinstance(key, ScalarNode) and key.tag != _MERGE_TAG:
                    first = lines.get((key.tag, key.value))
                    if first:
                        self.fail(key, f"duplicate key {key.value!r} (first at line {first})")
                    lines[key.tag, key.value] = key.start_mark.line + 1
                self.check_duplicates(value, seen)
        elif isinstance(node, SequenceNode):
            for item in node.value:
                self.check_duplicates(item, seen)

    def items(self, node: MappingNode) -> list[tuple[str, Node, Node]]:
        """(name, key node, value node) of a mapping, `<<` merges applied; keys must be names."""
        self.yaml.flatten_mapping(node)
        out = []
        for key, value in node.value:
            if not isinstance(key, ScalarNode) or not key.value:
                self.fail(key, f"expected a name as key, not {_kind(key)}")
            out.append((key.value, key, value))
        return out

    def names(self, node: Node, group: str, section: str) -> list[tuple[str, Node, Node | None]]:
        """Entries of a group's `hosts` or `children`: a mapping, null, or one name (as Ansible allows)."""
        if _is_null(node):
            return []
        if isinstance(node, ScalarNode):
            return [(node.value, node, None)]
        if not isinstance(node, MappingNode):
            self.fail(node, f"'{section}' of group '{group}' must be a mapping of names, not {_kind(node)}")
        return self.items(node)

    def group(self, name: str, key: Node, node: Node | None, parent: str | None):
        if name == "all" and parent is not None:
            self.fail(key, "group 'all' cannot be a child of another group")
        if not _is_null(node) and not isinstance(node, MappingNode):
            self.fail(node, f"group '{name}' must be a mapping of hosts, children and vars, "
                            f"not {_kind(node)}")
        self.group_vars.setdefault(name, _Vars())
        self.members.setdefault(name, [])
        self.children.setdefault(name, {})
        if parent is not None:
            self.children[parent].setdefault(name, key)
        for section, skey, value in ([] if _is_null(node) else self.items(node)):
            if section == "vars":
                own = self.vars(value, f"vars of group '{name}'")
                if "ansible_group_priority" in own:
                    self.priority[name] = own.pop("ansible_group_priority")
                self.group_vars[name].merge(own)
            elif section == "children":
                for child, ckey, cvalue in self.names(value, name, section):
                    self.group(child, ckey, cvalue, name)
            elif section == "hosts":
                for host, hkey, hvalue in self.names(value, name, section):
                    self.host(host, hkey, hvalue, name)
            else:
                self.fail(skey, f"unknown key '{section}' in group '{name}' (a group has only "
                                f"hosts, children and vars; is a 'hosts:' or 'children:' level missing?)")

    def host(self, entry: str, key: Node, node: Node | None, group: str):
        try:
            names, port = _host_names(entry)
        except ValueError as e:
            self.fail(key, f"bad host range in {entry!r}: {e}")
        own = self.vars(node, f"vars of host '{entry}'")
        for name in names:
            merged = self.host_vars.setdefault(name, _Vars())
            if name not in self.members[group]:
                self.members[group].append(name)
            if port is not None:
                merged.set("ansible_port", port, f"{self.path}:{key.start_mark.line + 1}")
            merged.merge(own)

    def vars(self, node: Node | None, what: str) -> _Vars:
        """A vars mapping, its values constructed, each with its file:line; the vars fleetctl
        reads are checked at their line unless templated or vaulted (then after rendering)."""
        out = _Vars()
        if _is_null(node):
            return out
        if not isinstance(node, MappingNode):
            self.fail(node, f"{what} must be a mapping, not {_kind(node)}")
        for name, _, value in self.items(node):
            data = self.yaml.construct_object(value, deep=True)
            if name == "ansible_group_priority" and (not isinstance(data, int) or isinstance(data, bool)):
                self.fail(value, f"{name} must be an integer, not {data!r}")
            try:
                data = _prechecked(name, data)
            except ValueError as e:
                self.fail(value, str(e))
            out.set(name, data, f"{self.path}:{value.start_mark.line + 1}")
        return out

    def build(self) -> Inventory:
        """Resolve children into ancestors and depths, place ungrouped hosts, merge vars."""
        parents: dict[str, list[str]] = {g: [] for g in self.children}
        for parent, kids in self.children.items():
            for kid in kids:
                parents[kid].append(parent)
        self.check_cycles()
        depth: dict[str, int] = {}

        def depth_of(group: str) -> int:  # longest path from `all`, as Ansible's Group.depth
            if group not in depth:
                depth[group] = 0 if group == "all" else 1 + max(map(depth_of, parents[group]), default=0)
            return depth[group]

        def ancestors(group: str) -> set[str]:
            return {group, "all"}.union(*(ancestors(p) for p in parents[group]))

        in_groups: dict[str, set[str]] = {}
        for host in self.host_vars:
            direct = [g for g, members in self.members.items() if host in members]
            in_groups[host] = set().union(*(ancestors(g) for g in direct)) | {"all"}
            if in_groups[host] - {"all", "ungrouped"}:
                in_groups[host].discard("ungrouped")
            else:
                in_groups[host].add("ungrouped")
        self.group_vars.setdefault("ungrouped", _Vars())
        parents.setdefault("ungrouped", [])
        order = ["all", "ungrouped"] + [g for g in self.group_vars if g not in ("all", "ungrouped")]
        groups = {g: tuple(h for h in self.host_vars if g in in_groups[h]) for g in order}
        if not groups["ungrouped"] and "ungrouped" not in self.members:
            del groups["ungrouped"]
        group_files = self.adjacent_vars("group_vars", groups)
        host_files = self.adjacent_vars("host_vars", self.host_vars)
        merged_vars = {}
        for host, own in self.host_vars.items():
            ordered = sorted(in_groups[host], key=lambda g: (depth_of(g), self.priority.get(g, 1), g))
            merged = _Vars()
            for layer in [self.group_vars[g] for g in ordered] + [group_files.get(g, _Vars()) for g in ordered]:
                merged.merge(layer)
            merged.merge(own)
            merged.merge(host_files.get(host, _Vars()))
            merged_vars[host] = merged
        return _inventory(self.path, merged_vars, groups, self.decrypt)

    def check_cycles(self):
        """Refuse a group that is its own ancestor, naming the line of the edge that closes the loop."""
        done: set[str] = set()

        def visit(group: str, path: list[str]):
            for kid, key in self.children[group].items():
                if kid in path:
                    loop = " -> ".join(path[path.index(kid):] + [kid])
                    self.fail(key, f"group '{kid}' is its own ancestor: {loop}")
                if kid not in done:
                    visit(kid, path + [kid])
            done.add(group)

        for group in self.children:
            visit(group, [group])
