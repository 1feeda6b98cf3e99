"""A lab of real SSH hosts on this machine, for demos and fleet tests.

Each lab (`lab_id` 0..255) owns the subnet 10.213.<lab_id>.0/24: a bridge `flab<id>` at .1 in
the root network namespace, and per host a network namespace `flab<id>-NN` (/run/netns/NAME)
joined to the bridge by a veth pair, address .11, .12, ... Each host is, like a real one, a
set of namespaces of its own (see unshare(1), nsenter(1), pid_namespaces(7)):

- its own PID namespace, whose PID 1 is the lab's init (`fleetctl-init`, the script LAB_INIT
  written to <state_dir>/lab-init.py): it reaps every child, orphans included, and on SIGTERM
  passes SIGTERM on to the rest of the host. A process on the host sees only the host's
  processes in `ps` and /proc: its own private /proc is mounted in the host's mount namespace;
- its own mount and UTS namespaces: its hostname (lab-01, ...) and private bind mounts over
  /tmp, /var/lib/fleetctl, /opt/sglang (the venv is /opt/sglang/venv) and
  /opt/fleetctl-standin. The real directories are under `<state_dir>/hosts/<name>/`. The root
  filesystem, /sys and its cgroup mounts are this machine's;
- `sshd -D -f <own config>` (entered into the init's PID, mount, UTS and network namespaces
  with `nsenter -t INIT`) listening on 127.0.0.1:22 with its own ed25519 host key, root login
  by the lab's own client key; the stand-in server, when started, runs there too.

Outside the host's PID and mount namespaces but inside its network namespace (entered with
`nsenter --net=/run/netns/NAME`, never `ip netns exec`, which remounts /sys and hides the
cgroup mounts) runs a `delayproxy` on <address>:22 forwarding to sshd, delay 0 unless a
`delay` fault is set, so the inventory address never changes whatever the fault. It is the
lab's network, not a process of the host, so the host does not see it.

State (pids as this machine's root PID namespace sees them, faults) is kept in
`<state_dir>/lab.json`; teardown finds namespaces and links by name, so it also cleans up after
a half-failed `lab_up`. Needs root.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import fcntl
import hashlib
import hmac
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from pathlib import Path

import yaml

from ..errors import FleetctlError, UsageError
from ..wheels import cache_dir, ensure_wheel

DEFAULT_RELEASES = ["0.4.6.post5", "0.5.2", "0.5.10", "0.5.23"]
SSHD = "/usr/sbin/sshd"
STANDIN_SRC = Path(__file__).with_name("standin")
SERVER_PORT = 30000
# The stand-in decodes in ~5 ms, but its median under a loaded 2-core machine (the lab hosts
# share the control's cores) was seen at 0.1-0.2 s right after a restart: the lab's gate allows
# 250 ms of scheduling noise. A real slowdown (the tests' 50 ms per decode step) adds 800 ms.
LATENCY_SLACK_S = 0.25
# in-host path -> directory name under <state_dir>/hosts/<name>/
PRIVATE_DIRS = {"/tmp": "tmp", "/var/lib/fleetctl": "var-lib-fleetctl",
                "/opt/sglang": "opt-sglang", "/opt/fleetctl-standin": "opt-fleetctl-standin"}
VENV = "/opt/sglang/venv"
VENV_PYTHONS = ("python", "python3", f"python{sys.version_info[0]}.{sys.version_info[1]}")
FAULTS = ("delay", "down", "up", "freeze", "thaw", "rekey", "unrekey", "hang", "unhang")
HANG_SCRIPT = "#!/bin/sh\n# fleetctl lab fault: an interpreter that hangs forever\nexec sleep 2147483647\n"
# ioctl_ns(2): NS_GET_PARENT = _IO(0xb7, 0x2), a new fd for the parent of a PID namespace
NS_GET_PARENT = 0xB702
# PID 1 of each lab host's PID namespace; written to <state_dir>/lab-init.py, run with python3 -I -S
LAB_INIT = '''"""fleetctl lab init: PID 1 of one lab host's PID namespace (written by fleetctl.lab).

Reaps every child: its own and the orphans the kernel reparents to it (pid_namespaces(7)).
On SIGTERM, SIGINT or SIGHUP: SIGCONT and SIGTERM to every other process of the namespace
(kill(-1, ...), kill(2)), up to 2 s for them to go, then exit; the kernel SIGKILLs whatever is
left when a namespace's init exits. Signals are taken with sigwaitinfo(2) while blocked, so none
is lost; each has a handler because an init receives only signals it handles (SIGKILL and
SIGSTOP from an ancestor namespace excepted).
"""
import os
import signal
import sys
import time

SIGNALS = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
for s in SIGNALS:
    signal.signal(s, lambda *_: None)
signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
with open("/proc/self/comm", "w") as f:
    f.write("fleetctl-init")


def reap():
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


while True:
    reap()
    if signal.sigwaitinfo(SIGNALS).si_signo != signal.SIGCHLD:
        break
for s in (signal.SIGCONT, signal.SIGTERM):
    try:
        os.kill(-1, s)
    except ProcessLookupError:
        pass
end = time.monotonic() + 2
while time.monotonic() < end and any(d.isdigit() and d != "1" for d in os.listdir("/proc")):
    reap()
    time.sleep(0.05)
sys.exit(0)
'''


class LabError(FleetctlError):
    """The lab could not be built, changed or inspected (message says what and why)."""


# ---------------------------------------------------------------- names and paths

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


def _bridge(lab_id: int) -> str:
    return f"flab{lab_id}"


def _netns(lab_id: int, i: int) -> str:
    return f"flab{lab_id}-{i + 1:02d}"


def _address(lab_id: int, i: int) -> str:
    return f"10.213.{lab_id}.{11 + i}"


def _hostname(i: int) -> str:
    return f"lab-{i + 1:02d}"


def _group(release: str) -> str:
    return "sglang_" + release.replace(".", "_")


def default_known_hosts() -> Path:
    """~/.ssh/known_hosts of the passwd home, where fleetctl and OpenSSH look (not $HOME)."""
    from ..connection.base import passwd_home
    return passwd_home() / ".ssh" / "known_hosts"


# ---------------------------------------------------------------- small helpers

def _run(cmd: list[str], check: bool = True, timeout: float = 120, input: str | None = None) -> subprocess.CompletedProcess:
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


def _alive(pid: int | None) -> bool:
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


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)


# ---------------------------------------------------------------- PID namespaces
# All pids here are as this machine's root PID namespace sees them, unless named `nspid`.

def _children(pid: int) -> list[int]:
    """Pids of `pid`'s children, from /proc/PID/task/PID/children (proc(5)), else from the
    PPid of every process."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        if not Path(f"/proc/{pid}").exists():
            return []
    out = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d))
        except (OSError, IndexError, ValueError):
            pass
    return out


