"""Host-side file changes with backups and a ledger: apply, commit, rollback, recover, status.

Runs on the host as root, stdlib only (Python 3.8+), sent on stdin like every probe;
`main(params)` returns JSON-serialisable data and never prints. The caller holds the host's
lock for the whole apply/rollback; this module does no locking.

State lives in `state_dir` (param, default /var/lib/fleetctl):
  ledger.jsonl                    one JSON object per line: change_id, playbook, time (UTC ISO
                                  8601 of that line), operator, files [{path, before_sha256,
                                  after_sha256, backup}], state (pending | applied | rolled-back |
                                  failed), reason, schema (LEDGER_SCHEMA); a state change appends
                                  the whole entry again, and the last line of a change_id wins.
  backups/<change_id>/<path>      the original bytes of every file the change writes.
Every action returns {"ok": true, ...} or {"ok": false, "error": "..."} (a refusal changes nothing).
"""

import base64
import errno
import fnmatch
import glob
import hashlib
import json
import os
import re
import secrets
import stat
import time

try:  # the probe bundle loads this helper before this module
    import scancache
except ImportError:  # imported as a package module (fleetctl.probes.change; the collection's module_utils)
    from . import scancache

STATE_DIR = "/var/lib/fleetctl"
# Ledger states (the control side's fleetctl.vocab.ChangeState has the same words).
PENDING, APPLIED, ROLLED_BACK, FAILED = "pending", "applied", "rolled-back", "failed"
STATES = (PENDING, APPLIED, ROLLED_BACK, FAILED)
# The ledger's line format. Every entry written says it ("schema"; lines without it are schema 1,
# as fleetctl wrote before it was named); a ledger with an entry of a newer schema is refused
# whole (read_ledger), since an older fleetctl or collection would misread its changes.
LEDGER_SCHEMA = 1
_CHANGE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class Refused(Exception):
    """A precondition failed before anything was changed."""


class UnsafePath(Exception):
    """A path fleetctl would write or read as root goes through a symlink, is not a regular
    file, or leaves the directory it is confined to."""


# statfs(2) f_type names as /proc/self/mountinfo gives them (proc(5)) of file systems that
# other hosts may mount too: writing there from one host changes every host that mounts it.
NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "lustre", "gpfs", "glusterfs", "beegfs",
              "afs", "9p", "fuse", "fuseblk")
