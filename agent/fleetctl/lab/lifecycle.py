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

import concurrent.futures
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Callable

import yaml

from ..errors import UsageError
from ..wheels import ensure_wheel
from .base import (DEFAULT_RELEASES, LATENCY_SLACK_S, PRIVATE_DIRS, REAL_ROOT, SERVER_PORT, LabError, alive,
                   bridge_name, find_host, host_address, host_dir, host_name, inventory_path, load, netns_name,
                   release_group, require_root, run, save, state_dir_for, wait_banner)
from .become import lab_add_become_users, lab_remove_become_users
from .host import (LAB_INIT, build_venv, sshd_config, stage_wheels, start_init, start_proxy, start_server,
                   start_sshd, wait_server)
from .knownhosts import default_known_hosts, forget_known_hosts
from .pidns import in_pidns, is_pidns_init, pidns_members
from .reach import REACH_HOSTS, reach_address
from .sshconfig import write_lab_ssh_config


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
    nss = [line.split()[0] for line in run(["ip", "netns", "list"]).stdout.splitlines()
           if line.split() and line.split()[0].startswith(prefix)]
    pid_nss: set[tuple[int, int]] = set()  # the hosts' PID namespaces, to see them empty below
    for _ in range(50):  # again until empty: a process may be starting (restart.sh, a session)
        pids = [int(p) for ns in nss
                for p in run(["ip", "netns", "pids", ns], check=False).stdout.split()]
        if not pids:
            break
        pids.sort(key=lambda p: not is_pidns_init(p))  # inits first
        for pid in filter(is_pidns_init, pids):
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
    while pid_nss and time.monotonic() < deadline and any(in_pidns(d, pid_nss) for d in os.listdir("/proc")):
        time.sleep(0.05)
    for ns in nss:
        run(["ip", "netns", "del", ns], check=False)
    for line in run(["ip", "-o", "link", "show"]).stdout.splitlines():
        dev = line.split(":")[1].strip().split("@")[0]
        if dev == bridge_name(lab_id) or dev.startswith(prefix):
            run(["ip", "link", "del", dev], check=False)
    forget_known_hosts(known_hosts or default_known_hosts(),
                       [host_address(lab_id, i) for i in range(244)] + [reach_address(lab_id, n) for n in REACH_HOSTS])
    lab_remove_become_users(lab_id)
    for p in ("lab.json", "hosts.yaml", "ssh_config", "become_password"):
        (sd / p).unlink(missing_ok=True)
    shutil.rmtree(sd / "hosts", ignore_errors=True)


def hidden_interpreter(executable: str | None = None) -> str | None:
    """Why the lab's hosts cannot start `executable` (default: sys.executable, the interpreter
    host.start_init execs in each host), or None when they can. Each host mounts its own /tmp,
    /opt/sglang, ... over this machine's (base.PRIVATE_DIRS), so an interpreter under one of them
    (a venv made in the temp directory) is "not found" inside every host, and the lab's init dies
    before sshd starts (review newcomer-turn4.md, item 8). Both the path as given and its
    symlinks' target are checked."""
    given = Path(os.path.abspath(executable or sys.executable))
    for path in dict.fromkeys([given, Path(os.path.realpath(given))]):
        for private in PRIVATE_DIRS:
            if path == Path(private) or Path(private) in path.parents:
                return (f"fleetctl runs under {given}, inside {private}, which each lab host mounts a "
                        f"private copy over: the hosts cannot start it. Install fleetctl in an "
                        f"interpreter or venv outside {', '.join(PRIVATE_DIRS)} (e.g. python3 -m venv "
                        f"/opt/fleetctl-venv) and run `fleetctl lab up` from there")
    return None


def keep_logs(sd: Path) -> Path | None:
    """Copy each host's logs (`<sd>/hosts/NAME/*.log`: init, sshd, the stand-in) of a failed
    `lab up` to `<sd>/failed-up/NAME/` before the teardown removes `<sd>/hosts`, and return that
    directory (None when there was no log). An earlier failed-up directory is replaced. Regular
    files only, never through a symlink."""
    hosts = sd / "hosts"
    kept = sd / "failed-up"
    shutil.rmtree(kept, ignore_errors=True)
    found = False
    for log in sorted(hosts.glob("*/*.log")) if hosts.is_dir() else []:
        if log.is_symlink() or not log.is_file():
            continue
        dest = kept / log.parent.name
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log, dest / log.name, follow_symlinks=False)
        found = True
    return kept if found else None