def _nspid(pid: int) -> list[int] | None:
    """The `NSpid:` line of /proc/PID/status (proc(5)): the process's pid in each PID namespace
    from this one down to its own, so its length is the namespace's depth + 1; None if gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return [int(x) for x in line.split()[1:]]
    except OSError:
        pass
    return None


def _in_pidns(entry: str, namespaces: set[tuple[int, int]]) -> bool:
    """Whether /proc/ENTRY is a process (not a zombie) in one of `namespaces` ((st_dev, st_ino)
    of a /proc/PID/ns/pid link)."""
    if not entry.isdigit():
        return False
    try:
        st = os.stat(f"/proc/{entry}/ns/pid")
    except OSError:
        return False
    return (st.st_dev, st.st_ino) in namespaces


def _pidns_members(init_pid: int) -> list[int]:
    """Pids (root view, ascending) of every live process in the PID namespace whose init is
    `init_pid` (its /proc/PID/ns/pid is the init's), and in PID namespaces nested in it (a
    container on the host: its NS_GET_PARENT chain, ioctl_ns(2), reaches the init's): what the
    host sees in its /proc. The init itself is included; zombies are not (their ns links are
    gone). [] if the init is gone."""
    try:
        target = os.stat(f"/proc/{init_pid}/ns/pid")
    except OSError:
        return []
    depth = len(_nspid(init_pid) or [])
    out = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            st = os.stat(f"/proc/{d}/ns/pid")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
            out.append(int(d))
            continue
        levels = len(_nspid(int(d)) or []) - depth
        if depth and levels > 0:
            try:
                fd = os.open(f"/proc/{d}/ns/pid", os.O_RDONLY)
            except OSError:
                continue
            try:
                for _ in range(levels):
                    parent = fcntl.ioctl(fd, NS_GET_PARENT)
                    os.close(fd)
                    fd = parent
                st = os.fstat(fd)
            except OSError:
                continue
            finally:
                os.close(fd)
            if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
                out.append(int(d))
    return sorted(out)


def _root_pid(init_pid: int, nspid: int) -> int | None:
    """The root-view pid of the process that is `nspid` inside the init's PID namespace (as
    its own /proc, `$!` or a pid file there say), from NSpid; None if there is none."""
    depth = len(_nspid(init_pid) or [])
    for pid in _pidns_members(init_pid):
        ns = _nspid(pid)
        if ns and depth and len(ns) >= depth and ns[depth - 1] == nspid:
            return pid
    return None


def _is_pidns_init(pid: int) -> bool:
    """Whether `pid` is PID 1 of a PID namespace below the root one (NSpid ends in 1)."""
    ns = _nspid(pid)
    return bool(ns) and len(ns) > 1 and ns[-1] == 1


def _load(sd: Path) -> dict:
    try:
        return json.loads((sd / "lab.json").read_text())
    except FileNotFoundError:
        raise LabError(f"no lab in {sd}: run `fleetctl lab up` first") from None


def _save(sd: Path, state: dict) -> None:
    tmp = sd / "lab.json.tmp"
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(sd / "lab.json")


def _wait_banner(address: str, port: int = 22, timeout: float = 15.0) -> None:
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


# ---------------------------------------------------------------- known_hosts

def _host_matches(field: str, address: str) -> bool:
    names = {address, f"[{address}]:22"}
    for entry in field.split(","):
        if entry.startswith("|1|"):
            _, _, salt, digest = entry.split("|")
            for n in names:
                mac = hmac.new(base64.b64decode(salt), n.encode(), hashlib.sha1).digest()
                if base64.b64encode(mac).decode() == digest:
                    return True
        elif entry in names:
            return True
    return False


def _forget_known_hosts(known_hosts: Path, addresses: list[str]) -> None:
    """Drop known_hosts lines for `addresses` (plain or hashed), like `ssh-keygen -R`."""
    if not known_hosts.exists():
        return
    keep = []
    for line in known_hosts.read_text().splitlines(keepends=True):
        parts = line.split()
        field = parts[1] if parts and parts[0].startswith("@") and len(parts) >= 4 else (parts or [""])[0]
        if len(parts) >= 3 and not line.startswith("#") and any(
                _host_matches(field, a) for a in addresses):
            continue
        keep.append(line)
    known_hosts.write_text("".join(keep))


# ---------------------------------------------------------------- per-host pieces

def _host_dir(sd: Path, name: str) -> Path:
    return sd / "hosts" / name


def _sshd_config(hd: Path, sd: Path) -> Path:
    cfg = hd / "sshd_config"
    cfg.write_text(
        "ListenAddress 127.0.0.1:22\n"
        f"HostKey {hd / 'ssh_host_ed25519_key'}\n"
        f"PidFile {hd / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {sd / 'client_ed25519.pub'}\n"
        "PermitRootLogin prohibit-password\n"
        "PubkeyAuthentication yes\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "UsePAM no\nStrictModes no\nPrintMotd no\nUseDNS no\nMaxStartups 200\nLogLevel VERBOSE\n"
        "Subsystem sftp internal-sftp\n")
    return cfg


def _start_init(ns: str, hostname: str, hd: Path, sd: Path) -> int:
    """Make the host's PID, mount and UTS namespaces inside network namespace `ns` and return
    the root-view pid of their PID 1, the lab's init, once the hostname and bind mounts are in
    place.

    `nsenter --net=/run/netns/NS unshare --mount --uts --pid --fork --mount-proc sh -c ...`:
    unshare forks (its child is PID 1 of the new PID namespace and mounts a private /proc, see
    unshare(1)), the child sets the hostname and bind mounts and execs the init. The unshare
    process stays behind as the init's parent, in the root PID namespace."""
    binds = " && ".join(f"mount --bind {hd / d} {p}" for p, d in PRIVATE_DIRS.items())
    script = (f"hostname {hostname} && mount --make-rprivate / && {binds} && echo ready "
              f"&& exec {sys.executable} -I -S {sd / 'lab-init.py'} {hostname} </dev/null >/dev/null")
    with open(hd / "init.log", "ab") as log:
        p = subprocess.Popen(["nsenter", f"--net=/run/netns/{ns}", "unshare", "--mount", "--uts",
                              "--pid", "--fork", "--mount-proc", "sh", "-c", script],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                             start_new_session=True)
    line = p.stdout.readline()
    p.stdout.close()
    init = _children(p.pid)
    if line.strip() != b"ready" or len(init) != 1 or not _is_pidns_init(init[0]):
        raise LabError(f"host {hostname}: namespace setup failed, see {hd / 'init.log'}")
    return init[0]


def _enter(init: int, *cmd: str) -> list[str]:
    """Command line that runs `cmd` inside the host's PID, mount, UTS and network namespaces
    (those of its init, root-view pid `init`). nsenter forks for the PID namespace
    (nsenter(1)): the command is nsenter's child, nsenter waits for it and exits with its status."""
    return ["nsenter", "-t", str(init), "-p", "-m", "-u", "-n", "--", *cmd]


