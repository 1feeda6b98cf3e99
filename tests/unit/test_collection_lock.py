"""The collection's lease on fleetctl's host lock without a lab or root (security review turn 3, N12):
the lock module's wait runs on the monotonic clock, and only the play's own facts name its lease.
Real flock and fork on a state dir of the test's; tests/machine/test_collection_lock_as_root.py runs the
modules as a host runs them."""

from __future__ import annotations

import fcntl
import importlib
import os
import threading
import time

import pytest

from fleetctl.collection import build, ops


@pytest.fixture
def lock(tmp_path, monkeypatch):
    """The collection's lock module, imported from a fresh build."""
    build.build(tmp_path / "c")
    monkeypatch.syspath_prepend(str(tmp_path / "c"))
    return importlib.import_module("ansible_collections.fleetctl.sglang.plugins.modules.lock")


class SteppedClock:
    """The time module, except that its wall clock steps an hour ahead after its first reading (an NTP
    step, or an operator's `date -s`)."""

    def __init__(self):
        self.readings = 0

    def time(self) -> float:
        self.readings += 1
        return time.time() + (3600 if self.readings > 1 else 0)

    def __getattr__(self, name):
        return getattr(time, name)


def test_take_waits_on_the_monotonic_clock_through_a_wall_clock_step(lock, tmp_path, monkeypatch):
    """Another run holds fleetctl's lock (a flock on STATE_DIR/lock: here the test's own) and frees it
    1.5 s later, while the wall clock steps an hour ahead. take() with wait_s=10 keeps trying and
    gets it: its deadline is on time.monotonic, which no clock step moves."""
    sd = tmp_path / "state"
    sd.mkdir(mode=0o700)
    fd = os.open(sd / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    threading.Timer(1.5, os.close, (fd,)).start()
    monkeypatch.setattr(lock, "time", SteppedClock())
    t0 = time.monotonic()
    lease = lock.take(str(sd), "next-run", 60, 10)
    waited = time.monotonic() - t0
    try:
        assert lease is not None, f"take() gave up after {waited:.1f} s of its 10"
        assert lease["holder"] == "next-run" and 1.4 < waited < 9
    finally:
        if lease is not None:
            lock.release(str(sd), lease)
            os.waitpid(lease["pid"], 0)  # the holder was forked from this process


def test_only_the_plays_own_facts_name_its_lease():
    """The plugins renew the lease the play's facts name (set by the lock module or by patch); an
    inventory var of the same name, or a lease in another state dir, is not the play's."""
    lease = {"token": "ab" * 16, "holder": "ansible-playbook", "lease_s": 300, "state_dir": "/var/lib/fleetctl"}
    assert ops.held_lease({"ansible_facts": {ops.LEASE_FACT: lease}}, "/var/lib/fleetctl") == lease
    assert ops.held_lease({ops.LEASE_FACT: lease}, "/var/lib/fleetctl") == {}
    assert ops.held_lease({"ansible_facts": {ops.LEASE_FACT: lease}}, "/srv/fleetctl") == {}
    assert ops.held_lease({"ansible_facts": {ops.LEASE_FACT: {}}}, "/var/lib/fleetctl") == {}
