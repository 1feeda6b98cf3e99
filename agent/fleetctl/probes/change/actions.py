"""Host-side file changes with backups and a ledger: apply, commit, rollback, recover, status.

Runs on the host as root, stdlib only (Python 3.8+), sent on stdin like every probe;
`main(params)` returns JSON-serialisable data and never prints. The caller holds the host's
lock for the whole apply/rollback; this module does no locking.

State lives in `state_dir` (param, default ledger.STATE_DIR): the ledger and the backups (see
ledger.py); files are read and written with safefs (no link followed, atomic replacement),
confined to the change's root; status reports RECORD drift (drift.py).
Every action returns {"ok": true, ...} or {"ok": false, "error": "..."} (a refusal changes nothing).
"""

import glob
import hashlib
import json
import os
import stat

from . import ledger
from .. import evidence, safefs
from ..facts import distinfo, drift

# where deploy publishes kernel builds, their `current` links and dispatch tables: the host-side
# copy of the control side's config.PUBLIC_KERNELS_DIR (tests/unit/test_dispatch.py checks they agree)
PUBLIC_DIR = "/var/lib/fleetctl-kernels"
DISPATCH = "dispatch.json"
DISPATCH_MAX_BYTES = 64 << 10


def _state(f):
    """Current state of ledger file entry `f`: sha256 of a file, safefs.link_state of a link."""
    return safefs.link_state(f["path"]) if f.get("kind") == "link" else safefs.sha256_file(f["path"])


_STILL_PENDING = "; the ledger could not record this (%s): it still says pending, and the next run's recover undoes it"