def _spawn_in(init: int, cmd: list[str], log: Path, timeout: float = 10.0) -> int:
    """Start `cmd` in the background inside the host (see _enter) and return its root-view pid
    (nsenter's child), output appended to `log`."""
    p = _spawn(_enter(init, *cmd), log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = _children(p.pid)
        if kids:
            return kids[0]
        if p.poll() is not None:
            break
        time.sleep(0.002)
    raise LabError(f"{' '.join(cmd)} did not start in the lab host, see {log}")


def _start_sshd(h: dict, sd: Path) -> int:
    """Start the host's sshd (foreground, -D) inside it; return its root-view pid."""
    hd = _host_dir(sd, h["name"])
    return _spawn_in(h["init_pid"], [SSHD, "-D", "-e", "-f", str(hd / "sshd_config")], hd / "sshd.log")


def _start_proxy(h: dict, sd: Path) -> int:
    """Start the host's delay proxy in its network namespace only (the lab's network, not a
    process the host sees); return its pid."""
    hd = _host_dir(sd, h["name"])
    proxy = Path(__file__).with_name("delayproxy.py")
    p = _spawn(["nsenter", f"--net=/run/netns/{h['netns']}", sys.executable, str(proxy),
                "--listen", f"{h['address']}:22", "--connect", "127.0.0.1:22",
                "--delay-file", str(hd / "delay_ms")], hd / "proxy.log")
    return p.pid


def _stage_wheels(sd: Path, releases: list[str]) -> dict[str, Path]:
    """Link (or copy) each release's cached wheel into the lab's state dir: a cache under /tmp
    (a HOME there, say) would be hidden behind the hosts' private /tmp. {release: wheel path}."""
    wheels = sd / "wheels"
    wheels.mkdir(exist_ok=True)
    out = {}
    for release in releases:
        src = ensure_wheel(release)
        dst = out[release] = wheels / src.name
        if not dst.exists():
            try:
                os.link(src, dst)
            except OSError:  # another filesystem
                shutil.copyfile(src, dst)
    return out


def _venv_template(wheel: Path, venv: str) -> Path:
    """Where the venv `venv` holding `wheel` is kept once built: <wheel cache>/lab-venvs/<key>, the
    key naming the wheel (name, size), the in-host path and this interpreter (path, version)."""
    key = "\0".join([wheel.name, str(wheel.stat().st_size), venv, sys.executable, sys.version])
    return cache_dir() / "lab-venvs" / hashlib.sha256(key.encode()).hexdigest()[:24]


def _build_venv(h: dict, sd: Path, wheel: Path, venv: str = VENV) -> None:
    """Create `venv` (default /opt/sglang/venv) inside the host (so sys.prefix is that path there)
    and pip-install `wheel` (--no-deps --no-index; --no-compile for speed). The first venv of a
    wheel, in-host path and interpreter is kept as a template (_venv_template) and each later one
    is a copy of it: pip's own tree, made at the same in-host path, so every path inside holds."""
    assert venv.startswith("/opt/sglang/"), venv
    dst = _host_dir(sd, h["name"]) / PRIVATE_DIRS["/opt/sglang"] / venv[len("/opt/sglang/"):]
    template = _venv_template(wheel, venv)
    if template.is_dir():
        shutil.copytree(template, dst, symlinks=True, dirs_exist_ok=True)
        return
    enter = _enter(h["init_pid"])
    _run(enter + [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv])
    _run(enter + [sys.executable, "-m", "pip", "--python", f"{venv}/bin/python", "install",
                  "--quiet", "--no-deps", "--no-index", "--no-compile", "--disable-pip-version-check",
                  str(wheel)], timeout=600)
    template.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=template.name + ".", dir=template.parent))
    try:
        shutil.copytree(dst, tmp / "venv", symlinks=True)
        os.rename(tmp / "venv", template)
    except OSError:  # another host's build of the same venv got there first: theirs is kept
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _start_server(h: dict, sd: Path) -> int:
    """Copy agent/fleetctl/standin/ to the host's /opt/fleetctl-standin and run its restart.sh
    there; return the server's root-view pid (its pid file holds the host's view)."""
    if not (STANDIN_SRC / "restart.sh").exists():
        raise LabError(f"the stand-in server is missing: {STANDIN_SRC / 'restart.sh'} does not exist")
    dst = _host_dir(sd, h["name"]) / PRIVATE_DIRS["/opt/fleetctl-standin"]
    shutil.copytree(STANDIN_SRC, dst, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    _run(_enter(h["init_pid"], "env", f"PYTHON={VENV}/bin/python",
                "/opt/fleetctl-standin/restart.sh"), timeout=120)
    nspid = int((dst / "server.pid").read_text())
    pid = _root_pid(h["init_pid"], nspid)
    if pid is None:
        raise LabError(f"{h['name']}: the stand-in server (pid {nspid} on the host) exited at once; "
                       "see /opt/fleetctl-standin/server.log on the host")
    return pid


def _wait_server(h: dict, timeout: float = 180.0, port: int = SERVER_PORT) -> None:
    """Wait until GET http://127.0.0.1:PORT/health answers 200 inside the host, else LabError."""
    probe = ("import sys, time, urllib.request\n"
             f"end = time.monotonic() + {timeout}\n"
             "while time.monotonic() < end:\n"
             "    try:\n"
             f"        if urllib.request.urlopen('http://127.0.0.1:{port}/health', timeout=2).status == 200: sys.exit(0)\n"
             "    except OSError: pass\n"
             "    time.sleep(0.2)\n"
             "sys.exit(1)\n")
    r = _run(_enter(h["init_pid"], sys.executable, "-c", probe), check=False, timeout=timeout + 10)
    if r.returncode != 0:
        raise LabError(f"{h['name']}: the stand-in server is not healthy after {timeout:.0f} s; "
                       f"see /opt/fleetctl-standin/server.log on the host")


# ---------------------------------------------------------------- public API

def lab_down(lab_id: int = 0, state_dir: Path | None = None, known_hosts: Path | None = None) -> None:
    """Tear the lab down: kill every process in its namespaces, delete namespaces, veths and
    the bridge, its hosts' directories and inventory, and drop its addresses from known_hosts
    (the client key is kept for the next `lab_up`). Safe to call on a half-built or
    absent lab. Raises LabError without root.

    Each host's init (a PID-namespace init among the processes of the host's network namespace,
    `ip netns pids`) is SIGKILLed first: when it dies the kernel SIGKILLs every process in its
    PID namespace (pid_namespaces(7)). Then whatever is left in the network namespaces (the
    inits' parents, nsenter parents, delay proxies) is SIGKILLed until none is left."""
    require_root()
    sd = state_dir_for(lab_id, state_dir)
    prefix = f"flab{lab_id}-"
    nss = [line.split()[0] for line in _run(["ip", "netns", "list"]).stdout.splitlines()
           if line.split() and line.split()[0].startswith(prefix)]
    pid_nss: set[tuple[int, int]] = set()  # the hosts' PID namespaces, to see them empty below
    for _ in range(50):  # again until empty: a process may be starting (restart.sh, a session)
        pids = [int(p) for ns in nss
                for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split()]
        if not pids:
            break
        pids.sort(key=lambda p: not _is_pidns_init(p))  # inits first
        for pid in filter(_is_pidns_init, pids):
            try:
                st = os.stat(f"/proc/{pid}/ns/pid")
                pid_nss.add((st.st_dev, st.st_ino))
            except OSError:
                pass
        for pid in pids:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        time.sleep(0.05)
    # a process being killed leaves its network namespace before its PID namespace: wait until
    # no process is left in the hosts' PID namespaces either
    deadline = time.monotonic() + 30  # seconds: exits are slow on a loaded two-core machine
    while pid_nss and time.monotonic() < deadline and any(_in_pidns(d, pid_nss) for d in os.listdir("/proc")):
        time.sleep(0.05)
    for ns in nss:
        _run(["ip", "netns", "del", ns], check=False)
    for line in _run(["ip", "-o", "link", "show"]).stdout.splitlines():
        dev = line.split(":")[1].strip().split("@")[0]
        if dev == _bridge(lab_id) or dev.startswith(prefix):
            _run(["ip", "link", "del", dev], check=False)
    _forget_known_hosts(known_hosts or default_known_hosts(),
                        [_address(lab_id, i) for i in range(244)] + [_reach_address(lab_id, n) for n in REACH_HOSTS])
    lab_remove_become_users(lab_id)
    for p in ("lab.json", "hosts.yaml", "ssh_config", "become_password"):
        (sd / p).unlink(missing_ok=True)
    shutil.rmtree(sd / "hosts", ignore_errors=True)


def lab_up(hosts: int | None = None, releases: list[str] | None = None, with_server: bool = False,
           lab_id: int = 0, state_dir: Path | None = None, known_hosts: Path | None = None,
           jobs: int = 2) -> Path:
    """Build a lab of `hosts` real SSH hosts (default: one per release) and return its inventory path.

    Any existing lab with this id is torn down first. Host i gets releases[i % len(releases)]
    (default 0.4.6.post5, 0.5.2, 0.5.10, 0.5.23) pip-installed from the wheel cache
    (fleetctl.wheels) into /opt/sglang/venv, or copied from that venv's template once one
    was built on this machine (_build_venv); `jobs` venvs are built at once. Host keys go
    to `known_hosts` (default ~/.ssh/known_hosts of $HOME), stale lines for the lab's addresses
    removed first; `<state dir>/ssh_config` gets a Host block per host (lab_ssh_config_path;
    `fleetctl lab up` Includes it from ~/.ssh/config). With `with_server`,
    agent/fleetctl/standin/restart.sh starts the stand-in SGLang server on each host's
    127.0.0.1:30000. The lab's become users (become_users: sudo rules per host) are created
    with a new password (become_password). Raises LabError (no root, a step failed: the
    half-built lab is torn down) or FleetctlError (a wheel cannot be had).
    """
    require_root()
    releases = list(releases or DEFAULT_RELEASES)
    n = len(releases) if hosts is None else hosts
    if not 0 <= lab_id <= 255:
        raise UsageError(f"lab id must be 0..255, not {lab_id}")
    if not 1 <= n <= 244:
        raise UsageError(f"a lab has 1..244 hosts, not {n}")
    sd = state_dir_for(lab_id, state_dir).resolve()
    if any(sd == Path(p) or Path(p) in sd.parents for p in PRIVATE_DIRS):
        raise UsageError(f"the lab state dir {sd} is hidden inside the hosts; pick one outside "
                         f"{', '.join(PRIVATE_DIRS)}")
    known_hosts = Path(known_hosts or default_known_hosts())
    for r in releases:
        ensure_wheel(r)
    if (sd / "lab.json").exists():
        print(f"fleetctl lab {lab_id} exists: tearing it down and building it again "
              "(its hosts' files, ledgers and changes are discarded)", file=sys.stderr)
    lab_down(lab_id, sd, known_hosts)
    sd.mkdir(parents=True, exist_ok=True)
    try:
        return _up(n, releases, with_server, lab_id, sd, known_hosts, jobs)
    except BaseException:
        lab_down(lab_id, sd, known_hosts)
        raise


def _up(n: int, releases: list[str], with_server: bool, lab_id: int, sd: Path,
        known_hosts: Path, jobs: int) -> Path:
    key = sd / "client_ed25519"
    if not key.exists():
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"fleetctl-lab-{lab_id}",
              "-f", str(key)])
    for p in PRIVATE_DIRS:
        Path(p).mkdir(parents=True, exist_ok=True)  # mount points in the root filesystem
    Path("/run/sshd").mkdir(mode=0o755, parents=True, exist_ok=True)
    (sd / "lab-init.py").write_text(LAB_INIT)
    br = _bridge(lab_id)
    _run(["ip", "link", "add", br, "type", "bridge"])
    _run(["ip", "addr", "add", f"10.213.{lab_id}.1/24", "dev", br])
    _run(["ip", "link", "set", br, "up"])
    state = {"lab_id": lab_id, "with_server": with_server, "hosts": []}
    for i in range(n):
        name, ns, addr = _hostname(i), _netns(lab_id, i), _address(lab_id, i)
        hd = _host_dir(sd, name)
        for d in PRIVATE_DIRS.values():
            (hd / d).mkdir(parents=True, exist_ok=True)
        (hd / "tmp").chmod(0o1777)
        (hd / "delay_ms").write_text("0\n")
        _run(["ip", "netns", "add", ns])
        _run(["ip", "link", "add", ns, "type", "veth", "peer", "name", ns + "p"])
        _run(["ip", "link", "set", ns, "master", br, "up"])
        _run(["ip", "link", "set", ns + "p", "netns", ns])
        for cmd in (["link", "set", ns + "p", "name", "eth0"], ["addr", "add", f"{addr}/24", "dev", "eth0"],
                    ["link", "set", "eth0", "up"], ["link", "set", "lo", "up"]):
            _run(["ip", "-n", ns, *cmd])
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name,
              "-f", str(hd / "ssh_host_ed25519_key")])
        _sshd_config(hd, sd)
        h = {"name": name, "netns": ns, "address": addr, "release": releases[i % len(releases)],
             "veth": ns, "init_pid": _start_init(ns, name, hd, sd),
             "faults": {"delay_ms": 0, "down": False, "frozen": False, "rekeyed": False,
                        "hung": False}}
        h["sshd_pid"] = _start_sshd(h, sd)
        h["proxy_pid"] = _start_proxy(h, sd)
        state["hosts"].append(h)
    _save(sd, state)
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        wheels = _stage_wheels(sd, sorted({h["release"] for h in state["hosts"]}))
        list(pool.map(lambda h: _build_venv(h, sd, wheels[h["release"]]), state["hosts"]))
    for h in state["hosts"]:
        _wait_banner(h["address"])
    if with_server:
        for h in state["hosts"]:
            h["server_pid"] = _start_server(h, sd)
        _save(sd, state)
        for h in state["hosts"]:
            _wait_server(h)
    _forget_known_hosts(known_hosts, [h["address"] for h in state["hosts"]])
    known_hosts.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(known_hosts, "a") as f:
        for h in state["hosts"]:
            pub = (_host_dir(sd, h["name"]) / "ssh_host_ed25519_key.pub").read_text().split()
            f.write(f"{h['address']} {pub[0]} {pub[1]}\n")
    _write_lab_ssh_config(sd, state, known_hosts)
    lab_add_become_users(lab_id, sd)
    inv = inventory_path(state_dir=sd)
    inv.write_text(_inventory_yaml(state, sd))
    return inv