def lab_up(hosts: int | None = None, releases: list[str] | None = None, with_server: bool = False,
           lab_id: int = 0, state_dir: Path | None = None, known_hosts: Path | None = None,
           jobs: int = 2, say: Callable[[str], None] | None = None) -> Path:
    """Build a lab of `hosts` real SSH hosts (default: one per release) and return its inventory path.

    Any existing lab with this id is torn down first. Host i gets releases[i % len(releases)]
    (default 0.4.6.post5, 0.5.2, 0.5.10, 0.5.23) pip-installed from the wheel cache
    (fleetctl.wheels) into /opt/sglang/venv, or copied from that venv's template once one
    was built on this machine (build_venv); `jobs` venvs are built at once. Host keys go
    to `known_hosts` (default ~/.ssh/known_hosts of the passwd home), stale lines for the lab's addresses
    removed first; `<state dir>/ssh_config` gets a Host block per host (lab_ssh_config_path;
    `fleetctl lab up` Includes it from ~/.ssh/config). With `with_server`,
    agent/fleetctl/lab/standin/restart.sh starts the stand-in SGLang server on each host's
    127.0.0.1:30000. The lab's become users (become_users: sudo rules per host) are created
    with a new password (become_password). Raises LabError (no root, a step failed: the
    half-built lab is torn down) or FleetctlError (a wheel cannot be had). `say(line)` is
    told each step as it starts (`fleetctl lab up` prints them), the files outside the state
    dir it edits (known_hosts) included.
    """
    say = say or (lambda line: None)
    hidden = hidden_interpreter()
    if hidden:
        raise LabError(hidden)
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
    say(f"wheels: {', '.join(releases)} (cache, else downloaded)")
    for r in releases:
        ensure_wheel(r)
    if (sd / "lab.json").exists():
        print(f"fleetctl lab {lab_id} exists: tearing it down and building it again "
              "(its hosts' files, ledgers and changes are discarded)", file=sys.stderr)
    lab_down(lab_id, sd, known_hosts)
    sd.mkdir(parents=True, exist_ok=True)
    try:
        return _up(n, releases, with_server, lab_id, sd, known_hosts, jobs, say)
    except BaseException as e:
        kept = keep_logs(sd)
        lab_down(lab_id, sd, known_hosts)
        if kept is None or not isinstance(e, LabError):
            raise
        # the message may name a log under <sd>/hosts, which the teardown just removed
        raise LabError(str(e).replace(str(sd / "hosts"), str(kept))
                       + f" (the failed lab's host logs are kept in {kept})") from e