def apply(params, state_dir):
    """{change_id, playbook, operator, install?, files: [{path, pre_sha256, post_sha256, new_text}
    | {path, kind: "link", pre_target: str|None, post_target: str}], commit?}.

    A "link" item swaps symlink `path` from pre_target (None: absent) to post_target atomically;
    the ledger records link states as "link:<target>" in before/after_sha256 and needs no backup.
    A file item with pre_sha256 None creates `path`, which must not exist (nothing at all there,
    no dangling link either): its before_sha256 is None, it has no backup, and a rollback or
    recover deletes it.
    Refuses, changing nothing, when a file's sha256 is not pre_sha256 ("changed since inspect"),
    new_text does not hash to post_sha256, the change id is used, or a change is still pending.
    The entry records the release under `root` (distinfo.release: what its files are), which
    status, rollback and forget compare with the tree's release later (upgraded()).
    Then: the ledger's reserve (ledger.make_reserve), ledger "pending", originals to
    backups/<change_id>/ (fsynced), atomic writes in the order of `files` (a new file the others
    import comes first: the planner puts it there) with stale bytecode dropped, ledger "applied"
    (ledger.append_applied; on a full disk the answer's "note" says how it was recorded). With
    commit false the change stays "pending" (written, awaiting validation: `commit` makes it
    "applied", `rollback` undoes it, and a killed run's next `recover` undoes it). An error
    midway restores the written files (the last written first) from the originals read before
    the write and records "failed"; the error says "files restored" only when every touched file is back to
    pre_sha256, and names each file that is not.
    """
    cid = params["change_id"]
    known = ledger.changes(state_dir)
    if not ledger.CHANGE_ID.match(cid) or cid in known:
        raise safefs.Refused("bad or already used change id %r" % cid)
    pending = [c for c, e in known.items() if e["state"] == ledger.PENDING]
    if pending:
        raise safefs.Refused("change %s is still pending: recover first" % pending[0])
    root = _root(params)
    paths = [safefs.confine(f["path"], root) for f in params["files"]]
    if len(set(paths)) != len(paths):
        raise safefs.Refused("file paths must be distinct")
    backup_dir = os.path.join(state_dir, "backups", cid)
    originals, news, items = {}, {}, []
    for path, f in zip(paths, params["files"]):
        try:
            if f.get("kind") == "link":
                before = "link:" + f["pre_target"] if f.get("pre_target") else None
                if safefs.link_state(path) != before or (before is None and safefs.lexists(path)):
                    raise safefs.Refused("%s: changed since inspect (link is %s)" % (path, safefs.link_state(path)))
                items.append({"path": path, "kind": "link", "before_sha256": before,
                              "after_sha256": "link:" + f["post_target"]})
                continue
            if f["pre_sha256"] is None:
                if safefs.lexists(path):
                    raise safefs.Refused("%s: changed since inspect (it exists; this change creates it)" % path)
            else:
                try:
                    originals[path] = safefs.read_file(path)
                except OSError as e:
                    raise safefs.Refused("%s: %s" % (path, e.strerror))
            safefs.check_pycache(path)
        except safefs.UnsafePath as e:
            raise safefs.Refused("%s: not changing it" % e)
        if f["pre_sha256"] is not None and hashlib.sha256(originals[path]).hexdigest() != f["pre_sha256"]:
            raise safefs.Refused("%s: changed since inspect" % path)
        news[path] = f["new_text"].encode("utf-8")
        if hashlib.sha256(news[path]).hexdigest() != f["post_sha256"]:
            raise safefs.Refused("%s: new text does not hash to post_sha256" % path)
        items.append({"path": path, "before_sha256": f["pre_sha256"], "after_sha256": f["post_sha256"],
                      "backup": os.path.join(backup_dir, path.lstrip("/"))})
    entry = {"change_id": cid, "playbook": params.get("playbook"), "operator": params.get("operator"),
             "install": params.get("install"), "root": root, "files": items, "release": distinfo.release(root)}
    line = len(json.dumps(entry))
    ledger.make_reserve(state_dir, line, 3 * line + sum(map(len, originals.values())))
    entry = ledger.append(state_dir, entry, ledger.PENDING)
    written = []
    try:
        for f in entry["files"]:
            if f.get("kind") != "link" and f["before_sha256"] is not None:
                os.close(safefs.open_dir(os.path.dirname(f["backup"]), create=0o700))
                safefs.atomic_write(f["backup"], originals[f["path"]], cid)
        for f in entry["files"]:
            written.append(f)
            if f.get("kind") == "link":
                safefs.set_link(f["path"], f["after_sha256"][len("link:"):], cid)
            else:
                try:
                    safefs.atomic_write(f["path"], news[f["path"]], cid, expect=safefs.ABSENT
                                        if f["before_sha256"] is None else f["before_sha256"])
                except safefs.ChangedMeanwhile:
                    written.pop()  # not written by this change: never "restored" over the new bytes
                    raise
                safefs.drop_pycache(f["path"])
            if _state(f) != f["after_sha256"]:
                raise OSError("%s: state after the write is not post_sha256" % f["path"])
    except Exception as e:
        left = _undo_written(written, cid, originals)
        why = "%s: %s" % (type(e).__name__, e)
        if left:
            unrecorded = ledger.try_append(state_dir, entry, ledger.FAILED,
                                           "%s; NOT restored: %s" % (why, "; ".join(left)))
            return {"ok": False, "change_id": cid,
                    "error": "apply failed: %s; NOT restored: %s" % (e, "; ".join(left))
                    + (_STILL_PENDING % unrecorded if unrecorded else "")}
        unrecorded = ledger.try_append(state_dir, entry, ledger.FAILED, why)
        return {"ok": False, "change_id": cid, "error": "apply failed, files restored: %s" % e
                + (_STILL_PENDING % unrecorded if unrecorded else "")}
    out = {"ok": True, "change_id": cid, "files": entry["files"], "pruned": []}
    if params.get("commit", True):
        try:
            out.update(_commit(state_dir, entry))
        except OSError as e:
            return {"ok": False, "change_id": cid, "error": "the files are changed but the change could not be "
                    "committed" + _STILL_PENDING % ("%s: %s" % (type(e).__name__, e))}
    return out


