"""What the change probe does that only root can set up, as root finds it on a host: files of other
users (owner, group and mode kept through apply and rollback, and by the atomic write, set-id bits
too) and a full disk (a small tmpfs: the original bytes are kept, the ledger says failed; a validated
change whose commit finds the disk full is kept). The rest of the probe's tests are
tests/unit/test_change_probe.py; `site` is tests/sites.py's."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from fleetctl import inventory
from fleetctl.connection import Settings
from fleetctl.engine.changes import Change, ChangeOptions, change_job, execute
from fleetctl.engine.context import HostResult
from fleetctl.engine.fleet import Fleet
from fleetctl.engine.validate import SmokeOptions
from fleetctl.probes import safefs
from fleetctl.probes.change import actions as change, ledger
from fleetctl.vocab import HostStatus
from sites import ledger_consistent


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_apply_and_rollback_keep_another_users_owner_and_mode(tmp_path):
    site, state = tmp_path / "site", tmp_path / "state"
    p = site / "sglang" / "srt" / "m.py"
    old, new = b"need_sort = True\n", "need_sort = False\n"
    p.parent.mkdir(parents=True)
    p.write_bytes(old)
    os.chmod(p, 0o640)
    os.chown(p, 1234, 2345)
    params = {"action": "apply", "state_dir": str(state), "change_id": "c1", "playbook": "defrag-tier0",
              "operator": "tester", "root": str(site),
              "files": [{"path": str(p), "pre_sha256": sha(old), "post_sha256": sha(new.encode()), "new_text": new}]}
    r = change.main(params)
    assert r["ok"], r
    st = p.stat()
    assert (p.read_text(), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (new, 0o640, 1234, 2345)
    r = change.main({"action": "rollback", "state_dir": str(state), "last": True})
    assert r["ok"] and r["change_id"] == "c1", r
    st = p.stat()
    assert (p.read_bytes(), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (old, 0o640, 1234, 2345)


def test_atomic_write_modes_owners_and_a_failed_write(tmp_path):
    p = tmp_path / "new.py"
    data = bytes(range(256)) * 4096  # 1 MiB
    old = os.umask(0o077)
    try:
        safefs.atomic_write(str(p), data, "t")
    finally:
        os.umask(old)
    st = p.stat()
    assert p.read_bytes() == data
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o644, os.geteuid(), os.getegid())
    fds = _fds()
    with pytest.raises(TypeError):  # fails after its temp file was made: the temp file goes
        safefs.atomic_write(str(p), "not bytes", "t")
    assert p.read_bytes() == data and os.listdir(tmp_path) == ["new.py"] and _fds() == fds
    # set-id bits survive the change of owner (fchown clears them), and so do owner and group
    for uid, gid in ((1234, 2345), (os.geteuid(), 2345)):
        os.chown(p, uid, gid)
        os.chmod(p, 0o6750)
        safefs.atomic_write(str(p), b"y", "t")
        st = p.stat()
        assert (p.read_bytes(), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (b"y", 0o6750, uid, gid)
    assert os.listdir(tmp_path) == ["new.py"] and _fds() == fds


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size_kib, where): a small tmpfs there (root only), unmounted at the end."""
    mounted = []

    def mount(size_kib: int, where: Path) -> Path:
        where.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k,mode=0700", "tmpfs", str(where)], check=True)
        mounted.append(where)
        return where

    yield mount
    for where in reversed(mounted):
        subprocess.run(["umount", str(where)], check=False)


def test_disk_full_under_the_state_dir_keeps_the_original_bytes(site, tmpfs):
    """The backups do not fit (a 8 KiB tmpfs over the state dir holds the ledger, not the
    backups): nothing was written to the package, the apply says why, the ledger says failed."""
    site_dir, state, params, originals = site
    tmpfs(8, state)
    res = change.main(dict(params, change_id="full1"))
    assert not res["ok"] and res["error"] == "apply failed, files restored: [Errno 28] No space left on device", res
    assert {p: Path(p).read_bytes() for p in originals} == originals
    ledger_consistent(state, "full1", "failed")