def _up(n: int, releases: list[str], with_server: bool, lab_id: int, sd: Path,
        known_hosts: Path, jobs: int, say: Callable[[str], None]) -> Path:
    key = sd / "client_ed25519"
    if not key.exists():
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"fleetctl-lab-{lab_id}",
             "-f", str(key)])
    for p in PRIVATE_DIRS:
        Path(p).mkdir(parents=True, exist_ok=True)  # mount points in the root filesystem
    Path("/run/sshd").mkdir(mode=0o755, parents=True, exist_ok=True)
    (sd / "lab-init.py").write_text(LAB_INIT)
    br = bridge_name(lab_id)
    say(f"network: bridge {br}, 10.213.{lab_id}.0/24")
    run(["ip", "link", "add", br, "type", "bridge"])
    run(["ip", "addr", "add", f"10.213.{lab_id}.1/24", "dev", br])
    run(["ip", "link", "set", br, "up"])
    state = {"lab_id": lab_id, "with_server": with_server, "hosts": []}
    for i in range(n):
        name, ns, addr = host_name(i), netns_name(lab_id, i), host_address(lab_id, i)
        say(f"host {name}: namespace {ns}, {addr}, sshd")
        hd = host_dir(sd, name)
        for d in [*PRIVATE_DIRS.values(), REAL_ROOT]:
            (hd / d).mkdir(parents=True, exist_ok=True)
        (hd / "tmp").chmod(0o1777)
        (hd / PRIVATE_DIRS["/var/lib/fleetctl-kernels"]).chmod(0o755)  # root's: read by unprivileged servers
        (hd / "delay_ms").write_text("0\n")
        run(["ip", "netns", "add", ns])
        run(["ip", "link", "add", ns, "type", "veth", "peer", "name", ns + "p"])
        run(["ip", "link", "set", ns, "master", br, "up"])
        run(["ip", "link", "set", ns + "p", "netns", ns])
        for cmd in (["link", "set", ns + "p", "name", "eth0"], ["addr", "add", f"{addr}/24", "dev", "eth0"],
                    ["link", "set", "eth0", "up"], ["link", "set", "lo", "up"]):
            run(["ip", "-n", ns, *cmd])
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name,
             "-f", str(hd / "ssh_host_ed25519_key")])
        sshd_config(hd, sd)
        h = {"name": name, "netns": ns, "address": addr, "release": releases[i % len(releases)],
             "veth": ns, "init_pid": start_init(ns, name, hd, sd),
             "faults": {"delay_ms": 0, "down": False, "frozen": False, "rekeyed": False,
                        "hung": False}}
        h["sshd_pid"] = start_sshd(h, sd)
        h["proxy_pid"] = start_proxy(h, sd)
        state["hosts"].append(h)
    save(sd, state)
    say(f"SGLang venvs: {n} host(s), {jobs} at once (/opt/sglang/venv)")
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        wheels = stage_wheels(sd, sorted({h["release"] for h in state["hosts"]}))
        list(pool.map(lambda h: build_venv(h, sd, wheels[h["release"]]), state["hosts"]))
    say("waiting for each sshd's banner")
    for h in state["hosts"]:
        wait_banner(h["address"])
    if with_server:
        say(f"stand-in servers: starting on each host's 127.0.0.1:{SERVER_PORT} and waiting for /health")
        for h in state["hosts"]:
            h["server_pid"] = start_server(h, sd)
        save(sd, state)
        for h in state["hosts"]:
            wait_server(h)
    say(f"known_hosts: {known_hosts}: the lab's {n} host key(s) replace its addresses' lines")
    forget_known_hosts(known_hosts, [h["address"] for h in state["hosts"]])
    known_hosts.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(known_hosts, "a") as f:
        for h in state["hosts"]:
            pub = (host_dir(sd, h["name"]) / "ssh_host_ed25519_key.pub").read_text().split()
            f.write(f"{h['address']} {pub[0]} {pub[1]}\n")
    say(f"ssh_config: {sd / 'ssh_config'}; become users and their sudo rules")
    write_lab_ssh_config(sd, state, known_hosts)
    lab_add_become_users(lab_id, sd)
    inv = inventory_path(state_dir=sd)
    inv.write_text(_inventory_yaml(state, sd))
    return inv


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
        children.setdefault(release_group(h["release"]), {"hosts": {}})["hosts"][h["name"]] = None
    doc = {"all": {"children": {"lab": {"hosts": hosts, "children": children}}}}
    return (f"# fleetctl lab {state['lab_id']}: written by `fleetctl lab up`; "
            "`fleetctl lab down` removes the hosts\n" + yaml.safe_dump(doc, sort_keys=False))


def lab_status(lab_id: int = 0, state_dir: Path | None = None) -> list[dict]:
    """One dict per host: name, address, netns, release, sshd_pid, sshd_alive, proxy_alive,
    link_up, faults (delay_ms, down, frozen, rekeyed, hung; contention_ms and fail_every once
    `fleetctl lab fault` set them). Raises LabError if no lab is up."""
    require_root()
    sd = state_dir_for(lab_id, state_dir)
    out = []
    for h in load(sd)["hosts"]:
        link = run(["ip", "-o", "link", "show", h["veth"]], check=False).stdout
        out.append({"name": h["name"], "address": h["address"], "netns": h["netns"],
                    "release": h["release"], "sshd_pid": h["sshd_pid"],
                    "sshd_alive": alive(h["sshd_pid"]), "proxy_alive": alive(h["proxy_pid"]),
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
    h = find_host(load(sd), host)
    own = {h["init_pid"], h["sshd_pid"]}
    return [p for p in pidns_members(h["init_pid"]) if p not in own]
