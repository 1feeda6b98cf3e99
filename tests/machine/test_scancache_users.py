"""The probe wrapper's choice of interpreter and its kept code, run as another user (nobody, by
setpriv) as a probe runs on a host under an unprivileged login: needs root to switch user and to
give files away (the rest of the scan cache's tests are tests/unit/test_scancache.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from fleetctl.probes import result
from fleetctl.probes.facts import scancache


NOBODY = 65534


@pytest.fixture
def nobody_home():
    """A home directory owned by nobody under /tmp (pytest's tmp_path is root's 0700)."""
    home = Path(tempfile.mkdtemp(prefix="fc-finder-", dir="/tmp"))
    yield home
    shutil.rmtree(home, ignore_errors=True)


def run_finder(home: Path, record: str | None, link: bool = False, owner: int = NOBODY) -> str:
    """probes.command(None) run as nobody (setpriv), with its cache in home/cache/fleetctl and
    /usr/bin:/bin as PATH; `record` written there (through a symlink with `link`, owned by
    `owner`): the stdout of whatever it started (the fake interpreter prints its first argument)."""
    from fleetctl import probes
    cdir = home / "cache" / "fleetctl"
    cdir.mkdir(parents=True, exist_ok=True)
    rec = cdir / scancache.INTERPRETER
    rec.unlink(missing_ok=True)
    if record is not None:
        target = home / "record.txt" if link else rec
        target.write_text(record + "\n")
        if link:
            rec.symlink_to(target)
    # in a bin/ of its own: an interpreter directly in /tmp's child would have /tmp (sticky, anyone
    # may create pyvenv.cfg or lib/ there) as its prefix, which the trust rule refuses
    fake = home / "bin" / "fake-python"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text("#!/bin/sh\necho \"RECORDED $1\"\n")
    fake.chmod(0o755)
    for p in [home, *home.rglob("*")]:
        os.chown(p, NOBODY, NOBODY, follow_symlinks=False)
    if record is not None and not link:
        os.chown(rec, owner, owner)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "XDG_CACHE_HOME": str(home / "cache")}
    r = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                        *probes.command(None)], input=b"", capture_output=True, env=env, timeout=60)
    return r.stdout.decode()


def test_a_probe_starts_the_recorded_interpreter_directly(nobody_home):
    from fleetctl import probes
    fake = str(nobody_home / "bin" / "fake-python")
    # every probe starts without the site module (kbuild runs site.main() itself, after its check)
    assert run_finder(nobody_home, fake).strip() == "RECORDED -I"
    # review N10: checked on every start: once the directory it lies in is writable by others,
    # it is not run, and its record is removed
    nobody_home.chmod(0o777)
    out = run_finder(nobody_home, fake)
    assert "RECORDED" not in out and result.MARKER in out, out
    assert not (nobody_home / "cache" / "fleetctl" / scancache.INTERPRETER).exists()
    nobody_home.chmod(0o755)
    # no record, one through a symlink, one of another owner, one naming a missing file: python3 on PATH
    for record, link, owner in ((None, False, NOBODY), (fake, True, NOBODY), (fake, False, 0),
                                (str(nobody_home / "gone"), False, NOBODY)):
        out = run_finder(nobody_home, record, link, owner)
        assert "RECORDED" not in out and result.MARKER in out, (record, link, owner, out)
    # as root, the shell looks where the probe keeps root's cache
    assert f"c={scancache.STATE_DIR}/scan-cache;" in probes.command(None)[2]


def untimed(scan: dict) -> dict:
    """A scan's answer without its timings."""
    return {k: v for k, v in scan.items() if k != "phases_s"}


def run_probe_as_nobody(home: Path, doc: bytes, **extra_env: str) -> dict:
    """The probe wrapper run by /usr/bin/python3 as nobody (setpriv), its cache in home/cache/fleetctl."""
    from fleetctl import probes
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "XDG_CACHE_HOME": str(home / "cache"), **extra_env}
    r = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                        *probes.command("/usr/bin/python3")], input=doc, capture_output=True, env=env,
                       timeout=60)
    return probes.parse_output(r.stdout, r.stderr, r.returncode)


