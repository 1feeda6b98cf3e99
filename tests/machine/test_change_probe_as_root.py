"""What the change probe does that only root can set up, as root finds it on a host: files of other
users (owner, group and mode kept through apply and rollback, and by the atomic write, set-id bits
too) and a full disk (a small tmpfs: the original bytes are kept, the ledger says failed). The rest
of the probe's tests are tests/unit/test_change_probe.py; `site` is tests/sites.py's."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
from pathlib import Path

import pytest

from fleetctl.probes import change, safefs
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
