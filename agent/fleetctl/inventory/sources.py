"""Inventory sources other than YAML, and vault secrets, through the optional extra `fleetctl[ansible]`.

Ansible reads INI files, inventory directories, executable scripts and plugin configurations
(cloud inventories); fleetctl does not reimplement them. With ansible-core installed beside
fleetctl (`pip install 'fleetctl[ansible]'`), it runs `ansible-inventory -i SRC --list` as a
program with this same interpreter and takes its groups and hostvars (Ansible's own precedence,
group_vars/ and host_vars/ of the source included), unrendered: the vars fleetctl reads are then
templated as the YAML reader's are (model.build). In that JSON a vault value is
`{"__ansible_vault": CIPHERTEXT}` and an `!unsafe` one `{"__ansible_unsafe": TEXT}`
(ansible/parsing/ajson.py, AnsibleJSONEncoder); they become Vaulted and Unsafe. Vault values are
decrypted with ansible-core's vault library (ansible/parsing/vault).
"""

from __future__ import annotations

import getpass
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .. import config
from ..errors import InventoryError
from .templates import Unsafe, Vaulted

EXTRA = "pip install 'fleetctl[ansible]'"
_STDERR_MAX = 2000  # characters of ansible-inventory's stderr quoted in an error


def available() -> bool:
    """Whether ansible-core is importable by this interpreter (the `ansible` extra is installed)."""
    return importlib.util.find_spec("ansible") is not None


def load_source(source: Path, vault: Vault | None = None) -> tuple[dict[str, dict[str, Any]],
                                                                   dict[str, tuple[str, ...]]]:
    """Read `source` with `ansible-inventory -i SOURCE --list` (ansible-core of this interpreter,
    run as `python -m ansible.cli.inventory`, within config.ANSIBLE_INVENTORY_TIMEOUT_S seconds),
    with `vault`'s secret for the vault-encrypted files of the source.

    Returns (host -> vars in Ansible's precedence, unrendered; group -> hosts, transitively, `all`
    first, then `ungrouped` when it has hosts, then the other groups depth first as
    ansible-inventory lists them).
    A source Ansible cannot parse fails (ANSIBLE_INVENTORY_UNPARSED_FAILED) instead of giving an
    empty inventory. Raises InventoryError (exit 4) when ansible-core is missing, the command
    fails or times out, or its output is not an inventory.
    """
    if not available():
        raise InventoryError(f"{source}: {_what(source)} needs ansible-core to be read: {EXTRA} (or convert "
                             f"it where Ansible is installed: ansible-inventory -i {source} --list --export -y "
                             "> hosts.yaml)")
    argv = [sys.executable, "-m", "ansible.cli.inventory", "-i", str(source), "--list"]
    vault_args, stdin = vault.inventory_args() if vault else ([], None)
    env = {**os.environ, "ANSIBLE_INVENTORY_UNPARSED_FAILED": "True",
           "ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED": "True", "ANSIBLE_NOCOLOR": "1"}
    try:
        done = subprocess.run(argv + vault_args, capture_output=True, text=True, env=env, input=stdin or "",
                              timeout=config.ANSIBLE_INVENTORY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise InventoryError(f"{source}: ansible-inventory did not finish within "
                             f"{config.ANSIBLE_INVENTORY_TIMEOUT_S:g} s") from None
    if done.returncode != 0:
        raise InventoryError(f"{source}: ansible-inventory failed (exit {done.returncode}): "
                             f"{done.stderr.strip()[-_STDERR_MAX:]!r}")
    try:
        data = json.loads(done.stdout, object_hook=_tagged)
        return _hosts_and_groups(data)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise InventoryError(f"{source}: ansible-inventory printed no inventory fleetctl can read: {e}") from None


def _what(source: Path) -> str:
    if source.is_dir():
        return "an inventory directory"
    if os.access(source, os.X_OK):
        return "an executable inventory script"
    return "an inventory that is not Ansible's YAML format (INI, or a plugin configuration)"


def _tagged(obj: dict[str, Any]) -> Any:
    """A JSON object as ansible-inventory encodes a vault or unsafe value -> Vaulted / Unsafe."""
    if obj.keys() == {"__ansible_vault"}:
        return Vaulted(obj["__ansible_vault"])
    if obj.keys() == {"__ansible_unsafe"}:
        return Unsafe(obj["__ansible_unsafe"])
    return obj


def _hosts_and_groups(data: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, tuple[str, ...]]]:
    """ansible-inventory's --list document -> (host -> vars, group -> hosts transitively)."""
    hostvars = data.get("_meta", {}).get("hostvars", {})
    order: list[str] = []

    def visit(group: str):
        if group not in order:
            order.append(group)
            for child in data.get(group, {}).get("children", []):
                visit(child)

    visit("all")

    def members(group: str, seen: set[str]) -> list[str]:
        seen.add(group)
        found = list(data.get(group, {}).get("hosts", []))
        for child in data.get(group, {}).get("children", []):
            if child not in seen:
                found += members(child, seen)
        return found

    groups = {g: tuple(dict.fromkeys(members(g, set()))) for g in order}
    if not groups.get("ungrouped"):  # Ansible always lists it; the YAML reader only when it has hosts
        groups.pop("ungrouped", None)
    return {h: dict(hostvars.get(h, {})) for h in groups["all"]}, groups


