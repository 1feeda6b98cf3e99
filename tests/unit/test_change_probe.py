"""The host-side change probe on temp copies of real SGLang files: apply, rollback, recover, status.

Plans come from the real planner (fleetctl.engine.playbooks.plan) on real release sources; state_dir points
into tmp_path so nothing touches /var/lib/fleetctl.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from fleetctl.engine.playbooks.plan import plan_host
from fleetctl.engine.playbooks.model import load_playbook
from fleetctl.probes import safefs
from fleetctl.probes.change import actions as change, ledger
from fleetctl.probes.facts import drift as record
from sites import ledger_consistent
from fleetctl.wheels import ensure_wheel

from oracles import PLAYBOOK, host_inputs

def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def ledger_states(state: Path) -> list[tuple[str, str]]:
    return [(e["change_id"], e["state"]) for e in ledger.read(str(state))]


def test_apply_then_rollback_is_byte_identical(site):
    site_dir, state, params, originals = site
    r = change.main(dict(params, install="/opt/venv/bin/python"))
    assert r == {"ok": True, "change_id": "c1", "files": ledger.read(str(state))[-1]["files"], "pruned": []}, r
    for f in params["files"]:
        p = Path(f["path"])
        assert p.read_text() == f["new_text"] and sha(p) == f["post_sha256"]
        st = p.stat()
        assert (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (0o640, os.geteuid(), os.getegid())
        assert not list((p.parent / "__pycache__").glob(p.stem + ".*.pyc"))
        assert (p.parent / "__pycache__" / "other.cpython-311.pyc").read_bytes() == b"keep"
        backup = state / "backups" / "c1" / f["path"].lstrip("/")
        assert backup.read_bytes() == originals[f["path"]]
    assert ledger_states(state) == [("c1", "pending"), ("c1", "applied")]
    entry = ledger.read(str(state))[-1]
    assert (entry["operator"], entry["playbook"], entry["install"]) == ("tester", "defrag-tier0", "/opt/venv/bin/python")
    assert entry["root"] == params["root"]
    assert [(f["before_sha256"], f["after_sha256"]) for f in entry["files"]] == \
        [(f["pre_sha256"], f["post_sha256"]) for f in params["files"]]
    # the same change again: the pre-image no longer matches
    again = change.main(dict(params, change_id="c2"))
    assert not again["ok"] and "changed since inspect" in again["error"]

    r = change.main({"action": "rollback", "state_dir": str(state), "last": True})
    assert r["ok"] and r["change_id"] == "c1" and r["forced"] == []
    for path, data in originals.items():
        assert Path(path).read_bytes() == data
        assert (os.stat(path).st_mode & 0o7777, os.stat(path).st_uid) == (0o640, os.geteuid())
    assert ledger_states(state)[-1] == ("c1", "rolled-back")
    assert not [p for p in site_dir.rglob("*.tmp")]
    r = change.main({"action": "rollback", "state_dir": str(state), "change_id": "c1"})
    assert r["ok"] and r["nothing"] == "already rolled back"  # idempotent: a second rollback is a no-op
    assert ledger_states(state)[-1] == ("c1", "rolled-back")


def test_pre_image_mismatch_refused_nothing_changed(site):
    _, state, params, originals = site
    second = Path(params["files"][1]["path"])
    second.write_bytes(second.read_bytes() + b"# edited after inspect\n")
    before = {p: sha(Path(p)) for p in originals}
    r = change.main(params)
    assert not r["ok"] and r["refused"] and r["error"] == f"{second}: changed since inspect"
    assert {p: sha(Path(p)) for p in originals} == before
    assert not state.exists() or (ledger_states(state) == [] and not (state / "backups").exists())


def test_apply_refusals_say_why_and_change_nothing(site, tmp_path):
    """Each refusal of apply names its reason, and leaves the files, the ledger and the backups as
    they were."""
    site_dir, state, params, originals = site
    first, second = (dict(f) for f in params["files"])
    link = site_dir / "sglang" / "link.py"
    link.symlink_to(first["path"])
    (site_dir / "sglang" / "version.py").write_text("v = 1\n")
    (site_dir / "sglang" / "__pycache__").write_text("not a directory")
    cases = [
        (dict(params, change_id="../c1"), "bad or already used change id '../c1'"),
        (dict(params, files=[first, first]), "file paths must be distinct"),
        (dict(params, files=[dict(first, path=f"{site_dir}/missing.py")]), f"{site_dir}/missing.py: No such file or directory"),
        (dict(params, files=[dict(first, path=str(link))]), f"{link} is a symlink, not a regular file: not changing it"),
        (dict(params, files=[dict(first, path=f"{site_dir}/sglang/version.py")]),
         f"{site_dir}/sglang/__pycache__ is a regular file: not changing it"),
        (dict(params, files=[first, dict(second, post_sha256=first["post_sha256"])]),
         f"{second['path']}: new text does not hash to post_sha256"),
    ]
    for p, error in cases:
        assert change.main(p) == {"ok": False, "refused": True, "error": error}, error
    assert all(Path(p).read_bytes() == d for p, d in originals.items())
    assert ledger_states(state) == [] and not (state / "backups").exists()
    assert change.main(params)["ok"]
    assert change.main(params) == {"ok": False, "refused": True, "error": "bad or already used change id 'c1'"}


def test_a_link_changed_since_inspect_is_refused(tmp_path):
    state, link, plain = tmp_path / "state", tmp_path / "current", tmp_path / "plain"
    os.symlink("k9", link)
    plain.write_text("x")

    def act(path, pre):
        return change.main({"action": "apply", "change_id": "c1", "playbook": "kernel", "operator": "t",
                            "state_dir": str(state), "root": str(tmp_path),
                            "files": [{"path": str(path), "kind": "link", "pre_target": pre, "post_target": "k1"}]})

    for path, pre, now in ((link, "k0", "link:k9"), (link, None, "link:k9"), (plain, None, "None")):
        assert act(path, pre) == {"ok": False, "refused": True,
                                  "error": f"{path}: changed since inspect (link is {now})"}, (path, pre)
    assert os.readlink(link) == "k9" and plain.read_text() == "x" and ledger_states(state) == []


def test_a_change_of_a_link_and_a_file_applies_and_rolls_back_both(tmp_path):
    state, link, mod = tmp_path / "state", tmp_path / "current", tmp_path / "m.py"
    os.symlink("k0", link)
    mod.write_text("x = 1\n")
    old, new = mod.read_bytes(), b"x = 2\n"
    files = [{"path": str(link), "kind": "link", "pre_target": "k0", "post_target": "k1"},
             {"path": str(mod), "pre_sha256": sha(mod), "post_sha256": hashlib.sha256(new).hexdigest(),
              "new_text": new.decode()}]
    r = change.main({"action": "apply", "change_id": "c1", "playbook": "kernel", "operator": "t",
                     "state_dir": str(state), "root": str(tmp_path), "files": files})
    assert r["ok"] and [f["path"] for f in r["files"]] == [str(link), str(mod)], r
    assert os.readlink(link) == "k1" and mod.read_bytes() == new
    assert change.main({"action": "rollback", "state_dir": str(state), "change_id": "c1"})["ok"]
    assert os.readlink(link) == "k0" and mod.read_bytes() == old


def test_rolling_back_the_last_kernel_activation_removes_the_routing_evidence(tmp_path):
    """Review R4-5: PUBLIC/route-evidence goes with the last package's `current` link (its first
    activation rolled back); while a package still has one, it stays."""
    public, state = tmp_path / "public", tmp_path / "state"
    (public / "verify_attention").mkdir(parents=True)
    (public / "other").mkdir()
    os.symlink("k0", public / "other" / "current")
    (public / "route-evidence" / "0").mkdir(parents=True)
    (public / "route-evidence" / "0" / "1.json").write_text("{}")

    def activate(cid, pkg):
        return change.main({"action": "apply", "change_id": cid, "playbook": "kernel", "operator": "t",
                            "state_dir": str(state), "root": str(public / pkg),
                            "files": [{"path": str(public / pkg / "current"), "kind": "link", "pre_target": None,
                                       "post_target": "k1"}]})
    assert activate("c1", "verify_attention")["ok"]
    r = change.main({"action": "rollback", "state_dir": str(state), "change_id": "c1"})
    assert r["ok"] and "evidence_removed" not in r and (public / "route-evidence").is_dir()  # `other` still routes
    os.unlink(public / "other" / "current")
    assert activate("c2", "verify_attention")["ok"]
    r = change.main({"action": "rollback", "state_dir": str(state), "change_id": "c2"})
    assert r["ok"] and r["evidence_removed"] == str(public / "route-evidence"), r
    assert not (public / "route-evidence").exists() and not (public / "verify_attention" / "current").exists()


def test_rollback_refuses_changed_file_unless_forced(site):
    _, state, params, originals = site
    assert change.main(params)["ok"]
    first = Path(params["files"][0]["path"])
    first.write_text(first.read_text() + "# hand edit\n")
    edited = sha(first)
    r = change.main({"action": "rollback", "state_dir": str(state), "change_id": "c1"})
    assert not r["ok"] and "changed since the apply" in r["error"] and str(first) in r["error"]
    assert sha(first) == edited and ledger_states(state)[-1] == ("c1", "applied")
    r = change.main({"action": "rollback", "state_dir": str(state), "change_id": "c1", "force": True})
    assert r["ok"] and r["forced"] == [str(first)]
    assert all(Path(p).read_bytes() == d for p, d in originals.items())


def _fail_second_file(point, params, monkeypatch):
    """Make apply fail on the second file at `point` (review H2): (a) before its write, (b) after
    its rename, (c) dropping its bytecode (observation O1), (d) a post-write state mismatch."""
    second = params["files"][1]["path"]
    real_write, real_drop = safefs.atomic_write, safefs.drop_pycache

    def write(path, data, tag, expect=None):
        if path == second and data != Path(path).read_bytes() and point == "before-write":
            raise OSError("disk full")
        if path == second and point == "wrong-bytes" and data.endswith(b"\n") and tag == "c1" \
                and hashlib.sha256(data).hexdigest() == params["files"][1]["post_sha256"]:
            data = data + b"# torn\n"  # what lands on disk is not what was planned
        real_write(path, data, tag, expect)
        if path == second and point == "after-rename" and tag == "c1" and \
                hashlib.sha256(data).hexdigest() == params["files"][1]["post_sha256"]:
            raise OSError(5, "Input/output error")  # say, fsync of the directory after the rename

    def drop(path):
        if path == second and point == "drop-pycache":
            raise PermissionError(13, "Permission denied", path)
        real_drop(path)

    monkeypatch.setattr(safefs, "atomic_write", write)
    monkeypatch.setattr(safefs, "drop_pycache", drop)


@pytest.mark.parametrize("point, error", [
    ("before-write", "OSError: disk full"),
    ("after-rename", "OSError: [Errno 5] Input/output error"),
    ("drop-pycache", "PermissionError: [Errno 13] Permission denied: '{second}'"),
    ("wrong-bytes", "OSError: {second}: state after the write is not post_sha256"),
])
def test_error_midway_restores_and_records_failed(site, monkeypatch, point, error):
    """Wherever the second file's write fails, both files are back byte for byte, the ledger says
    failed, no temp file is left, and the probe says files restored (H2, O1)."""
    site_dir, state, params, originals = site
    _fail_second_file(point, params, monkeypatch)
    error = error.format(second=params["files"][1]["path"])
    r = change.main(params)
    assert r == {"ok": False, "change_id": "c1",
                 "error": "apply failed, files restored: " + error.split(": ", 1)[1]}, r
    for p, data in originals.items():
        assert Path(p).read_bytes() == data, (point, p)
    assert ledger_states(state) == [("c1", "pending"), ("c1", "failed")]
    assert ledger.read(str(state))[-1]["reason"] == error
    assert not list(site_dir.rglob("*.tmp"))
    monkeypatch.undo()
    assert change.main(dict(params, change_id="c2"))["ok"]  # nothing pending blocks the next apply


@pytest.mark.parametrize("failing", [(1,), (0, 1)])
def test_error_midway_with_a_failed_restore_says_not_restored(site, monkeypatch, failing):
    """When the restore itself fails, the probe must not claim "files restored": it names each
    file that is not back (the second only, or both), and puts back the others."""
    site_dir, state, params, originals = site
    second = params["files"][1]["path"]
    real = safefs.atomic_write
    pres = {params["files"][i]["pre_sha256"] for i in failing}

    def write(path, data, tag, expect=None):
        if tag == "c1" and hashlib.sha256(data).hexdigest() in pres and "backups" not in path:
            raise OSError("read-only file system")  # the restore of a failing file
        real(path, data, tag, expect)
        if path == second:
            raise OSError("lost the directory fsync")

    monkeypatch.setattr(safefs, "atomic_write", write)
    r = change.main(params)
    left = "; ".join(f"{params['files'][i]['path']} (OSError: read-only file system)" for i in failing)
    assert r == {"ok": False, "change_id": "c1",
                 "error": f"apply failed: lost the directory fsync; NOT restored: {left}"}, r
    first = params["files"][0]["path"]
    if failing == (1,):
        assert Path(first).read_bytes() == originals[first]  # the first file was put back
    assert all(sha(Path(params["files"][i]["path"])) == params["files"][i]["post_sha256"] for i in failing)
    last = ledger.read(str(state))[-1]
    assert (last["state"], last["reason"]) == ("failed", f"OSError: lost the directory fsync; NOT restored: {left}")


# a probe run in a child process (which SIGKILLs itself) may take this long: generous, as on a
# loaded machine (a mutation run at nice 19) a child that is not killed early is merely slow
CHILD_S = 600
# runs the probe with the params on stdin; SIGKILLs it at the first rename onto argv[1]
KILLER = """
import json, os, signal, sys
from fleetctl.probes.change import actions as change
params = json.load(sys.stdin)
real = os.replace
def replace(src, dst, **dir_fds):
    where = os.readlink("/proc/self/fd/%d" % dir_fds["dst_dir_fd"])
    if os.path.join(where, dst) == sys.argv[1]:
        os.kill(os.getpid(), signal.SIGKILL)  # killed after the temp file, before the rename
    real(src, dst, **dir_fds)
