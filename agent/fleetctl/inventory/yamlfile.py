"""The YAML reader: Ansible's YAML inventory format, its vars files and precedence, with file:line.

The file format is exactly that of Ansible's `yaml` inventory plugin
(ansible/plugins/inventory/yaml.py): top-level keys are groups (`all` among them); a group
is null or a mapping with `hosts` (name -> vars or null), `children` (nested groups) and
`vars`. Host names may carry `:PORT` and `[a:b(:step)]` ranges (numeric or one-letter
alphabetic), as in ansible/parsing/utils/addresses.py and ansible/inventory/helpers.
Vars files in group_vars/ and host_vars/ beside the inventory are read as Ansible's
host_group_vars plugin reads them. Where Ansible only warns (a key other than
hosts/children/vars, a group that is not a mapping, a duplicate key), fleetctl refuses the
file, naming the file and line. A file vault-encrypted whole is decrypted first, and each var set
in it is located by an InEncryptedFile (its value is a secret though nothing marks the value).
The merged vars become Hosts in model.build.
"""

from __future__ import annotations

import ipaddress
import re
import string
from pathlib import Path
from typing import Any, Callable

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from ..errors import InventoryError
from .model import NO_SECRET, CommandLineVars, Decrypt, Inventory, LocatedVars, build, prechecked
from .templates import InEncryptedFile, Unsafe, Vaulted

_NULL_TAG = "tag:yaml.org,2002:null"
_MERGE_TAG = "tag:yaml.org,2002:merge"
# A host key `name:port` and `[address]:port` (ansible/parsing/utils/addresses.py, 'hostport' and
# 'bracketed_hostport'); the only way to give an IPv6 address a port is the brackets.
_HOSTPORT = re.compile(r"((?:[^:\[\]]|\[[^\]]*\])*):([0-9]+)")
_BRACKETED_HOSTPORT = re.compile(r"\[(.+)\]:([0-9]+)")
# A host name as Ansible's parse_address accepts it: dot-separated labels of word characters and
# '-', not ending in '-' or '_' (ansible/parsing/utils/addresses.py, 'label').
_HOSTNAME = re.compile(r"[\w][\w-]*(?<![_-])(?:\.[\w][\w-]*(?<![_-]))*")
_VARS_EXTENSIONS = ("", ".yml", ".yaml", ".json")
# Inventory file suffixes of Ansible's yaml inventory plugin (ansible/plugins/inventory/yaml.py).
SUFFIXES = (".yml", ".yaml", ".json")
# What an encrypted file starts with (ansible/parsing/vault, b_HEADER).
_VAULT_HEADER = "$ANSIBLE_VAULT"


class Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """SafeLoader that also reads Ansible's own tags: `!unsafe` (an Unsafe string, never
    templated) and `!vault` (a Vaulted ciphertext). libyaml's parser where PyYAML has it (the
    same nodes and marks; a 2000-host inventory loads in 0.38 s instead of 1.45 s), else PyYAML's
    own; only the wording of a syntax error differs."""


Loader.add_constructor("!unsafe", lambda loader, node: Unsafe(loader.construct_scalar(node)))
Loader.add_constructor("!vault", lambda loader, node: Vaulted(loader.construct_scalar(node)))


