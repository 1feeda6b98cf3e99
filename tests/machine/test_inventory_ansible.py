"""Every inventory in tests/inventories/ gives the same hosts, groups and connection values in
fleetctl as in Ansible itself; vault values decrypt with ansible-core's vault library.

The `ansible` extra (pyproject.toml) is installed once into a venv in the wheel cache
(`$FLEETCTL_WHEEL_CACHE/venvs/`), which later sessions reuse; fleetctl runs there from this
checkout (PYTHONPATH, set by conftest).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

from fleetctl import wheels

ROOT = Path(__file__).resolve().parents[2]
INVENTORIES = ROOT / "tests" / "inventories"
SOURCES = ["yaml/hosts.yaml", "ini/hosts.ini", "mixed", "script/inventory.py", "bastion/hosts.yaml"]
# the vars fleetctl reads (templates.needed), spelled independently of it
NEEDED = r"ansible_(host|port|user|connection|python_interpreter|private_key_file|ssh_.*|become.*)|fleetctl_.*"

FLEETCTL_VIEW = """
import json, sys
from fleetctl import inventory
from fleetctl.inventory.templates import needed
inv = inventory.load(sys.argv[1])
print(json.dumps({"groups": {g: list(h) for g, h in inv.groups.items()}, "hosts": {
    h.name: {"vars": {k: v for k, v in h.vars.items() if needed(k)}, "groups": list(h.groups),
             "address": h.address, "port": h.port, "user": h.user, "connection": h.connection,
             "ssh_common_args": list(h.ssh_common_args), "ssh_extra_args": list(h.ssh_extra_args)}
    for h in inv.hosts.values()}}))
"""


@pytest.fixture(scope="session")
def ansible_python() -> Path:
    """The python of a venv holding the `ansible` extra, made once (under a lock) and reused."""
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["ansible"]
    key = hashlib.sha256(json.dumps([spec, sys.version]).encode()).hexdigest()[:12]
    home = wheels.cache_dir() / "venvs" / f"ansible-{key}"
    home.parent.mkdir(parents=True, exist_ok=True)
    python, ready = home / "bin" / "python", home / ".fleetctl-ready"
    with open(home.parent / f"ansible-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ready.exists():
            venv.EnvBuilder(clear=True, with_pip=True).create(home)
            subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *spec],
                           check=True, timeout=600)
            ready.touch()
    return python


def view(python: Path, *argv: str) -> dict:
    done = subprocess.run([str(python), *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("source", SOURCES)
def test_inventory_agrees_with_ansible(ansible_python, source):
    path = str(INVENTORIES / source)
    ansible = view(ansible_python, str(ROOT / "tests" / "ansible_view.py"), path, NEEDED)
    ours = view(ansible_python, "-c", FLEETCTL_VIEW, path)
    expected_groups = {g: set(h) for g, h in ansible["groups"].items() if h or g != "ungrouped"}
    assert {g: set(h) for g, h in ours["groups"].items()} == expected_groups
    assert set(ours["hosts"]) == set(ansible["hosts"]) and any(ansible["hosts"].values())
    for name, theirs in ansible["hosts"].items():
        host = ours["hosts"][name]
        assert host["vars"] == theirs, name
        assert set(host["groups"]) == {g for g, members in expected_groups.items() if name in members}
        assert host["address"] == theirs.get("ansible_host", name)
        assert (host["port"], host["user"]) == (theirs.get("ansible_port"), theirs.get("ansible_user"))
        assert host["connection"] == theirs.get("ansible_connection", "paramiko")
        # Ansible's ssh connection splits both with shlex (plugins/connection/ssh.py, _build_command)
        assert host["ssh_common_args"] == shlex.split(theirs.get("ansible_ssh_common_args", ""))
        assert host["ssh_extra_args"] == shlex.split(theirs.get("ansible_ssh_extra_args", ""))


def test_the_sources_cover_what_the_issue_names():
    """The comparison above is only as good as its inventories: each form must really be there."""
    assert "{{" in (INVENTORIES / "yaml/group_vars/gpu/10-connection.yml").read_text()
    assert "lookup(" in (INVENTORIES / "yaml/group_vars/all.yml").read_text()
    ini = (INVENTORIES / "ini/hosts.ini").read_text()
    assert all(part in ini for part in ("[01:04]", ":vars]", ":children]", "[2001:db8::8]:2201"))
    assert {p.suffix for p in (INVENTORIES / "mixed").iterdir() if p.is_file()} == {".yaml", ".ini"}
    assert (INVENTORIES / "script/inventory.py").stat().st_mode & 0o111


VAULTED = """\
all:
  hosts:
    gpu-01:
      ansible_become_password: !vault |
{cipher}
      other_secret: !vault |
{cipher}
"""

DECRYPT = """
import sys
from fleetctl import inventory
from fleetctl.inventory import sources
from fleetctl.errors import InventoryError
try:
    inv = inventory.load(sys.argv[1], sources.Vault(sys.argv[2]))
