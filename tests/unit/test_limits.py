"""What a large fleet reaches on the control machine (issue 55): the open-files limit raised and
what it allows at once, descriptors numbered past select(2)'s 1024 waited on, and a fan-out
wider than --forks holding one connection per host in progress, not per host."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading

from fleetctl import inventory, limits
from fleetctl.connection import Settings, polling
from fleetctl.engine.fleet import Fleet
from fleetctl.vocab import HostStatus


def test_the_soft_open_files_limit_is_raised_to_the_hard_one():
    code = ("import resource; from fleetctl.limits import raise_open_files; "
            "print(raise_open_files(), resource.getrlimit(resource.RLIMIT_NOFILE)[1])")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(256, soft)

    def lower():
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    out = subprocess.run([sys.executable, "-c", code], preexec_fn=lower, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)), check=True).stdout.split()
    assert int(out[0]) == (hard if hard != resource.RLIM_INFINITY else 1 << 20) > low


def test_forks_are_narrowed_to_what_the_open_files_limit_allows(monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 4096))
    assert limits.forks_allowed(64) == 64
    assert limits.forks_allowed(1000) == (1024 - limits.RESERVED_FDS) // limits.FDS_PER_HOST == 120
    monkeypatch.setattr(resource, "getrlimit", lambda which: (10, 4096))
    assert limits.forks_allowed(64) == 1


def test_a_descriptor_past_1024_is_waited_on():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1030)]
    r, w = os.pipe()
    try:
        assert r > 1024
        assert polling.wait([r], [w], 0) == ([], [w])
        os.write(w, b"x")
        assert polling.wait([r], [], 0) == ([r], [])
        os.read(r, 1)
        os.close(w)
        assert polling.wait([r], [], 0) == ([r], [])  # EOF is readable, as select says
    finally:
        for fd in held + [r]:
            os.close(fd)
        try:
            os.close(w)
        except OSError:
            pass


def test_a_last_run_wider_than_forks_holds_a_connection_per_host_in_progress(tmp_path):
    path = tmp_path / "hosts.yaml"
    path.write_text("all:\n  hosts:\n" + "".join(f"    h{i}:\n      ansible_connection: local\n" for i in range(12)))
    hosts = inventory.load(path).select("all")
    most, lock = [0], threading.Lock()

    def job(ctx):
        with lock:
            most[0] = max(most[0], len(fleet._conns))
        return ctx.result(HostStatus.OK)

    with Fleet(Settings(), forks=3, timeout=60) as fleet:
        assert all(r.status == HostStatus.OK for r in fleet.run(hosts, job, last=True))
        assert most[0] <= 3 and fleet._conns == {}
    with Fleet(Settings(), forks=3, timeout=60) as fleet:  # a run that later runs reuse keeps them
        fleet.run(hosts, job)
        assert len(fleet._conns) == 12
