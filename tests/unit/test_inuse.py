"""Installs in use by processes that are no server (issue 49): which processes the facts probe
names (probes/facts/inuse.py, on real processes of this machine: an interpreter of a venv, a
file mapped, a file open), and the refusal a change gets (engine/inuse.py), on hostile data."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fleetctl.engine import inuse as refuse
from fleetctl.probes.facts import inuse

SLEEP = "import sys, time; sys.stdout.write('up\\n'); sys.stdout.flush(); time.sleep(60)"


@pytest.fixture
def tree(tmp_path):
    """A venv (pyvenv.cfg, bin/python linking this interpreter) holding an sglang package, and a
    system-style install (a site directory with sglang/, no env): two discover() entries."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text(f"home = {os.path.dirname(sys.executable)}\n")
    os.symlink(sys.executable, venv / "bin" / "python")
    pkg = venv / "lib" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    site = tmp_path / "site"
    (site / "sglang").mkdir(parents=True)
    (site / "sglang" / "data.bin").write_bytes(b"\0" * 8192)
    return {
        "venv": {"id": "host:" + str(pkg), "python": {"path": str(venv / "bin" / "python")},
                 "sglang": {"package_dir": str(pkg), "location": str(pkg.parent)}},
        # an interpreter's own site directory, of an interpreter no process here runs
        "site": {"id": "host:" + str(site / "sglang"), "python": {"path": str(tmp_path / "base" / "bin" / "python3")},
                 "sglang": {"package_dir": str(site / "sglang"), "location": str(site)}},
        "root": tmp_path,
    }


def spawn(argv):
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert p.stdout.readline() == b"up\n"
    return p


def test_interpreter_mapped_and_open_files_name_a_process_and_nothing_else_does(tree):
    venv, site = tree["venv"], tree["site"]
    data = site["sglang"]["package_dir"] + "/data.bin"
    procs = [
        spawn([venv["python"]["path"], "-c", SLEEP, "\x1b[31m" + "y" * 5000]),  # the venv's interpreter
        spawn([sys.executable, "-c", f"import mmap; f = open({data!r}, 'rb'); m = mmap.mmap(f.fileno(), 0, "
                                     f"access=mmap.ACCESS_READ); f.close(); {SLEEP}"]),  # a file mapped
        spawn([sys.executable, "-c", f"f = open({data!r}, 'rb'); {SLEEP}"]),  # a file open
        spawn([sys.executable, "-c", SLEEP]),  # uses neither
    ]
    try:
        inuse.mark([venv, site], [])
        got = {i["id"]: {p["pid"]: p for p in i["in_use"]["processes"]} for i in (venv, site)}
        vp, mp, op, none = (p.pid for p in procs)
        assert set(got[venv["id"]]) == {vp}
        assert got[venv["id"]][vp]["why"] == f"runs its interpreter {venv['python']['path']}"
        line = got[venv["id"]][vp]["cmdline"]
        assert line.startswith(f"{venv['python']['path']} -c ") and line.endswith(" more characters)")
        assert len(line) < inuse.MAX_CMDLINE + 40
        assert set(got[site["id"]]) == {mp, op}, got  # no env: only its files tie a process to it
        assert got[site["id"]][mp]["why"] == f"has a file under {site['sglang']['package_dir']} mapped"
        assert got[site["id"]][op]["why"] == f"has a file under {site['sglang']['package_dir']} open"
        assert got[site["id"]][op]["uid"] == os.geteuid()
        # a server's tree is validated: neither the server nor what runs below it is named
        inuse.mark([venv, site], [{"pid": vp}, {"pid": mp}])
        assert [p["pid"] for p in site["in_use"]["processes"]] == [op] and venv["in_use"]["processes"] == []
    finally:
        for p in procs:
            p.kill()
            p.wait()


# One program, run twice with one command line: as a peer probe (it holds a file of the install
# open and starts a child that holds one too, as the scan and its grep -rl do) and as the probe
# that marks the installs (FLEETCTL_TEST_ROLE=probe): the bootstrap every fleetctl probe shares.
PEER = """
import json, os, subprocess, sys, time
data = os.environ["FLEETCTL_TEST_DATA"]
if os.environ.get("FLEETCTL_TEST_ROLE") == "probe":
    from fleetctl.probes.facts import inuse
    inst = json.loads(os.environ["FLEETCTL_TEST_INSTALL"])
    inuse.mark([inst], [])
    sys.stdout.write(json.dumps(inst["in_use"]) + "\\n")
else:
    f = open(data, "rb")
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1], 'rb'); "
                              "sys.stdout.write('up\\\\n'); sys.stdout.flush(); time.sleep(60)", data],
                             stdout=subprocess.PIPE)
    child.stdout.readline()
    sys.stdout.write("up %d\\n" % child.pid)
    sys.stdout.flush()
    time.sleep(60)
"""


