"""Installs on lab hosts over real sshd: the layouts fleets have (an editable checkout in a git
work tree, two venvs of different releases, a server behind a launcher), inspect exact against
what each server itself imports, apply/validate/rollback per install, and `--export-patch`."""

from __future__ import annotations

import hashlib
import json
import shlex
import os
import subprocess
import time
import zipfile
from pathlib import Path

import pytest
import yaml

from conftest import TEST_LAB_ID, Lab, running_lab
from fleetctl import lab as labmod
from fleetctl.wheels import ensure_wheel
from oracles import independent


# this module's own lab, derived from the session's lab id (never another session's)
LAB_ID = (TEST_LAB_ID + 100) % 256
CHECKOUT_RELEASE, SECOND_RELEASE = "0.5.10", "0.5.2"

RELEASES = {"lab-01": "0.4.6.post5", "lab-02": "0.5.2", "lab-03": "0.5.10", "lab-04": "0.5.23"}


def test_exported_patches_apply_to_a_fresh_unpack_of_each_release(lab, tmp_path):
    """One patch per release with need_sort (0.4.6.post5 has none), written in check mode; each
    applies with `patch -p1` to a fresh unpack of its wheel and gives the bytes apply writes (the
    plan's post-images), and names the wheel's sha256 it was checked against."""
    out = tmp_path / "patches"
    r, doc, hosts = lab.cli_json("apply", "defrag-tier0", "all", "--export-patch", str(out), timeout=300)
    assert r.returncode == 0, r.stderr
    assert doc["check"] is True and doc["change_id"] is None
    names = {f"defrag-tier0-sglang-{v}.patch": h for h, v in RELEASES.items() if v != "0.4.6.post5"}
    assert sorted(doc["patches"]) == sorted(str(out / n) for n in names)
    assert hosts["lab-01"]["status"] == "skipped"
    for name, host in names.items():
        version = RELEASES[host]
        text = (out / name).read_text()
        wheel = ensure_wheel(version)
        assert f"{wheel.name} sha256 {hashlib.sha256(wheel.read_bytes()).hexdigest()}" in text
        fresh = tmp_path / f"fresh-{version}"
        with zipfile.ZipFile(wheel) as z:
            z.extractall(fresh, [n for n in z.namelist() if n.startswith("sglang/")])
        p = subprocess.run(["patch", "-p1", "--batch", "-d", str(fresh)], input=text, capture_output=True, text=True)
        assert p.returncode == 0, p.stdout + p.stderr
        files = hosts[host]["plan"]["files"]
        assert files and "texts" not in hosts[host]
        for f in files:
            assert hashlib.sha256((fresh / f["rel"]).read_bytes()).hexdigest() == f["post_sha256"]
    # check mode: no host has a ledger
    assert lab.ssh("lab-04", "test -e /var/lib/fleetctl/ledger.jsonl").returncode == 1


@pytest.fixture(scope="module")
def layouts(lab_machine, tmp_path_factory):
    """One lab host (0.5.10 in /opt/sglang/venv, no server there) given lab.add_install_layouts:
    an editable 0.5.10 checkout (git work tree) with a stand-in server, and a 0.5.2 venv with a
    stand-in server started through `timeout`; built once for this module."""
    with running_lab(tmp_path_factory.mktemp("home-installs"), LAB_ID, [CHECKOUT_RELEASE], hosts=1) as up:
        extra = labmod.add_install_layouts("lab-01", CHECKOUT_RELEASE, SECOND_RELEASE, lab_id=LAB_ID,
                                           state_dir=up.state_dir)
        up.add_host_vars("lab-01", {"fleetctl_restart_cmd": extra["restart_cmd"],
                                    "fleetctl_latency_slack": labmod.LATENCY_SLACK_S})
        yield up


def root_side(lab: Lab, path: str) -> Path:
    """Where a path under the host's private /opt/sglang is on this machine."""
    assert path.startswith("/opt/sglang/")
    return lab.state_dir / "hosts" / "lab-01" / "opt-sglang" / path[len("/opt/sglang/"):]


