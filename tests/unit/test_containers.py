"""Containers without a lab: the runtime and id read from /proc/PID/cgroup lines of each runtime's
layout, the entry prefix per way in, the choice of that way, the host record's path, change-lost
judgement, and the Python lock used where a container has no shell."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from fleetctl.engine import containers
from fleetctl.connection import command
from fleetctl.errors import HostFailed
from fleetctl.probes import enter
from fleetctl.probes.facts import containers as probe

CID = "4f" * 32
IMG = "9a" * 32


@pytest.mark.parametrize("text, runtime, kube", [
    (f"0::/machine.slice/libpod-{CID}.scope\n", "podman", False),
    (f"4:memory:/process_api/x/libpod_parent/libpod-{CID}\n0::/\n", "podman", False),
    (f"0::/system.slice/docker-{CID}.scope\n", "docker", False),
    (f"12:pids:/docker/{CID}\n", "docker", False),
    (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podab.slice/cri-containerd-{CID}.scope\n",
     "containerd", True),
    (f"0::/kubepods.slice/kubepods-pod1.slice/crio-{CID}.scope\n", "cri-o", True),
    (f"3:cpu:/kubepods/besteffort/pod1/{CID}\n", "unknown", True),
    (f"0::/kubepods.slice/kubepods-pod1.slice/{CID}.scope\n", "unknown", True),
])
def test_runtime_and_id_from_cgroup(text, runtime, kube):
    assert probe.from_cgroup(text) == (runtime, CID, kube)


def test_no_container_in_cgroup():
    assert probe.from_cgroup("0::/user.slice/session-3.scope\n") == ("unknown", None, False)
    # a 64-hex leaf outside kubepods names no runtime (it used to count as an "unknown" container)
    assert probe.from_cgroup(f"0::/lxc.payload.c1/{CID}\n") == ("unknown", None, False)


def test_entry_prefixes():
    proc = {"uid": 1000, "gid": 1001, "start_time": "98765"}
    assert command.container_entry("podman", CID, 42, proc) == ["podman", "exec", "-i", CID]
    assert command.container_entry("crictl", CID, 42, proc) == ["crictl", "exec", "-i", CID]
    entry = command.container_entry("nsenter", "", 42, proc)
    # python3 on PATH, cleared by trust.GUARD, runs probes/enter.py's source with the process's ids
    assert entry[:2] == ["sh", "-c"] and "fleetctl_trust" in entry[2] and 'exec "$q" -I -S "$@"' in entry[2]
    assert entry[4] == "-c" and "setns" in entry[5] and entry[6:] == ["42", "98765", "1000", "1001", "--"]
    with pytest.raises(ValueError, match="unknown: not entered"):
        command.container_entry("nsenter", "", 42, {"uid": None, "gid": 0, "start_time": "1"})
    with pytest.raises(ValueError):
        command.container_entry("docker", "name; rm -rf /", 42, proc)
    with pytest.raises(ValueError):
        command.container_entry("lxc", CID, 42, proc)


def _host(exec_=None):
    return SimpleNamespace(container_exec=exec_, name="h1", restart_cmd=None)


def test_how_to_enter():
    """A container by its runtime's CLI when it is on the host; nsenter only when asked (review
    N1); a rootless one only by nsenter; a foreign process never, whatever the inventory asks."""
    found = {"kind": "container", "root": {"runtime": "podman", "pid": 7}}
    assert containers.how_to_enter(_host(), found, {"podman": True}) == ("podman", None)
    how, note = containers.how_to_enter(_host(), found, {"podman": False})
    assert how is None and note == ("not entered: no podman on the host's PATH; fleetctl_container_exec: nsenter "
                                    "enters it with its process's uid and gid and no more capabilities than it has")
    assert containers.how_to_enter(_host("none"), found, {"podman": True})[0] is None
    assert containers.how_to_enter(_host("nsenter"), found, {"podman": True}) == ("nsenter", containers.NSENTER_NOTE)
    rootless = {"kind": "rootless", "reason": "a rootless container of uid 1000", "root": {"runtime": "podman", "pid": 7}}
    assert containers.how_to_enter(_host(), rootless, {"podman": True}) == (
        None, "not entered: a rootless container of uid 1000; fleetctl_container_exec: nsenter enters it as that user")
    assert containers.how_to_enter(_host("nsenter"), rootless, {})[0] == "nsenter"
    foreign = {"kind": "foreign", "reason": "its cgroup (/user.slice) names no container runtime",
               "root": {"runtime": "unknown", "pid": 9}}
    for asked in (None, "nsenter", "podman"):
        assert containers.how_to_enter(_host(asked), foreign, {"podman": True}) == (
            None, "not entered: pid 9 is no container's: its cgroup (/user.slice) names no container runtime")
    with pytest.raises(HostFailed, match="fleetctl_container_exec"):
        containers.how_to_enter(_host("ssh"), found, {})


# /proc/self/mountinfo of a cgroup v1 + v2 hybrid host (this machine's layout) and of a v2 host
HYBRID = ("30 25 0:26 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n"
          "33 30 0:29 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n"
          "34 30 0:30 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
          "35 30 0:31 / /sys/fs/cgroup/systemd rw,nosuid - cgroup cgroup rw,xattr,name=systemd\n"
          "36 30 0:32 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw\n")
V2 = "29 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec - cgroup2 cgroup2 rw,nsdelegate\n"


def test_cgroup_targets_map_each_line_to_its_hierarchy():
    text = f"4:memory:/libpod_parent/libpod-{CID}\n2:cpu,cpuacct:/x\n1:name=systemd:/s\n0::/\n"
    assert enter.cgroup_targets(text, HYBRID) == [
        f"/sys/fs/cgroup/memory/libpod_parent/libpod-{CID}/cgroup.procs", "/sys/fs/cgroup/cpu,cpuacct/x/cgroup.procs",
        "/sys/fs/cgroup/systemd/s/cgroup.procs", "/sys/fs/cgroup/unified/cgroup.procs"]
    assert enter.cgroup_targets("0::/system.slice/a.service\n", V2) == ["/sys/fs/cgroup/system.slice/a.service/cgroup.procs"]
    with pytest.raises(ValueError, match="not mounted"):
        enter.cgroup_targets("5:pids:/x\n", HYBRID)


@pytest.mark.parametrize("cgroup, owner, kind, reason", [
    (f"0::/machine.slice/libpod-{CID}.scope", 0, "container", None),
    (f"0::/system.slice/docker-{CID}.scope", 1000, "foreign",
     f"its cgroup directory /sys/fs/cgroup/system.slice/docker-{CID}.scope belongs to uid 1000, not root"),
    (f"0::/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{CID}.scope", 1000, "rootless",
     f"a rootless container of uid 1000 (its cgroup /user.slice/user-1000.slice/user@1000.service/user.slice/"
     f"libpod-{CID}.scope is delegated to that user)"),
    (f"0::/user.slice/user-65534.slice/user@65534.service/docker-{CID}.scope", 0, "foreign",
     f"its cgroup /user.slice/user-65534.slice/user@65534.service/docker-{CID}.scope is under user@65534.service "
     "but belongs to uid 0"),
    ("0::/system.slice/sglang.service", 0, "service", None),
    ("0::/system.slice/sglang.service", 1000, "foreign", "its cgroup (/system.slice/sglang.service) names no "
                                                         "container runtime"),
    ("0::/user.slice/user-1000.slice/session-3.scope", 0, "foreign",
     "its cgroup (/user.slice/user-1000.slice/session-3.scope) names no container runtime"),
    (f"0::/lxc.payload.c1/{CID}", 0, "foreign", f"its cgroup (/lxc.payload.c1/{CID}) names no container runtime"),
])
def test_classify_by_cgroup_and_its_owner(tmp_path, monkeypatch, cgroup, owner, kind, reason):
    """Only a known runtime's root-owned, undelegated cgroup makes a container; a root-owned
    system service is a host server; everything else is foreign, with the reason (review N1)."""
    real_lstat = probe.os.lstat
    d = tmp_path / "cg"
    d.mkdir()

    def lstat(path):
        assert path == "/sys/fs/cgroup" + cgroup[3:], path
        st = real_lstat(d)
        return type("st", (), {"st_uid": owner, "st_mode": st.st_mode})()
    monkeypatch.setattr(probe.os, "lstat", lstat)
    got = probe.classify(cgroup + "\n", V2)
    assert (got["kind"], got["reason"]) == (kind, reason)


def test_record_path_keeps_hex_only():
    root = {"container_id": CID, "image_id": "sha256:" + IMG}
    assert containers.record_path("/var/lib/fleetctl", root) == f"/var/lib/fleetctl/containers/{CID}.{IMG}.json"
    assert "/" not in containers.record_path("/s", {"container_id": "../../x", "image_id": None})[len("/s/containers/"):]


def test_lost_changes():
    rec = {"root": {"container_id": CID, "image_id": IMG}, "install": "podman:s:/p",
           "changes": [{"change_id": "c1", "state": "applied"}]}
    same = {"installs": [{"root": {"container_id": CID, "image_id": IMG}}]}
    other = {"installs": [{"root": {"container_id": "1" * 64, "image_id": IMG}}]}
    gone = {"installs": []}
    assert containers.lost_changes([rec], same) == []
    assert containers.lost_changes([rec], gone) == []  # no container of that image runs: nothing to say
    assert containers.lost_changes([rec], other)[0]["problem"] == containers.CHANGE_LOST
    rolled = dict(rec, changes=[{"change_id": "c1", "state": "rolled_back"}])
    assert containers.lost_changes([rolled], other) == []


def test_the_restart_handler_from_a_record_stops_then_starts_by_hex_id_alone():
    """A container a killed run left stopped, or stuck stopping (`podman restart` refuses that
    state), is stopped then started by its runtime's CLI; the id keeps only hex digits (a
    record is the host's file, read as hostile); a CRI container, or a root without an id, has
    none (the kubelet starts CRI containers)."""
    h = containers.restart_handler({"runtime": "podman", "container_id": CID})
    assert h == {"name": "restart sglang", "command": f"podman stop {CID} && podman start {CID}"}
    assert containers.restart_handler({"runtime": "docker", "container_id": CID})["command"].startswith("docker stop ")
    evil = containers.restart_handler({"runtime": "podman", "container_id": "4f; rm -rf / #"})
    assert evil["command"] == "podman stop 4ff && podman start 4ff"
    assert containers.restart_handler({"runtime": "containerd", "container_id": CID}) is None
    assert containers.restart_handler({"runtime": "podman", "container_id": "; ;"}) is None
    assert containers.restart_handler({"runtime": "podman"}) is None


def test_refusal():
    inst = {"id": "podman:s:/p", "container": {"kubelet": False, "read_only_rootfs": True}}
    assert containers.REFUSED in containers.refusal(inst) and "read-only" in containers.refusal(inst)
    inst["container"] = {"kubelet": True, "read_only_rootfs": False}
    assert "kubepods" in containers.refusal(inst)
    assert containers.refusal({"id": "host:/p"}) is None


def test_python_lock(tmp_path):
    """The lock without a shell: its marker line once held; a second taker exits 75 naming the
    holder after its own holder marker line; EOF on stdin releases it."""
    lock = command.python_lock_argv
    first = subprocess.Popen(lock(sys.executable, str(tmp_path / "st"), "me@here", 30, 30, "a1"),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert first.stdout.readline() == b"fleetctl-locked-a1\n"
    second = subprocess.run(lock(sys.executable, str(tmp_path / "st"), "you", 30, 30, "b2"),
                            stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
    assert second.returncode == 75 and command.reply(second.stdout, "fleetctl-holder-b2").startswith(b"me@here since ")
    first.stdin.close()
    assert first.wait(10) == 0
    third = subprocess.Popen(lock(sys.executable, str(tmp_path / "st"), "you", 30, 30, "c3"),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert third.stdout.readline() == b"fleetctl-locked-c3\n"
    third.stdin.close()
    assert third.wait(10) == 0
