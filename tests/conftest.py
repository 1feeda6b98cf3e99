"""The suite's layout, its markers, and the fixtures its rooms share.

- tests/unit/: no root, no sshd, no network namespace, no compiler, no network (SGLang release
  wheels are read from the wheel cache that scripts/setup.sh fills); `bash scripts/test.sh --fast`
  runs them, as any user.
- tests/fleet/: the real sshd lab: hosts in network namespaces, brought up by root.
- tests/machine/: this machine for real, without the lab: compilers (the CPU kernel build), other
  users (setpriv, sudo, chown), venvs and package installs, ansible-test.

Every test is marked from where it lives (`unit`, `machine`) and from the fixtures it uses
(pytest_collection_modifyitems): `lab` for every test whose fixtures bring a lab up (each such
fixture requests `lab_machine`), `slow` for compiler and image builds (SLOW_FIXTURES). A test in
tests/unit that uses either is a usage error, and so is a test in tests/fleet that uses no lab.
The fixtures: `lab` and `server_lab` (one lab each for the whole run, made by `running_lab`, which
the modules' own labs and test_lab's own use too), and `cpu_kernel` (the run's one CPU build of
verify_attention). Beside this file: sites.py (a plugin: the change probe's test site, shared by
tests/unit and tests/machine), oracles.py (the second readings the rooms share), probe_cases.py
(the recorded fact cases under tests/unit/probes/) and count_checks.py (the suite's counts of tests
and checks, for tests/TIMINGS.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

import fleetctl
from fleetctl import lab as labmod
from fleetctl.lab import base as labbase, host as labhost
from fleetctl.wheels import cache_dir
from helpers.proc import group_pids

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
KERNELS_DIR = ROOT / "kernels"
# The suite tests this checkout, never another installed copy: pytest's `pythonpath` puts agent/
# first for this process (src/ in scripts/mutation.sh's copy), and PYTHONPATH carries that
# directory to every subprocess (probes, `python -m fleetctl.cli`, build helpers).
if not Path(fleetctl.__file__).resolve().is_relative_to(ROOT):
    raise pytest.UsageError(f"tests import fleetctl from {fleetctl.__file__}, not from this checkout {ROOT}: "
                            "run pytest from the repository root")
AGENT = Path(fleetctl.__file__).resolve().parent.parent
os.environ["PYTHONPATH"] = os.pathsep.join([str(AGENT)] + [  # once, however the caller named it
    p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != AGENT])

pytest_plugins = ["sites"]  # fixtures the rooms share

ROOMS = ("unit", "fleet", "machine")
LAB_FIXTURE = "lab_machine"
# fixtures that run a compiler or build an image (directly, or on lab hosts)
SLOW_FIXTURES = frozenset({"cpu_kernel", "clab", "deployed"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test from its room and its fixtures (see the module docstring); raises
    pytest.UsageError for a test outside the rooms, a unit test that needs the lab or a build,
    and a fleet test that brings up no lab."""
    for item in items:
        try:
            room = Path(item.path).resolve().relative_to(TESTS).parts[0]
        except ValueError:
            room = None
        if room not in ROOMS:
            raise pytest.UsageError(f"{item.nodeid}: a test lives in tests/unit, tests/fleet or tests/machine")
        used = set(item.fixturenames)
        lab, slow = LAB_FIXTURE in used, bool(used & SLOW_FIXTURES) or item.get_closest_marker("slow")
        if room == "unit" and (lab or slow):
            raise pytest.UsageError(f"{item.nodeid}: a unit test may not bring up a lab or build "
                                    f"({sorted(used & (SLOW_FIXTURES | {LAB_FIXTURE}))}): move it to "
                                    "tests/fleet or tests/machine")
        if room == "fleet" and not lab:
            raise pytest.UsageError(f"{item.nodeid}: a test in tests/fleet uses no lab (no fixture requests "
                                    f"{LAB_FIXTURE}): move it to tests/unit or tests/machine")
        if room != "fleet":
            item.add_marker(room)
        if lab:
            item.add_marker("lab")
        if slow:
            item.add_marker("slow")


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
    behaved: set[str] = field(default_factory=set)  # hosts whose stand-in was given a behaviour

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

    def add_host_vars(self, host: str, host_vars: dict) -> None:
        """Add `host_vars` to `host` in the lab's inventory, and read the lab's status again (after
        a fixture added to a host: an install layout, a container)."""
        doc = yaml.safe_load(self.inventory.read_text())
        doc["all"]["children"]["lab"]["hosts"][host].update(host_vars)
        self.inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
        self.status[:] = labmod.lab_status(self.lab_id, self.state_dir)

    def set_behavior(self, host: str, behavior: dict, restart: bool) -> None:
        """Write the stand-in server's behaviour file on `host` (read when the server starts, see
        fleetctl/lab/standin/server.py); with `restart`, restart the server now."""
        cmd = f"echo {shlex.quote(json.dumps(behavior))} > /opt/fleetctl-standin/behavior.json"
        if restart:
            # restart.sh returns at once; wait (10 s at most) until its background job has exec'd
            # past setsid and nohup, so that a facts probe right after sees the server's process,
            # not a setsid (a race seen on a loaded CI machine: "no SGLang server identified")
            cmd += (" && /opt/fleetctl-standin/restart.sh && p=$(cat /opt/fleetctl-standin/server.pid)"
                    " && for i in $(seq 100); do case $(readlink /proc/$p/exe) in"
                    " */setsid|*/nohup|'') sleep 0.1;; *) break;; esac; done")
        r = self.ssh(host, cmd)
        assert r.returncode == 0, r.stderr
        (self.behaved.add if behavior else self.behaved.discard)(host)

    def server_healthy(self, host: str, timeout: float = 1.0) -> bool:
        """Whether the host's stand-in answers GET /health with 200 within `timeout` s (asked inside
        the host's network namespace, fleetctl.lab.host.wait_server)."""
        h = next(h for h in labbase.load(self.state_dir)["hosts"] if h["name"] == host)
        try:
            labhost.wait_server(h, timeout=timeout)
        except labmod.LabError:
            return False
        return True

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