# Files the probe reads (package sources, backups) are at most this many bytes.
MAX_FILE_BYTES = 64 << 20
# The RECORD hash cache (status): entries of files changed this recently are not kept (their
# ctime cannot yet tell a later rewrite; as callsites.RACY_S); its cache key names the format.
RECORD_RACY_S = 2.0
RECORD_CACHE_KEY = "record-sha256-1"
KEEP_BACKUPS = 10  # backups kept of the latest changes, whatever their state (prune())
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_KINDS = ((stat.S_ISLNK, "symlink"), (stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"),
          (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"))


def kind_of(mode):
    """"regular file", "symlink", "directory", "FIFO", "socket", "character device" or "block device"."""
    return next((name for test, name in _KINDS if test(mode)), "regular file")


def open_dir(path, create=None):
    """A descriptor of directory `path` (absolute, normalised), reached from / one component at
    a time with O_DIRECTORY|O_NOFOLLOW relative to the previous one, so nothing on the way can
    redirect it. `create`: the mode of missing components (created, chmod'ed to it whatever the
    umask, their parent fsynced); None: a missing one raises FileNotFoundError. Raises
    UnsafePath when a component is a symlink or not a directory."""
    parts = [] if path == "/" else path.split("/")[1:]
    if not path.startswith("/") or os.path.normpath(path) != path or "" in parts:
        raise UnsafePath("%s: not an absolute, normalised path" % path)
    fd, done = os.open("/", _DIR), ""
    try:
        for part in parts:
            done += "/" + part
            try:
                nfd = os.open(part, _DIR, dir_fd=fd)
            except FileNotFoundError:
                if create is None:
                    raise
                os.mkdir(part, create, dir_fd=fd)
                nfd = os.open(part, _DIR, dir_fd=fd)
                os.fchmod(nfd, create)
                os.fsync(fd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                raise UnsafePath("%s is a %s: fleetctl does not go through it" % (done, kind_of(st.st_mode)))
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def _parent(path, create=None):
    """(descriptor of the directory holding `path`, its base name): see open_dir."""
    d, name = os.path.split(path)
    if name in ("", ".", ".."):
        raise UnsafePath("%s: not a file path" % path)
    return open_dir(d, create), name


def _lstat(dfd, name):
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _open_regular(dfd, name, path):
    """A read descriptor of regular file `name` in `dfd` (never a link, FIFO or device: those
    raise UnsafePath without being opened); FileNotFoundError when missing."""
    st = _lstat(dfd, name)
    if st is None:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath("%s is a %s, not a regular file" % (path, kind_of(st.st_mode)))
    fd = os.open(name, _READ, dir_fd=dfd)
    fst = os.fstat(fd)
    if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino) or fst.st_size > MAX_FILE_BYTES:
        os.close(fd)
        raise UnsafePath("%s changed while being opened, or is over %d bytes" % (path, MAX_FILE_BYTES))
    return fd


def read_file(path):
    """The bytes of regular file `path` (see _open_regular), at most MAX_FILE_BYTES."""
    dfd, name = _parent(path)
    try:
        fd = _open_regular(dfd, name, path)
    finally:
        os.close(dfd)
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise UnsafePath("%s is over %d bytes" % (path, MAX_FILE_BYTES))
    return data


def sha256_file(path):
    """Hex sha256 of the file's bytes, None when it does not exist, or "<why>" (never a hex
    digest) when it is not a regular file reached without symlinks: it is then not read."""
    try:
        return hashlib.sha256(read_file(path)).hexdigest()
    except FileNotFoundError:
        return None
    except UnsafePath as e:
        return "<%s>" % e


def link_state(path):
    """A symlink's state as the ledger records it: "link:<target>", or None when absent."""
    try:
        dfd, name = _parent(path)
    except (OSError, UnsafePath):
        return None
    try:
        return "link:" + os.readlink(name, dir_fd=dfd)
    except OSError:
        return None
    finally:
        os.close(dfd)


def _state(f):
    """Current state of ledger file entry `f`: sha256 of a file, link_state of a link."""
    return link_state(f["path"]) if f.get("kind") == "link" else sha256_file(f["path"])


def _tmp_name(name, tag):
    """A temp name beside `name` nobody can guess: the tag and 64 random bits."""
    return ".%s.fleetctl-%s.%s.tmp" % (name, tag, secrets.token_hex(8))


def _is_tmp(entry, name, tag):
    return re.match(r"\.%s\.fleetctl-%s(\.[0-9a-f]{16})?\.tmp\Z" % (re.escape(name), re.escape(tag)), entry)


def remove_tmp(path, tags):
    """Remove the temp files apply or a restore left beside `path` for any of `tags`
    (unlinking a planted symlink removes the link only). Returns their names."""
    try:
        dfd, name = _parent(path)
    except (OSError, UnsafePath):
        return []
    try:
        gone = [e for e in os.listdir(dfd) if any(_is_tmp(e, name, t) for t in tags)]
        for e in gone:
            os.unlink(e, dir_fd=dfd)
        return gone
    finally:
        os.close(dfd)


def set_link(path, target, tag):
    """Point symlink `path` at `target` atomically (new link beside it + rename); None removes it."""
    dfd, name = _parent(path)
    try:
        st = _lstat(dfd, name)
        if st is not None and not stat.S_ISLNK(st.st_mode):
            raise UnsafePath("%s is a %s, not a symlink" % (path, kind_of(st.st_mode)))
        if target is None:
            if st is not None:
                os.unlink(name, dir_fd=dfd)
        else:
            tmp = _tmp_name(name, tag)
            os.symlink(target, tmp, dir_fd=dfd)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _copy_xattrs(src, dst):
    """Copy every extended attribute (POSIX ACLs, SELinux labels, security.*) from descriptor
    `src` to `dst`; a file system without them (ENOTSUP) has none to keep."""
    try:
        names = os.listxattr(src)
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return
        raise
    for n in names:
        os.setxattr(dst, n, os.getxattr(src, n))


class ChangedMeanwhile(OSError):
    """atomic_write(expect=...) found the file no longer as expected: nothing was replaced."""


def _sha256_fd(fd):
    h = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return h.hexdigest()
        h.update(chunk)


def atomic_write(path, data, tag, expect=None):
    """Replace regular file `path` by `data` (bytes) atomically, never through a symlink: the
    parent reached by open_dir, a temp file beside it with an unguessable name opened
    O_CREAT|O_EXCL|O_NOFOLLOW, fsync, rename with directory descriptors, fsync the directory.
    Keeps the file's owner, mode and extended attributes (0644 and the caller's when it is
    missing). `expect`: the sha256 the file must still have right before the rename (review L6:
    a `pip install` that rewrote it meanwhile is not clobbered); else ChangedMeanwhile, nothing replaced.
    Raises UnsafePath when `path` is a symlink or anything but a regular file."""
    dfd, name = _parent(path)
    try:
        st = _lstat(dfd, name)
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise UnsafePath("%s is a %s: fleetctl does not replace it" % (path, kind_of(st.st_mode)))
        tmp = _tmp_name(name, tag)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=dfd)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                if st is None:
                    os.fchmod(fd, 0o644)
                else:
                    if (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
                        os.fchown(fd, st.st_uid, st.st_gid)
                    os.fchmod(fd, stat.S_IMODE(st.st_mode))  # after fchown, which clears set-id bits
                    src = _open_regular(dfd, name, path)
                    try:
                        _copy_xattrs(src, fd)
                    finally:
                        os.close(src)
                os.fsync(fd)
            finally:
                os.close(fd)
            if expect is not None:
                src = _open_regular(dfd, name, path)
                try:
                    if _sha256_fd(src) != expect:
                        raise ChangedMeanwhile(errno.EAGAIN, "changed on the host while being applied (a pip "
                                               "install?), left as it is", path)
                finally:
                    os.close(src)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except FileNotFoundError:
                pass
            raise
        os.fsync(dfd)
    finally:
        os.close(dfd)


def drop_pycache(path):
    """Remove the module's stale bytecode: __pycache__/<stem>.*.pyc next to `path` (a symlinked
    __pycache__ raises UnsafePath)."""
    dfd, name = _parent(path)
    try:
        try:
            pfd = os.open("__pycache__", _DIR, dir_fd=dfd)
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise UnsafePath("%s/__pycache__ is not a directory" % os.path.dirname(path))
            raise
    finally:
        os.close(dfd)
    try:
        pattern = glob.escape(os.path.splitext(name)[0]) + ".*.pyc"
        for pyc in os.listdir(pfd):
            if fnmatch.fnmatchcase(pyc, pattern):
                os.unlink(pyc, dir_fd=pfd)
    finally:
        os.close(pfd)


def fs_type(path, mountinfo="/proc/self/mountinfo"):
    """The type of the file system holding real path `path`: that of the last-mounted, longest
    mount point above it in `mountinfo` (proc(5): field 5 the mount point, octal escapes, and
    the type first after " - "). None when no line covers it."""
    best, kind = None, None
    with open(mountinfo, encoding="utf-8", errors="replace") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if len(fields) < 5 or not right.split():
                continue
            mp = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            inside = path == mp or path.startswith(mp.rstrip("/") + "/")
            if inside and (best is None or len(mp) >= len(best)):
                best, kind = mp, right.split()[0]
    return kind


def is_network_fs(kind):
    """True for a type in NETWORK_FS or any FUSE file system ("fuse.sshfs")."""
    return kind in NETWORK_FS or (kind or "").startswith("fuse.")


def confine(path, root):
    """`path` with its directory's links resolved, when that lies under `root` (a real path);
    else Refused. The path must be absolute and normalised."""
    if not isinstance(path, str) or not os.path.isabs(path) or os.path.normpath(path) != path:
        raise Refused("%r: not an absolute, normalised path" % (path,))
    d, name = os.path.split(path)
    real = os.path.join(os.path.realpath(d), name)
    if not real.startswith(root.rstrip("/") + "/"):
        raise Refused("%s is outside %s (links resolved): fleetctl only writes there" % (real, root))
    return real


def check_entry(entry, state_dir):
    """Refuse a ledger entry whose paths fall outside what it may touch: every file under its
    "root" (when recorded) and every backup exactly backups/<change_id>/<path>."""
    root = entry.get("root")
    for f in entry.get("files") or []:
        p = f.get("path")
        if not isinstance(p, str) or not os.path.isabs(p) or os.path.normpath(p) != p or \
                (root and not p.startswith(root.rstrip("/") + "/")):
            raise Refused("ledger entry %s names %r outside %s: not trusting it" % (entry.get("change_id"), p, root))
        want = os.path.join(state_dir, "backups", entry["change_id"], p.lstrip("/"))
        if f.get("kind") != "link" and f.get("backup") != want:
            raise Refused("ledger entry %s has backup %r, not %s: not trusting it"
                          % (entry.get("change_id"), f.get("backup"), want))


def _now():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _state_fd(state_dir, create):
    """A descriptor of the state dir, which must be a directory root (this euid) owns, no
    symlink on the way, writable by nobody else; it is made 0700 whatever the umask. None when
    it is missing and not `create`. Raises Refused otherwise: its ledger cannot be trusted."""
    try:
        fd = open_dir(state_dir, 0o700 if create else None)
    except FileNotFoundError:
        return None
    except UnsafePath as e:
        raise Refused("state dir: %s" % e)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        raise Refused("state dir %s is owned by uid %d with mode %o: only its owner (uid %d) may write "
                      "it, or its ledger cannot be trusted" % (state_dir, st.st_uid, stat.S_IMODE(st.st_mode),
                                                               os.geteuid()))
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.fchmod(fd, 0o700)
    return fd


def read_ledger(state_dir):
    """The ledger's entries in file order; a torn last line (killed mid-write) is skipped.
    Raises Refused when an entry has a newer schema than LEDGER_SCHEMA."""
    out = []
    dfd = _state_fd(state_dir, create=False)
    if dfd is None:
        return out
    try:
        fd = _open_regular(dfd, "ledger.jsonl", os.path.join(state_dir, "ledger.jsonl"))
    except FileNotFoundError:
        return out
    except UnsafePath as e:
        raise Refused("ledger: %s" % e)
    finally:
        os.close(dfd)
    with os.fdopen(fd, encoding="utf-8") as f:
        for line in f:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            schema = entry.get("schema", 1) if isinstance(entry, dict) else None
            if not isinstance(schema, int) or schema > LEDGER_SCHEMA:
                raise Refused("ledger %s/ledger.jsonl has an entry of schema %r, newer than this fleetctl's %d "
                              "(change %s): upgrade fleetctl (and rebuild the collection) to read it"
                              % (state_dir, schema, LEDGER_SCHEMA, entry.get("change_id") if isinstance(entry, dict)
                                 else None))
            out.append(entry)
    return out


def changes(state_dir):
    """{change_id: last ledger entry}, ordered by each change's latest line."""
    out = {}
    for e in read_ledger(state_dir):
        out.pop(e.get("change_id"), None)
        out[e.get("change_id")] = e
    return out


def _append(state_dir, entry, state, reason=None):
    entry = dict(entry, state=state, time=_now(), reason=reason, schema=LEDGER_SCHEMA)
    dfd = _state_fd(state_dir, create=True)
    try:
        fd = os.open("ledger.jsonl", os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=dfd)
        with os.fdopen(fd, "a+b") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise Refused("ledger %s/ledger.jsonl is not a regular file" % state_dir)
            os.fchmod(fd, 0o600)
            f.seek(0, os.SEEK_END)
            if f.tell():
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":  # a line torn by a kill: do not glue this entry onto it
                    f.write(b"\n")
            f.write((json.dumps(entry, sort_keys=True) + "\n").encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return entry


def _record(state_dir, entry, state, reason=None):
    """_append, tried twice (a disk that was full a moment ago may have room again, review L7).
    Returns None, or the OSError's text when the ledger could not record the state."""
    for attempt in (0, 1):
        try:
            _append(state_dir, entry, state, reason)
            return None
        except OSError as e:
            if attempt:
                return "%s: %s" % (type(e).__name__, e)
            time.sleep(0.2)


_STILL_PENDING = "; the ledger could not record this (%s): it still says pending, and the next run's recover undoes it"


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
    root = _root(params)
    paths = [confine(f["path"], root) for f in params["files"]]
    if len(set(paths)) != len(paths):
        raise Refused("file paths must be distinct")
    backup_dir = os.path.join(state_dir, "backups", cid)
    originals, news, items = {}, {}, []
    for path, f in zip(paths, params["files"]):
        try:
            if f.get("kind") == "link":
                before = "link:" + f["pre_target"] if f.get("pre_target") else None
                if link_state(path) != before or (before is None and _lexists(path)):
                    raise Refused("%s: changed since inspect (link is %s)" % (path, link_state(path)))
                items.append({"path": path, "kind": "link", "before_sha256": before,
                              "after_sha256": "link:" + f["post_target"]})
                continue
            try:
                originals[path] = read_file(path)
            except OSError as e:
                raise Refused("%s: %s" % (path, e.strerror))
            _check_pycache(path)
        except UnsafePath as e:
            raise Refused("%s: not changing it" % e)
        if hashlib.sha256(originals[path]).hexdigest() != f["pre_sha256"]:
            raise Refused("%s: changed since inspect" % path)
        news[path] = f["new_text"].encode("utf-8")
        if hashlib.sha256(news[path]).hexdigest() != f["post_sha256"]:
            raise Refused("%s: new text does not hash to post_sha256" % path)
        items.append({"path": path, "before_sha256": f["pre_sha256"], "after_sha256": f["post_sha256"],
                      "backup": os.path.join(backup_dir, path.lstrip("/"))})
    entry = {"change_id": cid, "playbook": params.get("playbook"), "operator": params.get("operator"),
             "install": params.get("install"), "root": root, "files": items}
    entry = _append(state_dir, entry, PENDING)
    written = []
    try:
        for f in entry["files"]:
            if f.get("kind") != "link":
                os.close(open_dir(os.path.dirname(f["backup"]), create=0o700))
                atomic_write(f["backup"], originals[f["path"]], cid)
        for f in entry["files"]:
            written.append(f)
            if f.get("kind") == "link":
                set_link(f["path"], f["after_sha256"][len("link:"):], cid)
            else:
                try:
                    atomic_write(f["path"], news[f["path"]], cid, expect=f["before_sha256"])
                except ChangedMeanwhile:
                    written.pop()  # not written by this change: never "restored" over the new bytes
                    raise
                drop_pycache(f["path"])
            if _state(f) != f["after_sha256"]:
                raise OSError("%s: state after the write is not post_sha256" % f["path"])
    except Exception as e:
        left = _undo_written(written, cid, originals)
        why = "%s: %s" % (type(e).__name__, e)
        if left:
            unrecorded = _record(state_dir, entry, FAILED, "%s; NOT restored: %s" % (why, "; ".join(left)))
            return {"ok": False, "change_id": cid,
                    "error": "apply failed: %s; NOT restored: %s" % (e, "; ".join(left))
                    + (_STILL_PENDING % unrecorded if unrecorded else "")}
        unrecorded = _record(state_dir, entry, FAILED, why)
        return {"ok": False, "change_id": cid, "error": "apply failed, files restored: %s" % e
                + (_STILL_PENDING % unrecorded if unrecorded else "")}
    pruned = []
    if params.get("commit", True):
        unrecorded = _record(state_dir, entry, APPLIED)
        if unrecorded:
            return {"ok": False, "change_id": cid, "error": "the files are changed but the change could not be "
                    "committed" + _STILL_PENDING % unrecorded}
        pruned = prune(state_dir)
    return {"ok": True, "change_id": cid, "files": entry["files"], "pruned": pruned}


def _root(params):
    """The real path of params["root"], the directory the change is confined to (the install's
    package directory, or the kernels dir). Refused when missing, or on a network file system
    (NETWORK_FS) unless params["shared_tree"] (inventory fleetctl_shared_tree) says so."""
    if not isinstance(params.get("root"), str) or not os.path.isabs(params["root"]):
        raise Refused("no root: the absolute directory the change is confined to")
    root = os.path.realpath(params["root"])
    kind = fs_type(root)
    if is_network_fs(kind) and not params.get("shared_tree"):
        raise Refused("%s is on %s, a network file system: one host's apply would change every host that "
                      "mounts it (set fleetctl_shared_tree: true for this host if that is meant)" % (root, kind))
    return root


def _lexists(path):
    """True when `path` exists as anything, a dangling link included."""
    try:
        dfd, name = _parent(path)
    except FileNotFoundError:
        return False
    try:
        return _lstat(dfd, name) is not None
    finally:
        os.close(dfd)


def _check_pycache(path):
    """Raise UnsafePath when the __pycache__ beside `path` exists and is not a directory."""
    dfd, _ = _parent(path)
    try:
        st = _lstat(dfd, "__pycache__")
    finally:
        os.close(dfd)
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise UnsafePath("%s/__pycache__ is a %s" % (os.path.dirname(path), kind_of(st.st_mode)))


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
    unrecorded = _record(state_dir, entry, APPLIED, params.get("reason"))
    if unrecorded:
        return {"ok": False, "change_id": cid, "error": "validated, but the change could not be committed"
                + _STILL_PENDING % unrecorded}
    return {"ok": True, "change_id": cid, "pruned": prune(state_dir)}


def _restore(f, tag, data=None):
    """Put ledger file entry `f` back to before_sha256: a link to its old target, a file from
    `data` or its backup; verify the result."""
    if f.get("kind") == "link":
        before = f["before_sha256"]
        set_link(f["path"], before[len("link:"):] if before else None, tag)
        if _state(f) != before:
            raise OSError("%s: link after restore is not %s" % (f["path"], before))
        return
    data = read_file(f["backup"]) if data is None else data
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
    check_entry(entry, state_dir)
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
        check_entry(entry, state_dir)
        actions, unknown = [], []
        for f in entry["files"]:
            remove_tmp(f["path"], (cid, cid + "-rb"))
            cur = _state(f)
            if cur == f["before_sha256"]:
                action = "untouched"
            elif cur == f["after_sha256"]:
                try:
                    _restore(f, cid + "-rb")
                    action = "restored"
                except (OSError, UnsafePath) as e:
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


def record_hashes(paths, state_dir, ident, location):
    """{path: sha256_file(path)} for real paths `paths`, each file read only when its identity
    (size, mtime_ns, ctime_ns, inode; lstat) is not the one the record cache `ident` holds
    (state_dir/scan-cache, a scancache.Store), which is then refreshed (files changed in the
    last RECORD_RACY_S seconds left out). A cache that cannot be used costs only the reads."""
    store = scancache.Store(RECORD_CACHE_KEY, os.path.join(state_dir, "scan-cache"))
    try:
        old, _ = store.load(ident, "record")
        settled = time.time_ns() - int(RECORD_RACY_S * 1e9)
        out, new = {}, {}
        for path in paths:
            try:
                st = os.lstat(path)
            except OSError:
                st = None
            ident_now = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino] if st and stat.S_ISREG(st.st_mode) else None
            kept = old.get(path)
            if ident_now is not None and isinstance(kept, list) and len(kept) == 5 and kept[:4] == ident_now \
                    and isinstance(kept[4], str):
                out[path] = kept[4]
            else:
                out[path] = sha256_file(path)
            if ident_now is not None and st.st_ctime_ns < settled and out[path] and not out[path].startswith("<"):
                new[path] = ident_now + [out[path]]
        if new != old:
            try:
                store.save(ident, location, new, "record")
            except OSError:
                pass  # an optimisation: the answer stands
        return out
    finally:
        store.close()


def _record_problems(location, dist_name, explained, state_dir):
    """Files of distribution `dist_name` in `location` whose sha256 differs from its RECORD
    (sha256=<urlsafe b64, no padding>), minus files whose hex sha256 is `explained[realpath]`;
    hashes come through record_hashes (cached by file identity in `state_dir`)."""
    from importlib import metadata

    want = re.sub(r"[-_.]+", "-", dist_name).lower()
    dist = next((d for d in metadata.distributions(path=[location])
                 if re.sub(r"[-_.]+", "-", d.metadata["Name"] or "").lower() == want), None)
    if dist is None:
        return None, "no %s distribution in %s" % (dist_name, location)
    out = []
    hashed = [(pp, os.path.realpath(str(dist.locate_file(pp)))) for pp in dist.files or []
              if pp.hash is not None and pp.hash.mode == "sha256"]
    hashes = record_hashes([path for _, path in hashed], state_dir, "%s|%s" % (location, want), location)
    for pp, path in hashed:
        cur = hashes[path]
        if cur is None:
            out.append({"path": path, "problem": "missing"})
            continue
        if cur.startswith("<"):  # a FIFO, device, socket or link: never read
            out.append({"path": path, "problem": "skipped, not read: " + cur[1:-1]})
            continue
        b64 = base64.urlsafe_b64encode(bytes.fromhex(cur)).rstrip(b"=").decode()
        if b64 != pp.hash.value and explained.get(path) != cur:
            out.append({"path": path, "problem": "modified outside fleetctl"})
    return out, None


def _rmtree(dfd, name):
    """Remove directory entry `name` of open directory `dfd` and everything below it, never
    following a symlink (a link is removed itself)."""
    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dfd)
        return
    sub = os.open(name, _DIR, dir_fd=dfd)
    try:
        for entry in os.listdir(sub):
            _rmtree(sub, entry)
    finally:
        os.close(sub)
    os.rmdir(name, dir_fd=dfd)


def _remove_under(state_dir, rel):
    """Remove state_dir/rel (rel: "backups/<cid>" or "kernels/<name>/<key>") if it is there,
    walking from the state dir without following links. Returns the path removed, or None."""
    parts = rel.split("/")
    dfd = _state_fd(state_dir, create=False)
    if dfd is None:
        return None
    try:
        for part in parts[:-1]:
            nxt = os.open(part, _DIR, dir_fd=dfd)
            os.close(dfd)
            dfd = nxt
        _rmtree(dfd, parts[-1])
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
        if files and (e["state"] == ROLLED_BACK or superseded) and _CHANGE_ID.match(e["change_id"]):
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


def status(params, state_dir):
    """{location?, dist: "sglang"}: ledger summary, drift of applied changes, RECORD differences.

    changes: [{change_id, playbook, install, time, operator, state, reason, files: [path]}] (last state);
    drift: [{change_id, path, problem: "drift: reverted or reinstalled"}] for applied changes whose
    file no longer has after_sha256; modified: [{path, problem}] for files of the installed
    distribution (dist-info RECORD) that differ and no applied change explains; record_error;
    kernels: {name: active build key} from the `kernels/<name>/current` links; space: space_used().
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
        modified, err = _record_problems(params["location"], params.get("dist", "sglang"), explained, state_dir)
    kernels = {os.path.basename(os.path.dirname(c)): os.readlink(c)
               for c in sorted(glob.glob(os.path.join(state_dir, "kernels", "*", "current")))}
    return {"ok": True, "changes": summary, "drift": drift, "modified": modified, "record_error": err,
            "kernels": kernels, "space": space_used(state_dir)}


def compile_check(params, state_dir):
    """params: {paths: [str]}. Compile each file with this interpreter (run the probe under the
    interpreter that serves SGLang, so its grammar is the one that counts).
    Returns {"ok": true, "problems": ["path:line: message"]}; touches nothing."""
    problems = []
    for path in params["paths"]:
        text = read_file(path)
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
