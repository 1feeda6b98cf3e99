"""Shared fixtures: `lab`, one lab of real SSH hosts (lab id 7, or $FLEETCTL_TEST_LAB_ID so
that two test sessions can run side by side) for the whole test session."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

import fleetctl
from fleetctl import lab as labmod
from fleetctl.wheelcache import cache_dir

KERNELS_DIR = Path(__file__).resolve().parents[1] / "kernels"

ROOT = Path(__file__).resolve().parent.parent
# The suite tests this checkout, never another installed copy: pytest's `pythonpath` puts agent/
# first for this process (src/ in scripts/mutation.sh's copy), and PYTHONPATH carries that
# directory to every subprocess (probes, `python -m fleetctl.cli`, build helpers).
if not Path(fleetctl.__file__).resolve().is_relative_to(ROOT):
    raise pytest.UsageError(f"tests import fleetctl from {fleetctl.__file__}, not from this checkout {ROOT}: "
                            "run pytest from the repository root")
os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(fleetctl.__file__).resolve().parent.parent)] + [
    p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

TEST_LAB_ID = int(os.environ.get("FLEETCTL_TEST_LAB_ID", "7"))


def missing(what: str, env: str) -> None:
    """Skip the test for lack of `what`; with `env`=1 (CI sets it) fail it instead, so that a
    machine that cannot run these tests never reports green."""
    if os.environ.get(env) == "1":
        pytest.fail(f"{what} ({env}=1: required here)", pytrace=False)
    pytest.skip(what)


def require_lab() -> None:
    """The lab needs root (network namespaces, bridge, sshd); see missing()."""
    if os.geteuid() != 0:
        missing("lab tests need root (network namespaces, bridge, sshd): run pytest as root",
                "FLEETCTL_REQUIRE_LAB")


@dataclass
class Lab:
    """A running lab: its inventory, host names, state dir, and an env for subprocesses
    (FLEETCTL_SSH_CONFIG names `ssh_config`, whose UserKnownHostsFile holds exactly the lab's host
    keys: tests isolate with the ssh_config, never by changing HOME)."""

    inventory: Path
    hosts: list[str]
    state_dir: Path
    env: dict[str, str]
    known_hosts: Path
    ssh_config: Path
    lab_id: int = TEST_LAB_ID
    status: list[dict] = field(default_factory=list)

    def settings(self, **kw):
        """fleetctl.connection.Settings that read this lab's ssh_config (and so its known_hosts)."""
        from fleetctl.connection import Settings
        return Settings(ssh_config=self.ssh_config, **kw)

    def fault(self, host: str, kind: str, arg=None) -> dict:
        """Inject or clear a fault (see fleetctl.lab.lab_fault)."""
        return labmod.lab_fault(host, kind, arg, lab_id=self.lab_id, state_dir=self.state_dir)

    def address(self, host: str) -> str:
        """The host's inventory address."""
        return next(h["address"] for h in self.status if h["name"] == host)

    def pids(self, host: str) -> list[int]:
        """Processes on the host other than the lab's own machinery (fleetctl.lab.host_pids)."""
        return labmod.host_pids(host, lab_id=self.lab_id, state_dir=self.state_dir)

    def set_behavior(self, host: str, behavior: dict, restart: bool) -> None:
        """Write the stand-in server's behaviour file on `host` (read when the server starts, see
        fleetctl/standin/server.py); with `restart`, restart the server now."""
        cmd = f"echo {shlex.quote(json.dumps(behavior))} > /opt/fleetctl-standin/behavior.json"
        if restart:
            cmd += " && /opt/fleetctl-standin/restart.sh"
        r = self.ssh(host, cmd)
        assert r.returncode == 0, r.stderr

    def cli(self, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        """Run the fleetctl CLI as a user would: this lab's ssh_config and inventory, plus `env`."""
        return subprocess.run([sys.executable, "-m", "fleetctl.cli", *args], capture_output=True, text=True,
                              env={**self.env, **(env or {})}, timeout=timeout)

    def cli_json(self, *args: str, env: dict | None = None, timeout: float = 300, rc: int | None = None):
        """cli(*args, "--json") -> (process, JSON document, {host name: its entry}); a run that
        prints no JSON fails the test with its output, and so does an exit status other than
        `rc` (when given), with each host's status, error and failed gate checks."""
        r = self.cli(*args, "--json", env=env, timeout=timeout)
        try:
            doc = json.loads(r.stdout)
        except json.JSONDecodeError:
            raise AssertionError(f"no JSON (exit {r.returncode}): {r.stdout[-2000:]} {r.stderr[-2000:]}") from None
        hosts = {h["host"]: h for h in doc["hosts"]}
        if rc is not None and r.returncode != rc:
            raise AssertionError(f"exit {r.returncode}, not {rc}: {host_outcomes(hosts)} {r.stderr[-2000:]}")
        return r, doc, hosts

    def ssh(self, host: str, command: str, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        """Run `command` on `host` with the OpenSSH client, strict host-key checking on."""
        return subprocess.run(
            ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
             "-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "ConnectTimeout=5",
             "-i", str(self.state_dir / "client_ed25519"), f"root@{self.address(host)}", command],
            capture_output=True, text=True, timeout=timeout, env=self.env, **kw)


def kernel_variant(tmp_path: Path, name: str, edit=None) -> Path:
    """A copy of kernels/ whose verify_attention differs (new build key), optionally broken."""
    root = tmp_path / name
    shutil.copytree(KERNELS_DIR, root, ignore=shutil.ignore_patterns("__pycache__"))
    readme = root / "verify_attention" / "README.md"
    readme.write_text(readme.read_text() + f"\n<!-- variant {name} -->\n")
    if edit:
        edit(root / "verify_attention")
    return root


def become_inventory(lab: Lab, path: Path, **per_host: dict) -> str:
    """Write an inventory at `path` of the lab hosts named in `per_host`, each with its lab vars,
    `ansible_become: true` and the given vars (ansible_user: one of labmod.become_users, say)."""
    hosts = yaml.safe_load(lab.inventory.read_text())["all"]["children"]["lab"]["hosts"]
    doc = {"all": {"hosts": {h: {**hosts[h], "ansible_become": True, **v} for h, v in per_host.items()}}}
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def host_outcomes(hosts: dict) -> dict:
    """{host: (status, error, [failed gate checks])} from a --json report's host entries."""
    def failed(entry):
        checks = (entry.get("validation") or {}).get("checks") or []
        return [c for c in checks if not c.get("passed")]
    return {h: (e.get("status"), e.get("error"), failed(e)) for h, e in hosts.items()}


def write_ssh_config(path: Path, known_hosts: Path, extra: str = "") -> Path:
    """An ssh_config at `path` whose every host uses `known_hosts`, after `extra` Host blocks."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{extra}Host *\n  UserKnownHostsFile {known_hosts}\n")
    return path


def one_host_lab(inv: Path, sd: Path, home: Path, known_hosts: Path, lab_id: int, host_vars: dict) -> Lab:
    """A module's own one-host lab (lab-01, up): `host_vars` added to its inventory, an
    ssh_config under `home` whose known_hosts is `known_hosts`, and the env to run the CLI with."""
    doc = yaml.safe_load(inv.read_text())
    doc["all"]["children"]["lab"]["hosts"]["lab-01"].update(host_vars)
    inv.write_text(yaml.safe_dump(doc, sort_keys=False))
    ssh_config = write_ssh_config(home / "ssh_config", known_hosts)
    env = dict(os.environ, FLEETCTL_SSH_CONFIG=str(ssh_config), FLEETCTL_INVENTORY=str(inv),
               FLEETCTL_WHEEL_CACHE=str(cache_dir()))
    return Lab(inv, ["lab-01"], sd, env, known_hosts, ssh_config, lab_id=lab_id, status=labmod.lab_status(lab_id, sd))


@pytest.fixture(scope="session")
def lab(tmp_path_factory) -> Iterator[Lab]:
    """Bring up the test lab (four hosts, releases 0.4.6.post5, 0.5.2, 0.5.10, 0.5.23, no servers)
    once per session; skipped when not root (failed with FLEETCTL_REQUIRE_LAB=1)."""
    require_lab()
    home = tmp_path_factory.mktemp("home")
    known_hosts = home / ".ssh" / "known_hosts"
    sd = labmod.state_dir_for(TEST_LAB_ID)
    inv = labmod.lab_up(None, labmod.DEFAULT_RELEASES, lab_id=TEST_LAB_ID, state_dir=sd,
                        known_hosts=known_hosts)
    ssh_config = write_ssh_config(home / "ssh_config", known_hosts)
    env = dict(os.environ, FLEETCTL_SSH_CONFIG=str(ssh_config), FLEETCTL_INVENTORY=str(inv),
               FLEETCTL_WHEEL_CACHE=str(cache_dir()))
    status = labmod.lab_status(TEST_LAB_ID, sd)
    try:
        yield Lab(inv, [h["name"] for h in status], sd, env, known_hosts, ssh_config, status=status)
    finally:
        labmod.lab_down(TEST_LAB_ID, sd, known_hosts)


SERVER_LAB_ID = int(os.environ.get("FLEETCTL_TEST_SERVER_LAB_ID", "8"))


@pytest.fixture(scope="session")
def server_lab(tmp_path_factory) -> Iterator[Lab]:
    """Lab 8: the four releases, each host running the SGLang stand-in server on 127.0.0.1:30000
    (inventory: fleetctl_sglang_port, fleetctl_restart_cmd); skipped when not root (failed with
    FLEETCTL_REQUIRE_LAB=1)."""
    require_lab()
    home = tmp_path_factory.mktemp("home-servers")
    known_hosts = home / ".ssh" / "known_hosts"
    sd = labmod.state_dir_for(SERVER_LAB_ID)
    inv = labmod.lab_up(None, labmod.DEFAULT_RELEASES, with_server=True, lab_id=SERVER_LAB_ID, state_dir=sd,
                        known_hosts=known_hosts)
    ssh_config = write_ssh_config(home / "ssh_config", known_hosts)
    env = dict(os.environ, FLEETCTL_SSH_CONFIG=str(ssh_config), FLEETCTL_INVENTORY=str(inv),
               FLEETCTL_WHEEL_CACHE=str(cache_dir()))
    status = labmod.lab_status(SERVER_LAB_ID, sd)
    try:
        yield Lab(inv, [h["name"] for h in status], sd, env, known_hosts, ssh_config, lab_id=SERVER_LAB_ID,
                  status=status)
    finally:
        labmod.lab_down(SERVER_LAB_ID, sd, known_hosts)
