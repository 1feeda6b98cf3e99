"""The change probe's new files (pre_sha256 None, as route-verify-attention's hook module): created
with the change's edits of real files, recorded in the ledger with no pre-image and no backup,
deleted by a rollback and by a recover, refused when something is already at the path."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from fleetctl.probes.change import actions as change, ledger

TEXT = "verify_fwd = None\n"


def created(site_dir: Path, name: str = "fleetctl_verify.py") -> dict:
    path = site_dir / "sglang" / "srt" / name
    return {"path": str(path), "pre_sha256": None, "post_sha256": hashlib.sha256(TEXT.encode()).hexdigest(),
            "new_text": TEXT}


def states(state: Path) -> list[str]:
    return [e["state"] for e in ledger.read(str(state))]


def test_a_new_file_is_created_recorded_and_deleted_by_rollback(site):
    site_dir, state, params, originals = site
    new = created(site_dir)
    path = Path(new["path"])
    pyc = path.parent / "__pycache__" / "fleetctl_verify.cpython-311.pyc"
    r = change.main(dict(params, files=params["files"] + [new]))
    assert r["ok"], r
    assert path.read_text() == TEXT and os.stat(path).st_mode & 0o7777 == 0o644
    entry = ledger.read(str(state))[-1]
    mine = next(f for f in entry["files"] if f["path"] == str(path))
    assert (mine["before_sha256"], mine["after_sha256"]) == (None, new["post_sha256"])
    assert not os.path.lexists(mine["backup"])  # nothing to back up
    pyc.parent.mkdir(exist_ok=True)
    pyc.write_bytes(b"stale")  # what importing it leaves
    r = change.main({"action": "rollback", "state_dir": str(state), "last": True})
    assert r["ok"] and str(path) in r["files"], r
    assert not os.path.lexists(path) and not pyc.exists()
    for p, data in originals.items():
        assert Path(p).read_bytes() == data
    assert states(state)[-1] == "rolled-back"


def test_a_path_that_exists_is_refused_and_nothing_changes(site):
    site_dir, state, params, originals = site
    new = created(site_dir)
    Path(new["path"]).write_text("mine\n")
    r = change.main(dict(params, files=params["files"] + [new]))
    assert not r["ok"] and r["refused"]
    assert r["error"] == f"{new['path']}: changed since inspect (it exists; this change creates it)"
    assert Path(new["path"]).read_text() == "mine\n"
    for p, data in originals.items():
        assert Path(p).read_bytes() == data
    dangling = created(site_dir, "dangling.py")
    Path(dangling["path"]).symlink_to("/nonexistent")
    r = change.main(dict(params, files=[dangling]))
    assert not r["ok"] and "it exists" in r["error"] and os.path.islink(dangling["path"])


def test_recover_deletes_a_file_a_killed_apply_created(site):
    site_dir, state, params, originals = site
    new = created(site_dir)
    r = change.main(dict(params, files=params["files"] + [new], commit=False))
    assert r["ok"] and states(state)[-1] == "pending"
    r = change.main({"action": "recover", "state_dir": str(state)})
    assert r["ok"] and r["recovered"][0]["state"] == "rolled-back"
    assert {f["path"]: f["action"] for f in r["recovered"][0]["files"]}[new["path"]] == "restored"
    assert not os.path.lexists(new["path"])
    for p, data in originals.items():
        assert Path(p).read_bytes() == data


def test_a_file_made_at_the_path_after_the_apply_is_not_deleted(site):
    site_dir, state, params, _ = site
    new = created(site_dir)
    assert change.main(dict(params, files=[new]))["ok"]
    Path(new["path"]).write_text("someone else's\n")
    r = change.main({"action": "rollback", "state_dir": str(state), "last": True})
    assert not r["ok"] and "changed since the apply" in r["error"]
    assert Path(new["path"]).read_text() == "someone else's\n"


def test_a_file_made_while_it_is_written_is_left_as_it_is(tmp_path, monkeypatch):
    from fleetctl.probes import safefs

    path = tmp_path / "new.py"
    real = os.open

    def racing(name, flags, mode=0o777, *, dir_fd=None):  # the temp file is opened: someone makes the target
        fd = real(name, flags, mode, dir_fd=dir_fd)
        if ".fleetctl-t." in str(name):
            path.write_text("theirs\n")
        return fd

    monkeypatch.setattr(os, "open", racing)
    try:
        safefs.atomic_write(str(path), b"ours\n", "t", expect=safefs.ABSENT)
    except safefs.ChangedMeanwhile:
        pass
    else:
        raise AssertionError("atomic_write replaced a file made meanwhile")
    monkeypatch.undo()
    assert path.read_text() == "theirs\n" and [p.name for p in tmp_path.iterdir()] == ["new.py"]


def test_files_are_undone_in_the_reverse_of_the_order_they_were_written(site, monkeypatch):
    """The new file comes first in `files` (the planner's order: an edit may import it), so it is
    written first and deleted last, by a rollback and by a failed apply's restore."""
    site_dir, state, params, originals = site
    new = created(site_dir)
    order = [new["path"]] + [f["path"] for f in params["files"]]
    restored = []
    real = change._restore
    monkeypatch.setattr(change, "_restore", lambda f, *a: (restored.append(f["path"]), real(f, *a))[1])
    r = change.main(dict(params, files=[new] + params["files"]))
    assert r["ok"], r
    r = change.main({"action": "rollback", "state_dir": str(state), "last": True})
    assert r["ok"] and restored == order[::-1], restored
    restored.clear()
    drop = change.safefs.drop_pycache

    def fail_last(path):  # the last file's write is done, then the apply fails
        if path == order[-1]:
            raise OSError("disk gone")
        drop(path)

    monkeypatch.setattr(change.safefs, "drop_pycache", fail_last)
    r = change.main(dict(params, change_id="c2", files=[new] + params["files"]))
    assert not r["ok"] and "files restored" in r["error"], r
    assert restored == order[::-1], restored
