"""The lab's names and paths, its state file (<state_dir>/lab.json) and the small helpers every
part of it uses: commands run or spawned, liveness of a pid, the root check, an SSH banner."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..errors import FleetctlError, UsageError

DEFAULT_RELEASES = ["0.4.6.post5", "0.5.2", "0.5.10", "0.5.23"]
SSHD = "/usr/sbin/sshd"
STANDIN_SRC = Path(__file__).with_name("standin")
SERVER_PORT = 30000
# The stand-in decodes in ~35 ms (16 tokens of its 2-layer, 256-wide model), but its median under a
# loaded 2-core machine (the lab hosts share the control's cores, and a deploy's after-smoke may run
# while other hosts still compile) was seen at 0.1-0.2 s right after a restart with the smaller
# model before issue 34: the lab's gate allows 500 ms of scheduling noise. A real slowdown (the
# tests' 50 ms per decode step) adds 800 ms.
LATENCY_SLACK_S = 0.5
# in-host path -> directory name under <state_dir>/hosts/<name>/ (lifecycle makes /tmp's 01777 and
# the published kernels' root 0755, as deploy would make them on a real host)
PRIVATE_DIRS = {"/tmp": "tmp", "/var/lib/fleetctl": "var-lib-fleetctl",
                "/var/lib/fleetctl-kernels": "var-lib-fleetctl-kernels",
                "/opt/sglang": "opt-sglang", "/opt/fleetctl-standin": "opt-fleetctl-standin"}
VENV = "/opt/sglang/venv"
# where each host's start binds the control machine's /root before covering it (host.start_init)
REAL_ROOT = "real-root"
VENV_PYTHONS = ("python", "python3", f"python{sys.version_info[0]}.{sys.version_info[1]}")


class LabError(FleetctlError):
    """The lab could not be built, changed or inspected (message says what and why)."""


def state_dir_for(lab_id: int = 0, state_dir: Path | None = None) -> Path:
    """The lab's state directory: `state_dir`, else `$FLEETCTL_LAB_DIR`, else
    /var/lib/fleetctl-lab/<lab_id>."""
    if state_dir is not None:
        return Path(state_dir)
    if os.environ.get("FLEETCTL_LAB_DIR"):
        return Path(os.environ["FLEETCTL_LAB_DIR"])
    return Path("/var/lib/fleetctl-lab") / str(lab_id)


def inventory_path(lab_id: int = 0, state_dir: Path | None = None) -> Path:
    """Path of the lab's Ansible YAML inventory (`<state_dir>/hosts.yaml`); it may not exist yet."""
    return state_dir_for(lab_id, state_dir) / "hosts.yaml"


def bridge_name(lab_id: int) -> str:
    return f"flab{lab_id}"


def netns_name(lab_id: int, i: int) -> str:
    return f"flab{lab_id}-{i + 1:02d}"


def host_address(lab_id: int, i: int) -> str:
    return f"10.213.{lab_id}.{11 + i}"


def host_name(i: int) -> str:
    return f"lab-{i + 1:02d}"


def release_group(release: str) -> str:
    return "sglang_" + release.replace(".", "_")


def host_dir(sd: Path, name: str) -> Path:
    """`<state dir>/hosts/<name>/`: the host's files (keys, configs, logs, its private directories)."""
    return sd / "hosts" / name


def run(cmd: list[str], check: bool = True, timeout: float = 120, input: str | None = None) -> subprocess.CompletedProcess:
    """Run `cmd` (text output captured); raise LabError with its stderr's tail when `check` and
    it fails."""
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, input=input)
    if check and r.returncode != 0:
        raise LabError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()[-800:]}")
    return r


def require_root() -> None:
    """Raise LabError (with what to do) unless running as root: the lab needs network namespaces."""
    if os.geteuid() != 0:
        raise LabError("the lab needs root (it creates network namespaces, a bridge and sshd "
                       "processes); run it as root, e.g. `sudo -E fleetctl lab up`")
    for tool in ("ip", "unshare", "nsenter", "ssh-keygen", SSHD):
        if shutil.which(tool) is None:
            raise LabError(f"the lab needs `{tool}`: apt-get install -y iproute2 util-linux openssh-server")


def alive(pid: int | None) -> bool:
    """Whether `pid` is a live process: not gone, not a zombie."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a stopped-but-unreaped child or a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    """Start `cmd` in the background in a session of its own, output appended to `log`."""
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)


def load(sd: Path) -> dict:
    """The lab's state (<sd>/lab.json). Raises LabError when no lab is up there."""
    try:
        return json.loads((sd / "lab.json").read_text())
    except FileNotFoundError:
        raise LabError(f"no lab in {sd}: run `fleetctl lab up` first") from None


def save(sd: Path, state: dict) -> None:
    """Write the lab's state to <sd>/lab.json, through a temp file and a rename."""
    tmp = sd / "lab.json.tmp"
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(sd / "lab.json")


def wait_banner(address: str, port: int = 22, timeout: float = 15.0) -> None:
    """Wait until an SSH banner comes from address:port, else raise LabError."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((address, port), timeout=2) as s:
                s.settimeout(2)
                if s.recv(64).startswith(b"SSH-"):
                    return
        except OSError as e:
            last = str(e)
        time.sleep(0.1)
    raise LabError(f"no SSH banner from {address}:{port} within {timeout:.0f} s ({last})")


def find_host(state: dict, host: str) -> dict:
    """The host of `state` named `host` or at that address. Raises UsageError if there is none."""
    for h in state["hosts"]:
        if host in (h["name"], h["address"]):
            return h
    raise UsageError(f"no lab host {host!r}; hosts: {', '.join(h['name'] for h in state['hosts'])}")