def _commit(state_dir, entry, reason=None):
    """Record pending `entry` applied (ledger.append_applied, which gets it on disk even when the
    disk is full), then prune. Returns {"pruned": [path], "note"?: what a full disk made it do}.
    Raises OSError when the ledger still says pending."""
    note = ledger.append_applied(state_dir, entry, reason)
    return dict({"pruned": ledger.prune(state_dir)}, **({"note": note} if note else {}))


def _root(params):
    """The real path of params["root"], the directory the change is confined to (the install's
    package directory, or the kernels dir). safefs.Refused when missing, or on a network file system
    (NETWORK_FS) unless params["shared_tree"] (inventory fleetctl_shared_tree) says so."""
    if not isinstance(params.get("root"), str) or not os.path.isabs(params["root"]):
        raise safefs.Refused("no root: the absolute directory the change is confined to")
    root = os.path.realpath(params["root"])
    kind = safefs.fs_type(root)
    if safefs.is_network_fs(kind) and not params.get("shared_tree"):
        raise safefs.Refused("%s is on %s, a network file system: one host's apply would change every host "
                             "that mounts it (set fleetctl_shared_tree: true for this host if that is meant)"
                             % (root, kind))
    return root


def _undo_written(written, tag, originals):
    """Put every entry apply touched back to before_sha256; a restore that fails (say, its
    stale bytecode cannot be dropped) counts only by the file's state afterwards. Returns
    ["path (error)"] for the entries that are not back to before_sha256."""
    left = []
    for f in reversed(written):  # the last written first: an edit goes before the new file it imports
        error = None
        if _state(f) != f["before_sha256"]:
            try:
                _restore(f, tag, originals.get(f["path"]))
            except Exception as e:
                error = "%s: %s" % (type(e).__name__, e)
        if _state(f) != f["before_sha256"]:
            left.insert(0, "%s (%s)" % (f["path"], error or "state after restore is not before_sha256"))
    return left  # in the order written


def commit(params, state_dir):
    """{change_id, reason?}: a pending change whose files all have after_sha256 becomes "applied"
    (on a full disk too: ledger.append_applied). Returns {"ok": true, change_id, pruned, note?
    (what a full disk made the commit do)}, or {"ok": false, error} when the ledger still says
    pending."""
    cid = params["change_id"]
    entry = ledger.changes(state_dir).get(cid)
    if entry is None or entry["state"] != ledger.PENDING:
        raise safefs.Refused("change %s is %s, not pending" % (cid, entry["state"] if entry else "unknown"))
    moved = [f["path"] for f in entry["files"] if _state(f) != f["after_sha256"]]
    if moved:
        raise safefs.Refused("changed since the apply: %s" % ", ".join(moved))
    try:
        return dict({"ok": True, "change_id": cid}, **_commit(state_dir, entry, params.get("reason")))
    except OSError as e:
        return {"ok": False, "change_id": cid, "error": "validated, but the change could not be committed"
                + _STILL_PENDING % ("%s: %s" % (type(e).__name__, e))}


def _restore(f, tag, data=None):
    """Put ledger file entry `f` back to before_sha256: a link to its old target, a file the
    change created (before_sha256 None) deleted with its bytecode, a file from `data` or its
    backup; verify the result."""
    if f.get("kind") == "link":
        before = f["before_sha256"]
        safefs.set_link(f["path"], before[len("link:"):] if before else None, tag)
        if _state(f) != before:
            raise OSError("%s: link after restore is not %s" % (f["path"], before))
        return
    if f["before_sha256"] is None:
        safefs.remove_file(f["path"])
        safefs.drop_pycache(f["path"])
        if safefs.lexists(f["path"]):
            raise OSError("%s: still there after removing it" % f["path"])
        return
    data = safefs.read_file(f["backup"]) if data is None else data
    if hashlib.sha256(data).hexdigest() != f["before_sha256"]:
        raise OSError("backup %s does not hash to before_sha256" % f["backup"])
    safefs.atomic_write(f["path"], data, tag)
    safefs.drop_pycache(f["path"])
    if safefs.sha256_file(f["path"]) != f["before_sha256"]:
        raise OSError("%s: sha256 after restore is not before_sha256" % f["path"])