# ---------------------------------------------------------------- ssh_config

def user_ssh_config() -> Path:
    """~/.ssh/config of the passwd home, which `lab up` / `lab down` add / remove the Include in."""
    from ..connection.base import passwd_home
    return passwd_home() / ".ssh" / "config"


def lab_ssh_config_path(lab_id: int = 0, state_dir: Path | None = None) -> Path:
    """`<state dir>/ssh_config`: Host blocks for the lab's host names (written by lab_up)."""
    return state_dir_for(lab_id, state_dir) / "ssh_config"


def _write_lab_ssh_config(sd: Path, state: dict, known_hosts: Path) -> Path:
    path = sd / "ssh_config"
    path.write_text(f"# fleetctl lab {state['lab_id']}: written by `fleetctl lab up`\n" + "".join(
        f"Host {h['name']}\n  HostName {h['address']}\n  User root\n  IdentityFile {sd / 'client_ed25519'}\n"
        f"  IdentitiesOnly yes\n  UserKnownHostsFile {known_hosts}\n" for h in state["hosts"]))
    return path


def _include_line(lab_id: int, lab_config: Path) -> str:
    return f"Include {lab_config} # fleetctl lab {lab_id}\n"


def _replace_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` through a private temp file beside it and a rename; the file keeps
    its mode (0600 when it is new) and never exists half-written."""
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o600
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.fleetctl-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def add_ssh_config_include(user_config: Path, lab_id: int = 0, state_dir: Path | None = None) -> None:
    """Add the marked line `Include <state dir>/ssh_config # fleetctl lab ID` to `user_config`
    (the passwd home's ~/.ssh/config for `fleetctl lab up`) before its first Host or Match line,
    so that it applies to every host; the file is created 0600 (its directory 0700) if missing
    and written atomically. Adding it twice leaves one line."""
    line = _include_line(lab_id, lab_ssh_config_path(lab_id, state_dir))
    user_config.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    lines = user_config.read_text().splitlines(keepends=True) if user_config.exists() else []
    if line in lines:
        return
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    at = next((i for i, text in enumerate(lines) if text.split()[:1] and text.split()[0].lower() in ("host", "match")),
              len(lines))
    _replace_atomically(user_config, "".join(lines[:at] + [line] + lines[at:]))


def remove_ssh_config_include(user_config: Path, lab_id: int = 0, state_dir: Path | None = None) -> None:
    """Remove exactly the line add_ssh_config_include wrote (nothing else changes)."""
    if not user_config.exists():
        return
    line = _include_line(lab_id, lab_ssh_config_path(lab_id, state_dir))
    lines = user_config.read_text().splitlines(keepends=True)
    if line in lines:
        _replace_atomically(user_config, "".join(text for text in lines if text != line))


# ---------------------------------------------------------------- hosts for reaching tests

# The reach hosts: name -> (what it is). Each is a bare sshd (LogLevel VERBOSE, its log in
# <host dir>/sshd.log) in a network namespace of its own, sharing this machine's filesystem: they
# exist to be reached, not to run SGLang.
REACH_HOSTS = {
    "lab-hidden": "reachable only through lab-01 (the bastion): no route from the control side",
    "lab-ca": "its ed25519 host key is signed by the lab's host CA; known_hosts has only @cert-authority",
    "lab-rsa": "only an RSA host key",
}


def _reach_address(lab_id: int, name: str) -> str:
    """lab-hidden: 10.214.<lab-id>.2 on a link to lab-01 only; the others on the lab bridge."""
    return {"lab-hidden": f"10.214.{lab_id}.2", "lab-ca": f"10.213.{lab_id}.251",
            "lab-rsa": f"10.213.{lab_id}.252"}[name]


def _reach_sshd(name: str, ns: str, address: str, hd: Path, sd: Path, host_keys: list[Path],
                certificate: Path | None = None) -> int:
    cfg = hd / "sshd_config"
    cfg.write_text(
        f"ListenAddress {address}:22\n" + "".join(f"HostKey {k}\n" for k in host_keys)
        + (f"HostCertificate {certificate}\n" if certificate else "")
        + f"PidFile {hd / 'sshd.pid'}\nAuthorizedKeysFile {sd / 'client_ed25519.pub'}\n"
        "PermitRootLogin prohibit-password\nPubkeyAuthentication yes\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nPrintMotd no\nUseDNS no\n"
        "LogLevel VERBOSE\n")
    return _spawn(["ip", "netns", "exec", ns, SSHD, "-D", "-e", "-f", str(cfg)], hd / "sshd.log").pid


def lab_add_reach_hosts(lab_id: int = 0, state_dir: Path | None = None, known_hosts: Path | None = None) -> dict:
    """Add REACH_HOSTS to the running lab `lab_id` and return {name: {address, log, key}}
    (`key`: the host's public key file). lab-01 becomes their bastion: lab-hidden sits on a link
    from lab-01's network namespace. `known_hosts` (default ~/.ssh/known_hosts of the passwd
    home) gets plain lines for lab-hidden and lab-rsa and one `@cert-authority` line for
    lab-ca's address; `lab_down` removes the hosts and those lines. Raises LabError."""
    require_root()
    sd = state_dir_for(lab_id, state_dir)
    state = _load(sd)
    bastion = next(h for h in state["hosts"] if h["name"] == _hostname(0))
    known_hosts = Path(known_hosts or default_known_hosts())
    out, lines = {}, []
    ca = sd / "host_ca"
    if not ca.exists():
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"fleetctl-lab-{lab_id}-host-ca", "-f", str(ca)])
    for name in REACH_HOSTS:
        ns, addr, hd = f"flab{lab_id}-{name[4:7]}", _reach_address(lab_id, name), _host_dir(sd, name)
        hd.mkdir(parents=True, exist_ok=True)
        ktype = "rsa" if name == "lab-rsa" else "ed25519"
        key = hd / f"ssh_host_{ktype}_key"
        key.unlink(missing_ok=True)
        _run(["ssh-keygen", "-q", "-t", ktype, "-N", "", "-C", name, "-f", str(key)])
        _run(["ip", "netns", "add", ns])
        _run(["ip", "link", "add", ns, "type", "veth", "peer", "name", ns + "p"])
        _run(["ip", "link", "set", ns + "p", "netns", ns])
        if name == "lab-hidden":  # a link to the bastion's namespace only
            _run(["ip", "link", "set", ns, "netns", bastion["netns"]])
            for cmd in (["addr", "add", f"10.214.{lab_id}.1/24", "dev", ns], ["link", "set", ns, "up"]):
                _run(["ip", "-n", bastion["netns"], *cmd])
        else:
            _run(["ip", "link", "set", ns, "master", _bridge(lab_id), "up"])
        for cmd in (["link", "set", ns + "p", "name", "eth0"], ["addr", "add", f"{addr}/24", "dev", "eth0"],
                    ["link", "set", "eth0", "up"], ["link", "set", "lo", "up"]):
            _run(["ip", "-n", ns, *cmd])
        cert = None
        pub = key.with_name(key.name + ".pub")
        if name == "lab-ca":
            _run(["ssh-keygen", "-q", "-s", str(ca), "-I", name, "-h", "-n", addr, str(pub)])
            cert = key.with_name(key.name + "-cert.pub")
            lines.append(f"@cert-authority {addr} {' '.join((sd / 'host_ca.pub').read_text().split()[:2])}\n")
        else:
            lines.append(f"{addr} {' '.join(pub.read_text().split()[:2])}\n")
        (hd / "sshd.log").write_bytes(b"")
        _reach_sshd(name, ns, addr, hd, sd, [key], cert)
        out[name] = {"address": addr, "log": hd / "sshd.log", "key": pub}
    deadline = time.monotonic() + 15
    for name, h in out.items():  # lab-hidden cannot be dialled from here: its log says when it listens
        while b"Server listening" not in h["log"].read_bytes():
            if time.monotonic() > deadline:
                raise LabError(f"{name}: sshd did not start, see {h['log']}")
            time.sleep(0.05)
    _forget_known_hosts(known_hosts, [h["address"] for h in out.values()])
    with open(known_hosts, "a") as f:
        f.writelines(lines)
    return out


