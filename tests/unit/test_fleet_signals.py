"""Fleet.run under a real SIGINT sent to this process (engine/fleet.py _Signals): the signal is
counted while the hosts' workers run and acted on between waits: the first lets the host in
progress finish and starts no other (a second Ctrl-C: tests/fleet/test_fleet_interrupt.py)."""

from __future__ import annotations

import os
import signal
import time

from fleetctl.connection import Settings
from fleetctl.engine.context import HostResult
from fleetctl.engine.fleet import Fleet
from fleetctl.vocab import HostStatus
from helpers.lab import local_host


def _job(sigints: int, sleep_s: float):
    def job(ctx):
        if ctx.host.name == "first":
            for _ in range(sigints):
                os.kill(os.getpid(), signal.SIGINT)  # delivered to the main thread, waiting in run()
                time.sleep(0.3)
            time.sleep(sleep_s)
        return HostResult(ctx.host.name, ctx.conn.address, HostStatus.OK)
    return job


def test_one_sigint_lets_the_host_in_progress_finish_and_starts_no_other(tmp_path):
    hosts = [local_host(tmp_path, "first"), local_host(tmp_path, "second")]
    # Python's own SIGINT handler, as a terminal's foreground job has it (a test run started as a
    # background job, as CI scripts start it, inherits SIGINT ignored, and run() then counts none)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with Fleet(Settings(), forks=1, timeout=60) as fleet:
            first, second = fleet.run(hosts, _job(1, 0.5))
        handler_after = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, before)
    assert fleet.interrupted
    assert first.status == HostStatus.OK
    assert (second.status, second.interrupted) == (HostStatus.NOT_ATTEMPTED, True)
    assert handler_after is signal.default_int_handler  # put back

