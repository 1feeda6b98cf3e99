"""Interpreter trust (security review M6) through the local connection: a named interpreter is
checked by the trust probe under python3 on PATH before anything runs it as this user/root.
And SIGTERM handled as Ctrl-C (L8), on the same local hosts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetctl import inventory
from fleetctl.connection import Settings
from fleetctl.engine.fleet import Fleet
from fleetctl.engine.gather import gather
from fleetctl.vocab import HostStatus


def venv(tmp_path: Path) -> Path:
    """A venv whose bin/python is this interpreter (pyvenv.cfg's home: its directory), with one site directory."""
    prefix = tmp_path / "venv"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / "python").symlink_to(sys.executable)
    site = prefix / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    site.mkdir(parents=True)
    (prefix / "pyvenv.cfg").write_text(f"home = {Path(sys.executable).parent}\ninclude-system-site-packages = false\n")
    return prefix


def inspect_with(tmp_path: Path, python: Path):
    path = tmp_path / "hosts.yaml"
    path.write_text(f"all:\n  hosts:\n    here:\n      ansible_connection: local\n      fleetctl_python: {python}\n")
    host = inventory.load(path).select("here")[0]
    with Fleet(Settings(), forks=1, timeout=60) as fleet:
        return fleet.run([host], lambda ctx: ctx.result(HostStatus.OK, data=gather(ctx, scan=False)))[0]


@pytest.mark.parametrize("plant", ["pth", "sitecustomize", "site-dir"])
def test_site_code_others_can_change_runs_only_as_the_asking_account(tmp_path, plant):
    """Issue 48: what an interpreter's site module runs (a `.pth` line, sitecustomize, a site
    directory anyone may write into) is the install's code: the facts probe no longer judges it,
    it asks the interpreter as runas.account's uid (this test's own, unprivileged; as root:
    tests/machine/test_runs_unprivileged.py), and the answer says which."""
    prefix = venv(tmp_path)
    site = next((prefix / "lib").glob("python*/site-packages"))
    marker = tmp_path / "ran"
    code = f"import os; open({str(marker)!r}, 'w').write(str(os.geteuid()))\n"
    target = {"pth": site / "zz.pth", "sitecustomize": site / "sitecustomize.py", "site-dir": site}[plant]
    if plant == "sitecustomize":
        target.write_text(code)
    else:
        (site / "zz.pth").write_text("import os; " + code)
    os.chmod(target, 0o777 if target.is_dir() else 0o666)
    r = inspect_with(tmp_path, prefix / "bin" / "python")
    assert r.status == "ok", r.error
    assert marker.read_text() == str(os.geteuid()) != "0"
    [asked] = [c for c in r.data["facts"]["interpreter_discovery"]["considered"] if c["reason"] == "inventory"]
    assert "error" not in asked and "skipped" not in asked


def test_an_interpreter_whose_directory_others_can_change_is_refused_before_it_runs(tmp_path):
    """The probe itself runs as root under the inventory's interpreter (`python -I -S`, GUARD):
    a bin/ directory others may write is refused before anything starts."""
    prefix = venv(tmp_path)
    marker = tmp_path / "ran"
    site = next((prefix / "lib").glob("python*/site-packages"))
    (site / "zz.pth").write_text(f"import os; open({str(marker)!r}, 'w')\n")
    os.chmod(prefix / "bin", 0o777)
    r = inspect_with(tmp_path, prefix / "bin" / "python")
    assert (r.status, r.error) == ("failed", f"interpreter {prefix}/bin/python refused: {prefix / 'bin'} is writable by "
                                             "group or others (fleetctl runs it as root)")
    assert not marker.exists()  # the interpreter never started


def test_a_trusted_interpreter_runs(tmp_path):
    prefix = venv(tmp_path)
    r = inspect_with(tmp_path, prefix / "bin" / "python")
    assert r.status == "ok", r.error
    assert r.data["facts"]["python"]["path"] == str(prefix / "bin" / "python")


def test_sigterm_is_handled_as_ctrl_c_and_exits_143(tmp_path):
    """SIGTERM mid-run (review L8): the host in progress finishes, the next is not started."""
    slow, started = tmp_path / "slowpy", tmp_path / "started"
    slow.write_text(f"#!/bin/sh\ntouch {started}\nsleep 1.5\nexec {sys.executable} \"$@\"\n")
    slow.chmod(0o755)
    inv = tmp_path / "hosts.yaml"
    inv.write_text("all:\n  hosts:\n" + "".join(
        f"    {h}:\n      ansible_connection: local\n      fleetctl_python: {slow}\n" for h in ("a", "b")))
    p = subprocess.Popen([sys.executable, "-m", "fleetctl.cli", "inspect", "all", "-i", str(inv), "--forks", "1",
                          "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    end = time.monotonic() + 60
    while not started.exists() and time.monotonic() < end:  # host a is in progress
        time.sleep(0.02)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 143, (out[-2000:], err[-2000:])
    hosts = {h["host"]: h for h in json.loads(out)["hosts"]}
    assert hosts["a"]["status"] == "ok" and hosts["b"]["status"] == "not attempted", hosts
