"""fleetctl's container entry (probes/enter.py, `fleetctl_container_exec: nsenter`) against real
processes in namespaces of their own on this machine, as root (review N1): what runs inside has
the target's uid and gid, no capability its bounding set lacks, no_new_privs, the target's
namespaces and cgroups; a pid that is no longer the process inspected is refused before
anything runs. The same through sshd and a lab host: tests/fleet/test_fleet_hostile_containers.py."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fleetctl.connection import command
from fleetctl.probes import enter
from fleetctl.probes.facts import containers

SHOW = ('grep -E "^(Uid|Gid|Groups|CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs):" /proc/self/status; '
        'readlink /proc/self/ns/mnt /proc/self/ns/pid; grep -E "^[0-9]+:pids:" /proc/self/cgroup; echo "pid $$"')


@pytest.fixture
def target():
    """Start `argv` (a target process) in namespaces of its own; yields a starter, then kills
    every target with SIGKILL (a pid namespace's init ignores TERM) and removes its cgroup."""
    started, groups = [], []

    def start(argv: list[str], cgroup: bool = False) -> int:
        p = subprocess.Popen(argv)
        started.append(p)
        for _ in range(100):  # the last process of the chain: unshare forks or execs into it
            kids = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
            pid = int(kids[0]) if kids else p.pid
            if Path(f"/proc/{pid}/comm").read_text().strip() == "sleep":
                break
            time.sleep(0.05)
        if cgroup:
            d = Path(f"/sys/fs/cgroup/pids/fc-enter-{secrets.token_hex(4)}")
            d.mkdir()
            groups.append(d)
            (d / "cgroup.procs").write_text(str(pid))
        return pid

    yield start
    for p in started:
        for pid in [p.pid] + [int(x) for x in Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
                              if Path(f"/proc/{p.pid}").exists()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait(timeout=10)
    for d in groups:
        for _ in range(50):
            try:
                d.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def entered(pid: int, uid: int, gid: int, script: str = SHOW, start: str | None = None) -> subprocess.CompletedProcess:
    """`sh -c script` run through container_entry("nsenter", ...) for process `pid`."""
    proc = containers.process(pid)
    proc.update(uid=uid, gid=gid)
    if start is not None:
        proc["start_time"] = start
    argv = command.container_entry("nsenter", "", pid, proc) + ["/bin/sh", "-c", script]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


def fields(out: str) -> dict:
    return {k: v.strip() for k, _, v in (line.partition(":") for line in out.splitlines()) if v}


def test_a_nobody_target_gives_nobody_with_no_capabilities(target):
    """A process of nobody in its own mount namespace: the command runs as nobody (real,
    effective, saved, fs), no groups, no capabilities, no_new_privs, in that namespace."""
    pid = target(["unshare", "--mount", "--propagation", "private", "--", "setpriv", "--reuid=65534",
                  "--regid=65534", "--clear-groups", "sleep", "300"])
    r = entered(pid, 65534, 65534)
    assert r.returncode == 0, r.stderr
    f = fields(r.stdout)
    assert f["Uid"].split() == ["65534"] * 4 and f["Gid"].split() == ["65534"] * 4 and f["Groups"] == ""
    assert (f["CapInh"], f["CapPrm"], f["CapEff"], f["CapAmb"], f["NoNewPrivs"]) == ("0" * 16,) * 4 + ("1",)
    assert os.readlink(f"/proc/{pid}/ns/mnt") in r.stdout and os.readlink("/proc/self/ns/mnt") not in r.stdout


def test_a_root_target_keeps_only_what_its_bounding_set_allows(target):
    """A root process with two capabilities in its bounding set, in its own pid namespace and
    cgroup: the command runs as root with exactly those two, in its pid namespace (pid 2 or
    more: it is not the target) and its cgroup; never host root's full set."""
    pid = target(["unshare", "--mount", "--pid", "--fork", "--mount-proc", "--propagation", "private", "--",
                  "setpriv", "--bounding-set=-all,+chown,+dac_override", "sleep", "300"], cgroup=True)
    r = entered(pid, 0, 0)
    assert r.returncode == 0, r.stderr
    f = fields(r.stdout)
    assert f["Uid"].split() == ["0"] * 4
    assert (f["CapBnd"], f["CapPrm"], f["CapEff"], f["CapInh"], f["NoNewPrivs"]) == ("0" * 15 + "3",) * 3 + ("0" * 16, "1")
    cgroup = next(line for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines() if ":pids:" in line)
    assert "fc-enter-" in cgroup and cgroup in r.stdout.splitlines()
    assert os.readlink(f"/proc/{pid}/ns/pid") in r.stdout
    assert int(r.stdout.rsplit("pid ", 1)[1]) > 1


def test_a_reused_pid_is_refused_before_anything_runs(target, tmp_path):
    """A start time that is not the process's (its pid was reused since the facts probe): exit
    125 with the reason, and the command never ran."""
    pid = target(["unshare", "--mount", "--propagation", "private", "--", "sleep", "300"])
    mark = tmp_path / "ran"
    r = entered(pid, 0, 0, f"touch {mark}", start="1")
    assert (r.returncode, r.stderr.strip()) == (
        enter.FAILED, f"fleetctl-enter: pid {pid} is no longer the process the facts probe saw")
    assert not mark.exists()


def test_a_target_at_its_pids_limit_is_refused_with_no_traceback(target):
    """Review round 3's red team: a container at its pids.max makes the fork inside its cgroup
    fail. That failure is a one-line exit 125, never a traceback (which opens files and imports
    modules from the container's root while still host root), and nothing ran."""
    pid = target(["unshare", "--mount", "--propagation", "private", "--", "sleep", "300"], cgroup=True)
    group = next(line for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines() if ":pids:" in line)
    limit = Path("/sys/fs/cgroup/pids") / group.split(":", 2)[2].lstrip("/") / "pids.max"
    limit.write_text("1\n")
    r = entered(pid, 0, 0, "echo ran")
    assert (r.returncode, r.stdout) == (enter.FAILED, "")
    assert r.stderr.startswith("fleetctl-enter: BlockingIOError: ") and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