def rollback(params, state_dir):
    """{change_id | last: true, force: bool, reason?}: restore a change's files from its backup.

    The change must be "applied", "pending" or "failed" (`last`: the latest applied one); one
    already rolled back is a no-op. An applied change whose release was replaced (upgraded():
    say `pip install -U sglang` since) is refused whatever `force` says, naming forget's command
    (forget_command; params "host": the host's name for it) and the re-apply. Refuses, changing nothing, unless every file has
    after_sha256 or already before_sha256 (force skips that check). Restores in the reverse of
    the apply's order (an edit before the new file it imports). Verifies each restored
    file has before_sha256; records "rolled-back" with the reason, or "failed" with the files
    restored so far when a restore fails midway (a later rollback finishes the job). When it
    rolled back a kernel's `current` link and no package of that PUBLIC has one any more, the
    routing evidence goes too ("evidence_removed": evidence.remove's answer).
    """
    known = ledger.changes(state_dir)
    if params.get("last"):
        applied = [c for c, e in known.items() if e["state"] == ledger.APPLIED]
        if not applied:
            return {"ok": True, "change_id": None, "nothing": "no applied change to roll back"}
        cid = applied[-1]
    else:
        cid = params["change_id"]
    entry = known.get(cid)
    if entry is None:
        raise safefs.Refused("no change %r in the ledger" % cid)
    if entry["state"] == ledger.ROLLED_BACK:
        return {"ok": True, "change_id": cid, "nothing": "already rolled back"}
    if entry["state"] not in (ledger.APPLIED, ledger.PENDING, ledger.FAILED):
        raise safefs.Refused("change %s is %s, not applied" % (cid, entry["state"]))
    ledger.check_entry(entry, state_dir)
    gone = upgraded(entry)
    if gone:
        raise safefs.Refused(
            "change %s was applied to %s %s and %s is now %s %s (%s): a rollback would write %s's files into %s, "
            "with or without --force. Drop the stale entry with `%s` (it checks the tree first), then apply %s "
            "again" % (cid, gone[0], gone[1] or "(a release not recorded)", entry["root"], gone[0],
                       gone[2] or "(none)", _replaced_by(gone), gone[1] or "the old release",
                       gone[2] or "the new tree", forget_command(cid, params.get("host")),
                       entry.get("playbook") or "the change"))
    moved = [f["path"] for f in entry["files"] if _state(f) not in (f["after_sha256"], f["before_sha256"])]
    if moved and not params.get("force"):
        raise safefs.Refused("changed since the apply (--force restores anyway): %s" % ", ".join(moved))
    restored = []
    try:
        for f in reversed(entry["files"]):  # apply's order undone: an edit goes before the new file it imports
            if _state(f) != f["before_sha256"]:
                _restore(f, cid + "-rb")
            restored.append(f["path"])
    except Exception as e:
        done = ", ".join(restored) or "none"
        ledger.append(state_dir, entry, ledger.FAILED,
                      "rollback stopped: %s: %s; restored: %s" % (type(e).__name__, e, done))
        return {"ok": False, "change_id": cid,
                "error": "rollback failed after restoring %d of %d files (%s): %s"
                         % (len(restored), len(entry["files"]), done, e)}
    reason = "; ".join(r for r in (params.get("reason"), moved and "forced over: " + ", ".join(moved)) if r)
    ledger.append(state_dir, entry, ledger.ROLLED_BACK, reason or None)
    out = {"ok": True, "change_id": cid, "files": [f["path"] for f in entry["files"]], "forced": moved}
    links = [f["path"] for f in entry["files"] if os.path.basename(f["path"]) == "current"]
    for public in sorted({os.path.dirname(os.path.dirname(p)) for p in links}):
        if not any(_package_link(c) for c in glob.glob(os.path.join(glob.escape(public), "*", "current"))):
            out["evidence_removed"] = evidence.remove(public)  # the last kernel change rolled back (R4-5)
    return out


