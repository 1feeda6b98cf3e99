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
from fleetctl.probes import containers as probe

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
])
def test_runtime_and_id_from_cgroup(text, runtime, kube):
    assert probe.from_cgroup(text) == (runtime, CID, kube)


def test_no_container_in_cgroup():
    assert probe.from_cgroup("0::/user.slice/session-3.scope\n") == ("unknown", None, False)


def test_entry_prefixes():
    assert command.container_entry("podman", CID, 42) == ["podman", "exec", "-i", CID]
    assert command.container_entry("crictl", CID, 42) == ["crictl", "exec", "-i", CID]
    assert command.container_entry("nsenter", "", 42) == ["nsenter", "-t", "42", "-a", "--"]
    with pytest.raises(ValueError):
        command.container_entry("docker", "name; rm -rf /", 42)
    with pytest.raises(ValueError):
        command.container_entry("lxc", CID, 42)


def _host(exec_=None):
    return SimpleNamespace(container_exec=exec_, name="h1", restart_cmd=None)


def test_how_to_enter():
    found = {"root": {"runtime": "podman"}}
    assert containers.how_to_enter(_host(), found, {"podman": True}) == ("podman", None)
    how, note = containers.how_to_enter(_host(), found, {"podman": False})
    assert how == "nsenter" and "host root" in note
    assert containers.how_to_enter(_host("none"), found, {"podman": True})[0] is None
    assert containers.how_to_enter(_host("nsenter"), found, {"podman": True})[0] == "nsenter"
    with pytest.raises(HostFailed, match="fleetctl_container_exec"):
        containers.how_to_enter(_host("ssh"), found, {})


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


def test_refusal():
    inst = {"id": "podman:s:/p", "container": {"kubelet": False, "read_only_rootfs": True}}
    assert containers.REFUSED in containers.refusal(inst) and "read-only" in containers.refusal(inst)
    inst["container"] = {"kubelet": True, "read_only_rootfs": False}
    assert "kubepods" in containers.refusal(inst)
    assert containers.refusal({"id": "host:/p"}) is None


def test_python_lock(tmp_path):
    """The lock without a shell: LOCKED once held; a second taker exits 75 naming the holder;
    EOF on stdin releases it."""
    first = subprocess.Popen(command.python_lock_argv(sys.executable, str(tmp_path / "st"), "me@here", 30),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert first.stdout.readline() == b"LOCKED\n"
    second = subprocess.run(command.python_lock_argv(sys.executable, str(tmp_path / "st"), "you", 30),
                            stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
    assert second.returncode == 75 and second.stdout.startswith(b"me@here since ")
    first.stdin.close()
    assert first.wait(10) == 0
    third = subprocess.Popen(command.python_lock_argv(sys.executable, str(tmp_path / "st"), "you", 30),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert third.stdout.readline() == b"LOCKED\n"
    third.stdin.close()
    assert third.wait(10) == 0