except InventoryError as e:
    print("ERROR", e)
else:
    host = inv.hosts["gpu-01"]
    print(host.vars["ansible_become_password"], type(host.vars["other_secret"]).__name__, host.user)
"""


def test_vault_values_decrypt_with_ansible_core(ansible_python, tmp_path):
    secret = tmp_path / "vault-pass"
    secret.write_text("correct horse\n")
    done = subprocess.run([str(ansible_python), "-m", "ansible.cli.vault", "encrypt_string",
                           "--vault-password-file", str(secret), "s3cret become"],
                          capture_output=True, text=True, timeout=120, check=True)
    cipher = "\n".join("        " + line.strip() for line in done.stdout.splitlines()[1:] if line.strip())
    path = tmp_path / "hosts.yaml"
    path.write_text(VAULTED.format(cipher=cipher))
    group_vars = tmp_path / "group_vars" / "all.yml"   # a vars file encrypted whole
    group_vars.parent.mkdir()
    group_vars.write_text("ansible_user: vaulted-ops\n")
    subprocess.run([str(ansible_python), "-m", "ansible.cli.vault", "encrypt", "--vault-password-file", str(secret),
                    str(group_vars)], capture_output=True, timeout=120, check=True)
    assert group_vars.read_text().startswith("$ANSIBLE_VAULT;")
    out = subprocess.run([str(ansible_python), "-c", DECRYPT, str(path), str(secret)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out == "s3cret become Vaulted vaulted-ops\n"  # a vault value fleetctl never reads stays encrypted
    secret.write_text("wrong\n")
    out = subprocess.run([str(ansible_python), "-c", DECRYPT, str(path), str(secret)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.startswith(f"ERROR {group_vars}:1: the file: cannot decrypt the vault value")
    group_vars.unlink()
    out = subprocess.run([str(ansible_python), "-c", DECRYPT, str(path), str(secret)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.startswith(f"ERROR {path}:4: ansible_become_password: cannot decrypt the vault value")


LOAD = """
import sys
from fleetctl import inventory
from fleetctl.errors import InventoryError
try:
    inventory.load(sys.argv[1])
except InventoryError as e:
    print("ERROR", e)