def recover(params, state_dir):
    """Undo every change whose last state is "pending" (fleetctl was killed mid-apply).

    A file with before_sha256 is left as it is, one with after_sha256 is restored from the
    backup (in the reverse of the apply's order); either way the change becomes "rolled-back"
    (reason "interrupted"). A file with any
    other content is left alone and the change becomes "failed". Leftover temp files are removed.
    Returns {"recovered": [{change_id, state, files: [{path, action}]}], "container_records": the
    number of host-side container change records (*.json) in params["records"] (0 when not given
    or unreadable: engine/containers.keep_record writes them; a recover that finds any enters
    those containers too)}.
    """
    done = []
    for cid, entry in ledger.changes(state_dir).items():
        if entry["state"] != ledger.PENDING:
            continue
        ledger.check_entry(entry, state_dir)
        actions, unknown = [], []
        for f in reversed(entry["files"]):
            safefs.remove_tmp(f["path"], (cid, cid + "-rb"))
            cur = _state(f)
            if cur == f["before_sha256"]:
                action = "untouched"
            elif cur == f["after_sha256"]:
                try:
                    _restore(f, cid + "-rb")
                    action = "restored"
                except (OSError, safefs.UnsafePath) as e:
                    action = "restore failed: %s" % e
                    unknown.insert(0, f["path"])
            else:
                action = "unknown content, left alone"
                unknown.insert(0, f["path"])
            actions.insert(0, {"path": f["path"], "action": action})  # reported in the apply's order
        if unknown:
            state = ledger.append(state_dir, entry, ledger.FAILED,
                                  "interrupted; unknown content: " + ", ".join(unknown))
        else:
            state = ledger.append(state_dir, entry, ledger.ROLLED_BACK, "interrupted")
        done.append({"change_id": cid, "state": state["state"], "reason": state["reason"], "files": actions})
    try:
        kept = sum(1 for n in os.listdir(params["records"]) if n.endswith(".json")) if params.get("records") else 0
    except OSError:
        kept = 0
    return {"ok": True, "recovered": done, "container_records": kept}