def _sudoers_path(lab_id: int) -> Path:
    return Path(f"/etc/sudoers.d/fleetctl-lab-{lab_id}")


def become_users(lab_id: int) -> dict[str, str]:
    """The lab's non-root logins (role -> user name): `sudo` may sudo to any user, without a
    password on lab-03 and with one on lab-04 (and nowhere else); `nosudo` has no sudo rights;
    `tty` may sudo without a password anywhere, but only from a tty (`Defaults requiretty`)."""
    return {"sudo": f"flab{lab_id}sudo", "nosudo": f"flab{lab_id}nosudo", "tty": f"flab{lab_id}tty"}


def lab_add_become_users(lab_id: int = 0, state_dir: Path | None = None) -> str:
    """Create (again: any earlier ones are removed first; `lab up` creates them) the lab's become_users on this machine (the hosts share its /etc: each host is
    its own UTS namespace, so sudo matches rules by the host name) and one sudoers file
    /etc/sudoers.d/fleetctl-lab-<id> with the per-host rules, checked by `visudo -c`; both
    logins sign in with the lab's client key and have a new random password, returned (also in
    <state dir>/become_password, mode 0600). `lab_down` removes users and file. Raises LabError."""
    require_root()
    sd = state_dir_for(lab_id, state_dir)
    if shutil.which("sudo") is None:
        raise LabError("sudo is not installed (scripts/setup.sh installs it)")
    lab_remove_become_users(lab_id)
    password = base64.b32encode(os.urandom(15)).decode().lower()
    users = become_users(lab_id)
    for user in users.values():
        _run(["useradd", "--create-home", "--home-dir", f"/home/{user}", "--shell", "/bin/sh", user])
        _run(["chpasswd"], input=f"{user}:{password}\n")
    rules = (f"# fleetctl lab {lab_id}: written by `fleetctl lab up`, removed by `fleetctl lab down`\n"
             f"{users['sudo']} {_hostname(2)} = (ALL) NOPASSWD: ALL\n"
             f"{users['sudo']} {_hostname(3)} = (ALL) ALL\n"
             f"Defaults:{users['tty']} requiretty\n{users['tty']} ALL = (ALL) NOPASSWD: ALL\n")
    tmp = _sudoers_path(lab_id).with_name(f".fleetctl-lab-{lab_id}.tmp")  # sudo skips names with a dot
    tmp.write_text(rules)
    tmp.chmod(0o440)
    _run(["visudo", "-c", "-q", "-f", str(tmp)])
    tmp.rename(_sudoers_path(lab_id))
    secret = sd / "become_password"
    secret.unlink(missing_ok=True)
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(password)
    return password


def become_password(lab_id: int = 0, state_dir: Path | None = None) -> str:
    """The become_users' password `lab up` chose (<state dir>/become_password). Raises LabError
    when the lab has none (not up, or built before `lab up` created become users)."""
    try:
        return (state_dir_for(lab_id, state_dir) / "become_password").read_text()
    except FileNotFoundError:
        raise LabError(f"lab {lab_id} has no become users: run `fleetctl lab up --lab-id {lab_id}`") from None


def lab_remove_become_users(lab_id: int) -> None:
    """Remove the lab's sudoers file and become_users (their homes too), if there."""
    _sudoers_path(lab_id).unlink(missing_ok=True)
    for user in become_users(lab_id).values():
        _run(["userdel", "--remove", user], check=False)


def _inventory_yaml(state: dict, sd: Path) -> str:
    hosts, children = {}, {}
    for h in state["hosts"]:
        v = {"ansible_host": h["address"], "ansible_user": "root",
             "ansible_ssh_private_key_file": str(sd / "client_ed25519")}
        if state["with_server"]:
            v.update(fleetctl_sglang_port=SERVER_PORT,
                     fleetctl_restart_cmd="/opt/fleetctl-standin/restart.sh",
                     fleetctl_latency_slack=LATENCY_SLACK_S)
        hosts[h["name"]] = v
        children.setdefault(_group(h["release"]), {"hosts": {}})["hosts"][h["name"]] = None
    doc = {"all": {"children": {"lab": {"hosts": hosts, "children": children}}}}
    return (f"# fleetctl lab {state['lab_id']}: written by `fleetctl lab up`; "
            "`fleetctl lab down` removes the hosts\n" + yaml.safe_dump(doc, sort_keys=False))


