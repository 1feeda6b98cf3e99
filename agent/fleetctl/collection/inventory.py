"""`fleetctl inventory export`: the inventory as Ansible YAML, with what Ansible needs to connect.

fleetctl reaches a host with what OpenSSH's `ssh -G` resolves from the ssh_config it is given
(--ssh-config / $FLEETCTL_SSH_CONFIG, see connection.resolve); ansible-playbook reads no such file
unless told. So each host gets `ansible_ssh_private_key_file` (the first identity file resolved)
and `ansible_ssh_common_args: -o UserKnownHostsFile=... -o StrictHostKeyChecking=yes` (the
known_hosts files resolved, host keys still checked) before the inventory's own args (OpenSSH
keeps the first value, so a `StrictHostKeyChecking=no` there does not weaken it), on top of the
inventory's own vars as fleetctl read them (templated vars rendered, vault values left out:
Ansible decrypts its own).

The export is for ansible-playbook, not for fleetctl: fleetctl takes known_hosts files only from
ssh_config, and refuses an inventory whose args set UserKnownHostsFile (exit 4, saying to give it
the inventory the export was made from; connection/hostkey_policy.py).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import yaml

from ..connection import Session, Settings
from ..inventory import Inventory
from ..connection.describe import describe


def _plain(value: Any) -> Any:
    """A var as YAML can write it: str/int/float/bool/None, lists and dicts of those."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return str(value)


def host_vars(host, session: Session) -> dict:
    """One host's vars for Ansible: its inventory vars plus the connection details resolved by
    `ssh -G` (connection.describe). Raises ValueError naming the host when its ssh_config, or the
    host-key options of its ssh args (connection.hostkey_policy), are refused."""
    doc = describe(host, session)
    if doc["error"]:
        raise ValueError(f"{host.name}: {doc['error']}")
    out = {k: _plain(v) for k, v in host.vars.items() if type(v).__name__ != "Vaulted"}
    if doc["connection"] == "local":
        return out
    out.setdefault("ansible_host", doc["address"])
    if doc["port"]:
        out.setdefault("ansible_port", doc["port"])
    if doc["user"]:
        out.setdefault("ansible_user", doc["user"])
    keys = [p for p in doc["identity_files"] if not p.endswith((".pub",))]
    if keys and not (out.get("ansible_ssh_private_key_file") or out.get("ansible_private_key_file")):
        out["ansible_ssh_private_key_file"] = keys[0]
    known = [f for f in doc["known_hosts"] if Path(f).exists()]
    common = shlex.split(out.get("ansible_ssh_common_args") or "")  # names no known_hosts file (describe)
    if known:
        common = ["-o", "UserKnownHostsFile=" + " ".join(known), "-o", "StrictHostKeyChecking=yes", *common]
    if common:
        out["ansible_ssh_common_args"] = shlex.join(common)
    return out


def export(inv: Inventory, settings: Settings) -> str:
    """The inventory as Ansible YAML: every host under `all.hosts` with host_vars(), and every
    group's hosts under `all.children` (membership only: vars are already merged per host)."""
    with Session(settings) as session:
        hosts = {h.name: host_vars(h, session) for h in inv.hosts.values()}
    children = {g: {"hosts": {h: None for h in members}} for g, members in inv.groups.items()
                if g not in ("all", "ungrouped") and members}
    doc = {"all": {"hosts": hosts, **({"children": children} if children else {})}}
    return "# written by `fleetctl inventory export`\n" + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)