def status(params, state_dir):
    """{location?, dist: "sglang"}: ledger summary, drift of applied ledger.changes, RECORD differences.

    ledger.changes: [{change_id, playbook, install, time, operator, state, reason, files: [path],
    upgraded?: {dist, from, to} (upgraded())}] (last state);
    drift: [{change_id, path, problem: "drift: reverted or reinstalled"}] for applied ledger.changes whose
    file no longer has after_sha256 (a file a later applied change wrote over that change's result is
    judged by the later one: _superseded), or, for every file of an applied change whose release
    was replaced, "replaced by an upgrade of D (X -> Y): ..." naming forget's command (params
    "host"); modified: [{path, problem}] for files of the installed distribution (the RECORD of the
    dist-info that matches its files: distinfo.choose) that differ and no applied change explains;
    record_error; metadata_warning (only when there are stale or duplicate dist-infos there);
    kernels: {name: active build key} from the published `PUBLIC/<name>/current` links (params
    public_dir, default PUBLIC_DIR); dispatch: {name: the table PUBLIC/<name>/dispatch.json holds
    (a JSON object), None when there is none, {"error": why} when it is a link, not a regular
    file, over DISPATCH_MAX_BYTES or not a JSON object}; space: ledger.space_used().
    """
    summary, drifted, explained = [], [], {}
    entries = list(ledger.changes(state_dir).items())
    for i, (cid, e) in enumerate(entries):
        summary.append({"change_id": cid, "playbook": e.get("playbook"), "install": e.get("install"),
                        "time": e.get("time"),
                        "operator": e.get("operator"), "state": e["state"], "reason": e.get("reason"),
                        "files": [f["path"] for f in e["files"]]})
        if e["state"] == ledger.PENDING:  # interrupted, or a run in progress: its files are explained
            for f in e["files"]:
                cur = _state(f)
                if cur in (f["before_sha256"], f["after_sha256"]) and f.get("kind") != "link":
                    explained[os.path.realpath(f["path"])] = cur
            continue
        if e["state"] != ledger.APPLIED:
            continue
        gone = upgraded(e)
        if gone:
            summary[-1]["upgraded"] = {"dist": gone[0], "from": gone[1], "to": gone[2]}
            for f in e["files"]:
                left = f["before_sha256"] is None and f.get("kind") != "link" and _state(f) == f["after_sha256"]
                drifted.append({"change_id": cid, "path": f["path"], "problem": (
                    "%s: the change is gone with the old release; %s `%s`, then apply %s again" % (
                        _replaced_by(gone), "this file it created is left behind, removed by"
                        if left else "drop its entry with", forget_command(cid, params.get("host")),
                        e.get("playbook") or "it"))})
            continue
        for f in e["files"]:
            if _superseded(f, entries[i + 1:]):
                continue  # a later applied change was written over this one's result: it is judged there
            cur = _state(f)
            if cur == f["after_sha256"]:
                explained[os.path.realpath(f["path"])] = f["after_sha256"]
            elif cur == f["before_sha256"]:
                drifted.append({"change_id": cid, "path": f["path"], "problem": "drift: reverted or reinstalled"})
            else:
                drifted.append({"change_id": cid, "path": f["path"], "problem": "drift: edited since the apply"})
    modified, err, warning = (None, None, None)
    if params.get("location"):
        modified, err, warning = drift.problems(params["location"], params.get("dist", "sglang"), explained, state_dir)
    public = os.path.abspath(params.get("public_dir") or PUBLIC_DIR)
    kernels, tables = {}, {}
    for c in sorted(glob.glob(os.path.join(glob.escape(public), "*", "current"))):
        name = os.path.basename(os.path.dirname(c))
        if _package_link(c):
            kernels[name] = os.readlink(c)
            tables[name] = _dispatch(os.path.join(os.path.dirname(c), DISPATCH))
    out = {"ok": True, "changes": summary, "drift": drifted, "modified": modified, "record_error": err,
           "kernels": kernels, "dispatch": tables, "space": ledger.space_used(state_dir)}
    if warning:
        out["metadata_warning"] = warning
    return out


def upgraded(entry):
    """(dist, version applied to (None: not recorded), version now or None when the package is
    gone) when the release under ledger entry `entry`'s root (distinfo.release) is no longer the
    one it recorded at apply; None when it is the same, or when it cannot be told (a kernel's
    entry). An entry that recorded no release (a fleetctl before issue 49) counts as upgraded
    when every file it edited is now neither its before nor its after but exactly what the
    RECORD of the release installed there now says (_reinstalled)."""
    was = entry.get("release")
    if not entry.get("root") or not os.path.isdir(entry["root"]):
        return (was.get("dist"), was.get("version"), None) if isinstance(was, dict) and was.get("version") else None
    if not isinstance(was, dict) or not was.get("version"):
        return _reinstalled(entry)
    now = distinfo.release(entry["root"], was.get("dist"))
    now = now["version"] if now else None
    return None if now == was["version"] else (was.get("dist"), was["version"], now)


def _reinstalled(entry):
    """upgraded() of an entry with no release recorded: (dist, None, version now) when each file
    it edited (one with a before_sha256) is neither its before nor its after but what the RECORD
    of the dist-info matching the tree now (distinfo.choose) says; else None."""
    root = entry["root"].rstrip("/")
    site, package = os.path.dirname(root), os.path.basename(root)
    chosen = distinfo.choose(site, package, package)
    rec = distinfo.record(chosen["path"]) if chosen["path"] else None
    edited = [f for f in entry["files"] if f.get("kind") != "link" and f["before_sha256"] is not None]
    if not rec or not edited:
        return None
    for f in edited:
        cur = _state(f)
        if cur in (f["before_sha256"], f["after_sha256"]) or \
                rec.get(os.path.relpath(f["path"], site)) != distinfo.b64(cur or "<missing>"):
            return None
    now = distinfo.release(root, package)
    return (package, None, now["version"] if now else chosen["version"])