def lab_status(lab_id: int = 0, state_dir: Path | None = None) -> list[dict]:
    """One dict per host: name, address, netns, release, sshd_pid, sshd_alive, proxy_alive,
    link_up, faults (delay_ms, down, frozen, rekeyed, hung). Raises LabError if no lab is up."""
    require_root()
    sd = state_dir_for(lab_id, state_dir)
    out = []
    for h in _load(sd)["hosts"]:
        link = _run(["ip", "-o", "link", "show", h["veth"]], check=False).stdout
        out.append({"name": h["name"], "address": h["address"], "netns": h["netns"],
                    "release": h["release"], "sshd_pid": h["sshd_pid"],
                    "sshd_alive": _alive(h["sshd_pid"]), "proxy_alive": _alive(h["proxy_pid"]),
                    "link_up": "UP" in link.partition("<")[2].partition(">")[0].split(","),
                    "faults": dict(h["faults"])})
    return out


def host_pids(host: str, lab_id: int = 0, state_dir: Path | None = None) -> list[int]:
    """Pids (root PID namespace view, ascending) of the processes running on `host` (name or
    address): every process in the host's PID namespace (and ones nested in it), found by
    comparing /proc/PID/ns/pid with the host's init's, less the lab's own machinery there (the
    init, the sshd listener): what is left are SSH sessions, the commands they started, and
    servers. The delay proxy is not on the host (it is in its network namespace only). To get a
    pid as the host sees it, take the last field of `NSpid:` in /proc/PID/status."""
    sd = state_dir_for(lab_id, state_dir)
    h = _find(_load(sd), host)
    own = {h["init_pid"], h["sshd_pid"]}
    return [p for p in _pidns_members(h["init_pid"]) if p not in own]


def _find(state: dict, host: str) -> dict:
    for h in state["hosts"]:
        if host in (h["name"], h["address"]):
            return h
    raise UsageError(f"no lab host {host!r}; hosts: {', '.join(h['name'] for h in state['hosts'])}")


