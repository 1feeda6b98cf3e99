"""The change ledger on the host: its store in the state dir, read, appended to, pruned.

Stdlib only (Python 3.8+), loaded in the change probe's bundle. State lives in `state_dir`
(default STATE_DIR):
  ledger.jsonl                    one JSON object per line: change_id, playbook, time (UTC ISO
                                  8601 of that line), operator, files [{path, before_sha256,
                                  after_sha256, backup}], release ({dist, version} of the
                                  package under its root when applied: distinfo.release; None
                                  for a kernel's), state (pending | applied | rolled-back |
                                  failed | superseded), reason, schema (SCHEMA); a state change appends the
                                  whole entry again, and the last line of a change_id wins.
                                  Lines are only ever appended, whole or not at all (append),
                                  with one exception: a commit that finds the disk full even
                                  after freeing the reserve rewrites its pending line's
                                  "pending" as "applied" in place (append_applied).
  ledger.reserve                  RESERVE_BYTES of random bytes, made before each apply's
                                  pending line (make_reserve) and freed when a commit finds the
                                  disk full, so that a validated change can still be recorded.
  backups/<change_id>/<path>      the original bytes of every file the change writes.
  kernels/<name>/<key>            private kernel builds (src/, build/, PASSED), built and tested
                                  here; deploy publishes a passed one to PUBLIC/<name>/<key>
                                  (/var/lib/fleetctl-kernels, root 0755: probes/kernel/publish.py),
                                  where the active link PUBLIC/<name>/current and the dispatch
                                  table PUBLIC/<name>/dispatch.json live (one ledger change, its
                                  root PUBLIC/<name>; deploy and the Ansible collection's kernel
                                  action alike). A `kernels/<name>/current` link here is the
                                  layout before issue 34; prune() keeps the builds such links name.
The state dir is reached without following links (safefs.open_dir) and must be root's (this
euid's) alone; a ledger that is not is refused (safefs.Refused), never read or written.
"""

import errno
import glob
import json
import os
import re
import stat
import time

from .. import safefs

STATE_DIR = "/var/lib/fleetctl"
# Ledger states (the control side's fleetctl.vocab.ChangeState has the same words).
PENDING, APPLIED, ROLLED_BACK, FAILED = "pending", "applied", "rolled-back", "failed"
# an applied change whose release was replaced by an upgrade, dropped by `rollback --forget`
# (actions.forget): nothing of it is restored, ever
SUPERSEDED = "superseded"
STATES = (PENDING, APPLIED, ROLLED_BACK, FAILED, SUPERSEDED)
# The ledger's line format. Every entry written says it ("schema"; lines without it are schema 1,
# as fleetctl wrote before it was named); a ledger with an entry of a newer schema is refused
# whole (read), since an older fleetctl or collection would misread its changes.
SCHEMA = 1
CHANGE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
KEEP_BACKUPS = 10  # backups kept of the latest changes, whatever their state (prune())
RESERVE = "ledger.reserve"
RESERVE_BYTES = 64 << 10  # the reserve's least size; 4 x the change's ledger line when that is more
FULL = (errno.ENOSPC, errno.EDQUOT)  # the errors of a full file system


def check_entry(entry, state_dir):
    """Refuse a ledger entry whose paths fall outside what it may touch: every file under its
    "root" (when recorded) and every backup exactly backups/<change_id>/<path>."""
    root = entry.get("root")
    for f in entry.get("files") or []:
        p = f.get("path")
        if not isinstance(p, str) or not os.path.isabs(p) or os.path.normpath(p) != p or \
                (root and not p.startswith(root.rstrip("/") + "/")):
            raise safefs.Refused("ledger entry %s names %r outside %s: not trusting it"
                                 % (entry.get("change_id"), p, root))
        want = os.path.join(state_dir, "backups", entry["change_id"], p.lstrip("/"))
        if f.get("kind") != "link" and f.get("backup") != want:
            raise safefs.Refused("ledger entry %s has backup %r, not %s: not trusting it"
                                 % (entry.get("change_id"), f.get("backup"), want))


