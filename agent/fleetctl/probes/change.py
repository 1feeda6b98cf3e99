"""Host-side file changes with backups and a ledger: apply, commit, rollback, recover, status.

Runs on the host as root, stdlib only (Python 3.8+), sent on stdin like every probe;
`main(params)` returns JSON-serialisable data and never prints. The caller holds the host's
lock for the whole apply/rollback; this module does no locking.

State lives in `state_dir` (param, default /var/lib/fleetctl):
  ledger.jsonl                    one JSON object per line: change_id, playbook, time (UTC ISO
                                  8601 of that line), operator, files [{path, before_sha256,
                                  after_sha256, backup}], state (pending | applied | rolled-back |
                                  failed), reason; a state change appends the whole entry again,
                                  and the last line of a change_id wins.
  backups/<change_id>/<path>      the original bytes of every file the change writes.
Every action returns {"ok": true, ...} or {"ok": false, "error": "..."} (a refusal changes nothing).
"""

import base64
import glob
import hashlib
import json
import os
import re
import stat
import time

STATE_DIR = "/var/lib/fleetctl"
# Ledger states (the control side's fleetctl.vocab.ChangeState has the same words).
PENDING, APPLIED, ROLLED_BACK, FAILED = "pending", "applied", "rolled-back", "failed"
STATES = (PENDING, APPLIED, ROLLED_BACK, FAILED)
_CHANGE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class Refused(Exception):
    """A precondition failed before anything was changed."""


def sha256_file(path):
    """Hex sha256 of the file's bytes, or None when it does not exist."""
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        return None


def link_state(path):
    """A symlink's state as the ledger records it: "link:<target>", or None when absent."""
    try:
        return "link:" + os.readlink(path)
    except OSError:
        return None


def _state(f):
    """Current state of ledger file entry `f`: sha256 of a file, link_state of a link."""
    return link_state(f["path"]) if f.get("kind") == "link" else sha256_file(f["path"])


def set_link(path, target, tag):
    """Point symlink `path` at `target` atomically (new link beside it + rename); None removes it."""
    if target is None:
        if os.path.lexists(path):
            os.unlink(path)
    else:
        tmp = _tmp_name(path, tag)
        if os.path.lexists(tmp):
            os.unlink(tmp)
        os.symlink(target, tmp)
        os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _fsync_dir(d):
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_name(path, tag):
    return os.path.join(os.path.dirname(path), ".%s.fleetctl-%s.tmp" % (os.path.basename(path), tag))


def atomic_write(path, data, tag):
    """Replace `path` by `data` (bytes) atomically: temp file in the same directory, fsync, rename,
    fsync the directory. Keeps the file's mode and owner (0644 and the caller's when it is missing)."""
    try:
        st = os.stat(path)
        mode, owner = stat.S_IMODE(st.st_mode), (st.st_uid, st.st_gid)
    except FileNotFoundError:
        mode, owner = 0o644, None
    tmp = _tmp_name(path, tag)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, mode)
            if owner and owner != (os.geteuid(), os.getegid()):
                os.fchown(fd, *owner)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(os.path.dirname(path) or ".")


def drop_pycache(path):
    """Remove the module's stale bytecode: __pycache__/<stem>.*.pyc next to `path`."""
    d, name = os.path.split(path)
    stem = os.path.splitext(name)[0]
    for pyc in glob.glob(os.path.join(d, "__pycache__", glob.escape(stem) + ".*.pyc")):
        os.unlink(pyc)


def _now():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def read_ledger(state_dir):
    """The ledger's entries in file order; a torn last line (killed mid-write) is skipped."""
    out = []
    try:
        with open(os.path.join(state_dir, "ledger.jsonl"), encoding="utf-8") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    except FileNotFoundError:
        pass
    return out


def changes(state_dir):
    """{change_id: last ledger entry}, ordered by each change's latest line."""
    out = {}
    for e in read_ledger(state_dir):
        out.pop(e.get("change_id"), None)
        out[e.get("change_id")] = e
    return out