# Run by the server's own interpreter (its argv[0]), in its working directory, with its
# environment: the file `import sglang` really runs (SGLang's __init__ needs packages a lab host
# lacks, so the file is taken from the traceback when the import fails past it).
IMPORTED = """
import sys, traceback
try:
    import sglang
    print(sglang.__file__)
except Exception as e:
    print([f.filename for f in traceback.extract_tb(e.__traceback__) if f.filename.endswith("sglang/__init__.py")][0])
"""
ONE_OFF = """
import json, os, subprocess, sys
pid = int(sys.argv[1])
argv = open("/proc/%d/cmdline" % pid, "rb").read().split(b"\\0")
env = dict(kv.split(b"=", 1) for kv in open("/proc/%d/environ" % pid, "rb").read().split(b"\\0") if b"=" in kv)
r = subprocess.run([argv[0], "-c", sys.argv[2]], cwd=os.readlink("/proc/%d/cwd" % pid), env=env,
                   capture_output=True, text=True)
print(json.dumps({"python": argv[0].decode(), "file": r.stdout.strip(), "err": r.stderr[-500:]}))
"""


def imported_by(lab: Lab, pid: int) -> dict:
    import shlex
    r = lab.ssh("lab-01", f"python3 -c {shlex.quote(ONE_OFF)} {pid} {shlex.quote(IMPORTED)}")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_inspect_shows_the_sglang_each_server_imports(layouts):
    r, _, hosts = layouts.cli_json("inspect", "lab-01")
    h = hosts["lab-01"]
    assert (r.returncode, h["status"], h["error"]) == (0, "ok", None), r.stderr
    servers = {s["port"]: s for s in h["facts"]["servers"]}
    assert sorted(servers) == [30000, 30001]  # the `timeout` launcher is no server
    installs = {i["id"]: i for i in h["installs"]}
    assert len(installs) == 3  # the two servers' and /opt/sglang/venv's (no server)
    want = {30000: (CHECKOUT_RELEASE, "editable", "/opt/sglang/src/sglang/python"),
            30001: (SECOND_RELEASE, "wheel", None)}
    for port, s in servers.items():
        truth = imported_by(layouts, s["pid"])
        package_dir = os.path.dirname(truth["file"])
        assert truth["file"].endswith("/sglang/__init__.py"), truth
        assert s["python"] == truth["python"] and s["install"] == f"host:{package_dir}"
        inst = installs[s["install"]]
        version, kind, location = want[port]
        assert (inst["sglang"]["version"], inst["sglang"]["install"]) == (version, kind)
        assert inst["sglang"]["location"] == (location or os.path.dirname(package_dir))
        assert inst["servers"] == [s["pid"]] and inst["scan"]["error"] is None
        # exact against an independent AST reading of that tree
        direct, aliased, origins = independent(root_side(layouts, os.path.dirname(package_dir)))
        sites = {(x["file"], x["line"]): x for x in inst["allocator_call_sites"]}
        assert {k for k, x in sites.items() if not x["aliased"]} == direct and direct
        assert {k for k, x in sites.items() if x["aliased"]} == aliased
        assert {(o["file"], o["line"]) for o in inst["need_sort_origins"]} == origins
    primary = min(servers.values(), key=lambda s: s["pid"])
    assert h["facts"]["sglang"] == installs[primary["install"]]["sglang"]
    assert h["allocator_call_sites"] == installs[primary["install"]]["allocator_call_sites"]


def tree_digest(lab: Lab, location: str) -> dict[str, str]:
    root = root_side(lab, location) / "sglang"
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*.py"))}


