"""Golden outputs of the commands on a 2-host lab (0.5.2 and 0.5.23, stand-in servers): hosts,
inspect, apply --check --diff, status, validate, deploy kernel --check, and the failure paths (a
pattern that matches nothing, a failed probe, an unreachable host), each as `--json`, exit status
and stderr, byte-equal to tests/golden/lab/ after normalising (tests/golden.py)."""

from __future__ import annotations

import pytest

from conftest import running_lab
from golden import ROOT, check, record

GOLDEN_LAB_ID = 109
RUNS = [
    ("hosts", ["hosts", "all"]),
    ("inspect", ["inspect", "all"]),
    ("inspect-no-match", ["inspect", "nosuchhost"]),
    ("apply-check-diff", ["apply", "defrag-tier0", "all", "--check", "--diff"]),
    ("status", ["status", "all"]),
    ("validate", ["validate", "all", "--repeat", "1"]),
    ("validate-no-install", ["validate", "all", "--install", "host:/opt/nowhere/sglang"]),
    ("deploy-kernel-check", ["deploy", "kernel", "verify_attention", "all", "--check"]),
]


@pytest.fixture(scope="module")
def golden_lab(lab_machine, tmp_path_factory):
    with running_lab(tmp_path_factory.mktemp("home-golden"), GOLDEN_LAB_ID, ["0.5.2", "0.5.23"], hosts=2,
                     with_server=True) as up:
        yield up


def _paths(lab) -> dict[str, str]:
    return {str(ROOT): "<repo>", str(lab.ssh_config.parent): "<home>"}


@pytest.mark.parametrize("name,argv", RUNS, ids=[n for n, _ in RUNS])
def test_golden(golden_lab, name, argv):
    r = golden_lab.cli(*argv, "--json")
    check(f"lab/{name}", record(name, argv, r.returncode, r.stdout, r.stderr, _paths(golden_lab)))


def test_golden_unreachable(golden_lab):
    """A host that is down: unreachable (exit 3) with the connect error, the other host inspected."""
    golden_lab.fault("lab-02", "down")
    try:
        argv = ["inspect", "all", "--connect-timeout", "2"]
        r = golden_lab.cli(*argv, "--json")
    finally:
        golden_lab.fault("lab-02", "up")
    check("lab/inspect-unreachable", record("inspect-unreachable", argv, r.returncode, r.stdout, r.stderr,
                                            _paths(golden_lab)))