def test_a_peer_probe_and_what_runs_below_it_use_no_install_a_reader_does(tree):
    # CI of 2026-12-07: two inspects of one host at once (inventory aliases of lab-03) each
    # named the other's probe as a process using the venv: a false "in use" that refuses changes
    site = tree["site"]
    data = site["sglang"]["package_dir"] + "/data.bin"
    env = dict(os.environ, FLEETCTL_TEST_DATA=data, FLEETCTL_TEST_INSTALL=json.dumps(site))
    peer = subprocess.Popen([sys.executable, "-c", PEER], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            env=env, start_new_session=True)
    line = peer.stdout.readline().split()
    assert line[0] == b"up", line
    below = int(line[1])
    reader = spawn([sys.executable, "-c", f"f = open({data!r}, 'rb'); {SLEEP}"])  # another command line
    try:
        r = subprocess.run([sys.executable, "-c", PEER], capture_output=True, text=True, timeout=60,
                           env=dict(env, FLEETCTL_TEST_ROLE="probe"))
        assert r.returncode == 0, r.stderr
        named = {p["pid"]: p["why"] for p in json.loads(r.stdout)["processes"]}
        assert named == {reader.pid: f"has a file under {site['sglang']['package_dir']} open"}, (named, peer.pid, below)
        # the same peer, seen by a probe with another command line (this test's process), is named
        inuse.mark([site], [])
        assert {peer.pid, below, reader.pid} <= {p["pid"] for p in site["in_use"]["processes"]}
    finally:
        os.killpg(peer.pid, 9)
        peer.wait()
        reader.kill()
        reader.wait()


def test_named_processes_are_bounded_and_the_rest_counted(tree, monkeypatch):
    venv = tree["venv"]
    monkeypatch.setattr(inuse, "MAX_PROCESSES", 2)
    procs = [spawn([venv["python"]["path"], "-c", SLEEP]) for _ in range(4)]
    try:
        inuse.mark([venv], [])
        assert [p["pid"] for p in venv["in_use"]["processes"]] == sorted(p.pid for p in procs)[:2]
        assert venv["in_use"]["more"] == 2
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_env_root_is_a_venv_or_conda_prefix_never_a_shared_one(tmp_path):
    (tmp_path / "conda" / "conda-meta").mkdir(parents=True)
    assert inuse.env_root(str(tmp_path / "conda" / "bin" / "python")) == str(tmp_path / "conda")
    assert inuse.env_root("/usr/bin/python3") is None
    assert inuse.same_interpreter("/usr/bin/python3", "/usr/bin/python3")
    assert not inuse.same_interpreter(str(tmp_path / "conda" / "bin" / "python"), "/usr/bin/python3")


def facts(processes, more=0, where="/srv/venv/lib/python3.11/site-packages/sglang"):
    return {"sglang": {"package_dir": where}, "in_use": {"processes": processes, "more": more}}


def test_refusal_names_pids_command_lines_and_why_escaped_and_bounded():
    procs = [{"pid": 100 + i, "uid": 1000, "cmdline": "python -c 'import sglang' \x1b[2J\u202e" + "z" * 9000,
              "why": "runs its interpreter /srv/venv/bin/python\n"} for i in range(6)]
    why = refuse.refusal(facts(procs, more=3, where="/srv/\x1b]0;x\x07sglang"), validated=False)
    assert why.startswith("not changed: install /srv/\\x1b]0;x\\x07sglang is in use by processes")
    assert "pid 100 (uid 1000; runs its interpreter /srv/venv/bin/python\\n): python -c 'import sglang' " \
           "\\x1b[2J\\u202ezzz" in why
    assert "pid 104" not in why and "; and 5 more;" in why  # 4 named, 2 + 3 counted
    assert "pass --no-validate" in why and "no SGLang server of this install was identified" in why
    assert all(c.isprintable() for c in why) and len(why) < 2000


@pytest.mark.parametrize("f,validated", [
    (facts([{"pid": 1, "uid": 0, "cmdline": "x", "why": "y"}]), True),  # a server or offline check decodes
    (facts([]), False),  # nothing uses it: changed as before
    ({"sglang": {"package_dir": "/x"}, "in_use": None}, False),  # facts of a host that said nothing
    ({"sglang": {}, "in_use": {"processes": "not a list"}}, False),
])
def test_no_refusal(f, validated):
    assert refuse.refusal(f, validated) is None


def test_a_hostile_entry_is_text_too():
    why = refuse.refusal(facts(["\x1b[31m" + "q" * 500, {"pid": "1\n2", "uid": None}]), validated=False)
    assert "\\x1b[31mqqq" in why and "pid 1\\n2 (uid ; ): " in why and all(c.isprintable() for c in why)


@pytest.mark.parametrize("argv", [["apply", "defrag-tier0", "all", "--gate", "load", "--no-validate", "--yes"],
                                  ["deploy", "kernel", "verify_attention", "all", "--gate", "load", "--no-validate",
                                   "--yes"]])
def test_no_validate_runs_no_gate_so_a_gate_asked_with_it_is_refused(tmp_path, argv):
    from fleetctl.errors import EXIT_OPTIONS

    inv = tmp_path / "hosts.yaml"
    inv.write_text("all:\n  hosts:\n    here:\n      ansible_connection: local\n")
    r = subprocess.run([sys.executable, "-m", "fleetctl.cli", *argv, "-i", str(inv), "--no-history"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == EXIT_OPTIONS and "--no-validate runs no gate: leave out --gate" in r.stderr, r.stderr
