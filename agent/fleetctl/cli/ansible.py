"""The commands that hand fleetctl's view to Ansible: `inventory export` (the inventory as
ansible-playbook reads it) and `collection build` (the collection fleetctl.sglang)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from .. import config
from .options import AskVaultPass, ConnectTimeout, InventoryOpt, SshConfig, VaultPasswordFile, load_inventory, settings

inventory_app = typer.Typer(no_args_is_help=True, help="The inventory, for other tools.")
collection_app = typer.Typer(no_args_is_help=True, help="The Ansible collection fleetctl.sglang.")


@inventory_app.command("export")
def inventory_export(inventory: InventoryOpt = None, vault_password_file: VaultPasswordFile = None,
                     ask_vault_pass: AskVaultPass = False, ssh_config: SshConfig = None,
                     connect_timeout: ConnectTimeout = config.CONNECT_TIMEOUT_S) -> None:
    """Print the inventory (lab hosts included) as Ansible YAML, with the connection details
    ansible-playbook needs (ansible_ssh_private_key_file, ansible_ssh_common_args: -o
    UserKnownHostsFile=...) resolved from the ssh_config fleetctl reads. No decrypted value is
    printed: `!vault` values stay vaulted, vars rendered from them are written unrendered, vars
    of files vault-encrypted whole are left out, `!unsafe` stays `!unsafe`; stderr names them."""
    from ..collection.inventory import export, refuse_decrypted_vars_files
    from ..errors import ParseError
    from ..inventory import resolve_path
    from ..inventory.templates import templars

    refuse_decrypted_vars_files(resolve_path(str(inventory) if inventory else None))
    with templars() as made:
        loaded = load_inventory(inventory, vault_password_file, ask_vault_pass)
    (templar,) = made
    try:
        text, notes = export(loaded, templar, settings(connect_timeout, False, ssh_config))
    except ValueError as e:
        raise ParseError(str(e)) from None
    for note in notes:
        typer.echo(f"fleetctl inventory export: {note}", err=True)
    sys.stdout.write(text)


@collection_app.command("build")
def collection_build(out: Annotated[Optional[str], typer.Option(
        "--out", help="Put a complete copy in OUT/ansible_collections/fleetctl/sglang (default: generate in place).")]
        = None) -> None:
    """Generate the collection's plugins/module_utils from fleetctl's probes (never committed);
    prints the collection's root."""
    from ..collection import build

    typer.echo(str(build.build(Path(out) if out else None)))