def load(path: Path, decrypt: Decrypt = None, cli: CommandLineVars | None = None) -> Inventory:
    """The Inventory of the YAML inventory file `path`, vault values decrypted with `decrypt`
    (Vaulted, var name, "file:line" -> plain text; None: a vault value fleetctl reads is an error).

    Like Ansible's host_group_vars plugin, also reads the vars files beside the inventory:
    group_vars/<group> and host_vars/<host> (no extension, .yml, .yaml, .json, or a directory of
    such files), with Ansible's precedence: inventory group vars < group_vars/all <
    group_vars/<group> < inventory host vars < host_vars/<host>.
    Raises InventoryError (exit 4) "<file>:<line>[:<col>]: <what>" for unreadable or bad YAML
    (line and column from PyYAML's problem_mark), a duplicate key, or a bad structure (a group
    or `hosts` that is not a mapping, an unknown key in a group, a bad host range, a group
    cycle, ansible_port not a port number, a connection var that is not a string), and for a var
    fleetctl reads that cannot be templated (templates) or is vault-encrypted while `decrypt`
    is None. `cli`: the command line's vars, under and over the file's (model.CommandLineVars).
    """
    return _parsed(path, lambda parser: parser.parse(cli), decrypt)


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
    encrypted = text.startswith(_VAULT_HEADER)  # a whole file encrypted with ansible-vault
    if encrypted:
        if decrypt is None:
            raise InventoryError(f"{path}:1: the file is vault-encrypted and {NO_SECRET}")
        text = decrypt(Vaulted(text), "the file", f"{path}:1")
    parser = None
    try:
        parser = _Parser(path, text, decrypt, encrypted)
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

    def __init__(self, path: Path, text: str, decrypt: Decrypt = None, encrypted: bool = False):
        self.path = path
        self.decrypt = decrypt
        self.encrypted = encrypted  # `text` is the decrypted text of a file vault-encrypted whole
        self.yaml = Loader(text)
        self.host_vars: dict[str, LocatedVars] = {}  # host -> own vars, file order
        self.group_vars: dict[str, LocatedVars] = {"all": LocatedVars()}  # group -> vars, file order
        self.priority: dict[str, int] = {}
        self.members: dict[str, list[str]] = {"all": []}  # group -> hosts listed directly
        self.children: dict[str, dict[str, Node]] = {"all": {}}  # group -> child -> key node

    def fail(self, node: Node, what: str):
        raise InventoryError(f"{self.path}:{node.start_mark.line + 1}: {what}")

    def at(self, node: Node) -> str:
        """Where a var set at `node` comes from: "file:line", an InEncryptedFile when the file
        is vault-encrypted whole (its values are secrets; templates.Templar.from_vault)."""
        where = f"{self.path}:{node.start_mark.line + 1}"
        return InEncryptedFile(where) if self.encrypted else where

    def parse(self, cli: CommandLineVars | None = None) -> Inventory:
        root = self.yaml.get_single_node()
        if _is_null(root) or (isinstance(root, ScalarNode) and not root.value.strip()):
            raise InventoryError(f"{self.path}:1: empty inventory (expected a mapping such as 'all:')")
        if not isinstance(root, MappingNode):
            self.fail(root, f"an inventory is a mapping of groups (such as 'all:'), not {_kind(root)}")
        self.check_duplicates(root, set())
        for name, key, value in self.items(root):
            self.group(name, key, value, None)
        return self.resolve(cli)

    def vars_file(self) -> LocatedVars:
        """The vars in a group_vars/ or host_vars/ file (an empty file has none)."""
        root = self.yaml.get_single_node()
        if root is not None:
            self.check_duplicates(root, set())
        return self.vars(root, "a vars file")

    def adjacent_vars(self, kind: str, names) -> dict[str, LocatedVars]:
        """name -> vars from <inventory dir>/<kind>/ ("group_vars" or "host_vars") for each of `names`."""
        base = self.path.parent / kind
        found: dict[str, LocatedVars] = {}
        for name in names if base.is_dir() else ():
            files = [base / (name + ext) for ext in _VARS_EXTENSIONS if (base / (name + ext)).is_file()]
            files += _vars_files(base / name) if (base / name).is_dir() else []
            for path in files:
                found.setdefault(name, LocatedVars()).merge(_parsed(path, _Parser.vars_file, self.decrypt))
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
        self.group_vars.setdefault(name, LocatedVars())
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
            merged = self.host_vars.setdefault(name, LocatedVars())
            if name not in self.members[group]:
                self.members[group].append(name)
            if port is not None:
                merged.set("ansible_port", port, self.at(key))
            merged.merge(own)

    def vars(self, node: Node | None, what: str) -> LocatedVars:
        """A vars mapping, its values constructed, each with its file:line; the vars fleetctl
        reads are checked at their line unless templated or vaulted (then after rendering)."""
        out = LocatedVars()
        if _is_null(node):
            return out
        if not isinstance(node, MappingNode):
            self.fail(node, f"{what} must be a mapping, not {_kind(node)}")
        for name, _, value in self.items(node):
            data = self.yaml.construct_object(value, deep=True)
            try:
                if name == "ansible_group_priority" and (not isinstance(data, int) or isinstance(data, bool)):
                    raise ValueError(f"{name} must be an integer, not {data!r}")
                data = prechecked(name, data)
            except ValueError as e:  # a decrypted value is never printed
                self.fail(value, f"{name}: the value in this vault-encrypted file is not what fleetctl needs "
                                 "here (a port number, an integer, or a string)" if self.encrypted else str(e))
            out.set(name, data, self.at(value))
        return out

    def resolve(self, cli: CommandLineVars | None = None) -> Inventory:
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
        self.group_vars.setdefault("ungrouped", LocatedVars())
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
            merged = LocatedVars()
            layers = [self.group_vars[g] for g in ordered] + [group_files.get(g, LocatedVars()) for g in ordered]
            for layer in layers:
                merged.merge(layer)
            merged.merge(own)
            merged.merge(host_files.get(host, LocatedVars()))
            merged_vars[host] = merged
        return build(self.path, merged_vars, groups, self.decrypt, cli)

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
