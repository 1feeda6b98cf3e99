"""`fleetctl inventory export` writes no decrypted secret and keeps `!unsafe` (security review
turn 3, N4 and N5): run as the operator runs it, with a real vault password file and values
encrypted by ansible-core's vault library (the `test` extra); `ssh -G` resolves, nothing is dialled.
The round trip through ansible-inventory and ansible itself is tests/machine/test_inventory_ansible.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from ansible.parsing.vault import VaultLib, VaultSecret

from fleetctl import inventory
from fleetctl.errors import InventoryError
from fleetctl.inventory import sources, yamlfile
from fleetctl.inventory.templates import Unsafe, Vaulted

PASSWORD = "correct horse"
VAULT = VaultLib([("default", VaultSecret(PASSWORD.encode()))])


def encrypted(text: str) -> str:
    """`text` encrypted as `ansible-vault encrypt` / `encrypt_string` write it."""
    return VAULT.encrypt(text).decode()


def vault_block(text: str, indent: int) -> str:
    """A `!vault |` value of `text`, its lines indented by `indent` spaces."""
    return "!vault |\n" + textwrap.indent(encrypted(text), " " * indent)


def export(tmp_path: Path, source: Path, *vault: str) -> tuple[subprocess.CompletedProcess, dict]:
    """Run `fleetctl inventory export -i SOURCE` (with --vault-password-file when `vault`), and the
    exported YAML read as Ansible reads it (yamlfile.Loader: `!vault` as Vaulted, `!unsafe` as Unsafe)."""
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host *\n  UserKnownHostsFile {tmp_path}/known_hosts\n")
    (tmp_path / "known_hosts").write_text("")
    argv = [sys.executable, "-m", "fleetctl.cli", "inventory", "export", "-i", str(source), "--ssh-config", str(cfg)]
    if vault:
        (tmp_path / "vault-pass").write_text(PASSWORD + "\n")
        argv += ["--vault-password-file", str(tmp_path / "vault-pass")]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r, yaml.load(r.stdout, Loader=yamlfile.Loader)


def test_no_decrypted_value_is_printed_and_what_was_vaulted_stays_usable(tmp_path):
    """N4: a `!vault` become password, one templated from a vaulted var (also through a filter and
    a chain of vars, and from another host's var), and a vaulted port: the export holds none of
    the plain texts, re-emits the ciphertexts and the templates as the inventory wrote them, names
    them on stderr, and fleetctl reading the export back gets the same passwords."""
    source = tmp_path / "hosts.yaml"
    source.write_text(textwrap.dedent("""\
        all:
          hosts:
            gpu-01:
              ansible_host: 10.213.7.11
              ansible_become_password: {direct}
            gpu-02:
              ansible_host: 10.213.7.12
              ansible_become_password: "{{{{ sudo_pw }}}}"
              sudo_pw: "{{{{ vault_sudo }}}}"
              vault_sudo: {templated}
              fleetctl_smoke_cmd: "echo {{{{ vault_sudo | upper }}}}"
            gpu-03:
              ansible_user: "{{{{ hostvars['gpu-02'].vault_sudo }}}}"
              ansible_port: {port}
        """).format(direct=vault_block("S3cr3t-sudo-pw", 8), templated=vault_block("S3cr3t-two", 8),
                    port=vault_block("2222", 8)))
    r, doc = export(tmp_path, source, "vault")
    for secret in ("S3cr3t-sudo-pw", "S3cr3t-two", "S3CR3T-TWO"):
        assert secret.encode() not in r.stdout.encode() + r.stderr.encode(), secret
    hosts = doc["all"]["hosts"]
    written = yaml.load(source.read_text(), Loader=yamlfile.Loader)["all"]["hosts"]
    assert isinstance(hosts["gpu-01"]["ansible_become_password"], Vaulted)
    assert hosts["gpu-01"]["ansible_become_password"] == written["gpu-01"]["ansible_become_password"]
    assert isinstance(hosts["gpu-02"]["vault_sudo"], Vaulted)
    assert (hosts["gpu-02"]["ansible_become_password"], hosts["gpu-02"]["sudo_pw"],
            hosts["gpu-02"]["fleetctl_smoke_cmd"]) == ("{{ sudo_pw }}", "{{ vault_sudo }}",
                                                       "echo {{ vault_sudo | upper }}")
    assert hosts["gpu-03"]["ansible_user"] == "{{ hostvars['gpu-02'].vault_sudo }}"
    assert isinstance(hosts["gpu-03"]["ansible_port"], Vaulted)
    # gpu-03's connection comes from vault values: nothing `ssh -G` derived from them is added
    assert set(hosts["gpu-03"]) == {"ansible_user", "ansible_port"}
    assert hosts["gpu-01"]["ansible_ssh_common_args"].startswith("-o UserKnownHostsFile=")  # the others still get it
    notes = r.stderr.splitlines()
    assert "fleetctl inventory export: left vaulted (`!vault`, for Ansible to decrypt with its vault secret): " \
           "ansible_become_password (gpu-01); vault_sudo (gpu-02); ansible_port (gpu-03)" in notes
    assert any(n.startswith("fleetctl inventory export: written unrendered") and n.endswith(
        ": ansible_become_password (gpu-02); fleetctl_smoke_cmd (gpu-02); ansible_user (gpu-03)") for n in notes)
    assert any("given nothing `ssh -G` resolves" in n and n.endswith(": ansible_port/ansible_user (gpu-03)")
               for n in notes), notes
    assert all(f"# {n.removeprefix('fleetctl inventory export: ')}\n" in r.stdout for n in notes)
    exported = tmp_path / "exported.yaml"
    exported.write_text(r.stdout)
    back = inventory.load(exported, sources.Vault(str(tmp_path / "vault-pass"))).hosts
    assert (back["gpu-01"].become_password, back["gpu-02"].become_password) == ("S3cr3t-sudo-pw", "S3cr3t-two")
    assert (back["gpu-03"].user, back["gpu-03"].port) == ("S3cr3t-two", 2222)


def test_vars_of_a_file_vault_encrypted_whole_are_left_out(tmp_path):
    """N4: a group_vars file encrypted whole (ansible-vault encrypt) has no ciphertext per value:
    its vars are left out, as is what `ssh -G` resolves from them (the user), and the vars
    templated from one of them are written unrendered."""
    source = tmp_path / "hosts.yaml"
    source.write_text("gpu:\n  hosts:\n    gpu-01:\n      ansible_host: 10.213.7.11\n"
                      "      ansible_become_password: '{{ vault_sudo }}'\n"
                      "      fleetctl_smoke_cmd: 'check {{ vault_sudo }}'\n")
    (tmp_path / "group_vars").mkdir()
    (tmp_path / "group_vars" / "gpu.yml").write_text(encrypted("ansible_user: vaulted-ops\nvault_sudo: pw-from-file\n"))
    r, doc = export(tmp_path, source, "vault")
    for secret in ("vaulted-ops", "pw-from-file"):
        assert secret.encode() not in r.stdout.encode() + r.stderr.encode(), secret
    host = doc["all"]["hosts"]["gpu-01"]
    assert host == {"ansible_host": "10.213.7.11", "ansible_become_password": "{{ vault_sudo }}",
                    "fleetctl_smoke_cmd": "check {{ vault_sudo }}"}
    assert any(n.startswith("fleetctl inventory export: left out: set in a file vault-encrypted whole")
               and n.endswith(": ansible_user (gpu-01); vault_sudo (gpu-01)") for n in r.stderr.splitlines()), r.stderr


def test_unsafe_stays_unsafe_at_any_depth(tmp_path):
    """N5: `!unsafe` values are written `!unsafe` (in lists and mappings too), a rendered value
    that holds template text from one is written `!unsafe` (rendered values are final), a
    nested `!vault` stays vaulted, and a template the inventory left live stays live."""
    source = tmp_path / "hosts.yaml"
    source.write_text(textwrap.dedent("""\
        all:
          hosts:
            gpu-01:
              ansible_connection: local
              cmdb_note: !unsafe "{{ lookup('pipe', 'id') }}"
              tags:
                - plain
                - !unsafe "{{ a }}"
                - deep: !unsafe "{% b %}"
                  token: {token}
              ansible_python_interpreter: !unsafe "/opt/{{ weird }}/bin/python"
              note: !unsafe "{{ evil }}"
              fleetctl_smoke_cmd: "echo {{ note }}"
              live: "{{ inventory_hostname }}"
        """).replace("{token}", vault_block("nested", 12)))
    r, doc = export(tmp_path, source)
    host = doc["all"]["hosts"]["gpu-01"]
    assert type(host["cmdb_note"]) is Unsafe and host["cmdb_note"] == "{{ lookup('pipe', 'id') }}"
    assert [type(t) for t in host["tags"][:2]] == [str, Unsafe]
    assert type(host["tags"][2]["deep"]) is Unsafe and type(host["tags"][2]["token"]) is Vaulted
    assert type(host["ansible_python_interpreter"]) is Unsafe and type(host["note"]) is Unsafe
    assert type(host["fleetctl_smoke_cmd"]) is Unsafe and host["fleetctl_smoke_cmd"] == "echo {{ evil }}"
    assert type(host["live"]) is str and host["live"] == "{{ inventory_hostname }}"
    assert "left vaulted (`!vault`, for Ansible to decrypt with its vault secret): tags (gpu-01)" in r.stderr


def test_a_var_name_cannot_end_the_note_comment(tmp_path):
    """The notes atop the YAML name vars: a name holding a line break is escaped, so it cannot
    add a line, or a var, to the export."""
    source = tmp_path / "hosts.yaml"
    source.write_text(f'all:\n  hosts:\n    gpu-01:\n      ansible_connection: local\n'
                      f'      "x\\nevil: 1\\u2028e2: 2": {vault_block("v", 8)}\n')
    r, doc = export(tmp_path, source)
    header = r.stdout.split("all:\n")[0]
    assert all(line.startswith("# ") for line in header.splitlines()), header
    assert "x\\nevil: 1\\u2028e2: 2 (gpu-01)" in header
    assert list(doc) == ["all"]
    assert list(doc["all"]["hosts"]["gpu-01"]) == ["ansible_connection", "x\nevil: 1\u2028e2: 2"]


def test_a_bad_value_in_a_file_vault_encrypted_whole_is_not_printed(tmp_path):
    """The refusal of a var fleetctl reads names its file, line and var, never the decrypted value
    (as for a bad `!vault` value, tests/unit/test_inventory.py)."""
    source = tmp_path / "hosts.yaml"
    source.write_text("gpu:\n  hosts:\n    gpu-01:\n")
    group_vars = tmp_path / "group_vars" / "gpu.yml"
    group_vars.parent.mkdir()
    group_vars.write_text(encrypted("ansible_user: ops\nansible_port: hunter2-port\n"))
    (tmp_path / "vault-pass").write_text(PASSWORD + "\n")
    with pytest.raises(InventoryError) as refused:
        inventory.load(source, sources.Vault(str(tmp_path / "vault-pass")))
    assert str(refused.value) == (f"{group_vars}:2: ansible_port: the value in this vault-encrypted file is not what fleetctl "
                     "needs here (a port number, an integer, or a string)")


def test_a_bad_value_rendered_from_a_vault_value_is_not_printed(tmp_path):
    """`ansible_port: "{{ vault_port }}"` whose vaulted value is no port: the refusal names the
    file:line and the var, never the decrypted text nor what it rendered."""
    source = tmp_path / "hosts.yaml"
    source.write_text("all:\n  hosts:\n    gpu-01:\n      ansible_port: \"{{ vault_port | upper }}\"\n"
                      f"      vault_port: {vault_block('hunter2-port', 8)}\n")
    (tmp_path / "vault-pass").write_text(PASSWORD + "\n")
    with pytest.raises(InventoryError) as refused:
        inventory.load(source, sources.Vault(str(tmp_path / "vault-pass")))
    assert "hunter2" not in str(refused.value).lower()
    assert str(refused.value).startswith(f"{source}:4: ansible_port: the value rendered from a vault value is not")


@pytest.mark.parametrize("kind", ["ini", "directory"])
def test_a_source_ansible_inventory_reads_with_a_vars_file_encrypted_whole_is_not_exported(tmp_path, kind):
    """ansible-inventory hands the vars of a vars file vault-encrypted whole over decrypted: an
    INI file or an inventory directory beside such a group_vars file is refused (exit 4) naming
    the file, and nothing of it is printed (red-team finding on N4; Ansible's usual
    group_vars/all/vault.yml)."""
    src = tmp_path / "inv"
    (src / "group_vars" / "all").mkdir(parents=True)
    (src / "hosts.ini").write_text("[gpus]\ngpu-01 ansible_host=10.213.7.11\n")
    vault = src / "group_vars" / "all" / "vault.yml"
    vault.write_text(encrypted("ansible_become_password: S3cret-BECOME-INFILE\n"))
    (tmp_path / "vault-pass").write_text(PASSWORD + "\n")
    source = src / "hosts.ini" if kind == "ini" else src
    r = subprocess.run([sys.executable, "-m", "fleetctl.cli", "inventory", "export", "-i", str(source),
                        "--vault-password-file", str(tmp_path / "vault-pass")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 4, r.stderr
    assert f"{vault}: vault-encrypted whole" in r.stderr and "read through ansible-inventory" in r.stderr
    assert "S3cret" not in r.stdout + r.stderr