class Vault:
    """The vault secret of one run, as Ansible's --vault-password-file FILE (a file, or an
    executable printing the password) or --ask-vault-pass (typed at a prompt), read once, when
    first needed. Called as (ciphertext, var name, "file:line") -> plain text, it decrypts with
    ansible-core's vault library.
    Raises InventoryError (exit 4) when neither is given or ansible-core is missing, and, when
    called, when the secret cannot be read or a value cannot be decrypted with it.
    """

    def __init__(self, password_file: str | None = None, ask: bool = False):
        if not (password_file or ask):
            raise InventoryError("a vault secret needs --vault-password-file FILE or --ask-vault-pass")
        if not available():
            raise InventoryError(f"decrypting vault values needs ansible-core: {EXTRA}")
        self.password_file = password_file
        self._vault: Any = None
        self._password: bytes | None = None

    def password(self) -> bytes:
        """The vault password (prompted for or read from the file on first use)."""
        from ansible.errors import AnsibleError
        from ansible.parsing.dataloader import DataLoader
        from ansible.parsing.vault import VaultLib, VaultSecret, get_file_vault_secret

        if self._vault is None:
            try:
                if self.password_file:
                    secret = get_file_vault_secret(filename=self.password_file, vault_id="default",
                                                   loader=DataLoader())
                    secret.load()
                else:
                    secret = VaultSecret(getpass.getpass("Vault password: ").encode())
            except AnsibleError as e:
                raise InventoryError(f"cannot read the vault secret: {e.message}") from None
            self._vault, self._password = VaultLib([("default", secret)]), secret.bytes
        return self._password

    def __call__(self, value: Vaulted, name: str, where: str) -> str:
        from ansible.errors import AnsibleError

        self.password()
        try:
            return self._vault.decrypt(str(value)).decode("utf-8")
        except AnsibleError as e:
            raise InventoryError(f"{where}: {name}: cannot decrypt the vault value: {e.message}") from None
        except UnicodeDecodeError:
            raise InventoryError(f"{where}: {name}: the decrypted vault value is not UTF-8 text") from None

    def inventory_args(self) -> tuple[list[str], str | None]:
        """ansible-inventory's options for this secret, and what to send on its stdin: the file
        itself, or the typed password through /dev/stdin."""
        if self.password_file:
            return ["--vault-password-file", self.password_file], None
        return ["--vault-password-file", "/dev/stdin"], self.password().decode() + "\n"