def test_apply_validate_status_rollback_per_install(layouts):
    """Default apply changes every install a server runs from (not /opt/sglang/venv), one ledger
    entry and validation each; status judges the checkout against git; rollback of the run's id
    gives both trees back byte-identical."""
    _, _, hosts = layouts.cli_json("inspect", "lab-01")
    installs = {i["id"]: i for i in hosts["lab-01"]["installs"]}
    served = sorted(i for i, x in installs.items() if x["servers"])
    idle = next(x["sglang"]["location"] for x in installs.values() if not x["servers"])
    locations = [installs[i]["sglang"]["location"] for i in served]
    before = {loc: tree_digest(layouts, loc) for loc in locations + [idle]}
    r, doc, hosts = layouts.cli_json("apply", "defrag-tier0", "lab-01", "--yes", timeout=600)
    h = hosts["lab-01"]
    assert (r.returncode, h["status"], h["error"]) == (0, "changed", None), r.stderr[-2000:]
    cid = doc["change_id"]
    changes = h["changes"]
    assert sorted(c["install"] for c in changes) == served
    assert sorted(c["change_id"] for c in changes) == [f"{cid}.1", f"{cid}.2"]
    assert all(c["validation"]["status"] == "passed" for c in changes)
    for loc in locations:
        assert tree_digest(layouts, loc) != before[loc]
    assert tree_digest(layouts, idle) == before[idle]
    for iid in served:
        r, _, v = layouts.cli_json("validate", "lab-01", "--install", iid, timeout=300)
        assert v["lab-01"]["status"] == "ok" and len(v["lab-01"]["servers"]) == 1, r.stderr
    r, _, st = layouts.cli_json("status", "lab-01")
    assert st["lab-01"]["status"] == "ok", st["lab-01"]["error"]
    checkout = next(i for i in st["lab-01"]["installs"] if i["install"] == "editable")
    assert (checkout["git"], checkout["modified"]) == ("/opt/sglang/src/sglang", [])
    r, _, rb = layouts.cli_json("rollback", cid, "lab-01", "--yes", timeout=300)
    assert rb["lab-01"]["status"] == "changed", rb["lab-01"]["error"]
    for loc in locations + [idle]:
        assert tree_digest(layouts, loc) == before[loc]


def test_a_failing_install_rolls_back_the_installs_changed_before_it(layouts):
    """One run, two installs: the second's validation fails (its server decodes other tokens after
    the restart handler of the second change), so it is rolled back, and so is the first install
    the run had changed already; the host is `failed` naming both, and both trees are
    byte-identical after."""
    _, _, hosts = layouts.cli_json("inspect", "lab-01")
    installs = {i["id"]: i for i in hosts["lab-01"]["installs"] if i["servers"]}
    locations = [i["sglang"]["location"] for i in installs.values()]
    before = {loc: tree_digest(layouts, loc) for loc in locations}
    behavior = f"{labmod.SECOND_STANDIN}/behavior.json"
    doc = yaml.safe_load(layouts.inventory.read_text())
    host_vars = doc["all"]["children"]["lab"]["hosts"]["lab-01"]
    restart = host_vars["fleetctl_restart_cmd"]
    # The handler restarts both servers after each install's change. Each change takes its baseline
    # just before its write, so the second server must decode differently only from the second
    # handler run on: this restart command counts its runs and, on the second, makes the second
    # stand-in shift its tokens (read at its start) before restarting them as the lab's does.
    script = "/tmp/fleetctl-test-restart.sh"
    counter = "/tmp/fleetctl-test-restarts"
    body = (f'n=$(( $(cat {counter} 2>/dev/null || echo 0) + 1 )); echo $n > {counter}\n'
            f'if [ $n -eq 2 ]; then echo \'{{"token_shift": 3}}\' > {behavior}; fi\n{restart}\n')
    assert layouts.ssh("lab-01", f"rm -f {counter} {behavior} && printf '%s' {shlex.quote(body)} > {script}"
                       ).returncode == 0
    host_vars["fleetctl_restart_cmd"] = f"sh {script}"
    original = layouts.inventory.read_text()
    layouts.inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
    try:
        r, doc, hosts = layouts.cli_json("apply", "defrag-tier0", "lab-01", "--yes", timeout=600)
    finally:
        layouts.inventory.write_text(original)
        layouts.ssh("lab-01", f"rm -f {behavior} {counter} {script} && {restart}", timeout=180)
    h = hosts["lab-01"]
    assert (r.returncode, h["status"]) == (2, "failed"), [(c["install"], c.get("validation"))
                                                          for c in h.get("changes", [])]
    cid = doc["change_id"]
    changes = {c["install"]: c for c in h["changes"]}
    second = next(i for i, x in installs.items() if x["sglang"]["install"] == "wheel")
    first = next(i for i in installs if i != second)
    assert [c["install"] for c in h["changes"]] == [first, second]  # the failing one came second
    assert changes[second]["validation"]["status"] == "failed"
    assert h["error"].startswith(f"{second}: ") and h["error"].endswith(f"; rolled back with it: {cid}.1"), h["error"]
    for loc in locations:
        assert tree_digest(layouts, loc) == before[loc], loc
    ledger = [json.loads(x) for x in layouts.ssh("lab-01", "cat /var/lib/fleetctl/ledger.jsonl").stdout.splitlines()]
    assert {e["change_id"]: e["state"] for e in ledger if e["change_id"].startswith(cid)} == {
        f"{cid}.1": "rolled-back", f"{cid}.2": "rolled-back"}