def test_disk_full_in_the_package_tree_keeps_the_original_bytes(site, tmpfs, tmp_path):
    """A copy of the package tree on a tmpfs with no room for the new file's temp copy: the target
    is never half-written, the error says files restored, the ledger says failed."""
    site_dir, state, params, originals = site
    small = tmpfs(256, tmp_path / "full-site")
    for p in originals:
        dst = small / Path(p).relative_to(site_dir)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(originals[p])
    copies = {str(small / Path(p).relative_to(site_dir)): b for p, b in originals.items()}
    with open(small / "filler", "wb", buffering=0) as f:  # fill the rest
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    moved = dict(params, change_id="full2", root=str(small),
                 files=[dict(f, path=str(small / Path(f["path"]).relative_to(site_dir))) for f in params["files"]])
    res = change.main(moved)
    assert not res["ok"] and res["error"].startswith("apply failed, files restored: "), res
    assert "No space left on device" in res["error"]
    assert {p: Path(p).read_bytes() for p in copies} == copies
    assert not [n for n in os.listdir(small / Path(params["files"][0]["path"]).relative_to(site_dir).parent)
                if ".fleetctl-" in n]  # no temp file left behind
    ledger_consistent(state, "full2", "failed")


def _fill(disk: Path) -> None:
    """Fill the file system of `disk` to its last page (a file of 4 KiB writes until ENOSPC)."""
    with open(disk / "filler", "ab", buffering=0) as f:
        with pytest.raises(OSError) as e:
            while True:
                f.write(b"\xff" * 4096)
    assert e.value.errno == errno.ENOSPC
    with pytest.raises(OSError, match="No space left"):
        (disk / "one-byte").write_bytes(b"x")


def _twelve_files(site: Path) -> tuple[list[dict], dict[str, bytes]]:
    """12 files under `site` with long paths (the review's case: a ledger line over a page)."""
    files, originals = [], {}
    for i in range(12):
        p = site / "sglang" / "srt" / "layers" / "attention" / f"flashinfer_mla_backend_with_a_long_name_{i:02d}.py"
        p.parent.mkdir(parents=True, exist_ok=True)
        old, new = f"need_sort = True  # {i}\n".encode(), f"need_sort = False  # {i}\n"
        p.write_bytes(old)
        originals[str(p)] = old
        files.append({"path": str(p), "pre_sha256": sha(old), "post_sha256": sha(new.encode()), "new_text": new})
    return files, originals


@pytest.mark.parametrize("reserve", [True, False], ids=["reserve", "no-reserve"])
def test_a_validated_change_whose_commit_finds_the_disk_full_is_kept(tmp_path, tmpfs, reserve):
    """Review section 4 (ENOSPC at commit, L7): the state dir on a real 2 MiB tmpfs, filled after the
    apply so that the commit's ledger line needs a page the disk no longer has. The commit frees the
    reserve and appends (or, with no reserve, as when there was no room at apply time, marks the
    pending line applied in place): the answer says so, the change stays applied, and the next
    `recover` leaves it applied."""
    disk = tmpfs(2048, tmp_path / "disk")
    state = disk / "fleetctl"
    files, originals = _twelve_files(tmp_path / "site")
    sd = {"state_dir": str(state)}
    res = change.main({"action": "apply", "change_id": "big", "playbook": "defrag-tier0", "operator": "tester",
                       "root": str(tmp_path / "site"), "files": files, "commit": False, **sd})
    assert res["ok"], res
    assert (state / "ledger.reserve").stat().st_size == ledger.RESERVE_BYTES
    if not reserve:
        (state / "ledger.reserve").unlink()
    _fill(disk)
    size = (state / "ledger.jsonl").stat().st_size
    line = len((state / "ledger.jsonl").read_bytes().splitlines()[-1])
    assert line > -size % 4096, "the commit's line must need a new page for this test to mean anything"

    res = change.main({"action": "commit", "change_id": "big", **sd})
    assert res["ok"], res
    how = ("committed after freeing the ledger's reserve" if reserve
           else "marking the change's pending ledger line applied in place")
    assert res["note"].startswith(f"the file system of {state} is full (No space left on device)"), res
    assert how in res["note"], res
    assert {p: sha(Path(p).read_bytes()) for p in originals} == {f["path"]: f["post_sha256"] for f in files}
    assert [e["state"] for e in ledger.read(str(state))] == (["pending", "applied"] if reserve else ["applied"])

    assert change.main({"action": "recover", **sd}) == {"ok": True, "recovered": [], "container_records": 0}
    assert {p: sha(Path(p).read_bytes()) for p in originals} == {f["path"]: f["post_sha256"] for f in files}
    ledger_consistent(state, "big", "applied")