def _replaced_by(gone):
    """The words for an upgraded() answer: "replaced by an upgrade of D (X -> Y)"."""
    return "replaced by an upgrade of %s (%s -> %s)" % (gone[0], gone[1] or "a release not recorded",
                                                        gone[2] or "none: removed")


def forget_command(cid, host):
    """The command that drops stale change `cid` (a ledger.CHANGE_ID) on `host` (shell-quoted;
    None: HOST)."""
    import shlex
    return "fleetctl rollback --forget %s %s" % (cid, shlex.quote(host) if host else "HOST")


def forget(params, state_dir):
    """{change_id, reason?}: drop an applied (or failed) change whose release was replaced by an
    upgrade.

    Refuses, changing nothing, unless the change is applied or failed and its root's release is no longer
    the one it was applied to (upgraded(): the tree is checked here, now). Then every file the
    change created (no before_sha256) that still has exactly its after_sha256 is removed with
    its bytecode (it is in no RECORD: the upgrade left it behind, and the next apply of the
    playbook would find it in its way), unless a change applied since on the same root (not
    itself upgraded) found it there as already applied: then it is kept, that change's
    ("adopted"); edited files are left as the upgrade made them. Records the change
    "superseded" with the upgrade, what was removed or kept and `reason`. Returns {"ok": true,
    change_id, upgraded: {dist, from, to}, removed: [path], left: [path of created files edited
    since, left alone], adopted: [path kept for the later change]}."""
    cid = params["change_id"]
    entry = ledger.changes(state_dir).get(cid)
    if entry is None:
        raise safefs.Refused("no change %r in the ledger" % cid)
    if entry["state"] not in (ledger.APPLIED, ledger.FAILED):
        raise safefs.Refused("change %s is %s, not applied: nothing to forget" % (cid, entry["state"]))
    ledger.check_entry(entry, state_dir)
    gone = upgraded(entry)
    if not gone:
        was = entry.get("release") or {}
        raise safefs.Refused("change %s is not stale: %s is still %s %s as it was applied to (roll it back instead)"
                             % (cid, entry.get("root"), was.get("dist") or "the release", was.get("version") or
                                "(not recorded)") if was else
                             "change %s recorded no release to compare the tree with: roll it back instead" % cid)
    known = list(ledger.changes(state_dir).values())
    # a change applied since to the new release, on the same root (the playbook applied again
    # before this forget, which found the created file already there): the file is now its
    later = [e["change_id"] for e in known[known.index(entry) + 1:] if e["state"] == ledger.APPLIED
             and e.get("root") == entry.get("root") and upgraded(e) is None]
    removed, left, adopted = [], [], []
    for f in entry["files"]:
        if f["before_sha256"] is not None or f.get("kind") == "link" or _state(f) is None:
            continue
        if _state(f) != f["after_sha256"]:
            left.append(f["path"])
        elif later:
            adopted.append(f["path"])
        else:
            safefs.remove_file(f["path"])
            safefs.drop_pycache(f["path"])
            removed.append(f["path"])
    reason = "; ".join(r for r in (_replaced_by(gone), "forgotten: nothing restored",
                                   removed and "removed the files it created: " + ", ".join(removed),
                                   adopted and "kept for change %s, applied since: %s" % (later[-1], ", ".join(adopted)),
                                   left and "left (edited since): " + ", ".join(left), params.get("reason")) if r)
    ledger.append(state_dir, entry, ledger.SUPERSEDED, reason)
    return {"ok": True, "change_id": cid, "upgraded": {"dist": gone[0], "from": gone[1], "to": gone[2]},
            "removed": removed, "left": left, "adopted": adopted}