def test_probe_modules_are_compiled_once_per_interpreter_build_and_kept(nobody_home):
    """A bundle led by scancache keeps the other modules' code objects on the host; the next run
    execs them instead of compiling (shown by a planted code object answering instead); a file
    of another build, a damaged one or one of another owner is not used, and the next run
    compiles and rewrites it."""
    import marshal
    from fleetctl import probes
    pkg = nobody_home / "site"
    (pkg / "sglang").mkdir(parents=True)
    (pkg / "sglang" / "__init__.py").write_text("")
    (pkg / "sglang" / "m.py").write_text("x = TokenToKVPoolAllocator(need_sort=True)\n")
    os.chown(nobody_home, NOBODY, NOBODY)
    for p in nobody_home.rglob("*"):
        os.chown(p, NOBODY, NOBODY)
    # the callsites probe after the code cache: a bundle made here, as probes.bundle makes one
    led = probes.modules_for("facts.scancache")
    mods = [*led, *(m for m in probes.modules_for("facts.callsites") if m not in led)]
    doc = json.dumps({"modules": [[m, probes.source(m)] for m in mods], "main": "facts.callsites",
                      "params": {"location": str(pkg)}, "wrapper": probes.WRAPPER,
                      "code_key": probes.sources_sha256(mods)}).encode()
    real = run_probe_as_nobody(nobody_home, doc)
    assert [s["file"] for s in real["allocator_call_sites"]] == ["sglang/m.py"]
    cdir = nobody_home / "cache" / "fleetctl"
    [kept] = list(cdir.glob("code-*.marshal"))
    head, body = kept.read_bytes().split(b"\n", 1)
    assert json.loads(head)["key"] == probes.sources_sha256(mods)
    # scancache (and safefs) are compiled every run; the rest (callsites, grepfilter) kept
    assert sorted(marshal.loads(body)) == sorted(m for m in mods if m not in led) and "facts.callsites" in mods

    def plant(head_bytes: bytes, code=None, owner=NOBODY):
        code = code or {"facts.callsites": compile("def main(params):\n    return {'from': 'kept code'}\n",
                                                   "<fleetctl probe facts.callsites>", "exec")}
        kept.write_bytes(head_bytes + b"\n" + marshal.dumps(code))
        os.chown(kept, owner, owner)

    plant(head)
    assert run_probe_as_nobody(nobody_home, doc) == {"from": "kept code"}
    other_build = json.dumps(dict(json.loads(head), build="3.0.0|cpython-30")).encode()
    for planted in (lambda: plant(other_build), lambda: kept.write_bytes(head + b"\n\xff\x00garbage"),
                    lambda: plant(head, {"facts.callsites": compile("1", "<elsewhere>", "exec")}),
                    lambda: plant(head, owner=0)):
        planted()
        assert untimed(run_probe_as_nobody(nobody_home, doc)) == untimed(real)
    # each refused file was replaced by the run after it: nobody's, this build's, the real module's code
    assert kept.stat().st_uid == NOBODY and kept.read_bytes().split(b"\n", 1)[0] == head
    assert "scan" in marshal.loads(kept.read_bytes().split(b"\n", 1)[1])["facts.callsites"].co_names  # not the planted main
    assert untimed(run_probe_as_nobody(nobody_home, doc)) == untimed(real)
    # the probe starts with -I: an environment's PYTHONOPTIMIZE (or any PYTHON* variable) changes
    # nothing, so no second build's code is kept
    assert untimed(run_probe_as_nobody(nobody_home, doc, PYTHONOPTIMIZE="2")) == untimed(real)
    assert len(list(cdir.glob("code-*.marshal"))) == 1 and kept.read_bytes().split(b"\n", 1)[0] == head
    cleared = run_probe_as_nobody(nobody_home, probes.bundle("facts.scancache", {"action": "clear"}))
    assert cleared["removed"] >= 1 and not list(cdir.glob("code-*"))  # `fleetctl cache clear` takes it too
