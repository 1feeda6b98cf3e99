"""Installs in use that fleetctl cannot validate, and installs of users the host does not list,
over real sshd on lab hosts (issue 49):

- an install used by processes that are no server fleetctl identifies (an engine embedded in
  another framework, a scheduler's job: here a Python process of the install's own interpreter
  that found sglang and holds its `__init__.py` open, listening on nothing, and a process of
  another interpreter holding a file of the install open): apply refuses the host naming each
  pid and its command line (escaped, bounded), exit 2, nothing written; `--no-validate` applies
  it and the result, the run history and the host's ledger say so; once the processes are
  gone, the same host is changed as before (validation skipped: no server);
- a user known only to a directory service (a uid with no /etc/passwd entry, as an SSSD or LDAP
  user is): the project `.venv` under their home holds SGLang and inspect lists it, asked as
  that uid.

What cannot exist here is named as a stand-in: the embedded engine (a process that finds sglang
and waits: the lab's releases import nothing without their dependencies) and the directory
service (a uid nothing names); the user's project venv holds the real 0.5.2 release's package
`__init__.py`, `version.py` and dist-info, not its whole tree (the scan of 30 MB is not the point).
"""

from __future__ import annotations

import hashlib
import json
import shlex
import subprocess

from fleetctl.lab import base as labbase

HOST = "lab-03"  # SGLang 0.5.10, no server
SITE = f"{labbase.VENV}/lib/python3.11/site-packages"
TARGET = f"{SITE}/sglang/srt/model_executor/model_runner_kv_cache_mixin.py"  # what defrag-tier0 edits on 0.5.10
HOSTILE = "\x1b[31mred\x1b[0m"  # an argv item a terminal would obey
LONG = "x" * 5000  # an argv item past every bound
ENGINE = ("import importlib.util, sys, time; s = importlib.util.find_spec('sglang'); f = open(s.origin); "
          "time.sleep(600)")
HOLDER = f"import time; f = open({SITE + '/sglang/version.py'!r}); time.sleep(600)"


def sh(lab, host: str, cmd: str, timeout: float = 60) -> str:
    r = lab.ssh(host, cmd, timeout=timeout)
    assert r.returncode == 0, (cmd, r.stdout, r.stderr)
    return r.stdout


def sha(lab, path: str) -> str:
    return sh(lab, HOST, f"sha256sum {shlex.quote(path)}").split()[0]


def start(lab, argv: list[str]) -> int:
    """`argv` started on HOST in a session of its own, detached; its pid there (found by a mark
    in its environment)."""
    mark = hashlib.sha256(" ".join(argv).encode()).hexdigest()[:12]
    r = lab.ssh(HOST, f"(cd / && FLEETCTL_TEST_MARK={mark} exec setsid {shlex.join(argv)}) </dev/null >/dev/null 2>&1 &",
                stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    out = sh(lab, HOST, f"sleep 0.5; grep -l FLEETCTL_TEST_MARK={mark} /proc/[0-9]*/environ 2>/dev/null || true")
    (pid,) = [int(p.split("/")[2]) for p in out.split()]
    return pid


def rollback(lab, cid: str) -> None:
    r = lab.cli("rollback", cid, HOST, "--yes", "--json")
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])


def test_an_install_in_use_by_no_server_is_refused_unless_no_validate(lab):
    """Cases (a) and (b): refused while in use (pids, command lines, why), --no-validate recorded
    as such in the result, the history and the ledger; applied as today once nothing uses it."""
    before = sha(lab, TARGET)
    engine = start(lab, [f"{labbase.VENV}/bin/python", "-c", ENGINE, HOSTILE, LONG])
    holder = start(lab, ["/usr/bin/env", "python3", "-c", HOLDER])
    try:
        r, _, hosts = lab.cli_json("apply", "defrag-tier0", HOST, "--yes", rc=2)
        h = hosts[HOST]
        err = h["error"]
        assert h["status"] == "failed" and err.startswith(f"not changed: install {SITE}/sglang is in use"), err
        assert f"pid {engine} (uid 0; runs its interpreter {labbase.VENV}/bin/python): {labbase.VENV}/bin/python -c " in err
        assert f"pid {holder} (uid 0; has a file under {labbase.VENV} open): python3 -c " in err
        assert "\x1b" not in err and "\\x1b[31mred" in err and len(err) < 2000  # escaped, bounded
        assert "pass --no-validate" in err and "no SGLang server of this install was identified" in err
        assert sha(lab, TARGET) == before  # untouched
        r, doc, hosts = lab.cli_json("apply", "defrag-tier0", HOST, "--yes", "--no-validate", rc=0)
        h = hosts[HOST]
        assert h["status"] == "changed" and h["validation"] == {"status": "skipped", "reason": "by --no-validate"}
        assert sha(lab, TARGET) != before
        cid = doc["change_id"]
        shown = lab.cli("history", "show", "last", "--json")
        assert shown.returncode == 0, shown.stderr
        record = json.loads(shown.stdout)
        assert "--no-validate" in record["run"]["argv"]
        assert record["hosts"][0]["validation"] == {"status": "skipped", "reason": "by --no-validate"}
        _, _, st = lab.cli_json("status", HOST, rc=0)
        (entry,) = [c for c in st[HOST]["changes"] if c["change_id"] == cid]
        assert (entry["state"], entry["reason"]) == ("applied", "validation: skipped by --no-validate")
        rollback(lab, cid)
        assert sha(lab, TARGET) == before
    finally:
        sh(lab, HOST, f"kill -9 {engine} {holder}; sleep 0.3")
    # (b): nothing uses the install now: changed and judged by what can be judged, as before
    r, doc, hosts = lab.cli_json("apply", "defrag-tier0", HOST, "--yes", rc=0)
    h = hosts[HOST]
    assert h["status"] == "changed" and h["validation"] == {"status": "skipped", "reason": "no server"}, h
    rollback(lab, doc["change_id"])
    assert sha(lab, TARGET) == before