SERVER_LAB_ID = int(os.environ.get("FLEETCTL_TEST_SERVER_LAB_ID", "8"))


@pytest.fixture(scope="session", autouse=True)
def run_history(tmp_path_factory) -> Path:
    """The run's history file ($FLEETCTL_HISTORY, set in this process's environment, which the
    fleetctl runs the tests start inherit): their runs are recorded there, not in the home of
    whoever runs the suite."""
    path = tmp_path_factory.mktemp("history") / "history.sqlite"
    os.environ["FLEETCTL_HISTORY"] = str(path)
    return path


@pytest.fixture(scope="session")
def lab_machine() -> None:
    """This machine as the lab's host: root (network namespaces, bridge, sshd). Every fixture
    that brings a lab up requests it, which is how its tests are marked `lab`; skipped when not
    root (failed with FLEETCTL_REQUIRE_LAB=1)."""
    require_lab()


@contextlib.contextmanager
def running_lab(home: Path, lab_id: int, releases: list[str], hosts: int | None = None,
                with_server: bool = False) -> Iterator[Lab]:
    """A lab up for the `with` block and down after it (fleetctl.lab.lab_up/lab_down): `hosts`
    hosts (default one per release) of `releases`, with the stand-in server on each when
    `with_server`; its known_hosts and ssh_config under `home`, and the env to run the CLI with."""
    known_hosts = home / ".ssh" / "known_hosts"
    sd = labmod.state_dir_for(lab_id)
    inv = labmod.lab_up(hosts, releases, with_server=with_server, lab_id=lab_id, state_dir=sd,
                        known_hosts=known_hosts)
    try:
        ssh_config = write_ssh_config(home / "ssh_config", known_hosts)
        env = dict(os.environ, FLEETCTL_SSH_CONFIG=str(ssh_config), FLEETCTL_INVENTORY=str(inv),
                   FLEETCTL_WHEEL_CACHE=str(cache_dir()))
        status = labmod.lab_status(lab_id, sd)
        yield Lab(inv, [h["name"] for h in status], sd, env, known_hosts, ssh_config, lab_id=lab_id, status=status)
    finally:
        labmod.lab_down(lab_id, sd, known_hosts)


@pytest.fixture(scope="session")
def lab(lab_machine, tmp_path_factory) -> Iterator[Lab]:
    """Lab 7 for the whole run: the four releases 0.4.6.post5, 0.5.2, 0.5.10, 0.5.23, no servers."""
    with running_lab(tmp_path_factory.mktemp("home"), TEST_LAB_ID, labmod.DEFAULT_RELEASES) as up:
        yield up


@pytest.fixture(scope="session")
def server_lab(lab_machine, tmp_path_factory) -> Iterator[Lab]:
    """Lab 8 for the whole run: the four releases, each host running the SGLang stand-in server on
    127.0.0.1:30000 (inventory: fleetctl_sglang_port, fleetctl_restart_cmd)."""
    with running_lab(tmp_path_factory.mktemp("home-servers"), SERVER_LAB_ID, labmod.DEFAULT_RELEASES,
                     with_server=True) as up:
        yield up


@pytest.fixture
def open_tmp():
    """A fresh directory under /tmp that any uid may pass through and read (0755; pytest's own
    tmp dirs are root-only): where a test puts what a child dropped to nobody reads (probes/runas.py,
    as a host's published kernel tree is). Removed after."""
    d = Path(tempfile.mkdtemp(prefix="fleetctl-open-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def cpu_kernel(tmp_path_factory):
    """The run's one CPU build of kernels/verify_attention, made as a host makes it (the kbuild
    probe's build action, whose child runs as nobody: tests/machine runs in scripts/root-view.sh):
    first a build killed at its 6 s deadline (with a compiler cache of its own, empty: it
    compiles), then the real build in the same directory (through ccache where it is installed,
    as torch does). Returns (package, killed build's result, pids of its process group still
    alive 10 s later, the real build's result); the module is result["module_path"] (under a
    directory any uid may read, as a published build is: the reference test runs as nobody), and
    a copy of its directory serves bench/gpu_check.sh as --build-dir."""
    from fleetctl.engine.kernels.package import load_package
    from fleetctl.probes.kernel import kbuild

    pkg = load_package(KERNELS_DIR, "verify_attention")
    top = Path(tempfile.mkdtemp(prefix="fleetctl-kbuild-", dir="/tmp"))
    top.chmod(0o755)
    build_dir = top / "build"
    params = dict(action="build", src_dir=str(pkg.root), build_dir=str(build_dir), arch=None, max_jobs=2,
                  **pkg.build_params("cpu"))
    cold = tempfile.mkdtemp(prefix="fleetctl-cold-ccache-", dir="/tmp")
    os.chmod(cold, 0o755)
    try:
        killed = kbuild.main(dict(params, deadline_s=6, cache_dir=cold))
    finally:
        shutil.rmtree(cold, ignore_errors=True)
    end = time.monotonic() + 10
    while group_pids(killed["pgid"]) and time.monotonic() < end:
        time.sleep(0.2)
    leftovers = group_pids(killed["pgid"])
    ok = kbuild.main(dict(params, deadline_s=600))
    yield pkg, killed, leftovers, ok
    shutil.rmtree(top, ignore_errors=True)