os.replace = replace
change.main(params)
"""


def test_recover_after_kill_mid_apply(site):
    _, state, params, originals = site
    p = subprocess.run([sys.executable, "-c", KILLER, params["files"][1]["path"]], input=json.dumps(params),
                       text=True, timeout=CHILD_S)
    assert p.returncode == -signal.SIGKILL
    first, second = (Path(f["path"]) for f in params["files"])
    assert sha(first) == params["files"][0]["post_sha256"]
    assert sha(second) == params["files"][1]["pre_sha256"]
    [tmp] = second.parent.glob(f".{second.name}.fleetctl-c1.*.tmp")  # a random name nobody can plant
    assert ledger_states(state) == [("c1", "pending")]
    assert change.main(dict(params, change_id="c2")) == {
        "ok": False, "refused": True, "error": "change c1 is still pending: recover first"}

    r = change.main({"action": "recover", "state_dir": str(state)})
    assert r["ok"] and r["recovered"] == [{
        "change_id": "c1", "state": "rolled-back", "reason": "interrupted",
        "files": [{"path": str(first), "action": "restored"}, {"path": str(second), "action": "untouched"}]}]
    assert all(Path(q).read_bytes() == d for q, d in originals.items())
    assert not tmp.exists()
    assert ledger_states(state)[-1] == ("c1", "rolled-back")
    assert change.main({"action": "recover", "state_dir": str(state)})["recovered"] == []
    assert change.main(dict(params, change_id="c3"))["ok"]  # a fresh apply goes through


def test_recover_counts_the_hosts_container_change_records(tmp_path):
    """recover says how many container change records (*.json) the records dir holds, which is
    what makes `fleetctl recover` enter those containers too (engine/ledger.recover_containers);
    none, or no such dir, is 0."""
    state, records = tmp_path / "state", tmp_path / "state" / "containers"
    assert change.main({"action": "recover", "state_dir": str(state), "records": str(records)})["container_records"] == 0
    records.mkdir(parents=True)
    for name in ("a1.b2.json", "c3.d4.json", "notes.txt"):
        (records / name).write_text("{}")
    r = change.main({"action": "recover", "state_dir": str(state), "records": str(records)})
    assert (r["ok"], r["recovered"], r["container_records"]) == (True, [], 2)
    assert change.main({"action": "recover", "state_dir": str(state)})["container_records"] == 0


UNDO_KILLER = """
import json, os, signal, sys
from fleetctl.probes.change import actions as change
params = json.load(sys.stdin)
second = params["files"][1]["path"]
real, seen = os.replace, []
def replace(src, dst, **dir_fds):
    where = os.path.join(os.readlink("/proc/self/fd/%d" % dir_fds["dst_dir_fd"]), dst)
    if where == second:
        seen.append(src)
        if len(seen) == 2:  # the undo's restore of the second file: temp written, not renamed
            os.kill(os.getpid(), signal.SIGKILL)
    real(src, dst, **dir_fds)
    if where == second:
        raise OSError(5, "Input/output error")  # after apply's rename: the undo starts
