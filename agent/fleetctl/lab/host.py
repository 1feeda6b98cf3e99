"""One lab host's pieces: its init and namespaces, its sshd and delay proxy, its venvs and its
stand-in server; commands run inside it."""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..wheels import cache_dir, ensure_wheel
from .base import PRIVATE_DIRS, REAL_ROOT, SERVER_PORT, SSHD, STANDIN_SRC, VENV, LabError, host_dir, run, spawn
from .pidns import children, is_pidns_init, root_pid

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


def sshd_config(hd: Path, sd: Path) -> Path:
    """Write the host's sshd config, <hd>/sshd_config (127.0.0.1:22, its own ed25519 host key, root
    login by the lab's client key only), and return its path."""
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


# the entries of the machine's /root others may read that a host keeps: the lab venvs' interpreter
# and the build caches (ccache, torch extensions, Triton); other tools' world-readable files stay out
ROOT_SHARED = (".pyenv", ".cache")


def root_binds(hd: Path) -> list[str]:
    """Shell commands that give the host a /root every user may pass through (a 0711 tmpfs)
    holding, bind-mounted (a link copied as a link), ROOT_SHARED and every entry of the control
    machine's /root that others may not read (its own mode keeps it private: /root/.ssh 0700),
    so that a server of another uid runs the lab's venvs, whose interpreter lies under
    /root/.pyenv (0755), as any user runs a real host's /usr/bin/python3. The machine's own /root
    stays 0700; what a host writes at the top of its /root stays in its tmpfs. The machine's
    /root is reached through HOST_DIR/real-root, bound there first and unmounted after."""
    real = hd / REAL_ROOT
    cmds = [f"mount --bind /root {real}", "mount -t tmpfs -o mode=0711,size=64m fleetctl-root /root"]
    for e in sorted(os.listdir("/root")):
        p, src, dst = Path("/root") / e, shlex.quote(str(real / e)), shlex.quote(f"/root/{e}")
        if e not in ROOT_SHARED and p.lstat().st_mode & 0o004:
            continue
        if p.is_symlink():
            cmds.append(f"cp -P {src} {dst}")
        else:
            cmds.append(f"{'mkdir' if p.is_dir() else 'touch'} {dst} && mount --bind {src} {dst}")
    return cmds + [f"umount {real}"]


def start_init(ns: str, hostname: str, hd: Path, sd: Path) -> int:
    """Make the host's PID, mount and UTS namespaces inside network namespace `ns` and return
    the root-view pid of their PID 1, the lab's init, once the hostname and bind mounts are in
    place (PRIVATE_DIRS, and /root as root_binds makes it).

    `nsenter --net=/run/netns/NS unshare --mount --uts sh -c '... exec unshare --pid --fork
    --mount-proc sh -c ...'`: the hostname and bind mounts are made in the new mount and UTS
    namespaces before the PID namespace exists, so the processes they take use no pid in it and
    the host's pids do not depend on how many mounts it has (its /root's entries); the inner
    unshare forks (its child is PID 1 of the new PID namespace, in a copy of those mounts with a
    private /proc, see unshare(1)), which says ready (a builtin: no pid) and execs the init. The
    unshare process stays behind as the init's parent, in the root PID namespace."""
    binds = " && ".join([f"mount --bind {hd / d} {p}" for p, d in PRIVATE_DIRS.items()] + root_binds(hd))
    init = shlex.quote(f"echo ready && exec {sys.executable} -I -S {sd / 'lab-init.py'} {hostname} </dev/null >/dev/null")
    script = (f"hostname {hostname} && mount --make-rprivate / && {binds} "
              f"&& exec unshare --pid --fork --mount-proc sh -c {init}")
    with open(hd / "init.log", "ab") as log:
        p = subprocess.Popen(["nsenter", f"--net=/run/netns/{ns}", "unshare", "--mount", "--uts", "sh", "-c", script],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                             start_new_session=True)
    line = p.stdout.readline()
    p.stdout.close()
    init = children(p.pid)
    if line.strip() != b"ready" or len(init) != 1 or not is_pidns_init(init[0]):
        raise LabError(f"host {hostname}: namespace setup failed, see {hd / 'init.log'}")
    return init[0]


def in_host(init: int, *cmd: str) -> list[str]:
    """Command line that runs `cmd` inside the host's PID, mount, UTS and network namespaces
    (those of its init, root-view pid `init`). nsenter forks for the PID namespace
    (nsenter(1)): the command is nsenter's child, nsenter waits for it and exits with its status."""
    return ["nsenter", "-t", str(init), "-p", "-m", "-u", "-n", "--", *cmd]


