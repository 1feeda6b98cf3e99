"""The suite's own guards: it tests this checkout and nothing else (review H3), and a machine that
cannot run the fleet tests does not pass quietly when CI requires them (review L10)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import conftest

ROOT = Path(__file__).resolve().parents[2]

# Imports a copy of fleetctl first (as an installed copy found before this checkout would be), then
# runs pytest on this checkout: collecting one small test module is enough to reach the guard.
RUN = """
import sys
other = sys.argv[1]
if other:
    sys.path.insert(0, other)
    import fleetctl
    assert fleetctl.__file__.startswith(other), fleetctl.__file__
import pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "--collect-only", "tests/unit/test_report.py"]))
"""


def collect(other: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", RUN, other], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_suite_refuses_another_copy_of_fleetctl(tmp_path):
    """With another copy of fleetctl imported first, the run stops with a usage error naming it."""
    other = tmp_path / "elsewhere"
    shutil.copytree(ROOT / "agent" / "fleetctl", other / "fleetctl",
                    ignore=shutil.ignore_patterns("__pycache__"))
    r = collect(str(other))
    assert r.returncode == pytest.ExitCode.USAGE_ERROR, (r.stdout[-2000:], r.stderr[-2000:])
    assert f"tests import fleetctl from {other / 'fleetctl' / '__init__.py'}, not from this checkout" in r.stderr
    ok = collect("")  # the control: the same run without the other copy collects
    assert ok.returncode == 0, (ok.stdout[-2000:], ok.stderr[-2000:])
    assert "test_render_inspect_coalesces_identical_hosts_into_one_row" in ok.stdout


def test_subprocesses_import_this_checkout():
    """PYTHONPATH carries agent/ to subprocesses (probes, `python -m fleetctl.cli`)."""
    r = subprocess.run([sys.executable, "-c", "import fleetctl; print(fleetctl.__file__)"], capture_output=True,
                       text=True, timeout=60)
    assert Path(r.stdout.strip()).resolve() == ROOT / "agent" / "fleetctl" / "__init__.py"


def test_missing_lab_skips_or_fails_as_required(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.delenv("FLEETCTL_REQUIRE_LAB", raising=False)
    with pytest.raises(pytest.skip.Exception, match="lab tests need root"):
        conftest.require_lab()
    monkeypatch.setenv("FLEETCTL_REQUIRE_LAB", "1")
    with pytest.raises(pytest.fail.Exception, match="FLEETCTL_REQUIRE_LAB=1: required here"):
        conftest.require_lab()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    conftest.require_lab()  # root: nothing to say


class _Item:
    """What conftest.pytest_collection_modifyitems reads and writes of a pytest.Item."""

    def __init__(self, room: str, fixtures: list[str], marks: tuple[str, ...] = ()):
        self.path = conftest.TESTS / room / "test_x.py"
        self.nodeid = f"tests/{room}/test_x.py::test_x"
        self.fixturenames = fixtures
        self.marks = set(marks)

    def get_closest_marker(self, name: str):
        return name if name in self.marks else None

    def add_marker(self, name: str) -> None:
        self.marks.add(name)


def test_tests_are_marked_from_their_room_and_their_fixtures():
    items = [_Item("unit", ["tmp_path"]), _Item("fleet", ["server_lab", "lab_machine"]),
             _Item("machine", ["cpu_kernel", "tmp_path"]), _Item("machine", ["tmp_path"], ("slow",)),
             _Item("machine", ["clab", "lab_machine"])]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.marks for i in items] == [{"unit"}, {"lab"}, {"machine", "slow"}, {"machine", "slow"},
                                        {"machine", "lab", "slow"}]


@pytest.mark.parametrize("room, fixtures, why", [
    ("unit", ["lab_machine"], "a unit test may not bring up a lab or build"),
    ("unit", ["cpu_kernel"], "a unit test may not bring up a lab or build"),
    ("fleet", ["tmp_path"], "a test in tests/fleet uses no lab"),
    ("elsewhere", ["tmp_path"], "a test lives in tests/unit, tests/fleet or tests/machine"),
])
def test_a_test_in_the_wrong_room_is_a_usage_error(room, fixtures, why):
    with pytest.raises(pytest.UsageError, match=why):
        conftest.pytest_collection_modifyitems(None, [_Item(room, fixtures)])
