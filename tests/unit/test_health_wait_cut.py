"""A --timeout too short for the whole --health-timeout is refused before any host is touched
(found by the soak, issue 54: apply's `--timeout 200` with `--health-timeout 30` left the smoke
decode a 1 s health wait, engine/validate.py, and the gate failed on a server still starting)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fleetctl import config
from fleetctl.engine.validate import SmokeOptions, smoke_deadline_s


def _cli(tmp_path, *argv):
    inv = tmp_path / "hosts.yaml"
    # a host no connection can reach: a refusal at parse time never tries it
    inv.write_text("all:\n  hosts:\n    far:\n      ansible_host: 127.0.0.1\n      ansible_port: 9\n")
    return subprocess.run([sys.executable, "-m", "fleetctl.cli", *argv, "-i", str(inv), "--no-history",
                           "--connect-timeout", "2"], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv, need", [
    (("validate", "all", "--health-timeout", "30", "--timeout", "60"), 30 + 5 * 15),
    (("apply", "defrag-tier0", "all", "--yes", "--health-timeout", "30", "--timeout", "200"),
     30 + 5 * 15 + config.ROLLBACK_RESERVE_S),
    (("deploy", "kernel", "verify_attention", "all", "--yes", "--backend", "cpu", "--route", "all",
      "--health-timeout", "100", "--repeat", "1", "--timeout", "250"), 100 + 3 * 15 + config.ROLLBACK_RESERVE_S),
])
def test_a_timeout_that_would_cut_the_health_wait_is_refused_naming_both_and_the_minimum(tmp_path, argv, need):
    r = _cli(tmp_path, *argv)
    assert r.returncode == 5, (r.returncode, r.stdout[-500:], r.stderr[-1500:])
    t, h = argv[argv.index("--timeout") + 1], argv[argv.index("--health-timeout") + 1]
    msg = " ".join(r.stderr.split())
    assert f"--timeout {t} is too short for --health-timeout {h}" in msg, msg
    assert f"at least {need:g} s" in msg, msg
    assert "unreachable" not in msg.lower() and "far:" not in msg, msg  # no host was tried


def test_a_timeout_that_fits_and_check_mode_are_not_refused(tmp_path):
    """At the minimum the run goes on (to the host, unreachable here: exit 2, not 5); --check runs
    no gate, so any --timeout goes."""
    need = smoke_deadline_s(SmokeOptions(health_timeout=30, repeat=3), 0.0)
    ok = _cli(tmp_path, "validate", "all", "--health-timeout", "30", "--timeout", f"{need:g}")
    assert ok.returncode != 5, ok.stderr[-1500:]
    check = _cli(tmp_path, "apply", "defrag-tier0", "all", "--check", "--health-timeout", "30", "--timeout", "20")
    assert check.returncode != 5, check.stderr[-1500:]


def test_the_default_deadlines_hold_the_default_health_wait():
    """Without --timeout each command's own default is used: it must never cut the wait either."""
    smoke = SmokeOptions()
    assert config.smoke_job_timeout(smoke.health_timeout) >= smoke_deadline_s(smoke, config.ROLLBACK_RESERVE_S)
    assert config.deploy_job_timeout(0, smoke.health_timeout) >= smoke_deadline_s(smoke, config.ROLLBACK_RESERVE_S)