def _spawn_in(init: int, cmd: list[str], log: Path, timeout: float = 10.0) -> int:
    """Start `cmd` in the background inside the host (see in_host) and return its root-view pid
    (nsenter's child), output appended to `log`."""
    p = spawn(in_host(init, *cmd), log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = children(p.pid)
        if kids:
            return kids[0]
        if p.poll() is not None:
            break
        time.sleep(0.002)
    raise LabError(f"{' '.join(cmd)} did not start in the lab host, see {log}")


def start_sshd(h: dict, sd: Path) -> int:
    """Start the host's sshd (foreground, -D) inside it; return its root-view pid."""
    hd = host_dir(sd, h["name"])
    return _spawn_in(h["init_pid"], [SSHD, "-D", "-e", "-f", str(hd / "sshd_config")], hd / "sshd.log")


def start_proxy(h: dict, sd: Path) -> int:
    """Start the host's delay proxy in its network namespace only (the lab's network, not a
    process the host sees); return its pid."""
    hd = host_dir(sd, h["name"])
    proxy = Path(__file__).with_name("delayproxy.py")
    p = spawn(["nsenter", f"--net=/run/netns/{h['netns']}", sys.executable, str(proxy),
               "--listen", f"{h['address']}:22", "--connect", "127.0.0.1:22",
               "--delay-file", str(hd / "delay_ms")], hd / "proxy.log")
    return p.pid


def stage_wheels(sd: Path, releases: list[str]) -> dict[str, Path]:
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


def build_venv(h: dict, sd: Path, wheel: Path, venv: str = VENV) -> None:
    """Create `venv` (default /opt/sglang/venv) inside the host (so sys.prefix is that path there)
    and pip-install `wheel` (--no-deps --no-index; --no-compile for speed). The first venv of a
    wheel, in-host path and interpreter is kept as a template (_venv_template) and each later one
    is a copy of it: pip's own tree, made at the same in-host path, so every path inside holds."""
    assert venv.startswith("/opt/sglang/"), venv
    dst = host_dir(sd, h["name"]) / PRIVATE_DIRS["/opt/sglang"] / venv[len("/opt/sglang/"):]
    template = _venv_template(wheel, venv)
    if template.is_dir():
        shutil.copytree(template, dst, symlinks=True, dirs_exist_ok=True)
        return
    enter = in_host(h["init_pid"])
    run(enter + [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv])
    run(enter + [sys.executable, "-m", "pip", "--python", f"{venv}/bin/python", "install",
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


def start_server(h: dict, sd: Path) -> int:
    """Copy agent/fleetctl/lab/standin/ to the host's /opt/fleetctl-standin and run its restart.sh
    there; return the server's root-view pid (its pid file holds the host's view)."""
    if not (STANDIN_SRC / "restart.sh").exists():
        raise LabError(f"the stand-in server is missing: {STANDIN_SRC / 'restart.sh'} does not exist")
    dst = host_dir(sd, h["name"]) / PRIVATE_DIRS["/opt/fleetctl-standin"]
    shutil.copytree(STANDIN_SRC, dst, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    run(in_host(h["init_pid"], "env", f"PYTHON={VENV}/bin/python",
                "/opt/fleetctl-standin/restart.sh"), timeout=120)
    nspid = int((dst / "server.pid").read_text())
    pid = root_pid(h["init_pid"], nspid)
    if pid is None:
        raise LabError(f"{h['name']}: the stand-in server (pid {nspid} on the host) exited at once; "
                       "see /opt/fleetctl-standin/server.log on the host")
    return pid


def wait_server(h: dict, timeout: float = 180.0, port: int = SERVER_PORT) -> None:
    """Wait until GET http://127.0.0.1:PORT/health answers 200 inside the host, else LabError."""
    probe = ("import sys, time, urllib.request\n"
             f"end = time.monotonic() + {timeout}\n"
             "while time.monotonic() < end:\n"
             "    try:\n"
             f"        if urllib.request.urlopen('http://127.0.0.1:{port}/health', timeout=2).status == 200: sys.exit(0)\n"
             "    except OSError: pass\n"
             "    time.sleep(0.2)\n"
             "sys.exit(1)\n")
    r = run(in_host(h["init_pid"], sys.executable, "-c", probe), check=False, timeout=timeout + 10)
    if r.returncode != 0:
        raise LabError(f"{h['name']}: the stand-in server is not healthy after {timeout:.0f} s; "
                       f"see /opt/fleetctl-standin/server.log on the host")