def test_an_append_cut_short_by_a_full_disk_leaves_the_ledger_as_it_was(tmp_path, tmpfs):
    """Review section 4, code note: a ledger line whose last byte (its newline) finds no room on a
    real tmpfs, so that everything before it was written. The append fails and the ledger is cut
    back to what it was: a line reported unrecorded never parses as recorded."""
    disk = tmpfs(2048, tmp_path / "disk")
    state = disk / "fleetctl"
    entry = {"change_id": "c1", "files": []}
    ledger.append(str(state), entry, ledger.PENDING)
    _fill(disk)
    before = (state / "ledger.jsonl").read_bytes()
    room = -len(before) % 4096  # the free bytes of the ledger's last page
    probe = dict(entry, state=ledger.APPLIED, time=ledger._now(), reason="", schema=ledger.SCHEMA)
    reason = "r" * (room - len(json.dumps(probe, sort_keys=True)))  # the line without its newline fills the page
    with pytest.raises(OSError) as e:
        ledger.append(str(state), entry, ledger.APPLIED, reason)
    assert e.value.errno == errno.ENOSPC
    assert (state / "ledger.jsonl").read_bytes() == before
    assert [x["state"] for x in ledger.read(str(state))] == ["pending"]


def test_the_engine_keeps_a_validated_change_whose_commit_finds_the_disk_full(tmp_path, tmpfs):
    """The same through the change engine on a `local` host (engine/changes.py execute -> settle):
    the disk fills while the change is validated (its check fills the tmpfs and passes). The host
    is changed, its result says how the commit was recorded, and the next change job's `recover`
    undoes nothing and runs no restart."""
    disk = tmpfs(2048, tmp_path / "disk")
    state, restarted = disk / "fleetctl", tmp_path / "restarted"
    files, originals = _twelve_files(tmp_path / "site")
    inv = tmp_path / "hosts.yaml"
    inv.write_text("all:\n  hosts:\n    here:\n      ansible_connection: local\n"
                   f"      fleetctl_restart_cmd: {json.dumps(f'echo ran >> {restarted}')}\n")
    host = inventory.load(inv).select("here")[0]
    opts = ChangeOptions(smoke=SmokeOptions(), state_dir=str(state))
    change = Change("c-full", "test", files, {}, str(tmp_path / "site"), checks=lambda: _fill(disk) or [])

    def work(ctx, recovery):
        return execute(ctx, HostResult(ctx.host.name, ctx.conn.address, HostStatus.OK), change, opts)

    def run(job):
        with Fleet(Settings(), forks=1, timeout=60) as fleet:
            return fleet.run([host], job)[0]

    r = run(change_job(str(state), work))
    assert (r.status, r.error) == (HostStatus.CHANGED, None), r
    assert "is full (No space left on device): committed after freeing the ledger's reserve" in r.data["commit_note"]
    r = run(change_job(str(state), lambda ctx, recovery: ctx.result(HostStatus.OK, data={"undone": recovery.changes})))
    assert r.status == HostStatus.OK and r.data["undone"] == [], r
    assert {p: sha(Path(p).read_bytes()) for p in originals} == {f["path"]: f["post_sha256"] for f in files}
    assert not restarted.exists()
    ledger_consistent(state, "c-full", "applied")