def _now():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _state_fd(state_dir, create):
    """A descriptor of the state dir, which must be a directory root (this euid) owns, no
    symlink on the way, writable by nobody else; it is made 0700 whatever the umask. None when
    it is missing and not `create`. Raises safefs.Refused otherwise: its ledger cannot be trusted."""
    try:
        fd = safefs.open_dir(state_dir, 0o700 if create else None)
    except FileNotFoundError:
        return None
    except safefs.UnsafePath as e:
        raise safefs.Refused("state dir: %s" % e)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        if st.st_uid == 0 and os.geteuid() != 0:  # root's, as it should be: this login is not root
            raise safefs.Refused(safefs.denied(state_dir, "fleetctl's state dir is root's (mode %o): only root "
                                               "may use it" % stat.S_IMODE(st.st_mode)))
        raise safefs.Refused("state dir %s is owned by uid %d with mode %o: only its owner (uid %d) may "
                             "write it, or its ledger cannot be trusted"
                             % (state_dir, st.st_uid, stat.S_IMODE(st.st_mode), os.geteuid()))
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.fchmod(fd, 0o700)
    return fd


def read(state_dir):
    """The ledger's entries in file order; a torn last line (killed mid-write) is skipped.
    Raises safefs.Refused when an entry has a newer schema than SCHEMA."""
    out = []
    dfd = _state_fd(state_dir, create=False)
    if dfd is None:
        return out
    try:
        fd = safefs.open_regular(dfd, "ledger.jsonl", os.path.join(state_dir, "ledger.jsonl"))
    except FileNotFoundError:
        return out
    except safefs.UnsafePath as e:
        raise safefs.Refused("ledger: %s" % e)
    finally:
        os.close(dfd)
    with os.fdopen(fd, encoding="utf-8") as f:
        for line in f:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            schema = entry.get("schema", 1) if isinstance(entry, dict) else None
            if not isinstance(schema, int) or schema > SCHEMA:
                raise safefs.Refused("ledger %s/ledger.jsonl has an entry of schema %r, newer than this "
                                     "fleetctl's %d (change %s): upgrade fleetctl (and rebuild the collection) "
                                     "to read it" % (state_dir, schema, SCHEMA, entry.get("change_id")
                                                     if isinstance(entry, dict) else None))
            out.append(entry)
    return out


def changes(state_dir):
    """{change_id: last ledger entry}, ordered by each change's latest line."""
    out = {}
    for e in read(state_dir):
        out.pop(e.get("change_id"), None)
        out[e.get("change_id")] = e
    return out


def _open_rw(dfd, name, state_dir, flags=0):
    """A read-write descriptor of regular file `name` in the state dir `dfd` (O_NOFOLLOW, plus
    `flags`: O_CREAT makes it 0600), made 0600. Raises OSError, safefs.Refused (not a regular file)."""
    fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | flags, 0o600, dir_fd=dfd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise safefs.Refused("%s/%s is not a regular file" % (state_dir, name))
    os.fchmod(fd, 0o600)
    return fd


def _write_all(fd, data):
    while data:
        data = data[os.write(fd, data):]


def append(state_dir, entry, state, reason=None):
    """Append `entry` with `state`, `reason`, this time and SCHEMA as one line (fsynced, file and
    directory); a line a kill left torn is ended first. Whole or not at all: when a write or the
    fsync fails (ENOSPC after part of the line), the ledger is cut back to its length before, so
    a line reported unrecorded is not on disk (review L7). Returns the line's entry. Raises
    OSError, safefs.Refused (the state dir or ledger file is not safe)."""
    entry = dict(entry, state=state, time=_now(), reason=reason, schema=SCHEMA)
    line = (json.dumps(entry, sort_keys=True) + "\n").encode("utf-8")
    dfd = _state_fd(state_dir, create=True)
    try:
        fd = _open_rw(dfd, "ledger.jsonl", state_dir, os.O_APPEND | os.O_CREAT)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":  # a line torn by a kill: do not glue onto it
                line = b"\n" + line
            try:
                _write_all(fd, line)
                os.fsync(fd)
            except OSError:
                try:
                    os.ftruncate(fd, size)
                    os.fsync(fd)
                except OSError:
                    pass  # the first error is the one to report; a torn line is skipped by read
                raise
        finally:
            os.close(fd)
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return entry


def try_append(state_dir, entry, state, reason=None):
    """append, tried twice (a disk that was full a moment ago may have room again, review L7).
    Returns None, or the OSError's text when the ledger could not record the state."""
    for attempt in (0, 1):
        try:
            append(state_dir, entry, state, reason)
            return None
        except OSError as e:
            if attempt:
                return "%s: %s" % (type(e).__name__, e)
            time.sleep(0.2)


