"""Case 10 (../shared/cases/turn4/10-nvidia-smi-uninterruptible.md) on this machine, for real: a
nvidia-smi stuck in the driver is a process in uninterruptible sleep (state D) that SIGKILL does
not end, made here with the cgroup v1 freezer (a frozen task shows state D and dies on SIGKILL only
once thawed; cgroup v2's cgroup.freeze lets SIGKILL through). The GPU query leaves it behind within
its limit, names its pid and state, starts no second one while it is stuck; `fleetctl inspect`
answers within the host's deadline, the host ok with its other facts; kbuild's preflight refuses
with the same reason.
The `nvidia-smi` is a STAND-IN (no GPU here): a script that freezes itself before it answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fleetctl.probes import bounded
from fleetctl.probes.facts import gpus
from fleetctl.probes.kernel import preflight

FREEZER = Path("/sys/fs/cgroup/freezer")
SLACK_S = 2.0  # a loaded machine's scheduling, on top of a limit and bounded.GRACE_S
THAW_AFTER_S = 45  # the "driver" recovers: what a wait for the stuck child would last (fleetctl on main)
STUCK_SMI = """#!/bin/sh
# STAND-IN nvidia-smi stuck in the driver: frozen (state D) until the test thaws its cgroup
echo $$ > {group}/cgroup.procs
echo FROZEN > {group}/freezer.state
echo "0, 00000000:3B:00.0, NVIDIA A100-SXM4-80GB, 81920, 535.183.01, 8.0"
"""

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not (FREEZER / "cgroup.procs").exists(),
                                reason="needs root and the cgroup v1 freezer")


def procs_in(group: Path) -> list[int]:
    return [int(p) for p in (group / "cgroup.procs").read_text().split()]


@pytest.fixture
def stuck_smi(tmp_path, monkeypatch):
    """PATH with the stuck stand-in first; yields its freezer group. The group is thawed after
    THAW_AFTER_S (a fleetctl that waits for its child ends then) and at teardown, where each
    process left in it (killed, SIGKILL pending) is waited for and the group removed."""
    group = FREEZER / f"fleetctl-test-stuck-{os.getpid()}"
    group.mkdir()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nvidia-smi").write_text(STUCK_SMI.format(group=group))
    (bindir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    thaw = threading.Timer(THAW_AFTER_S, lambda: (group / "freezer.state").write_text("THAWED"))
    thaw.start()
    bounded.start(None)
    try:
        yield group
    finally:
        bounded.start(None)
        thaw.cancel()
        (group / "freezer.state").write_text("THAWED")
        end = time.monotonic() + 10
        while procs_in(group) and time.monotonic() < end:
            time.sleep(0.1)
        group.rmdir()


def test_a_stuck_nvidia_smi_is_left_behind_named_and_not_started_again(stuck_smi):
    bounded.start(bounded.RESERVE_S + 2)  # the host's deadline leaves each GPU query 2 s
    t0 = time.monotonic()
    r = bounded.run(["nvidia-smi"] + gpus.ARGS, gpus.SMI_DEADLINE_S)
    took = time.monotonic() - t0
    assert took < 2 + bounded.GRACE_S + SLACK_S, took
    assert r.returncode is None and r.state == "D" and procs_in(stuck_smi) == [r.pid]
    assert bounded.state(r.pid) == "D"  # alive, killed but not dead: abandoned, never waited for
    assert r.error == (f"nvidia-smi (pid {r.pid}, state D: uninterruptible sleep) did not answer within 2 s "
                       "and did not die on SIGKILL: left behind")
    # a second query while it is stuck (for longer than the query's limit) starts no other
    # nvidia-smi (they pile up) and says why
    bounded.start(bounded.RESERVE_S + 2)
    rows, errors, reason = gpus.gpu_facts()
    assert (rows, errors) == ([], []) and procs_in(stuck_smi) == [r.pid]
    assert reason == (f"nvidia-smi (pid {r.pid}, state D: uninterruptible sleep) from an earlier run is still "
                      "stuck: not started again; the driver is stuck: see dmesg for Xid")
    assert bounded.errors() == [reason.split("; ")[0]]


def test_the_kernel_preflight_refuses_in_bounded_time_with_the_same_reason(stuck_smi):
    bounded.start(bounded.RESERVE_S + 2)  # the kbuild child's own limit (kbuild.PREFLIGHT_TIMEOUT_S) left: 2 s
    t0 = time.monotonic()
    facts = preflight.gather_facts()
    assert time.monotonic() - t0 < 2 + bounded.GRACE_S + SLACK_S + 5  # + nvcc and torch/triton lookups
    [pid] = procs_in(stuck_smi)
    assert facts["gpus"] == [] and f"nvidia-smi (pid {pid}, state D: uninterruptible sleep)" in facts["gpu_error"]
    verdict = preflight.decide(facts, ["cuda", "triton"])
    assert verdict["backend"] is None
    assert f"cannot read the GPUs: {facts['gpu_error']}" in verdict["refusals"]


def test_inspect_reports_the_host_ok_with_its_facts_and_the_stuck_gpu_within_its_timeout(stuck_smi, tmp_path):
    """`fleetctl inspect --json` of this machine (ansible_connection: local) with the stuck GPU
    tool: the host's deadline reaches the probe (engine/gather.py deadline_s), which answers
    within it; the host is ok, with its other facts and the GPU's reason."""
    inv = tmp_path / "hosts.yaml"
    inv.write_text("all:\n  hosts:\n    g-12:\n      ansible_connection: local\n")
    timeout = 15
    env = dict(os.environ, HOME=str(tmp_path))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "fleetctl.cli", "inspect", "g-12", "-i", str(inv), "--json",
                        "--timeout", str(timeout)], capture_output=True, text=True, env=env, timeout=THAW_AFTER_S * 2)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-2000:]
    [host] = json.loads(r.stdout)["hosts"]
    assert took < timeout + SLACK_S, (took, host["error"])
    assert host["status"] == "ok" and host["error"] is None
    facts = host["facts"]
    assert facts["hostname"] == os.uname().nodename and facts["python"]["path"] and facts["sglang_reason"]
    assert "considered" in facts["interpreter_discovery"] and facts["runtime_clis"], json.dumps(facts)[:2000]
    [pid] = procs_in(stuck_smi)
    assert facts["gpus"] == [] and facts["gpus_reason"].startswith(f"nvidia-smi (pid {pid}, state D: ")
    assert facts["tool_errors"] == [facts["gpus_reason"].split("; ")[0]]
