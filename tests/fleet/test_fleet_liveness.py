"""Liveness through real sshd, for both SSH kinds (security review turn 3, H2 and L3): a control
process killed (SIGKILL) during a long restart handler leaves nothing of its run on the host and
the host lock free within 2x the keepalive interval, because every command of a locking run is
tied to the lock's holder. (Keepalives noticing a cut link, both kinds: test_fleet_connection.py.)"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import write_ssh_config
from helpers.ledger import from_lab as ledger

INTERVAL_S, COUNT = 2, 2
KEEPALIVE = f"Host *\n  ServerAliveInterval {INTERVAL_S}\n  ServerAliveCountMax {COUNT}\n"
HOST = "lab-04"


def run_processes(server_lab, host: str, before: set[int]) -> dict[int, str]:
    """The host's processes that were not there before the run, less sshd's own (the ssh kind's
    master connection lingers ControlPersist seconds on the control side's behalf): pid -> cmdline."""
    left = {}
    for pid in server_lab.pids(host):
        if pid in before:
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cmd and not cmd.startswith("sshd"):
            left[pid] = cmd
    return left


@pytest.mark.parametrize("kind", ["paramiko", "ssh"])
def test_a_killed_controller_leaves_no_process_of_its_run_and_a_free_lock(server_lab, tmp_path, kind):
    doc = yaml.safe_load(server_lab.inventory.read_text())
    doc["all"]["children"]["lab"]["hosts"][HOST]["fleetctl_restart_cmd"] = "sleep 300"  # a long handler
    inv = tmp_path / "hosts.yaml"
    inv.write_text(yaml.safe_dump(doc, sort_keys=False))
    cfg = write_ssh_config(tmp_path / "config", server_lab.known_hosts, KEEPALIVE)
    before_ids, before_pids = set(ledger(server_lab, HOST)), set(server_lab.pids(HOST))
    p = subprocess.Popen([sys.executable, "-m", "fleetctl.cli", "apply", "defrag-tier0", HOST, "--yes", "-i", str(inv),
                          "-c", kind, "--ssh-config", str(cfg)],
                         env=server_lab.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any("sleep 300" in c for c in run_processes(server_lab, HOST, before_pids).values()):
            assert time.monotonic() < deadline and p.poll() is None, f"the handler never started: {p.stderr.read()[-2000:] if p.poll() is not None else ''}"
            time.sleep(0.2)
        assert [s for c, s in ledger(server_lab, HOST).items() if c not in before_ids] == ["pending"]
        p.kill()  # SIGKILL to the control process alone: its ssh children, if any, are left to notice
        killed = time.monotonic()
        p.wait(10)
        while True:  # the processes first (read here, from /proc), then the lock (over ssh: slower)
            gone = time.monotonic() - killed
            left = run_processes(server_lab, HOST, before_pids)
            if not left or gone > 2 * INTERVAL_S:
                break
            time.sleep(0.05)
        free = server_lab.ssh(HOST, "flock -n /var/lib/fleetctl/lock true").returncode == 0
        assert left == {}, f"{kind}: still on {HOST} {gone:.1f} s after the kill: {left}"
        assert free, f"{kind}: the lock is still held {gone:.1f} s after the kill"
        assert gone < 2 * INTERVAL_S
    finally:
        if p.poll() is None:
            p.kill()
        # the killed run's change is pending: the next run (the lab's own restart handler) undoes it
        r = server_lab.cli("recover", HOST, "--yes", "--json")
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    cid, = [c for c in ledger(server_lab, HOST) if c not in before_ids]
    assert ledger(server_lab, HOST)[cid] == "rolled-back"