def make_reserve(state_dir, line_bytes=0, need_bytes=0):
    """Grow the state dir's ledger.reserve to RESERVE_BYTES or 4 x `line_bytes` (the change's
    ledger line), whichever is more, with random bytes (which no compressing file system stores
    as nothing), fsynced: room that append_applied frees when a commit finds the disk full. Only
    when there is room: what it adds and `need_bytes` (what the apply will write there: backups,
    ledger lines) must fit in the file system's free space (statvfs), and on a disk full
    meanwhile (FULL) it keeps what it wrote. Returns the reserve's size in bytes. Raises OSError,
    safefs.Refused (the state dir, or a reserve that is not a regular file)."""
    want = max(RESERVE_BYTES, 4 * line_bytes)
    dfd = _state_fd(state_dir, create=True)
    try:
        fd = _open_rw(dfd, RESERVE, state_dir, os.O_CREAT)
        try:
            size = os.fstat(fd).st_size
            if size >= want:
                return size
            vfs = os.fstatvfs(fd)
            free = (vfs.f_bfree if os.geteuid() == 0 else vfs.f_bavail) * vfs.f_frsize
            try:
                while size < want and want - size + need_bytes <= free:
                    size += os.pwrite(fd, os.urandom(min(want - size, 1 << 20)), size)
            except OSError as e:
                if e.errno not in FULL:
                    raise
            os.fsync(fd)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return size