"""


def test_a_source_ansible_cannot_parse_is_exit_4(ansible_python, tmp_path):
    """ansible-inventory only warns on a source it cannot parse and lists no hosts; fleetctl
    makes it fail and says why."""
    path = tmp_path / "hosts.ini"
    path.write_text("[gpu\ngpu-01 ansible_user\n")
    out = subprocess.run([str(ansible_python), "-c", LOAD, str(path)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.startswith(f"ERROR {path}: ansible-inventory failed (exit 1): ")
    assert "Completely failed to parse inventory source" in out


SOURCE_WITH_VAULT = """
import sys
from fleetctl import inventory
from fleetctl.inventory import sources
sources.getpass.getpass = lambda prompt: "correct horse"   # --ask-vault-pass, answered
vault = sources.Vault(ask=True) if sys.argv[2] == "ask" else sources.Vault(sys.argv[2])
host = inventory.load(sys.argv[1], vault).hosts["gpu-01"]
print(host.user, host.vars["ansible_become_password"])
"""


@pytest.mark.parametrize("how", ["file", "ask"])
def test_ansible_source_with_an_encrypted_vars_file(ansible_python, tmp_path, how):
    """ansible-inventory gets the secret too (a file, or the typed password on its stdin), so a
    source whose group_vars file is encrypted whole loads; the vars fleetctl reads decrypt."""
    secret = tmp_path / "vault-pass"
    secret.write_text("correct horse\n")
    (tmp_path / "inv" / "group_vars").mkdir(parents=True)
    (tmp_path / "inv" / "hosts.ini").write_text("[gpu]\ngpu-01 ansible_host=10.213.250.5\n")
    group_vars = tmp_path / "inv" / "group_vars" / "gpu.yml"
    become = subprocess.run([str(ansible_python), "-m", "ansible.cli.vault", "encrypt_string",
                             "--vault-password-file", str(secret), "pw-in-vault"],
                            capture_output=True, text=True, timeout=120, check=True).stdout
    group_vars.write_text("ansible_user: ops-from-vault\nansible_become_password: " + become)
    subprocess.run([str(ansible_python), "-m", "ansible.cli.vault", "encrypt", "--vault-password-file", str(secret),
                    str(group_vars)], capture_output=True, timeout=120, check=True)
    out = subprocess.run([str(ansible_python), "-c", SOURCE_WITH_VAULT, str(tmp_path / "inv"),
                          str(secret) if how == "file" else "ask"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "ops-from-vault pw-in-vault\n"


EXPORT_SOURCE = """\
all:
  hosts:
    localhost:
      ansible_connection: local
      ansible_become_password: !vault |
{direct}
      cmdb_note: !unsafe "{{{{ lookup('pipe', 'touch {marker}') }}}}"
      cmdb_tags: [rack-7, !unsafe "{{{{ lookup('pipe', 'touch {marker}-nested') }}}}"]
    gpu-02:
      ansible_connection: local
      ansible_become_password: "{{{{ vault_sudo }}}}"
      vault_sudo: !vault |
{templated}
"""


def test_export_round_trip_keeps_secrets_vaulted_and_unsafe_inert(ansible_python, tmp_path):
    """Security review turn 3, N4 and N5, against Ansible itself: `fleetctl inventory export`
    prints neither vault secret (a `!vault` become password, one templated from a vaulted var),
    yet Ansible reading the export decrypts both; and `!unsafe` lookups, inert in the source, stay
    inert in the export (nothing is touched when Ansible templates them)."""
    secret = tmp_path / "vault-pass"
    secret.write_text("correct horse\n")

    def encrypt_string(text: str) -> str:
        done = subprocess.run([str(ansible_python), "-m", "ansible.cli.vault", "encrypt_string",
                               "--vault-password-file", str(secret), text],
                              capture_output=True, text=True, timeout=120, check=True)
        return "\n".join("        " + line.strip() for line in done.stdout.splitlines()[1:] if line.strip())

    marker = tmp_path / "lookup-ran"
    source = tmp_path / "hosts.yaml"
    source.write_text(EXPORT_SOURCE.format(direct=encrypt_string("S3cr3t-sudo-pw"),
                                           templated=encrypt_string("S3cr3t-two"), marker=marker))
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_LOCALHOST_WARNING": "False",
           "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-tmp")}

    def debug(inventory: Path, pattern: str, msg: str) -> dict:
        """host -> the message `ansible PATTERN -m debug -a '{"msg": MSG}'` printed, Ansible templating it
        (its minimal output: `HOST | SUCCESS => {JSON}` per host)."""
        done = subprocess.run([str(ansible_python), "-m", "ansible.cli.adhoc", "-i", str(inventory), pattern,
                               "-m", "debug", "-a", json.dumps({"msg": msg}), "--vault-password-file", str(secret)],
                              capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        return {m[1]: json.JSONDecoder().raw_decode(done.stdout, m.end())[0]["msg"]
                for m in re.finditer(r"^(\S+) \| SUCCESS => ", done.stdout, re.M)}

    unsafe = "{{ cmdb_note }} {{ cmdb_tags[1] }}"
    assert debug(source, "localhost", unsafe)["localhost"].startswith("{{ lookup('pipe', 'touch ")
    assert not marker.exists()  # inert in the source: the check below can tell
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host *\n  UserKnownHostsFile {tmp_path}/known_hosts\n")
    done = subprocess.run([sys.executable, "-m", "fleetctl.cli", "inventory", "export", "-i", str(source),
                           "--vault-password-file", str(secret), "--ssh-config", str(cfg)],
                          capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for plain in (b"S3cr3t-sudo-pw", b"S3cr3t-two"):
        assert plain not in done.stdout and plain not in done.stderr
    exported = tmp_path / "exported.yaml"
    exported.write_bytes(done.stdout)
    assert done.stdout.count(b"!unsafe ") == 2 and done.stdout.count(b"!vault |") == 2
    listed = subprocess.run([str(ansible_python), "-m", "ansible.cli.inventory", "-i", str(exported), "--list"],
                            capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path, check=True)
    hostvars = json.loads(listed.stdout)["_meta"]["hostvars"]
    assert set(hostvars["localhost"]["cmdb_note"]) == {"__ansible_unsafe"}
    assert set(hostvars["localhost"]["cmdb_tags"][1]) == {"__ansible_unsafe"}
    assert set(hostvars["localhost"]["ansible_become_password"]) == {"__ansible_vault"}
    assert set(hostvars["gpu-02"]["vault_sudo"]) == {"__ansible_vault"}
    assert debug(exported, "localhost", unsafe)["localhost"].startswith("{{ lookup('pipe', 'touch ")
    assert not marker.exists() and not Path(f"{marker}-nested").exists()
    assert debug(exported, "all", "{{ ansible_become_password }}") == {"localhost": "S3cr3t-sudo-pw",
                                                                      "gpu-02": "S3cr3t-two"}