def _append(state_dir, entry, state, reason=None):
    entry = dict(entry, state=state, time=_now(), reason=reason)
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    path = os.path.join(state_dir, "ledger.jsonl")
    with open(path, "a+b") as f:
        f.seek(0, os.SEEK_END)
        if f.tell():
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":  # a line torn by a kill: do not glue this entry onto it
                f.write(b"\n")
        f.write((json.dumps(entry, sort_keys=True) + "\n").encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(state_dir)
    return entry


def apply(params, state_dir):
    """{change_id, playbook, operator, install?, files: [{path, pre_sha256, post_sha256, new_text}
    | {path, kind: "link", pre_target: str|None, post_target: str}], commit?}.

    A "link" item swaps symlink `path` from pre_target (None: absent) to post_target atomically;
    the ledger records link states as "link:<target>" in before/after_sha256 and needs no backup.
    Refuses, changing nothing, when a file's sha256 is not pre_sha256 ("changed since inspect"),
    new_text does not hash to post_sha256, the change id is used, or a change is still pending.
    Then: ledger "pending", originals to backups/<change_id>/ (fsynced), atomic writes with
    stale bytecode dropped, ledger "applied". With commit false the change stays "pending"
    (written, awaiting validation: `commit` makes it "applied", `rollback` undoes it, and a
    killed run's next `recover` undoes it). An error midway restores the written files from
    the originals read before the write and records "failed"; the error says "files restored"
    only when every touched file is back to pre_sha256, and names each file that is not.
    """
    cid = params["change_id"]
    known = changes(state_dir)
    if not _CHANGE_ID.match(cid) or cid in known:
        raise Refused("bad or already used change id %r" % cid)
    pending = [c for c, e in known.items() if e["state"] == PENDING]
    if pending:
        raise Refused("change %s is still pending: recover first" % pending[0])
    paths = [f["path"] for f in params["files"]]
    if len(set(paths)) != len(paths) or not all(os.path.isabs(p) for p in paths):
        raise Refused("file paths must be absolute and distinct")
    backup_dir = os.path.join(state_dir, "backups", cid)
    originals, news, items = {}, {}, []
    for f in params["files"]:
        if f.get("kind") == "link":
            before = "link:" + f["pre_target"] if f.get("pre_target") else None
            if link_state(f["path"]) != before or (before is None and os.path.lexists(f["path"])):
                raise Refused("%s: changed since inspect (link is %s)" % (f["path"], link_state(f["path"])))
            items.append({"path": f["path"], "kind": "link", "before_sha256": before,
                          "after_sha256": "link:" + f["post_target"]})
            continue
        try:
            originals[f["path"]] = _read(f["path"])
        except OSError as e:
            raise Refused("%s: %s" % (f["path"], e.strerror))
        if hashlib.sha256(originals[f["path"]]).hexdigest() != f["pre_sha256"]:
            raise Refused("%s: changed since inspect" % f["path"])
        news[f["path"]] = f["new_text"].encode("utf-8")
        if hashlib.sha256(news[f["path"]]).hexdigest() != f["post_sha256"]:
            raise Refused("%s: new text does not hash to post_sha256" % f["path"])
        items.append({"path": f["path"], "before_sha256": f["pre_sha256"], "after_sha256": f["post_sha256"],
                      "backup": os.path.join(backup_dir, f["path"].lstrip("/"))})
    entry = {"change_id": cid, "playbook": params.get("playbook"), "operator": params.get("operator"),
             "install": params.get("install"), "files": items}
    entry = _append(state_dir, entry, PENDING)
    written = []
    try:
        for f in entry["files"]:
            if f.get("kind") != "link":
                os.makedirs(os.path.dirname(f["backup"]), mode=0o700, exist_ok=True)
                atomic_write(f["backup"], originals[f["path"]], cid)
        for f in entry["files"]:
            written.append(f)
            if f.get("kind") == "link":
                set_link(f["path"], f["after_sha256"][len("link:"):], cid)
            else:
                atomic_write(f["path"], news[f["path"]], cid)
                drop_pycache(f["path"])
            if _state(f) != f["after_sha256"]:
                raise OSError("%s: state after the write is not post_sha256" % f["path"])
    except Exception as e:
        left = _undo_written(written, cid, originals)
        why = "%s: %s" % (type(e).__name__, e)
        if left:
            _append(state_dir, entry, FAILED, "%s; NOT restored: %s" % (why, "; ".join(left)))
            return {"ok": False, "change_id": cid,
                    "error": "apply failed: %s; NOT restored: %s" % (e, "; ".join(left))}
        _append(state_dir, entry, FAILED, why)
        return {"ok": False, "change_id": cid, "error": "apply failed, files restored: %s" % e}
    if params.get("commit", True):
        _append(state_dir, entry, APPLIED)
    return {"ok": True, "change_id": cid, "files": entry["files"]}


def _undo_written(written, tag, originals):
    """Put every entry apply touched back to before_sha256; a restore that fails (say, its
    stale bytecode cannot be dropped) counts only by the file's state afterwards. Returns
    ["path (error)"] for the entries that are not back to before_sha256."""
    left = []
    for f in written:
        error = None
        if _state(f) != f["before_sha256"]:
            try:
                _restore(f, tag, originals.get(f["path"]))
            except Exception as e:
                error = "%s: %s" % (type(e).__name__, e)
        if _state(f) != f["before_sha256"]:
            left.append("%s (%s)" % (f["path"], error or "state after restore is not before_sha256"))
    return left


def commit(params, state_dir):
    """{change_id, reason?}: a pending change whose files all have after_sha256 becomes "applied"."""
    cid = params["change_id"]
    entry = changes(state_dir).get(cid)
    if entry is None or entry["state"] != PENDING:
        raise Refused("change %s is %s, not pending" % (cid, entry["state"] if entry else "unknown"))
    moved = [f["path"] for f in entry["files"] if _state(f) != f["after_sha256"]]
    if moved:
        raise Refused("changed since the apply: %s" % ", ".join(moved))
    _append(state_dir, entry, APPLIED, params.get("reason"))
    return {"ok": True, "change_id": cid}


def _restore(f, tag, data=None):
    """Put ledger file entry `f` back to before_sha256: a link to its old target, a file from
    `data` or its backup; verify the result."""
    if f.get("kind") == "link":
        before = f["before_sha256"]
        set_link(f["path"], before[len("link:"):] if before else None, tag)
        if _state(f) != before:
            raise OSError("%s: link after restore is not %s" % (f["path"], before))
        return
    data = _read(f["backup"]) if data is None else data
    if hashlib.sha256(data).hexdigest() != f["before_sha256"]:
        raise OSError("backup %s does not hash to before_sha256" % f["backup"])
    atomic_write(f["path"], data, tag)
    drop_pycache(f["path"])
    if sha256_file(f["path"]) != f["before_sha256"]:
        raise OSError("%s: sha256 after restore is not before_sha256" % f["path"])


def rollback(params, state_dir):
    """{change_id | last: true, force: bool, reason?}: restore a change's files from its backup.

    The change must be "applied", "pending" or "failed" (`last`: the latest applied one); one
    already rolled back is a no-op. Refuses, changing nothing, unless every file has
    after_sha256 or already before_sha256 (force skips that check). Verifies each restored
    file has before_sha256; records "rolled-back" with the reason, or "failed" with the files
    restored so far when a restore fails midway (a later rollback finishes the job).
    """
    known = changes(state_dir)
    if params.get("last"):
        applied = [c for c, e in known.items() if e["state"] == APPLIED]
        if not applied:
            return {"ok": True, "change_id": None, "nothing": "no applied change to roll back"}
        cid = applied[-1]
    else:
        cid = params["change_id"]
    entry = known.get(cid)
    if entry is None:
        raise Refused("no change %r in the ledger" % cid)
    if entry["state"] == ROLLED_BACK:
        return {"ok": True, "change_id": cid, "nothing": "already rolled back"}
    if entry["state"] not in (APPLIED, PENDING, FAILED):
        raise Refused("change %s is %s, not applied" % (cid, entry["state"]))
    moved = [f["path"] for f in entry["files"] if _state(f) not in (f["after_sha256"], f["before_sha256"])]
    if moved and not params.get("force"):
        raise Refused("changed since the apply (--force restores anyway): %s" % ", ".join(moved))
    restored = []
    try:
        for f in entry["files"]:
            if _state(f) != f["before_sha256"]:
                _restore(f, cid + "-rb")
            restored.append(f["path"])
    except Exception as e:
        done = ", ".join(restored) or "none"
        _append(state_dir, entry, FAILED, "rollback stopped: %s: %s; restored: %s" % (type(e).__name__, e, done))
        return {"ok": False, "change_id": cid,
                "error": "rollback failed after restoring %d of %d files (%s): %s"
                         % (len(restored), len(entry["files"]), done, e)}
    reason = "; ".join(r for r in (params.get("reason"), moved and "forced over: " + ", ".join(moved)) if r)
    _append(state_dir, entry, ROLLED_BACK, reason or None)
    return {"ok": True, "change_id": cid, "files": [f["path"] for f in entry["files"]], "forced": moved}


def recover(params, state_dir):
    """Undo every change whose last state is "pending" (fleetctl was killed mid-apply).

    A file with before_sha256 is left as it is, one with after_sha256 is restored from the
    backup; either way the change becomes "rolled-back" (reason "interrupted"). A file with any
    other content is left alone and the change becomes "failed". Leftover temp files are removed.
    Returns {"recovered": [{change_id, state, files: [{path, action}]}]}.
    """
    done = []
    for cid, entry in changes(state_dir).items():
        if entry["state"] != PENDING:
            continue
        actions, unknown = [], []
        for f in entry["files"]:
            for tag in (cid, cid + "-rb"):
                if os.path.lexists(_tmp_name(f["path"], tag)):
                    os.unlink(_tmp_name(f["path"], tag))
            cur = _state(f)
            if cur == f["before_sha256"]:
                action = "untouched"
            elif cur == f["after_sha256"]:
                try:
                    _restore(f, cid + "-rb")
                    action = "restored"
                except OSError as e:
                    action = "restore failed: %s" % e
                    unknown.append(f["path"])
            else:
                action = "unknown content, left alone"
                unknown.append(f["path"])
            actions.append({"path": f["path"], "action": action})
        if unknown:
            state = _append(state_dir, entry, FAILED, "interrupted; unknown content: " + ", ".join(unknown))
        else:
            state = _append(state_dir, entry, ROLLED_BACK, "interrupted")
        done.append({"change_id": cid, "state": state["state"], "reason": state["reason"], "files": actions})
    return {"ok": True, "recovered": done}


def _record_problems(location, dist_name, explained):
    """Files of distribution `dist_name` in `location` whose sha256 differs from its RECORD
    (sha256=<urlsafe b64, no padding>), minus files whose hex sha256 is `explained[realpath]`."""
    from importlib import metadata

    want = re.sub(r"[-_.]+", "-", dist_name).lower()
    dist = next((d for d in metadata.distributions(path=[location])
                 if re.sub(r"[-_.]+", "-", d.metadata["Name"] or "").lower() == want), None)
    if dist is None:
        return None, "no %s distribution in %s" % (dist_name, location)
    out = []
    for pp in dist.files or []:
        if pp.hash is None or pp.hash.mode != "sha256":
            continue
        path = os.path.realpath(str(dist.locate_file(pp)))
        cur = sha256_file(path)
        if cur is None:
            out.append({"path": path, "problem": "missing"})
            continue
        b64 = base64.urlsafe_b64encode(bytes.fromhex(cur)).rstrip(b"=").decode()
        if b64 != pp.hash.value and explained.get(path) != cur:
            out.append({"path": path, "problem": "modified outside fleetctl"})
    return out, None


def status(params, state_dir):
    """{location?, dist: "sglang"}: ledger summary, drift of applied changes, RECORD differences.

    changes: [{change_id, playbook, install, time, operator, state, reason, files: [path]}] (last state);
    drift: [{change_id, path, problem: "drift: reverted or reinstalled"}] for applied changes whose
    file no longer has after_sha256; modified: [{path, problem}] for files of the installed
    distribution (dist-info RECORD) that differ and no applied change explains; record_error;
    kernels: {name: active build key} from the `kernels/<name>/current` links.
    """
    summary, drift, explained = [], [], {}
    for cid, e in changes(state_dir).items():
        summary.append({"change_id": cid, "playbook": e.get("playbook"), "install": e.get("install"),
                        "time": e.get("time"),
                        "operator": e.get("operator"), "state": e["state"], "reason": e.get("reason"),
                        "files": [f["path"] for f in e["files"]]})
        if e["state"] == PENDING:  # interrupted, or a run in progress: its files are explained
            for f in e["files"]:
                cur = _state(f)
                if cur in (f["before_sha256"], f["after_sha256"]) and f.get("kind") != "link":
                    explained[os.path.realpath(f["path"])] = cur
            continue
        if e["state"] != APPLIED:
            continue
        for f in e["files"]:
            cur = _state(f)
            if cur == f["after_sha256"]:
                explained[os.path.realpath(f["path"])] = f["after_sha256"]
            elif cur == f["before_sha256"]:
                drift.append({"change_id": cid, "path": f["path"], "problem": "drift: reverted or reinstalled"})
            else:
                drift.append({"change_id": cid, "path": f["path"], "problem": "drift: edited since the apply"})
    modified, err = (None, None)
    if params.get("location"):
        modified, err = _record_problems(params["location"], params.get("dist", "sglang"), explained)
    kernels = {os.path.basename(os.path.dirname(c)): os.readlink(c)
               for c in sorted(glob.glob(os.path.join(state_dir, "kernels", "*", "current")))}
    return {"ok": True, "changes": summary, "drift": drift, "modified": modified, "record_error": err,
            "kernels": kernels}


def compile_check(params, state_dir):
    """params: {paths: [str]}. Compile each file with this interpreter (run the probe under the
    interpreter that serves SGLang, so its grammar is the one that counts).
    Returns {"ok": true, "problems": ["path:line: message"]}; touches nothing."""
    problems = []
    for path in params["paths"]:
        with open(path, "rb") as f:
            text = f.read()
        try:
            compile(text, path, "exec", dont_inherit=True)
        except SyntaxError as e:
            problems.append("%s:%s: %s" % (path, e.lineno, e.msg))
    return {"ok": True, "problems": problems}


ACTIONS = {"apply": apply, "commit": commit, "rollback": rollback, "recover": recover,
           "status": status, "compile": compile_check}


def main(params):
    """params: {action: apply|commit|rollback|recover|status|compile, state_dir?: str, ...action params}.

    Returns the action's result dict, or {"ok": false, "error": ...} for an unknown action, a
    refusal ("refused": true; nothing was changed) or an unexpected error on the host.
    """
    fn = ACTIONS.get(params.get("action"))
    if fn is None:
        return {"ok": False, "error": "unknown action %r" % params.get("action")}
    try:
        return fn(params, os.path.abspath(params.get("state_dir") or STATE_DIR))
    except Refused as e:
        return {"ok": False, "error": str(e), "refused": True}
    except Exception as e:  # an unexpected host error (disk full, permissions): report, do not crash
        return {"ok": False, "error": "%s: %s" % (type(e).__name__, e)}