def release_reserve(state_dir):
    """Free ledger.reserve (cut to 0 bytes, fsynced, so that the file system counts the space
    free). Returns the bytes freed (0 when there is none). Raises OSError, safefs.Refused."""
    dfd = _state_fd(state_dir, create=False)
    if dfd is None:
        return 0
    try:
        fd = _open_rw(dfd, RESERVE, state_dir)
    except FileNotFoundError:
        return 0
    finally:
        os.close(dfd)
    try:
        size = os.fstat(fd).st_size
        os.ftruncate(fd, 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    return size


_PENDING_STATE = b'"state": "pending"'


def mark_applied(state_dir, change_id):
    """Rewrite the state of `change_id`'s last ledger line from "pending" to "applied" in place:
    the same 7 bytes, in blocks the ledger already has, so that it needs no free space (on a file
    system that overwrites in place: not btrfs or ZFS), fsynced. The line keeps its time and no
    reason. Raises ValueError when that line is not a pending one this rewrite turns into the
    same entry applied; OSError, safefs.Refused."""
    dfd = _state_fd(state_dir, create=False)
    if dfd is None:
        raise ValueError("no state dir %s" % state_dir)
    try:
        fd = _open_rw(dfd, "ledger.jsonl", state_dir)
    finally:
        os.close(dfd)
    try:
        data = os.pread(fd, os.fstat(fd).st_size, 0)
        found, offset = None, 0
        for line in data.splitlines(True):
            try:
                e = json.loads(line)
            except ValueError:
                e = None
            if isinstance(e, dict) and e.get("change_id") == change_id:
                found = (offset, line, e)
            offset += len(line)
        if found is not None and found[2].get("state") == APPLIED:
            return  # the failed append landed after all (its cut back failed too)
        if found is None or found[2].get("state") != PENDING:
            raise ValueError("change %s has no pending line in %s/ledger.jsonl" % (change_id, state_dir))
        offset, line, e = found
        at = line.find(_PENDING_STATE)
        new = line[:at] + b'"state": "applied"' + line[at + len(_PENDING_STATE):]
        if line.count(_PENDING_STATE) != 1 or json.loads(new) != dict(e, state=APPLIED):
            raise ValueError("change %s: its pending line in %s/ledger.jsonl does not rewrite cleanly"
                             % (change_id, state_dir))
        start = offset + at + len(b'"state": "')
        if os.pwrite(fd, APPLIED.encode(), start) != len(APPLIED):
            raise OSError(errno.EIO, "short write marking change %s applied" % change_id)
        os.fsync(fd)
    finally:
        os.close(fd)


def append_applied(state_dir, entry, reason=None):
    """Record `entry` as APPLIED (a validated commit) on a disk that may be full, so that it is
    never left pending to be undone (review L7): append; when that fails, free the reserve
    (release_reserve) and append again; when that fails too, mark_applied. Returns None when the
    first append took, else the note for the operator of what was done. Raises OSError (every
    attempt's error) when the ledger still says pending; safefs.Refused."""
    try:
        append(state_dir, entry, APPLIED, reason)
        return None
    except OSError as e:
        first = e
    full = ("the file system of %s is full (%s)" if first.errno in FULL else "appending to the ledger in %s failed (%s)") \
        % (state_dir, first.strerror or first)
    freed = 0
    try:
        freed = release_reserve(state_dir)
        append(state_dir, entry, APPLIED, reason)
        return ("%s: committed after freeing the ledger's reserve (%s, %d bytes); free space there before "
                "the next change" % (full, RESERVE, freed))
    except OSError as e:
        second = e
    try:
        mark_applied(state_dir, entry["change_id"])
    except (OSError, ValueError) as e:
        raise OSError(first.errno, "%s; after freeing the reserve (%d bytes): %s; marking its pending line "
                      "applied in place: %s" % (first.strerror or first, freed, second, e))
    return ("%s, even after freeing the ledger's reserve (%d bytes): committed by marking the change's "
            "pending ledger line applied in place (the commit's time and reason are not recorded); free "
            "space there before the next change" % (full, freed))


def _remove_under(state_dir, rel):
    """Remove state_dir/rel (rel: "backups/<cid>" or "kernels/<name>/<key>") if it is there,
    walking from the state dir without following links. Returns the path removed, or None."""
    parts = rel.split("/")
    dfd = _state_fd(state_dir, create=False)
    if dfd is None:
        return None
    try:
        for part in parts[:-1]:
            nxt = os.open(part, safefs.OPEN_DIR, dir_fd=dfd)
            os.close(dfd)
            dfd = nxt
        safefs.rmtree(dfd, parts[-1])
        return os.path.join(state_dir, rel)
    except FileNotFoundError:
        return None
    finally:
        os.close(dfd)


def prune(state_dir, keep=None):
    """Remove what no rollback can need any more (review "Backups, ledger, lock"): the backups
    of changes older than the latest `keep` (ledger order) that were rolled back, or applied
    and superseded (every file changed again by a later applied change); and the kernel
    builds (kernels/<name>/<key>) that are neither the one `current` points at nor the one the
    latest applied change of that link switched from (the previous build). Pending and failed
    changes keep their backups. `keep`: default KEEP_BACKUPS. Returns [paths removed]."""
    keep = KEEP_BACKUPS if keep is None else keep
    entries = list(changes(state_dir).values())
    removed = []
    for i, e in enumerate(entries[:max(0, len(entries) - keep)]):
        later = {f["path"] for x in entries[i + 1:] if x["state"] == APPLIED for f in x["files"]}
        files = [f for f in e["files"] if f.get("kind") != "link"]
        superseded = e["state"] == APPLIED and all(f["path"] in later for f in files)
        if files and (e["state"] in (ROLLED_BACK, SUPERSEDED) or superseded) and CHANGE_ID.match(e["change_id"]):
            gone = _remove_under(state_dir, "backups/" + e["change_id"])
            if gone:
                removed.append(gone)

    def where(p):
        return os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))
    for link in sorted(glob.glob(os.path.join(glob.escape(state_dir), "kernels", "*", "current"))):
        kdir = os.path.dirname(link)
        keep_keys = {os.readlink(link)} if os.path.islink(link) else set()
        for e in reversed(entries):
            f = next((f for f in e["files"] if f.get("kind") == "link" and where(f["path"]) == where(link)), None)
            if f is not None and e["state"] == APPLIED:
                if f.get("before_sha256"):
                    keep_keys.add(f["before_sha256"][len("link:"):])
                break
        for key in sorted(os.listdir(kdir)):
            path = os.path.join(kdir, key)
            if key in keep_keys or key == "current" or not os.path.isdir(path) or os.path.islink(path):
                continue
            gone = _remove_under(state_dir, os.path.relpath(path, state_dir))
            if gone:
                removed.append(gone)
    return removed


def space_used(state_dir):
    """Bytes the state dir holds: {"backups": n, "kernels": n, "total": n} (sizes of the files
    below it, links not followed)."""
    out = {"backups": 0, "kernels": 0, "total": 0}
    for dirpath, _, filenames in os.walk(state_dir):
        rel = os.path.relpath(dirpath, state_dir).split(os.sep)[0]
        for fn in filenames:
            try:
                size = os.lstat(os.path.join(dirpath, fn)).st_size
            except OSError:
                continue
            out["total"] += size
            if rel in ("backups", "kernels"):
                out[rel] += size
    return out