os.replace = replace
change.main(params)
"""


@pytest.mark.parametrize("backup", ["kept", "lost"])
def test_recover_after_kill_inside_the_undo(site, backup):
    """Killed while an apply that failed is putting files back: `recover` finishes the undo (or,
    with the backup gone, says it could not) and removes the undo's own temp file either way
    (mutation gap: the undo's temp-file tag)."""
    site_dir, state, params, originals = site
    listing = sorted(str(q) for q in site_dir.rglob("*") if "__pycache__" not in q.parts)
    p = subprocess.run([sys.executable, "-c", UNDO_KILLER], input=json.dumps(params), text=True, timeout=CHILD_S)
    assert p.returncode == -signal.SIGKILL
    first, second = (Path(f["path"]) for f in params["files"])
    assert sha(first) == params["files"][0]["post_sha256"]  # the undo starts at the last written: not yet back
    assert sha(second) == params["files"][1]["post_sha256"]
    left = sorted(str(q) for q in site_dir.rglob("*") if "__pycache__" not in q.parts)
    assert len(left) == len(listing) + 1  # the undo's temp file beside the second file
    assert ledger_states(state) == [("c1", "pending")]
    if backup == "lost":
        (state / "backups" / "c1" / str(second).lstrip("/")).unlink()

    r = change.main({"action": "recover", "state_dir": str(state)})
    actions = [f["action"] for f in r["recovered"][0]["files"]]
    assert sorted(str(q) for q in site_dir.rglob("*") if "__pycache__" not in q.parts) == listing
    if backup == "kept":
        assert r["ok"] and actions == ["restored", "restored"]
        assert all(Path(q).read_bytes() == d for q, d in originals.items())
        assert ledger_states(state)[-1] == ("c1", "rolled-back")
    else:
        assert actions[0] == "restored" and actions[1].startswith("restore failed: ")
        assert sha(second) == params["files"][1]["post_sha256"]
        assert ledger_states(state)[-1] == ("c1", "failed")


def test_recover_after_kill_inside_a_link_restore(tmp_path):
    """Killed between the new link and its rename while `recover` puts a kernel link back: the
    next recover finishes and removes the temp link (mutation gaps: the tag of the link swap in
    apply and in the restore)."""
    state, link = tmp_path / "state", tmp_path / "current"
    os.symlink("k0", link)
    apply = {"action": "apply", "change_id": "c1", "playbook": "kernel", "operator": "t", "commit": False,
             "state_dir": str(state), "root": str(tmp_path),
             "files": [{"path": str(link), "kind": "link", "pre_target": "k0", "post_target": "k1"}]}
    # killed inside the apply's own swap: recover finds the link untouched and drops apply's temp link
    listing = sorted(os.listdir(tmp_path)) + ["state"]
    p = subprocess.run([sys.executable, "-c", KILLER, str(link)], input=json.dumps(apply), text=True, timeout=CHILD_S)
    assert p.returncode == -signal.SIGKILL
    [tmp] = tmp_path.glob(".current.fleetctl-c1.*.tmp")
    assert os.readlink(tmp) == "k1" and os.readlink(link) == "k0"
    recover = {"action": "recover", "state_dir": str(state)}
    assert change.main(recover)["recovered"][0]["files"] == [{"path": str(link), "action": "untouched"}]
    assert sorted(os.listdir(tmp_path)) == listing
    # killed inside recover's swap back
    r = change.main(dict(apply, change_id="c2"))
    assert r["ok"] and os.readlink(link) == "k1"
    p = subprocess.run([sys.executable, "-c", KILLER, str(link)], input=json.dumps(recover), text=True, timeout=CHILD_S)
    assert p.returncode == -signal.SIGKILL
    [tmp] = tmp_path.glob(".current.fleetctl-c2-rb.*.tmp")
    assert os.readlink(tmp) == "k0" and os.readlink(link) == "k1" and ledger_states(state)[-1] == ("c2", "pending")
    assert change.main(recover)["recovered"] == [{"change_id": "c2", "state": "rolled-back", "reason": "interrupted",
                                                  "files": [{"path": str(link), "action": "restored"}]}]
    assert os.readlink(link) == "k0" and sorted(os.listdir(tmp_path)) == listing


@pytest.mark.parametrize("lost", [False, True])
def test_recover_leaves_unknown_content_alone(site, lost):
    """A file edited by hand while its change was pending is neither restored nor overwritten:
    the change becomes "failed" and names it; the other file is restored (or, its backup lost,
    named too)."""
    _, state, params, originals = site
    assert change.main(dict(params, commit=False))["ok"]
    first, second = (Path(f["path"]) for f in params["files"])
    second.write_bytes(b"# edited by hand while the change was pending\n")
    action, unknown = "restored", f"{second}"
    if lost:
        backup = state / "backups" / "c1" / str(first).lstrip("/")
        backup.unlink()
        action, unknown = f"restore failed: [Errno 2] No such file or directory: '{backup}'", f"{first}, {second}"
    assert change.main({"action": "recover", "state_dir": str(state)}) == {"ok": True, "recovered": [{
        "change_id": "c1", "state": "failed", "reason": f"interrupted; unknown content: {unknown}",
        "files": [{"path": str(first), "action": action},
                  {"path": str(second), "action": "unknown content, left alone"}]}], "container_records": 0}
    assert sha(first) == params["files"][0]["post_sha256" if lost else "pre_sha256"]
    assert second.read_bytes() == b"# edited by hand while the change was pending\n"
    assert ledger_states(state)[-1] == ("c1", "failed")


def test_a_restore_is_checked_against_before_sha256(site, monkeypatch):
    """A backup that no longer hashes to before_sha256 is never written back, and a restore
    whose bytes do not land as before_sha256 is reported, not counted as restored."""
    _, state, params, originals = site
    assert change.main(params)["ok"]
    first = params["files"][-1]["path"]  # the first a rollback restores: the last written
    backup = state / "backups" / "c1" / first.lstrip("/")
    good = backup.read_bytes()
    backup.write_bytes(b"import os  # not what was there\n")
    rollback = {"action": "rollback", "state_dir": str(state), "change_id": "c1"}
    r = change.main(rollback)
    assert not r["ok"] and r["error"] == (
        f"rollback failed after restoring 0 of 2 files (none): backup {backup} does not hash to before_sha256")
    assert sha(Path(first)) == params["files"][-1]["post_sha256"]
    backup.write_bytes(good)
    real = safefs.atomic_write
    monkeypatch.setattr(safefs, "atomic_write",
                        lambda path, data, tag, expect=None: real(path, data + b"# torn\n", tag, expect))
    r = change.main(rollback)
    assert not r["ok"] and r["error"] == (
        f"rollback failed after restoring 0 of 2 files (none): {first}: sha256 after restore is not before_sha256")
    monkeypatch.undo()
    assert change.main(dict(rollback, force=True))["ok"]
    assert all(Path(p).read_bytes() == d for p, d in originals.items())


def test_a_link_restore_that_does_not_take_is_reported(tmp_path, monkeypatch):
    """A link put back but found pointing elsewhere (replaced concurrently) fails the rollback
    with the link and the target it should have, and the change stays not rolled back."""
    state, link = tmp_path / "state", str(tmp_path / "current")
    os.symlink("k0", link)
    r = change.main({"action": "apply", "change_id": "c1", "playbook": "kernel", "operator": "t",
                     "state_dir": str(state), "root": str(tmp_path),
                     "files": [{"path": link, "kind": "link", "pre_target": "k0", "post_target": "k1"}]})
    assert r["ok"] and os.readlink(link) == "k1"
    monkeypatch.setattr(safefs, "set_link", lambda path, target, tag: None)  # someone else's link wins
    r = change.main({"action": "rollback", "change_id": "c1", "state_dir": str(state)})
    assert not r["ok"] and r["error"] == (
        "rollback failed after restoring 0 of 1 files (none): %s: link after restore is not link:k0" % link)
    assert ledger_states(state)[-1] == ("c1", "failed") and os.readlink(link) == "k1"


def test_status_drift_and_record(tmp_path):
    site, state = tmp_path / "site", tmp_path / "state"
    with zipfile.ZipFile(ensure_wheel("0.5.2")) as z:
        z.extractall(site)
    st = {"action": "status", "state_dir": str(state), "location": str(site), "dist": "sglang"}
    r = change.main(st)
    assert r["ok"] and r["modified"] == [] and r["drift"] == [] and r["changes"] == [], r
    # a file edited by hand: modified outside fleetctl
    hand = site / "sglang" / "version.py"
    hand.write_text(hand.read_text() + "# hand edit\n")
    assert change.main(st)["modified"] == [{"path": str(hand), "problem": "modified outside fleetctl"}]
    # a fleetctl change is explained by the ledger
    rel = "sglang/srt/model_executor/model_runner.py"
    text = (site / rel).read_text()
    plan = plan_host(load_playbook(PLAYBOOK), "h", {}, *host_inputs({rel: text}, location=str(site)))
    fc = plan.files[0]
    r = change.main({"action": "apply", "state_dir": str(state), "change_id": "c1", "playbook": "defrag-tier0",
                     "operator": "t", "root": str(site), "files": [{"path": fc.path, "pre_sha256": fc.pre_sha256,
                                                 "post_sha256": fc.post_sha256, "new_text": fc.new_text}]})
    assert r["ok"], r
    r = change.main(st)
    assert r["modified"] == [{"path": str(hand), "problem": "modified outside fleetctl"}] and r["drift"] == []
    assert [(c["change_id"], c["state"], c["files"]) for c in r["changes"]] == [("c1", "applied", [fc.path])]
    # reinstalled: the applied change no longer holds
    (site / rel).write_text(text)
    r = change.main(st)
    assert r["drift"] == [{"change_id": "c1", "path": fc.path, "problem": "drift: reverted or reinstalled"}]
    assert r["modified"] == [{"path": str(hand), "problem": "modified outside fleetctl"}]
    r = change.main(dict(st, location=str(tmp_path)))
    assert r["modified"] is None and "no sglang distribution" in r["record_error"]


def test_status_hashes_record_files_by_identity(tmp_path, monkeypatch):
    """A warm status reads no file whose identity the record cache holds; a same-size rewrite
    with its mtime put back (only ctime and inode tell) is read again and reported."""
    monkeypatch.setattr(record, "RACY_S", 0)
    site, state = tmp_path / "site", tmp_path / "state"
    with zipfile.ZipFile(ensure_wheel("0.5.2")) as z:
        z.extractall(site)
    st = {"action": "status", "state_dir": str(state), "location": str(site), "dist": "sglang"}
    assert change.main(st)["modified"] == []
    assert len(list((state / "scan-cache").glob("record-*.json"))) == 1
    reads, real = [], safefs.sha256_file
    monkeypatch.setattr(safefs, "sha256_file", lambda p: reads.append(p) or real(p))
    assert change.main(st)["modified"] == [] and reads == []
    hand = site / "sglang" / "version.py"
    before, data = hand.stat(), hand.read_bytes()
    assert b"0.5.2" in data
    tmp = hand.with_name("version.new")
    tmp.write_bytes(data.replace(b"0.5.2", b"9.9.9"))
    os.replace(tmp, hand)
    os.utime(hand, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert hand.stat().st_size == before.st_size
    r = change.main(st)
    assert reads == [str(hand)] and r["modified"] == [{"path": str(hand), "problem": "modified outside fleetctl"}]


def test_two_phase_apply_commit_or_rollback(site):
    _, state, params, originals = site
    r = change.main(dict(params, commit=False))  # written, awaiting validation
    assert r["ok"] and ledger_states(state) == [("c1", "pending")]
    assert all(sha(Path(f["path"])) == f["post_sha256"] for f in params["files"])
    r = change.main({"action": "rollback", "state_dir": str(state), "change_id": "c1", "reason": "smoke failed"})
    assert r["ok"] and all(Path(p).read_bytes() == d for p, d in originals.items())
    last = ledger.read(str(state))[-1]
    assert (last["state"], last["reason"]) == ("rolled-back", "smoke failed")
    bad = change.main({"action": "commit", "state_dir": str(state), "change_id": "c1"})
    assert not bad["ok"] and "rolled-back, not pending" in bad["error"]

    assert change.main(dict(params, change_id="c2", commit=False))["ok"]
    assert change.main({"action": "commit", "state_dir": str(state), "change_id": "c2"})["ok"]
    assert ledger_states(state)[-2:] == [("c2", "pending"), ("c2", "applied")]
    assert change.main({"action": "recover", "state_dir": str(state)})["recovered"] == []
    assert all(sha(Path(f["path"])) == f["post_sha256"] for f in params["files"])


def test_symlink_changes_swap_roll_back_and_recover(tmp_path):
    """Kernel activation: the `current` link is a ledger change like a file edit."""
    state, kdir = tmp_path / "state", tmp_path / "kernels"
    kdir.mkdir()
    link = str(kdir / "current")
    sd = {"state_dir": str(state)}

    def act(cid, pre, post, commit=True):
        return change.main({"action": "apply", "change_id": cid, "playbook": "kernel", "operator": "t",
                            "files": [{"path": link, "kind": "link", "pre_target": pre, "post_target": post}],
                            "commit": commit, "root": str(kdir), **sd})

    assert act("c1", None, "k1")["ok"] and os.readlink(link) == "k1"
    refused = act("c2", None, "k2")
    assert not refused["ok"] and "changed since inspect" in refused["error"] and os.readlink(link) == "k1"
    assert act("c3", "k1", "k2")["ok"] and os.readlink(link) == "k2"
    assert change.main({"action": "status", **sd})["kernels"] == {}  # only kernels/<name>/current counts
    assert change.main({"action": "rollback", "change_id": "c3", **sd})["ok"] and os.readlink(link) == "k1"
    assert act("c4", "k1", "k3", commit=False)["ok"] and os.readlink(link) == "k3"  # killed before commit
    rec = change.main({"action": "recover", **sd})["recovered"]
    assert [(r["change_id"], r["files"][0]["action"]) for r in rec] == [("c4", "restored")]
    assert os.readlink(link) == "k1"
    assert change.main({"action": "rollback", "change_id": "c1", **sd})["ok"]
    assert not os.path.lexists(link)
    assert ledger_states(state)[-1] == ("c1", "rolled-back")


# ---- a hostile or odd host (security review H1, M7, L1, L6, L11) ---------------------------

def test_state_dir_and_ledger_are_private_whatever_the_umask(site):
    _, state, params, _ = site
    old = os.umask(0)
    try:
        assert change.main(params)["ok"]
    finally:
        os.umask(old)
    assert (state.stat().st_mode & 0o7777, (state / "ledger.jsonl").stat().st_mode & 0o7777) == (0o700, 0o600)
    assert (state / "backups").stat().st_mode & 0o7777 == 0o700


def test_extended_attributes_are_kept(site):
    _, state, params, _ = site
    target = params["files"][0]["path"]
    os.setxattr(target, "user.fleetctl-test", b"label")
    assert change.main(params)["ok"]
    assert os.getxattr(target, "user.fleetctl-test") == b"label"
    assert change.main({"action": "rollback", "state_dir": str(state), "change_id": "c1"})["ok"]
    assert os.getxattr(target, "user.fleetctl-test") == b"label"


def test_network_file_system_is_refused_unless_shared_tree(site, tmp_path, monkeypatch):
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text("22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
                         "40 22 0:50 / /mnt/shared\\040tree rw - nfs4 srv:/x rw\n"
                         "41 22 0:51 / /mnt/fuse rw - fuse.sshfs u@h: rw\n")
    assert safefs.fs_type("/mnt/shared tree/lib", str(mountinfo)) == "nfs4"
    assert safefs.fs_type("/mnt/shared", str(mountinfo)) == "ext4"
    assert safefs.fs_type("/mnt/fuse", str(mountinfo)) == "fuse.sshfs"
    assert safefs.is_network_fs("fuse.sshfs") and not safefs.is_network_fs("ext4")
    _, state, params, originals = site
    monkeypatch.setattr(safefs, "fs_type", lambda path: "nfs4" if path == params["root"] else "ext4")
    r = change.main(params)
    assert not r["ok"] and r["refused"] and r["error"] == (
        f"{params['root']} is on nfs4, a network file system: one host's apply would change every host that "
        "mounts it (set fleetctl_shared_tree: true for this host if that is meant)")
    assert all(Path(p).read_bytes() == d for p, d in originals.items())
    assert change.main(dict(params, shared_tree=True))["ok"]


def test_paths_outside_the_root_or_not_normalised_are_refused(site, tmp_path):
    _, state, params, _ = site
    decoy = tmp_path / "decoy"
    decoy.write_text("x")
    first = params["files"][0]
    for path, why in [(str(decoy), f"{decoy} is outside {params['root']} (links resolved): fleetctl only writes there"),
                      (params["root"] + "/sglang/../../decoy", "not an absolute, normalised path"),
                      ("sglang/x.py", "not an absolute, normalised path")]:
        r = change.main(dict(params, files=[dict(first, path=path)]))
        assert not r["ok"] and r["refused"] and why in r["error"], r
    assert not change.main(dict(params, root=None))["ok"]
    assert decoy.read_text() == "x"


def test_forged_ledger_entry_is_refused(site, tmp_path):
    _, state, params, _ = site
    assert change.main(dict(params, commit=False))["ok"]
    decoy = tmp_path / "decoy"
    decoy.write_text("x")
    entry = ledger.read(str(state))[-1]
    entry["files"][0]["backup"] = str(decoy)  # a backup outside backups/<change_id>/
    with open(state / "ledger.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")
    r = change.main({"action": "recover", "state_dir": str(state)})
    assert not r["ok"] and r["refused"] and r["error"] == (
        f"ledger entry c1 has backup {str(decoy)!r}, not {state}/backups/c1{entry['files'][0]['path']}: "
        "not trusting it")
    entry["files"][0].update(path=str(decoy), backup=f"{state}/backups/c1{decoy}")
    with open(state / "ledger.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")
    r = change.main({"action": "rollback", "state_dir": str(state), "change_id": "c1"})
    assert not r["ok"] and f"names {str(decoy)!r} outside {params['root']}" in r["error"]
    assert decoy.read_text() == "x"


def test_a_ledger_of_a_newer_schema_is_refused_and_nothing_changes(site):
    """Every entry says its schema; a ledger holding one newer than this fleetctl's is refused by
    every action (an older fleetctl or collection would misread it), and nothing is written."""
    _, state, params, originals = site
    assert change.main(dict(params, commit=False))["ok"]
    assert {e["schema"] for e in ledger.read(str(state))} == {ledger.SCHEMA}
    entry = dict(ledger.read(str(state))[-1], change_id="c9", schema=ledger.SCHEMA + 1)
    with open(state / "ledger.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")
    written = (state / "ledger.jsonl").read_bytes()
    on_disk = {p: Path(p).read_bytes() for p in originals}
    for action in ({"action": "status"}, {"action": "recover"}, {"action": "commit", "change_id": "c1"},
                   {"action": "rollback", "change_id": "c1"}, dict(params, change_id="c2")):
        r = change.main(dict(action, state_dir=str(state)))
        assert not r["ok"] and r["refused"], (action, r)
        assert f"schema {ledger.SCHEMA + 1}, newer than this fleetctl's {ledger.SCHEMA}" in r["error"]
        assert "(change c9)" in r["error"] and "upgrade fleetctl" in r["error"]
    assert (state / "ledger.jsonl").read_bytes() == written
    assert {p: Path(p).read_bytes() for p in originals} == on_disk
    # a line of fleetctl before the schema was named (no "schema") is schema 1 and still read
    lines = written.decode().splitlines()[:-1]
    (state / "ledger.jsonl").write_text("".join(json.dumps({k: v for k, v in json.loads(x).items()
                                                            if k != "schema"}) + "\n" for x in lines))
    assert change.main({"action": "status", "state_dir": str(state)})["ok"]


def test_status_skips_a_record_naming_a_fifo_or_a_device(tmp_path):
    site, state = tmp_path / "site", tmp_path / "state"
    with zipfile.ZipFile(ensure_wheel("0.5.2")) as z:
        z.extractall(site)
    os.mkfifo(site / "sglang" / "fifo.py")
    [record] = site.glob("sglang-*.dist-info/RECORD")
    up = "../" * len(site.parts)
    with open(record, "a") as f:
        f.write(f"sglang/fifo.py,sha256=AAAA,1\n{up}dev/zero,sha256=AAAA,1\n")
    t0 = time.monotonic()
    r = change.main({"action": "status", "state_dir": str(state), "location": str(site), "dist": "sglang"})
    assert time.monotonic() - t0 < 30
    assert r["modified"] == [
        {"path": str(site / "sglang" / "fifo.py"),
         "problem": f"skipped, not read: {site}/sglang/fifo.py is a FIFO, not a regular file"},
        {"path": "/dev/zero", "problem": "skipped, not read: /dev/zero is a character device, not a regular file"}]


# ---- pruning and space (issue 13: backups and builds do not fill /var/lib) -------------------

def test_old_backups_no_rollback_needs_are_pruned_and_status_shows_the_space(site, monkeypatch):
    site_dir, state, params, originals = site
    monkeypatch.setattr(ledger, "KEEP_BACKUPS", 1)
    sd = {"state_dir": str(state)}
    pruned = []
    for cid in ("c1", "c2"):  # applied then rolled back: no rollback can need their backups
        pruned.append(change.main(dict(params, change_id=cid))["pruned"])
        assert change.main({"action": "rollback", "change_id": cid, **sd})["ok"]
    assert pruned == [[], [str(state / "backups" / "c1")]]  # c1: rolled back, older than the latest 1
    res = change.main(dict(params, change_id="c3"))
    assert res["ok"] and res["pruned"] == [str(state / "backups" / "c2")]
    assert os.listdir(state / "backups") == ["c3"]
    space = change.main({"action": "status", **sd})["space"]
    backup_bytes = sum(p.stat().st_size for p in (state / "backups").rglob("*") if p.is_file())
    assert space["backups"] == backup_bytes == sum(map(len, originals.values())) and space["kernels"] == 0
    assert space["total"] == backup_bytes + (state / "ledger.jsonl").stat().st_size + ledger.RESERVE_BYTES
    # c3 is applied and nothing changed its files since: older than KEEP_BACKUPS, it keeps its backup
    kdir = state / "kernels" / "k"
    kdir.mkdir(parents=True)
    assert change.main({"action": "apply", "change_id": "c4", "playbook": "kernel", "files": [
        {"path": str(kdir / "current"), "kind": "link", "pre_target": None, "post_target": "b1"}],
        "root": str(kdir), **sd})["pruned"] == []
    assert change.main({"action": "rollback", "change_id": "c3", **sd})["ok"]
    assert {str(p): p.read_bytes() for p in map(Path, originals)} == originals


def test_builds_that_are_neither_current_nor_previous_are_pruned(tmp_path):
    state = tmp_path / "state"
    kdir = state / "kernels" / "verify_attention"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the state dir's")
    def make(key):
        (kdir / key / "build").mkdir(parents=True)
        (kdir / key / "build" / "m.so").write_bytes(b"x" * 1000)

    for key in ("k1", "k2", "k3", "failed-build"):
        make(key)
    (kdir / "planted").symlink_to(outside, target_is_directory=True)
    sd = {"state_dir": str(state)}

    def act(cid, pre, post):
        return change.main({"action": "apply", "change_id": cid, "playbook": "kernel", "root": str(kdir),
                            "files": [{"path": str(kdir / "current"), "kind": "link", "pre_target": pre,
                                       "post_target": post}], **sd})

    assert act("c1", None, "k1")["pruned"] == [str(kdir / k) for k in ("failed-build", "k2", "k3")]
    for key in ("k2", "k3"):  # built again, as deploys build them
        make(key)
    assert act("c2", "k1", "k2")["pruned"] == [str(kdir / "k3")]  # k1 is the previous build: kept
    make("k3")
    assert act("c3", "k2", "k3")["pruned"] == [str(kdir / "k1")]
    assert sorted(os.listdir(kdir)) == ["current", "k2", "k3", "planted"]
    assert (outside / "keep.txt").read_text() == "not the state dir's"  # a link is never followed
    assert change.main({"action": "rollback", "change_id": "c3", **sd})["ok"] and os.readlink(kdir / "current") == "k2"
    assert change.main({"action": "status", **sd})["space"]["kernels"] == 2000


# ---- disk full (issue 13, review L7) ------------------------------------------------------------

def test_a_commit_the_ledger_cannot_append_is_marked_applied_in_its_pending_line(site, monkeypatch):
    """Review L7: ENOSPC on every append of the validated commit (a stand-in for a full disk:
    tests/machine/test_change_probe_as_root.py fills a real one), reserve freed or not: the
    pending line is marked applied in place, the answer says so, and recover keeps the change."""
    site_dir, state, params, originals = site
    assert change.main(dict(params, change_id="c1", commit=False))["ok"]
    real = ledger.append

    def full(state_dir, entry, state_, reason=None):
        if state_ == ledger.APPLIED:
            raise OSError(28, "No space left on device")
        return real(state_dir, entry, state_, reason)

    monkeypatch.setattr(ledger, "append", full)
    res = change.main({"action": "commit", "change_id": "c1", "state_dir": str(state), "reason": "kept"})
    assert res["ok"] and res["change_id"] == "c1", res
    assert res["note"] == (
        "the file system of %s is full (No space left on device), even after freeing the ledger's reserve (65536 "
        "bytes): committed by marking the change's pending ledger line applied in place (the commit's time and "
        "reason are not recorded); free space there before the next change" % state)
    monkeypatch.setattr(ledger, "append", real)
    assert ledger_states(state) == [("c1", "applied")] and ledger.read(str(state))[0]["reason"] is None
    assert change.main({"action": "recover", "state_dir": str(state)})["recovered"] == []
    assert all(sha(Path(f["path"])) == f["post_sha256"] for f in params["files"])
    # only a pending last line is rewritten: an applied one is left as it is, an unknown change refused
    before = (state / "ledger.jsonl").read_bytes()
    ledger.mark_applied(str(state), "c1")
    with pytest.raises(ValueError, match="change c0 has no pending line"):
        ledger.mark_applied(str(state), "c0")
    assert (state / "ledger.jsonl").read_bytes() == before


def test_a_commit_no_way_can_record_says_the_change_is_still_pending(site, monkeypatch):
    """Review L7: every way to record the commit fails (appends, and the in-place mark): the
    answer says it is still pending and what the next run does, instead of a bare OSError."""
    site_dir, state, params, originals = site
    assert change.main(dict(params, change_id="c1", commit=False))["ok"]
    real = ledger.append

    def full(state_dir, entry, state_, reason=None):
        if state_ == ledger.APPLIED:
            raise OSError(28, "No space left on device")
        return real(state_dir, entry, state_, reason)

    def no_mark(state_dir, change_id):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(ledger, "append", full)
    monkeypatch.setattr(ledger, "mark_applied", no_mark)
    res = change.main({"action": "commit", "change_id": "c1", "state_dir": str(state)})
    assert res == {"ok": False, "change_id": "c1", "error": (
        "validated, but the change could not be committed; the ledger could not record this (OSError: [Errno 28] "
        "No space left on device; after freeing the reserve (65536 bytes): [Errno 28] No space left on device; "
        "marking its pending line applied in place: [Errno 5] Input/output error): it still says pending, and the "
        "next run's recover undoes it")}
    monkeypatch.setattr(ledger, "append", real)
    ledger_consistent(state, "c1", "pending")
    assert change.main({"action": "recover", "state_dir": str(state)})["ok"]
    assert {p: Path(p).read_bytes() for p in originals} == originals


def test_a_file_rewritten_while_being_applied_is_left_as_the_writer_left_it(site, monkeypatch):
    """Review L6: a `pip install` that rewrites the target between the pre-image check and the
    rename: fleetctl does not clobber it (nor "restore" it afterwards); the files it did write
    are restored and the ledger says failed."""
    site_dir, state, params, originals = site
    first, second = [f["path"] for f in params["files"]]
    real = safefs._copy_xattrs

    def pip_meanwhile(src, dst):
        if os.fstat(src).st_ino == os.stat(second).st_ino:
            Path(second).write_bytes(b"# pip's new bytes\n")  # in place, as an editor or pip might
        return real(src, dst)

    monkeypatch.setattr(safefs, "_copy_xattrs", pip_meanwhile)
    res = change.main(dict(params, change_id="race"))
    assert not res["ok"] and res["error"].startswith("apply failed, files restored: [Errno 11] changed on the host "
                                                     "while being applied (a pip install?), left as it is"), res
    assert Path(second).read_bytes() == b"# pip's new bytes\n"
    assert Path(first).read_bytes() == originals[first]
    assert [e["state"] for e in ledger.read(str(state)) if e["change_id"] == "race"][-1] == "failed"


# ---- the write path: no link, FIFO or device is ever followed or replaced ------------------

def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_open_dir_goes_through_no_link_and_no_file(tmp_path):
    real, alias, plain = tmp_path / "real", tmp_path / "alias", tmp_path / "plain"
    (real / "sub").mkdir(parents=True)
    alias.symlink_to(real)
    plain.write_text("x")
    fds = _fds()
    for path in (real / "sub", Path("/")):
        fd = safefs.open_dir(str(path))
        try:
            assert os.path.samestat(os.fstat(fd), os.stat(path))
        finally:
            os.close(fd)
    for path, why in [(alias / "sub", f"{alias} is a symlink: fleetctl does not go through it"),
                      (plain / "sub", f"{plain} is a regular file: fleetctl does not go through it")]:
        for create in (None, 0o700):  # nor does creating the missing part go through them
            with pytest.raises(safefs.UnsafePath) as e:
                safefs.open_dir(str(path), create)
            assert str(e.value) == why
    with pytest.raises(FileNotFoundError):
        safefs.open_dir(str(tmp_path / "missing" / "sub"))
    assert not (tmp_path / "missing").exists() and sorted(os.listdir(real)) == ["sub"]
    # relative, "..", a trailing "/" and the leading "//" that normpath keeps
    for bad in ("relative/dir", f"{real}/../real", f"{real}/", f"/{real}", ""):
        with pytest.raises(safefs.UnsafePath) as e:
            safefs.open_dir(bad)
        assert str(e.value) == f"{bad}: not an absolute, normalised path"
    assert _fds() == fds  # no descriptor is left open, on success or on error


def test_open_dir_creates_the_missing_part_with_its_mode_whatever_the_umask(tmp_path):
    top = tmp_path.stat().st_mode
    old = os.umask(0o077)
    try:
        fd = safefs.open_dir(str(tmp_path / "new" / "deeper"), create=0o751)
    finally:
        os.umask(old)
    try:
        assert os.path.samestat(os.fstat(fd), os.stat(tmp_path / "new" / "deeper"))
    finally:
        os.close(fd)
    assert [stat.S_IMODE(os.stat(p).st_mode) for p in (tmp_path / "new", tmp_path / "new" / "deeper")] == [0o751] * 2
    assert tmp_path.stat().st_mode == top  # what existed is left as it was


def test_confine_resolves_the_directory_and_keeps_to_the_root(tmp_path):
    root = os.path.realpath(tmp_path / "site")
    os.makedirs(f"{root}/pkg")
    os.mkdir(f"{root}2")
    os.symlink(f"{root}/pkg", f"{root}/alias")
    os.symlink(f"{root}2", f"{root}/out")
    os.symlink("elsewhere", f"{root}/pkg/link.py")
    assert safefs.confine(f"{root}/alias/m.py", root) == f"{root}/pkg/m.py"
    assert safefs.confine(f"{root}/pkg/m.py", root + "/") == f"{root}/pkg/m.py"
    assert safefs.confine(f"{root}/pkg/link.py", root) == f"{root}/pkg/link.py"  # the file itself is not followed
    assert safefs.confine("/m.py", "/") == "/m.py"
    with pytest.raises(safefs.Refused):  # only "/" is stripped from the root's end
        safefs.confine(f"{root}/pkg/m.py", root + "X")
    for path in (f"{root}2/m.py", f"{root}/out/m.py"):  # a sibling that shares the root's prefix; a link out
        with pytest.raises(safefs.Refused) as e:
            safefs.confine(path, root)
        assert str(e.value) == f"{root}2/m.py is outside {root} (links resolved): fleetctl only writes there"
    for bad in (None, 7, "pkg/m.py", f"{root}/pkg/../pkg/m.py", f"{root}/pkg/"):
        with pytest.raises(safefs.Refused) as e:
            safefs.confine(bad, root)
        assert str(e.value) == "%r: not an absolute, normalised path" % (bad,)


def test_atomic_write_never_replaces_a_link_or_a_special_file(tmp_path):
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    link, fifo, folder = tmp_path / "link.py", tmp_path / "fifo.py", tmp_path / "dir.py"
    link.symlink_to(outside)
    os.mkfifo(fifo)
    folder.mkdir()
    listing, fds = sorted(os.listdir(tmp_path)), _fds()
    for path, kind in ((link, "symlink"), (fifo, "FIFO"), (folder, "directory")):
        with pytest.raises(safefs.UnsafePath) as e:
            safefs.atomic_write(str(path), b"new", "t")
        assert str(e.value) == f"{path} is a {kind}: fleetctl does not replace it"
    assert outside.read_bytes() == b"keep" and os.readlink(link) == str(outside) and not os.listdir(folder)
    assert sorted(os.listdir(tmp_path)) == listing and _fds() == fds


def test_atomic_write_never_opens_a_planted_temp_name(tmp_path, monkeypatch):
    """Even with its random part guessed, the temp name is opened O_EXCL|O_NOFOLLOW: a link
    planted there is neither followed nor removed, and the file is left as it was."""
    target, outside = tmp_path / "m.py", tmp_path / "outside"
    target.write_bytes(b"old")
    outside.write_bytes(b"keep")
    monkeypatch.setattr(safefs.os, "urandom", lambda n: bytes(n))
    planted = tmp_path / ".m.py.fleetctl-t.0000000000000000.tmp"
    planted.symlink_to(outside)
    with pytest.raises(FileExistsError):
        safefs.atomic_write(str(target), b"new", "t")
    assert (target.read_bytes(), outside.read_bytes(), os.readlink(planted)) == (b"old", b"keep", str(outside))


def test_atomic_write_takes_short_writes_and_keeps_its_temp_file_private(tmp_path, monkeypatch):
    """os.write may write less than asked: every byte still lands; and while the data is being
    written the temp file is 0600 (its final mode is set once the data is in)."""
    p, data, modes = tmp_path / "m.py", bytes(range(256)) * 64, set()
    p.write_bytes(b"old")
    os.chmod(p, 0o644)
    real = os.write

    def short(fd, view):
        modes.add(stat.S_IMODE(os.fstat(fd).st_mode))
        return real(fd, view[:1000])

    monkeypatch.setattr(os, "write", short)
    safefs.atomic_write(str(p), data, "t")
    monkeypatch.undo()
    assert p.read_bytes() == data and modes == {0o600} and stat.S_IMODE(p.stat().st_mode) == 0o644




@pytest.mark.skipif(os.geteuid() == 0, reason="root may enter every directory: the case is a login without root")
def test_a_state_dir_this_login_may_not_use_is_named_with_the_login_and_the_fix(tmp_path):
    """A login without root (hosts.yaml's shape, issue 50): a state dir below a directory it may
    not enter, and one that is root's, are named with the login and ansible_become, never a bare
    PermissionError of their last component."""
    import pwd

    me = pwd.getpwuid(os.geteuid()).pw_name
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    closed.chmod(0)
    try:
        for action in ("status", "recover"):
            res = change.main({"action": action, "state_dir": str(closed / "fleetctl")})
            assert res["ok"] is False and "PermissionError" not in res["error"], res
            assert res["error"].startswith(f"{closed}: permission denied to {me} (uid {os.geteuid()}): "), res
            assert res["error"].endswith("set ansible_become: true for this host (and pass -K if sudo asks for a "
                                         "password)"), res
    finally:
        closed.chmod(0o700)
    if os.stat("/").st_uid == 0:  # a directory of root's as the state dir
        res = change.main({"action": "status", "state_dir": "/"})
        assert res["ok"] is False and res["error"].startswith(f"/: permission denied to {me}"), res
        assert "fleetctl's state dir is root's" in res["error"] and "ansible_become: true" in res["error"]