def lab_fault(host: str, kind: str, arg: str | int | None = None, lab_id: int = 0,
              state_dir: Path | None = None) -> dict:
    """Inject or clear a fault on one lab host (name like "lab-01" or its address); return its faults.

    Kinds: `delay MS` (each direction, by the host's delayproxy; 0 clears), `down`/`up` (the
    bridge side of the host's veth: connects time out), `freeze`/`thaw` (SIGSTOP/SIGCONT sshd:
    TCP is accepted, no banner), `rekey` (a new host key, sshd restarted; known_hosts keeps the
    old one) / `unrekey` (the original key back), `hang`/`unhang` (/opt/sglang/venv/bin/python*
    replaced by a script that sleeps forever / restored). Raises UsageError for a bad kind or
    host, LabError if a step fails.
    """
    require_root()
    sd = state_dir_for(lab_id, state_dir)
    state = _load(sd)
    h = _find(state, host)
    hd, f = _host_dir(sd, h["name"]), h["faults"]
    if kind == "delay":
        try:
            ms = int(arg)
            assert ms >= 0
        except (TypeError, ValueError, AssertionError):
            raise UsageError(f"delay needs a whole number of milliseconds >= 0, not {arg!r}") from None
        (hd / "delay_ms").write_text(f"{ms}\n")
        os.kill(h["proxy_pid"], signal.SIGHUP)
        f["delay_ms"] = ms
    elif kind in ("down", "up"):
        _run(["ip", "link", "set", h["veth"], kind])
        f["down"] = kind == "down"
    elif kind in ("freeze", "thaw"):
        os.kill(h["sshd_pid"], signal.SIGSTOP if kind == "freeze" else signal.SIGCONT)
        f["frozen"] = kind == "freeze"
    elif kind in ("rekey", "unrekey"):
        k, orig = hd / "ssh_host_ed25519_key", hd / "ssh_host_ed25519_key.orig"
        if kind == "rekey":
            if not orig.exists():
                k.rename(orig)
                k.with_name(k.name + ".pub").rename(orig.with_name(orig.name + ".pub"))
            for p in (k, k.with_name(k.name + ".pub")):
                p.unlink(missing_ok=True)
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", h["name"], "-f", str(k)])
        elif orig.exists():
            orig.replace(k)
            orig.with_name(orig.name + ".pub").replace(k.with_name(k.name + ".pub"))
        for sig in (signal.SIGCONT, signal.SIGTERM):
            try:
                os.kill(h["sshd_pid"], sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while _alive(h["sshd_pid"]) and time.monotonic() < deadline:  # free 127.0.0.1:22
            time.sleep(0.05)
        h["sshd_pid"] = _start_sshd(h, sd)
        f["rekeyed"], f["frozen"] = kind == "rekey", False
        _save(sd, state)
        _wait_banner(h["address"])
    elif kind in ("hang", "unhang"):
        bindir = hd / PRIVATE_DIRS["/opt/sglang"] / "venv" / "bin"
        backup = hd / "hang-backup"
        backup.mkdir(exist_ok=True)
        for name in VENV_PYTHONS:
            if kind == "hang" and not (backup / name).is_symlink() and not (backup / name).exists():
                (bindir / name).rename(backup / name)
                (bindir / name).write_text(HANG_SCRIPT)
                (bindir / name).chmod(0o755)
            elif kind == "unhang" and ((backup / name).is_symlink() or (backup / name).exists()):
                (backup / name).replace(bindir / name)
        f["hung"] = kind == "hang"
    else:
        raise UsageError(f"unknown fault {kind!r}; kinds: {', '.join(FAULTS)}")
    _save(sd, state)
    return dict(f)


# ---------------------------------------------------------------- install layouts

CHECKOUT = "/opt/sglang/src/sglang"          # a git work tree laid out as SGLang's repository
EDITABLE_VENV = "/opt/sglang/venv-editable"  # `pip install -e CHECKOUT/python`
SECOND_VENV = "/opt/sglang/venv2"            # another release, beside /opt/sglang/venv
SECOND_STANDIN = "/opt/sglang/fleetctl-standin"
SECOND_PORT = SERVER_PORT + 1
SETUPTOOLS = "80.9.0"  # >= 70.1 (PEP 660 editable installs of a flat packages.find layout)
CHECKOUT_OWNER = "nobody"  # a developer's checkout is not root's: git must run as its owner


def add_install_layouts(host: str, checkout_release: str, second_release: str, lab_id: int = 0,
                        state_dir: Path | None = None) -> dict:
    """Give lab host `host` (of a lab that is up, built without servers) the install layouts
    fleets really have, next to its /opt/sglang/venv:

    - an editable checkout: CHECKOUT, a git work tree owned by CHECKOUT_OWNER holding python/
      (pyproject.toml, setuptools, packages.find) and python/sglang/ from the pure-Python release
      wheel `checkout_release`, installed `pip install -e` (PEP 660, setuptools SETUPTOOLS from
      the wheel cache, no index) into EDITABLE_VENV; the stand-in server runs from that venv on
      127.0.0.1:30000, started plainly;
    - SECOND_VENV with release `second_release`, and a stand-in server from it on
      127.0.0.1:SECOND_PORT started through `timeout` (a launcher that stays its parent).

    Returns {"restart_cmd": a handler command restarting both servers as they were started}.
    Raises LabError (a step failed, a release wheel that is not pure Python) or FleetctlError
    (a wheel cannot be had)."""
    require_root()
    sd = state_dir_for(lab_id, state_dir)
    h = _find(_load(sd), host)
    hd = _host_dir(sd, h["name"])
    wheels = _stage_wheels(sd, [checkout_release, second_release])
    if not wheels[checkout_release].name.endswith("-py3-none-any.whl"):
        raise LabError(f"sglang {checkout_release} is not pure Python ({wheels[checkout_release].name}): "
                       "an editable checkout needs no build step only for such a release")
    tools = sd / "wheels" / ensure_wheel(SETUPTOOLS, package="setuptools").name
    if not tools.exists():
        shutil.copyfile(ensure_wheel(SETUPTOOLS, package="setuptools"), tools)
    work = hd / PRIVATE_DIRS["/opt/sglang"] / CHECKOUT[len("/opt/sglang/"):]
    proj = work / "python"
    with zipfile.ZipFile(wheels[checkout_release]) as z:
        z.extractall(proj, [n for n in z.namelist() if n.startswith("sglang/")])
    (proj / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=70.1"]\nbuild-backend = "setuptools.build_meta"\n\n'
        f'[project]\nname = "sglang"\nversion = "{checkout_release}"\n\n'
        '[tool.setuptools.packages.find]\ninclude = ["sglang*"]\n')
    git = ["git", "-C", str(work), "-c", "user.name=fleetctl lab", "-c", "user.email=lab@example.invalid"]
    _run(["git", "init", "-q", str(work)])
    _run(git + ["add", "python"])
    _run(git + ["commit", "-q", "-m", f"sglang {checkout_release} (from its release wheel)"])
    _build_venv(h, sd, tools, EDITABLE_VENV)  # the build backend, from the cache (no build isolation)
    _run(_enter(h["init_pid"]) + [sys.executable, "-m", "pip", "--python", f"{EDITABLE_VENV}/bin/python", "install",
                                  "--quiet", "--no-deps", "--no-index", "--no-build-isolation",
                                  "--disable-pip-version-check", "-e", f"{CHECKOUT}/python"], timeout=600)
    _run(["chown", "-R", f"{CHECKOUT_OWNER}:", str(work)])
    _build_venv(h, sd, wheels[second_release], SECOND_VENV)
    second = hd / PRIVATE_DIRS["/opt/sglang"] / SECOND_STANDIN[len("/opt/sglang/"):]
    for dst in (hd / PRIVATE_DIRS["/opt/fleetctl-standin"], second):
        shutil.copytree(STANDIN_SRC, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    first_cmd = f"PYTHON={EDITABLE_VENV}/bin/python /opt/fleetctl-standin/restart.sh"
    second_cmd = (f"PYTHON={SECOND_VENV}/bin/python LAUNCHER='timeout 86400' "
                  f"{SECOND_STANDIN}/restart.sh --port {SECOND_PORT}")
    for cmd in (first_cmd, second_cmd):
        _run(_enter(h["init_pid"], "sh", "-c", cmd), timeout=120)
    _wait_server(h)
    _wait_server(h, port=SECOND_PORT)
    return {"restart_cmd": f"{first_cmd} && {second_cmd}"}


# ---------------------------------------------------------------- a container host

CONTAINER_IMAGE = "localhost/fleetctl-lab/sglang-standin"  # :<release>, built by build_container_image
CONTAINER_NAME = "sglang"
IMAGE_STORE = "/var/lib/fleetctl-images"  # inside a lab host: the shared store, mounted read-only
# in-host path -> directory name under <state_dir>/hosts/<name>/: Podman's own state, per lab host
CONTAINER_DIRS = {"/var/lib/containers": "var-lib-containers", "/run/containers": "run-containers",
                  "/run/libpod": "run-libpod", "/etc/containers": "etc-containers"}
# ulimits given explicitly: Podman's defaults (the engine's own nofile/nproc) are not permitted here
CONTAINER_ULIMITS = ("nofile=1024:1024", "nproc=4096:4096")
# where a container lab host's stand-in finds torch: this machine's site-packages, mounted read-only
STANDIN_DEPS = "/opt/fleetctl-standin-deps"
# what the stand-in needs of the lab's Python (torch and what `import torch` imports): the system
# libraries they link to go into the image
_IMAGE_PACKAGES = ("torch", "torchgen", "functorch", "typing_extensions", "sympy", "mpmath", "networkx",
                   "jinja2", "markupsafe", "filelock", "fsspec", "numpy", "numpy.libs")
_STORAGE_CONF = ('[storage]\ndriver = "overlay"\nrunroot = "/run/containers/storage"\n'
                 'graphroot = "/var/lib/containers/storage"\n\n[storage.options]\n'
                 f'additionalimagestores = ["{IMAGE_STORE}"]\n')
_CONTAINERS_CONF = ('[engine]\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\nruntime = "runc"\n'
                    '[containers]\nlog_driver = "k8s-file"\n')


def _image_rootfs(root: Path, release: str, wheel: Path) -> None:
    """Lay out an image's root filesystem at `root`: the lab's Python (this interpreter's prefix:
    its binary, libpython, the standard library without tests or site-packages; what the
    stand-in imports, torch, is mounted at STANDIN_DEPS when the container runs), the shared
    libraries all of that links to (ldd),
    an editable SGLang checkout of `release` (CHECKOUT/python, installed as pip does a PEP 660
    editable install of a flat layout: a `.pth` naming the project directory and a dist-info
    whose direct_url.json says editable) in the venv VENV, and the stand-in at
    /opt/fleetctl-standin. No sh, no coreutils: like a distroless image. Files are hard links
    where the file system allows (the image is tarred right after)."""
    prefix = Path(sys.base_prefix)
    ver = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    site = prefix / "lib" / ver / "site-packages"

    def put(src: Path, dst: Path | None = None) -> None:
        dst = root / str(dst or src).lstrip("/")
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            _run(["cp", "-al", str(src), str(dst)])
        elif not dst.exists():
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)

    for d in ("tmp", "proc", "sys", "dev", "etc", "run", "var/lib/fleetctl"):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "tmp").chmod(0o1777)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/nonexistent\n")
    (root / "etc" / "group").write_text("root:x:0:\n")
    put(Path(os.path.realpath(sys.executable)), prefix / "bin" / ver)
    for lib in sorted((prefix / "lib").glob("libpython3*.so*")):
        put(lib)
    stdlib = prefix / "lib" / ver
    for entry in sorted(stdlib.iterdir()):
        if entry.name not in ("site-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip"):
            put(entry)
    # what the stand-in imports (torch) is not SGLang: the container mounts it read-only from this
    # machine (STANDIN_DEPS), found through a .pth file, which keeps the image small to build
    (root / str(site).lstrip("/")).mkdir(parents=True, exist_ok=True)
    (root / str(site).lstrip("/") / "fleetctl-standin-deps.pth").write_text(STANDIN_DEPS + "\n")
    # the system libraries every binary there links to, at their own paths
    deps = [site / e.name for e in sorted(site.iterdir())
            if e.name.split("-")[0].lower().removesuffix(".py") in _IMAGE_PACKAGES]
    elfs = [p for top in [root, *deps] if top.is_dir() for p in top.rglob("*")
            if p.is_file() and (p.suffix == ".so" or ".so." in p.name or p.name == ver)]
    libs: set[str] = set()
    for i in range(0, len(elfs), 200):
        r = _run(["ldd", *map(str, elfs[i:i + 200])], check=False, timeout=300)
        for line in r.stdout.splitlines():
            parts = line.split()
            if "=>" in parts and len(parts) > parts.index("=>") + 1 and parts[parts.index("=>") + 1].startswith("/"):
                libs.add(parts[parts.index("=>") + 1])
            elif parts and parts[0].startswith("/") and "ld-linux" in parts[0]:
                libs.add(parts[0])
    for lib in sorted(libs):
        if not str(lib).startswith(str(prefix)):
            dst = root / lib.lstrip("/")
            dst.parent.mkdir(parents=True, exist_ok=True)
            if not dst.exists():
                shutil.copy2(os.path.realpath(lib), dst)
    if not (root / "lib64").exists():
        (root / "lib64").mkdir()
    ld = root / "lib64" / "ld-linux-x86-64.so.2"
    if not ld.exists() and Path("/lib64/ld-linux-x86-64.so.2").exists():
        shutil.copy2(os.path.realpath("/lib64/ld-linux-x86-64.so.2"), ld)
    # the venv, as `python -m venv --system-site-packages` lays it out
    venv = root / VENV.lstrip("/")
    (venv / "bin").mkdir(parents=True)
    for name in VENV_PYTHONS:
        (venv / "bin" / name).symlink_to(prefix / "bin" / ver)
    (venv / "pyvenv.cfg").write_text(f"home = {prefix / 'bin'}\ninclude-system-site-packages = true\n"
                                     f"version = {sys.version_info[0]}.{sys.version_info[1]}.{sys.version_info[2]}\n")
    vsite = venv / "lib" / ver / "site-packages"
    vsite.mkdir(parents=True)
    proj = root / CHECKOUT.lstrip("/") / "python"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(proj, [n for n in z.namelist() if n.startswith("sglang/")])
    (proj / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=70.1"]\nbuild-backend = "setuptools.build_meta"\n\n'
        f'[project]\nname = "sglang"\nversion = "{release}"\n\n'
        '[tool.setuptools.packages.find]\ninclude = ["sglang*"]\n')
    (vsite / f"__editable__.sglang-{release}.pth").write_text(f"{CHECKOUT}/python\n")
    dist = vsite / f"sglang-{release}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {release}\n")
    (dist / "INSTALLER").write_text("pip\n")
    (dist / "direct_url.json").write_text(json.dumps({"url": f"file://{CHECKOUT}/python",
                                                      "dir_info": {"editable": True}}))
    (dist / "RECORD").write_text("".join(f"{dist.name}/{n},,\n" for n in
                                         ("METADATA", "INSTALLER", "direct_url.json", "RECORD")) +
                                 f"__editable__.sglang-{release}.pth,,\n")
    standin = root / "opt" / "fleetctl-standin"
    shutil.copytree(STANDIN_SRC, standin, ignore=shutil.ignore_patterns("__pycache__"))


