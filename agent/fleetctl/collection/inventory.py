"""`fleetctl inventory export`: the inventory as Ansible YAML, with what Ansible needs to connect.

fleetctl reaches a host with what OpenSSH's `ssh -G` resolves from the ssh_config it is given
(--ssh-config / $FLEETCTL_SSH_CONFIG, see connection.resolve); ansible-playbook reads no such file
unless told. So each host gets `ansible_ssh_private_key_file` (the first identity file resolved)
and `ansible_ssh_common_args: -o UserKnownHostsFile=... -o StrictHostKeyChecking=yes` (the
known_hosts files resolved, host keys still checked) before the inventory's own args (OpenSSH
keeps the first value, so a `StrictHostKeyChecking=no` there does not weaken it), on top of the
inventory's own vars as fleetctl read them.

The export writes no decrypted secret and no text Ansible would template that the inventory
kept from templating, since it goes to CI logs, tickets and git:
- a `!vault` value is written as `!vault |` (its ciphertext, for Ansible to decrypt), and `!unsafe`
  as `!unsafe`, at any depth of lists and mappings (YAML representers, _Dumper);
- a var fleetctl renders (templates.needed) whose rendered value came from a vault value
  (templates.Templar.from_vault: a `!vault` value, or a template reading one through any chain of
  vars) is written as the inventory wrote it (its `!vault` ciphertext, or its template text, for
  Ansible to render), as are the become passwords (ansible_become_password, ansible_become_pass,
  ansible_sudo_pass) always: never rendered;
- a var set in a file vault-encrypted whole (ansible-vault encrypt) is left out: only its
  decrypted text exists;
- a rendered value that still holds a Jinja2 marker (it came from an `!unsafe` value) is
  written `!unsafe`: a rendered value is final;
- a host whose connection vars came from vault values gets none of the `ssh -G` details above
  (they are derived from the secret).
What was left vaulted, unrendered or out is said on stderr and at the top of the YAML, by var and
host name, never by value. Other vars are written as the inventory wrote them.

The export is for ansible-playbook, not for fleetctl: fleetctl takes known_hosts files only from
ssh_config, and refuses an inventory whose args set UserKnownHostsFile (exit 4, saying to give it
the inventory the export was made from; connection/hostkey_policy.py).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import yaml

from .. import config
from ..connection import Session, Settings
from ..connection.describe import describe
from ..errors import InventoryError
from ..inventory import Host, Inventory, is_yaml_inventory
from ..inventory.templates import InEncryptedFile, Templar, Unsafe, Vaulted, is_template, needed

# Ansible's sudo become plugin's password vars (ansible/plugins/become/sudo.py, become_pass).
BECOME_PASSWORDS = ("ansible_become_password", "ansible_become_pass", "ansible_sudo_pass")
# The vars `ssh -G` is given for a host (connection/resolve.py, resolve_host; session.kind_for):
# what the export adds from its answer derives from their values.
CONNECTION_VARS = ("ansible_connection", *(n for v in config.SSH_VARS for n in v.names))
# Why a var is not written as fleetctl rendered it (the notes on stderr and atop the YAML).
VAULTED = "left vaulted (`!vault`, for Ansible to decrypt with its vault secret)"
UNRENDERED = ("written unrendered, as the inventory wrote them (their rendered values come from vault "
              "values; Ansible renders them)")
LEFT_OUT = ("left out: set in a file vault-encrypted whole, whose values exist only decrypted (give Ansible "
            "that file in group_vars/ or host_vars/ beside the exported inventory)")
NOT_RESOLVED = ("given nothing `ssh -G` resolves (address, port, user, identity file, known_hosts options): "
                "it derives from connection vars whose values come from vault values (Ansible's own host key "
                "checking applies)")


class _Dumper(yaml.SafeDumper):
    """yaml.safe_dump's writer, plus Ansible's tags (ansible/parsing/yaml/constructor.py):
    Unsafe as `!unsafe`, Vaulted as `!vault |`."""


_Dumper.add_representer(Unsafe, lambda dumper, value: dumper.represent_scalar("!unsafe", str(value)))
_Dumper.add_representer(Vaulted, lambda dumper, value: dumper.represent_scalar("!vault", str(value), style="|"))


def _yaml(value: Any, rendered: bool) -> Any:
    """`value` as the export writes it: lists and mappings walked, Vaulted and Unsafe kept (their
    tags), None/bool/int/float as they are, anything else its text; when `rendered`, a string that
    still holds a Jinja2 marker becomes Unsafe (a rendered value is final)."""
    if isinstance(value, (list, tuple)):
        return [_yaml(v, rendered) for v in value]
    if isinstance(value, dict):
        return {(k if isinstance(k, str) else str(k)): _yaml(v, rendered) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, Unsafe, Vaulted)):
        return value
    text = str(value)
    return Unsafe(text) if rendered and is_template(text) else text


def _holds_vaulted(value: Any) -> bool:
    """Whether `value` is, or holds at any depth, a Vaulted."""
    if isinstance(value, (list, tuple)):
        return any(map(_holds_vaulted, value))
    if isinstance(value, dict):
        return any(map(_holds_vaulted, value.values()))
    return isinstance(value, Vaulted)


def _written(host: Host, name: str, templar: Templar) -> tuple[Any, str | None]:
    """What the export writes for the var `name` of `host` (None when LEFT_OUT) and why it is not
    what the inventory wrote, or fleetctl rendered (VAULTED, UNRENDERED, LEFT_OUT; None: it is)."""
    raw = templar.raw[host.name][name]
    if isinstance(templar.where[host.name][name], InEncryptedFile):
        return None, LEFT_OUT
    from_vault = templar.from_vault(host.name, name)
    if needed(name) and not (from_vault or name in BECOME_PASSWORDS):
        return _yaml(host.vars[name], rendered=True), None
    why = VAULTED if _holds_vaulted(raw) else UNRENDERED if needed(name) and from_vault else None
    return _yaml(raw, rendered=False), why


def host_vars(host: Host, templar: Templar, session: Session) -> tuple[dict, list[tuple[str, str]]]:
    """One host's vars for Ansible: its inventory vars (_written; `templar` is the one its
    inventory was loaded with, templates.templars) plus the connection details resolved by `ssh -G`
    (connection.describe), and the notes [(why, var name)] on what is not written as rendered.
    Raises ValueError naming the host when its ssh_config, or the host-key options of its ssh args
    (connection.hostkey_policy), are refused."""
    doc = describe(host, session)
    if doc["error"]:
        raise ValueError(f"{host.name}: {doc['error']}")
    out, notes = {}, []
    for name in host.vars:
        value, why = _written(host, name, templar)
        if why:
            notes.append((why, name))
        if why != LEFT_OUT:
            out[name] = value
    if doc["connection"] == "local":
        return out, notes
    secret = [n for n in CONNECTION_VARS if n in host.vars and templar.from_vault(host.name, n)]
    if secret:
        return out, notes + [(NOT_RESOLVED, "/".join(secret))]
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
        out["ansible_ssh_common_args"] = _yaml(shlex.join(common), rendered=True)
    return out, notes


def refuse_decrypted_vars_files(source: Path) -> None:
    """Refuse (InventoryError, exit 4) to export `source` when it is read through
    ansible-inventory (inventory.is_yaml_inventory is False: INI, a directory, a script, a plugin)
    and a vars file beside it (group_vars/, host_vars/ of its directory, at any depth) is
    vault-encrypted whole: `ansible-inventory --list` hands those vars over already decrypted, so
    nothing tells them from plain ones (red-team finding on N4). The YAML reader knows them."""
    if is_yaml_inventory(source):
        return
    base = source if source.is_dir() else source.parent
    for sub in ("group_vars", "host_vars"):
        for f in sorted((base / sub).rglob("*")) if (base / sub).is_dir() else []:
            try:
                with f.open("rb") as fh:
                    head = fh.read(14) if f.is_file() and not f.is_symlink() else b""
            except OSError:
                continue
            if head.startswith(b"$ANSIBLE_VAULT"):
                raise InventoryError(
                    f"{f}: vault-encrypted whole, and {source} is read through ansible-inventory, which hands its "
                    "vars over decrypted: not exported (no decrypted value is ever printed); give Ansible this "
                    "source itself, or export a YAML inventory (fleetctl's own reader keeps such vars out)")


def export(inv: Inventory, templar: Templar, settings: Settings) -> tuple[str, list[str]]:
    """The inventory as Ansible YAML, and the notes on what it left vaulted, unrendered or out
    (lines naming vars and hosts, never values, unprintable characters escaped; also at the top
    of the YAML). Every host is under
    `all.hosts` with host_vars(), every group's hosts under `all.children` (membership only: vars
    are already merged per host). `templar` is the one `inv` was loaded with (templates.templars).
    Raises ValueError as host_vars does."""
    hosts, seen = {}, {}
    with Session(settings) as session:
        for h in inv.hosts.values():
            hosts[h.name], notes = host_vars(h, templar, session)
            for why, name in notes:
                seen.setdefault(why, {}).setdefault(name, []).append(h.name)
    children = {g: {"hosts": {h: None for h in members}} for g, members in inv.groups.items()
                if g not in ("all", "ungrouped") and members}
    doc = {"all": {"hosts": hosts, **({"children": children} if children else {})}}
    lines = [_printable(f"{why}: " + "; ".join(f"{name} ({_hosts(names)})" for name, names in by_name.items()))
             for why, by_name in seen.items()]
    return ("# written by `fleetctl inventory export`\n" + "".join(f"# {line}\n" for line in lines)
            + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False), lines)


def _hosts(names: list[str], shown: int = 5) -> str:
    """Host names for a note: the first `shown`, then how many more."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


def _printable(text: str) -> str:
    """`text` with every character that is not printable (a line break among them) escaped, so a
    var or host name cannot end a YAML comment."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