def _package_link(path):
    """Whether `path` (PUBLIC/NAME/current) is a package's active link as deploy makes it: a link of
    this euid's (root's) in a directory of its that nobody else may write (not, say, a link someone
    made in the 01777 route-evidence/)."""
    try:
        link, pkg = os.lstat(path), os.lstat(os.path.dirname(path))
    except OSError:
        return False
    euid = os.geteuid()
    return (stat.S_ISLNK(link.st_mode) and link.st_uid == euid and stat.S_ISDIR(pkg.st_mode)
            and pkg.st_uid == euid and not pkg.st_mode & 0o022)


def _superseded(f, later):
    """Whether ledger file entry `f` was changed again by one of the `later` (ledger order) applied
    changes, over exactly its result (that change's before_sha256 of the path is f's after_sha256):
    a deploy's `current` link or dispatch table switched by the next deploy is no drift."""
    where = os.path.realpath(os.path.dirname(f["path"]))
    for _, e in later:
        if e["state"] != ledger.APPLIED:
            continue
        for g in e["files"]:
            if os.path.realpath(os.path.dirname(g["path"])) == where and \
                    os.path.basename(g["path"]) == os.path.basename(f["path"]) and \
                    g["before_sha256"] == f["after_sha256"]:
                return True
    return False


def _dispatch(path):
    """The dispatch table at `path` for status: a dict, None when absent, or {"error": why}."""
    try:
        data = safefs.read_file(path, DISPATCH_MAX_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, safefs.UnsafePath) as e:
        return {"error": str(e)}
    try:
        table = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # not JSON, or nested past the parser's depth
        return {"error": "%s: not JSON (%s)" % (path, e)}
    return table if isinstance(table, dict) else {"error": "%s: not a JSON object" % path}


def compile_check(params, state_dir):
    """params: {paths: [str]}. Compile each file with this interpreter (run the probe under the
    interpreter that serves SGLang, so its grammar is the one that counts).
    Returns {"ok": true, "problems": ["path:line: message"]}; touches nothing."""
    problems = []
    for path in params["paths"]:
        text = safefs.read_file(path)
        try:
            compile(text, path, "exec", dont_inherit=True)
        except SyntaxError as e:
            problems.append("%s:%s: %s" % (path, e.lineno, e.msg))
    return {"ok": True, "problems": problems}


def permission_error(e, state_dir):
    """The error text for a PermissionError `e` of an action (safefs.denied): its path, this login,
    and why; the state dir (or a directory on its way: safefs.open_dir names it) is root's."""
    path = e.filename or "?"
    if path == state_dir or state_dir.startswith(str(path).rstrip("/") + "/"):
        why = "fleetctl keeps its ledger and backups in %s, which only root may make and write" % state_dir
    else:
        why = "this login may not %s it" % ("read or write" if os.path.exists(path) else "create")
    return safefs.denied(path, why)


ACTIONS = {"apply": apply, "commit": commit, "rollback": rollback, "forget": forget, "recover": recover,
           "status": status, "compile": compile_check}


def main(params):
    """params: {action: apply|commit|rollback|forget|recover|status|compile, state_dir?: str, ...action params}.

    Returns the action's result dict, or {"ok": false, "error": ...} for an unknown action, a
    refusal ("refused": true; nothing was changed) or an unexpected error on the host.
    """
    fn = ACTIONS.get(params.get("action"))
    if fn is None:
        return {"ok": False, "error": "unknown action %r" % params.get("action")}
    state_dir = os.path.abspath(params.get("state_dir") or ledger.STATE_DIR)
    try:
        return fn(params, state_dir)
    except safefs.Refused as e:
        return {"ok": False, "error": str(e), "refused": True}
    except PermissionError as e:  # a login without root: which path, who, and the fix
        return {"ok": False, "error": permission_error(e, state_dir)}
    except Exception as e:  # an unexpected host error (disk full, permissions): report, do not crash
        return {"ok": False, "error": "%s: %s" % (type(e).__name__, e)}