def image_store_dir(state_dir: Path) -> Path:
    """The lab's shared image store (Podman's graph root layout), under the lab's state dir: built
    once, kept across lab_down, read-only in every container lab host."""
    return state_dir / "image-store"


def build_container_image(release: str, lab_id: int = 0, state_dir: Path | None = None) -> str:
    """Build (once: kept in the lab's image store, image_store_dir) the image
    CONTAINER_IMAGE:<release> from the root filesystem _image_rootfs lays out, with `podman
    import` (no registry is reached). Returns the image reference. Raises LabError."""
    require_root()
    sd = state_dir_for(lab_id, state_dir)
    ref = f"{CONTAINER_IMAGE}:{release}"
    store = image_store_dir(sd)
    pod = ["podman", "--root", str(store), "--runroot", str(sd / "image-store-run"), "--storage-driver", "overlay"]
    if _run([*pod, "image", "exists", ref], check=False).returncode == 0:
        return ref
    wheel = _stage_wheels(sd, [release])[release]
    rootfs = sd / "image-rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    rootfs.mkdir()
    try:
        _image_rootfs(rootfs, release, wheel)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        r = subprocess.run([*pod, "import", "--change", f"WORKDIR /", "-", ref], stdin=tar.stdout,
                           capture_output=True, text=True, timeout=900)
        tar.stdout.close()
        if tar.wait() != 0 or r.returncode != 0:
            raise LabError(f"podman import of {ref} failed: {r.stderr[-1500:]}")
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)
    return ref


def container_run_argv(image: str, name: str = CONTAINER_NAME, read_only: bool = False) -> list[str]:
    """The arguments of `podman run` for the lab's containerised stand-in server: rootful, runc,
    the host's network (the server answers on the lab host's 127.0.0.1:SERVER_PORT), explicit
    ulimits, the venv's interpreter executed directly (the image has no shell)."""
    # the stand-in is the container's PID 1, which a SIGTERM it has no handler for does not stop
    return ["run", "-d", "--name", name, "--runtime", "runc", "--network", "host", "--stop-timeout", "2",
            *[w for u in CONTAINER_ULIMITS for w in ("--ulimit", u)], *(["--read-only"] if read_only else []),
            "--volume", f"{sysconfig.get_paths()['purelib']}:{STANDIN_DEPS}:ro",
            image, f"{VENV}/bin/python", "/opt/fleetctl-standin/server.py", "--host", "127.0.0.1",
            "--port", str(SERVER_PORT), "--model-path", "fleetctl-standin/tiny", "--tp-size", "1"]


def podman_in(host: str, args: list[str], lab_id: int = 0, state_dir: Path | None = None,
              timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    """Run `podman ARGS` inside lab host `host` (its own Podman state). Raises LabError when
    `check` and it fails."""
    sd = state_dir_for(lab_id, state_dir)
    h = _find(_load(sd), host)
    r = _run(_enter(h["init_pid"], "podman", *args), check=False, timeout=timeout)
    if check and r.returncode != 0:
        raise LabError(f"{host}: podman {' '.join(args)} failed: {r.stderr[-1500:]}")
    return r


def add_container_host(host: str, release: str, lab_id: int = 0, state_dir: Path | None = None,
                       read_only: bool = False) -> dict:
    """Give lab host `host` (of a lab that is up, built without servers) its own rootful Podman
    (private /var/lib/containers, /run/containers, /run/libpod and /etc/containers, bind-mounted
    in its mount namespace, so `podman ps` there shows only its containers; the lab's image
    store mounted read-only as an additional image store) and run the stand-in server in a
    container CONTAINER_NAME of image build_container_image(release), then wait for its health.
    Returns {"image", "name", "restart_cmd"}. Raises LabError."""
    require_root()
    sd = state_dir_for(lab_id, state_dir)
    image = build_container_image(release, lab_id, sd)
    h = _find(_load(sd), host)
    hd = _host_dir(sd, h["name"])
    binds = []
    for path, d in {**CONTAINER_DIRS}.items():
        (hd / d).mkdir(parents=True, exist_ok=True)
        Path(path).mkdir(parents=True, exist_ok=True)  # the mount point on the shared root
        binds.append(f"mount --bind {hd / d} {path}")
    for src in Path("/etc/containers").glob("*"):
        if src.is_file() and src.name not in ("storage.conf", "containers.conf"):
            shutil.copy2(src, hd / CONTAINER_DIRS["/etc/containers"] / src.name)
    (hd / CONTAINER_DIRS["/etc/containers"] / "storage.conf").write_text(_STORAGE_CONF)
    (hd / CONTAINER_DIRS["/etc/containers"] / "containers.conf").write_text(_CONTAINERS_CONF)
    Path(IMAGE_STORE).mkdir(parents=True, exist_ok=True)
    binds.append(f"mount --bind {image_store_dir(sd)} {IMAGE_STORE} && mount -o remount,bind,ro {IMAGE_STORE}")
    _run(["nsenter", "-t", str(h["init_pid"]), "-m", "sh", "-c", " && ".join(binds)])
    podman_in(host, container_run_argv(image, read_only=read_only), lab_id, sd)
    _wait_server(h)
    return {"image": image, "name": CONTAINER_NAME, "restart_cmd": f"podman restart {CONTAINER_NAME}"}


# ---------------------------------------------------------------- python -m fleetctl.lab

def main(argv: list[str] | None = None) -> int:
    """`python -m fleetctl.lab up|down|status|inventory|fault ...` (the same as `fleetctl lab`)."""
    p = argparse.ArgumentParser(prog="python -m fleetctl.lab")
    p.add_argument("--lab-id", type=int, default=0)
    p.add_argument("--state-dir", type=Path)
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up")
    up.add_argument("--hosts", type=int)
    up.add_argument("--releases", default=",".join(DEFAULT_RELEASES))
    up.add_argument("--with-server", action="store_true")
    sub.add_parser("down")
    sub.add_parser("status")
    sub.add_parser("inventory")
    fault = sub.add_parser("fault")
    fault.add_argument("host")
    fault.add_argument("kind", choices=FAULTS)
    fault.add_argument("arg", nargs="?")
    a = p.parse_args(argv)
    try:
        if a.cmd == "up":
            t = time.monotonic()
            inv = lab_up(a.hosts, a.releases.split(","), a.with_server, a.lab_id, a.state_dir)
            add_ssh_config_include(user_ssh_config(), a.lab_id, a.state_dir)
            print(f"lab up in {time.monotonic() - t:.1f} s", file=sys.stderr)
            print(inv)
        elif a.cmd == "down":
            lab_down(a.lab_id, a.state_dir)
            remove_ssh_config_include(user_ssh_config(), a.lab_id, a.state_dir)
        elif a.cmd == "status":
            for h in lab_status(a.lab_id, a.state_dir):
                print(json.dumps(h))
        elif a.cmd == "inventory":
            print(inventory_path(a.lab_id, a.state_dir))
        else:
            print(json.dumps(lab_fault(a.host, a.kind, a.arg, a.lab_id, a.state_dir)))
    except FleetctlError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