ROUTER_PORT = labmod.SECOND_PORT + 1


def test_a_router_with_two_dp_workers_is_one_server_on_its_install(layouts):
    """`python -m sglang_router.launch_server --dp-size 2` (the stand-in router: spawned DP workers
    that are stand-in servers, the router routing to them), started through `sudo -u root` (a
    wrapper that stays its parent), from /opt/sglang/venv: inspect shows one server, the router,
    on that venv's install, with its two DP workers and the ports they listen on; the wrapper is
    no server and the workers are no servers of their own."""
    start = (f"cd /; setsid sudo -u root env PYTHONPATH=/opt/fleetctl-standin HOME=/tmp "
             f"/opt/sglang/venv/bin/python -m sglang_router.launch_server --dp-size 2 --port {ROUTER_PORT} "
             "> /tmp/router.log 2>&1 < /dev/null & echo $!")
    r = layouts.ssh("lab-01", start)
    assert r.returncode == 0, r.stderr
    sudo_pid = int(r.stdout.split()[-1])
    try:
        ask = (f"python3 -c \"import urllib.request,sys; print(urllib.request.urlopen("
               f"'http://127.0.0.1:{ROUTER_PORT}/health', timeout=5).status)\"")
        deadline = time.monotonic() + 240
        while layouts.ssh("lab-01", ask).stdout.strip() != "200":
            assert time.monotonic() < deadline, layouts.ssh("lab-01", "tail -n 30 /tmp/router.log").stdout
            time.sleep(1)
        r, _, hosts = layouts.cli_json("inspect", "lab-01")
        h = hosts["lab-01"]
        assert h["status"] == "ok", h["error"]
        [s] = [s for s in h["facts"]["servers"] if s["port"] == ROUTER_PORT]
        assert (s["kind"], s["dp_size"], s["python"]) == ("router", 2, "/opt/sglang/venv/bin/python"), s
        assert len(s["workers"]) == 2 and all(len(w["ports"]) == 1 for w in s["workers"]), s["workers"]
        # the workers' ports are the ones the router routes to: each answers as a stand-in server
        for w in s["workers"]:
            port = w["ports"][0]
            assert port >= 31000 and port != ROUTER_PORT
            ok = layouts.ssh("lab-01", ask.replace(str(ROUTER_PORT), str(port))).stdout.strip()
            assert ok == "200", (port, ok)
        pids = {x["pid"] for x in h["facts"]["servers"]}
        assert sudo_pid not in pids and not pids & {w["pid"] for w in s["workers"]}
        assert sorted(x["port"] for x in h["facts"]["servers"]) == [30000, 30001, ROUTER_PORT]
        venv = next(i for i in h["installs"] if i["id"] == s["install"])
        assert venv["sglang"]["location"] == "/opt/sglang/venv/lib/python3.11/site-packages"
        assert venv["servers"] == [s["pid"]]
    finally:
        layouts.ssh("lab-01", f"kill -TERM -- -{sudo_pid}; sleep 2; kill -KILL -- -{sudo_pid} 2>/dev/null; true")
    r = layouts.ssh("lab-01", f"ps -eo args | grep -c '[s]glang_router'")
    assert r.stdout.strip() == "0", r.stdout