def make_venv(lab, host: str, venv: str) -> str:
    """A venv at `venv` on `host` (of the lab venv's base interpreter) holding the real 0.5.2
    release's sglang `__init__.py`, `version.py` and dist-info; its site directory."""
    src = f"{labbase.VENV}/lib/python3.11/site-packages"
    dst = f"{venv}/lib/python3.11/site-packages"
    sh(lab, host, " && ".join([
        f"base=$({labbase.VENV}/bin/python3 -c 'import sys; print(sys.base_prefix)')",
        f"$base/bin/python3 -m venv --without-pip {venv}",
        f"mkdir -p {dst}/sglang && cp {src}/sglang/__init__.py {src}/sglang/version.py {dst}/sglang/",
        f"cp -r {src}/sglang-0.5.2.dist-info {dst}/"]))
    return dst


def test_a_user_no_passwd_lists_has_a_project_venv_that_is_found(lab):
    """Case (c): a home under /home of a uid /etc/passwd does not name (an SSSD or LDAP user),
    with a project .venv holding SGLang: inspect lists that install, asked as that uid."""
    host, uid = "lab-02", 42777
    assert sh(lab, host, f"getent passwd {uid} || echo none").strip() == "none"
    sh(lab, host, "mount -t tmpfs -o mode=755 tmpfs /home")
    try:
        dst = make_venv(lab, host, "/home/ldapuser/proj/.venv")
        sh(lab, host, f"chown -R {uid}:{uid} /home/ldapuser")
        _, _, hosts = lab.cli_json("inspect", host, rc=0)
        found = {i["id"]: i for i in hosts[host]["installs"]}
        inst = found.get(f"host:{dst}/sglang")
        assert inst is not None, sorted(found)
        assert inst["sglang"]["version"] == "0.5.2" and inst["asked_as"]["uid"] == uid, inst
        assert inst["in_use"] == {"processes": [], "more": 0}
    finally:
        sh(lab, host, "umount -l /home")


def test_the_interpreter_of_a_process_that_is_no_server_is_asked(lab):
    """An engine embedded in another framework, run from a venv in no place fleetctl looks in:
    its process's interpreter is asked, its install listed, and the process named as its user."""
    host = "lab-02"
    dst = make_venv(lab, host, "/tmp/fc-engine/env")
    pid = int(sh(lab, host, "cd / && (setsid /tmp/fc-engine/env/bin/python -c 'import time; time.sleep(600)' "
                            "</dev/null >/dev/null 2>&1 & echo $!)").strip())
    try:
        _, _, hosts = lab.cli_json("inspect", host, rc=0)
        found = {i["id"]: i for i in hosts[host]["installs"]}
        inst = found.get(f"host:{dst}/sglang")
        assert inst is not None, sorted(found)
        assert [(p["pid"], p["why"]) for p in inst["in_use"]["processes"]] == [
            (pid, "runs its interpreter /tmp/fc-engine/env/bin/python")]
        considered = hosts[host]["facts"]["interpreter_discovery"]["considered"]
        assert {"python": "/tmp/fc-engine/env/bin/python", "reason": f"interpreter of running pid {pid}",
                "sglang": "0.5.2"} in considered
    finally:
        sh(lab, host, f"kill -9 {pid}; rm -rf /tmp/fc-engine")
