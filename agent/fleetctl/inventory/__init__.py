"""The inventory: which source reads a path, and the names the rest of fleetctl uses.

An inventory file in Ansible's YAML format is read by fleetctl itself (yamlfile: the format, the
vars files beside it and Ansible's vars precedence, errors with file and line). Other sources
(INI, directories, scripts, plugins) come from `ansible-inventory` (sources). Either way the vars
fleetctl reads are templated as Ansible templates them (templates) and checked once rendered, and
become Hosts of an Inventory (model), whose host patterns are Ansible's (patterns).
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from yaml.nodes import MappingNode, ScalarNode

from ..errors import InventoryError
from . import sources, yamlfile
from .model import CommandLineVars, Decrypt, Host, Inventory, LocatedVars, build, prechecked

__all__ = ["DEFAULT_PATH", "ENV_VAR", "CommandLineVars", "Host", "Inventory", "is_host_list", "is_yaml_inventory",
           "load", "load_host_list", "resolve_path"]

ENV_VAR = "FLEETCTL_INVENTORY"
DEFAULT_PATH = "hosts.yaml"


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


def is_host_list(source: str) -> bool:
    """Whether `-i source` is a host list: a comma in it, and no such path (Ansible's host_list
    inventory plugin, verify_file: "not os.path.exists(host_list) and ',' in host_list";
    `-i host1,` is a list of one host)."""
    return "," in source and not os.path.exists(os.path.expanduser(source))


def load_host_list(source: str, cli: CommandLineVars | None = None) -> Inventory:
    """The Inventory of a host list (`-i 'gpu-01,10.213.250.5:2222,[fe80::1]:22,'`): each non-empty
    item a host in `all` and `ungrouped`, named as written; `NAME:PORT` sets ansible_port (as
    Ansible's host_list plugin parses it), `[IPV6]:PORT` too. `cli`: the command line's vars
    (model.CommandLineVars). Raises InventoryError (exit 4) for an empty list or a bad port."""
    merged: dict[str, LocatedVars] = {}
    for item in (w.strip() for w in source.split(",")):
        if not item:
            continue
        name, port = item, None
        head, sep, tail = item.rpartition(":")
        if sep and tail.isdigit() and (head.count(":") == 0 or head.startswith("[") and head.endswith("]")):
            name, port = head.strip("[]"), tail
        where = f"-i {source!r}: host {item}"
        merged[name] = LocatedVars()
        if port is not None:
            try:
                merged[name].set("ansible_port", prechecked("ansible_port", port), where)
            except ValueError as e:
                raise InventoryError(f"{where}: {e}") from None
    if not merged:
        raise InventoryError(f"-i {source!r}: a host list with no host in it")
    names = tuple(merged)
    return build(Path(source), merged, {"all": names, "ungrouped": names}, None, cli)


def load(path: Path, decrypt: Decrypt = None, cli: CommandLineVars | None = None) -> Inventory:
    """Read an inventory source into an Inventory.

    Ansible's YAML inventory format is read by the YAML reader (yamlfile.load: the vars files
    beside it, Ansible's precedence, its errors). Any other source (a directory, an executable
    script starting with `#!`, a plugin configuration with `plugin:`, a file that is not a YAML
    mapping, such as INI) is read through ansible-inventory (sources.load_source, given the
    secret when `decrypt` is a sources.Vault); without ansible-core that is exit 4 saying
    what to install.
    Either way the vars fleetctl reads are then templated (templates) and vault values among
    them decrypted with `decrypt` (Vaulted, var name, "file:line" -> plain text; model.build).
    Raises InventoryError (exit 4) "<file>[:<line>[:<col>]]: <what>" for a source that cannot be
    read or is bad (yamlfile.load lists the YAML reader's), and for a var fleetctl reads that
    cannot be templated, is not what fleetctl needs (a port number, a plain string, one of
    config.CONNECTIONS) or is vault-encrypted while `decrypt` is None. `cli`: the command
    line's vars, under and over the source's (model.CommandLineVars).
    """
    path = Path(path)
    if is_yaml_inventory(path):
        return yamlfile.load(path, decrypt, cli)
    hosts, groups = sources.load_source(path, decrypt if isinstance(decrypt, sources.Vault) else None)
    merged = {}
    for host, values in hosts.items():
        merged[host] = LocatedVars()
        for name, value in values.items():
            where = f"{path}: host {host} (as ansible-inventory reads it)"
            try:
                merged[host].set(name, prechecked(name, value), where)
            except ValueError as e:
                raise InventoryError(f"{where}: {e}") from None
    return build(path, merged, groups, decrypt, cli)


def is_yaml_inventory(path: Path) -> bool:
    """Whether `path` is for the YAML reader: a file with a YAML suffix that is not a plugin
    configuration or a script (a broken one is reported by the YAML reader, with its line), or
    any other file holding a YAML mapping of groups."""
    if not path.is_file():
        return False
    try:
        with path.open("rb") as f:
            if f.read(2) == b"#!" and os.access(path, os.X_OK):
                return False
        root = yaml.compose(path.read_text(encoding="utf-8"), Loader=yamlfile.Loader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return path.suffix in yamlfile.SUFFIXES
    if isinstance(root, MappingNode):
        return not any(isinstance(k, ScalarNode) and k.value == "plugin" for k, _ in root.value)
    return path.suffix in yamlfile.SUFFIXES
