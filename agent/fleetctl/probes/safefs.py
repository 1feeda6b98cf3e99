"""Safe file primitives for root on a host: a walk from / that never follows a link, regular
files read only when they are regular files, atomic replacement, confinement to a directory.

Stdlib only (Python 3.8+), loaded in a probe bundle before the probes that import it (change,
ledger, record, scancache). Every path is absolute and normalised; a directory is reached from /
one component at a time with O_DIRECTORY|O_NOFOLLOW relative to the previous one (open_dir), so
a symlink, FIFO or device planted on the way raises UnsafePath instead of being followed or
opened. Writes go to a temp file with an unguessable name beside the target, fsynced, renamed
with directory descriptors, the directory fsynced (atomic_write, set_link).
"""

import errno
import fnmatch
import glob
import hashlib
import os
import pwd
import re
import stat


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
OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_KINDS = ((stat.S_ISLNK, "symlink"), (stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"),
          (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"))


# what a login without root should set to be root on the host (README "Become"; -K: the become password)
BECOME_FIX = "set ansible_become: true for this host (and pass -K if sudo asks for a password)"


def login_name(uid):
    """The login name of `uid` (its passwd entry), else the number as text."""
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OSError):
        return str(uid)


def denied(path, why):
    """The message for a permission this login (the effective uid) lacks on the host: "PATH:
    permission denied to USER (uid N): WHY; BECOME_FIX"."""
    uid = os.geteuid()
    return "%s: permission denied to %s (uid %d): %s; %s" % (path, login_name(uid), uid, why, BECOME_FIX)


def kind_of(mode):
    """"regular file", "symlink", "directory", "FIFO", "socket", "character device" or "block device"."""
    return next((name for test, name in _KINDS if test(mode)), "regular file")


def open_dir(path, create=None):
    """A descriptor of directory `path` (absolute, normalised), reached from / one component at
    a time with O_DIRECTORY|O_NOFOLLOW relative to the previous one, so nothing on the way can
    redirect it. `create`: the mode of missing components (created, chmod'ed to it whatever the
    umask, their parent fsynced); None: a missing one raises FileNotFoundError. Raises
    UnsafePath when a component is a symlink or not a directory, PermissionError (its filename
    the path up to the component this uid may not enter or create) when one is not this uid's."""
    parts = [] if path == "/" else path.split("/")[1:]
    if not path.startswith("/") or os.path.normpath(path) != path or "" in parts:
        raise UnsafePath("%s: not an absolute, normalised path" % path)
    fd, done = os.open("/", OPEN_DIR), ""
    try:
        for part in parts:
            done += "/" + part
            try:
                nfd = os.open(part, OPEN_DIR, dir_fd=fd)
            except FileNotFoundError:
                if create is None:
                    raise
                os.mkdir(part, create, dir_fd=fd)
                nfd = os.open(part, OPEN_DIR, dir_fd=fd)
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
    except PermissionError as e:  # named by the whole path, not its last component
        os.close(fd)
        raise PermissionError(e.errno, e.strerror, done) from None
    except BaseException:
        os.close(fd)
        raise


def parent(path, create=None):
    """(descriptor of the directory holding `path`, its base name): see open_dir."""
    d, name = os.path.split(path)
    if name in ("", ".", ".."):
        raise UnsafePath("%s: not a file path" % path)
    return open_dir(d, create), name


def lstat(dfd, name):
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def open_regular(dfd, name, path, limit=MAX_FILE_BYTES):
    """A read descriptor of regular file `name` in `dfd` (never a link, FIFO or device: those
    raise UnsafePath without being opened, as does one over `limit` bytes); FileNotFoundError
    when missing."""
    st = lstat(dfd, name)
    if st is None:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath("%s is a %s, not a regular file" % (path, kind_of(st.st_mode)))
    fd = os.open(name, OPEN_READ, dir_fd=dfd)
    fst = os.fstat(fd)
    if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino) or fst.st_size > limit:
        os.close(fd)
        raise UnsafePath("%s changed while being opened, or is over %d bytes" % (path, limit))
    return fd


def read_file(path, limit=MAX_FILE_BYTES):
    """The bytes of regular file `path` (see open_regular), at most `limit` (UnsafePath when over)."""
    dfd, name = parent(path)
    try:
        fd = open_regular(dfd, name, path, limit)
    finally:
        os.close(dfd)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UnsafePath("%s is over %d bytes" % (path, limit))
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
        dfd, name = parent(path)
    except (OSError, UnsafePath):
        return None
    try:
        return "link:" + os.readlink(name, dir_fd=dfd)
    except OSError:
        return None
    finally:
        os.close(dfd)


def _tmp_name(name, tag):
    """A temp name beside `name` nobody can guess: the tag and 64 random bits (os.urandom, as
    secrets.token_hex reads them; importing secrets cost a probe's start 2.4 ms)."""
    return ".%s.fleetctl-%s.%s.tmp" % (name, tag, os.urandom(8).hex())


def _is_tmp(entry, name, tag):
    return re.match(r"\.%s\.fleetctl-%s(\.[0-9a-f]{16})?\.tmp\Z" % (re.escape(name), re.escape(tag)), entry)


def remove_tmp(path, tags):
    """Remove the temp files apply or a restore left beside `path` for any of `tags`
    (unlinking a planted symlink removes the link only). Returns their names."""
    try:
        dfd, name = parent(path)
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
    dfd, name = parent(path)
    try:
        st = lstat(dfd, name)
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


# atomic_write's `expect` for a file that must not exist yet
ABSENT = object()


def atomic_write(path, data, tag, expect=None):
    """Replace regular file `path` by `data` (bytes) atomically, never through a symlink: the
    parent reached by open_dir, a temp file beside it with an unguessable name opened
    O_CREAT|O_EXCL|O_NOFOLLOW, fsync, rename with directory descriptors, fsync the directory.
    Keeps the file's owner, mode and extended attributes (0644 and the caller's when it is
    missing). `expect`: the sha256 the file must still have right before the rename (review L6:
    a `pip install` that rewrote it meanwhile is not clobbered), or ABSENT: it must still not
    exist (a file the change creates); else ChangedMeanwhile, nothing replaced.
    Raises UnsafePath when `path` is a symlink or anything but a regular file."""
    dfd, name = parent(path)
    try:
        st = lstat(dfd, name)
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
                    src = open_regular(dfd, name, path)
                    try:
                        _copy_xattrs(src, fd)
                    finally:
                        os.close(src)
                os.fsync(fd)
            finally:
                os.close(fd)
            if expect is ABSENT:
                if lstat(dfd, name) is not None:
                    raise ChangedMeanwhile(errno.EEXIST, "made on the host while being applied, left as it is", path)
            elif expect is not None:
                src = open_regular(dfd, name, path)
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


def remove_file(path):
    """Remove regular file `path` (never through a symlink; a missing one is fine), the
    directory fsynced. Raises UnsafePath when it is anything but a regular file."""
    dfd, name = parent(path)
    try:
        st = lstat(dfd, name)
        if st is None:
            return
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath("%s is a %s: fleetctl does not remove it" % (path, kind_of(st.st_mode)))
        os.unlink(name, dir_fd=dfd)
        os.fsync(dfd)
    finally:
        os.close(dfd)


def drop_pycache(path):
    """Remove the module's stale bytecode: __pycache__/<stem>.*.pyc next to `path` (a symlinked
    __pycache__ raises UnsafePath)."""
    dfd, name = parent(path)
    try:
        try:
            pfd = os.open("__pycache__", OPEN_DIR, dir_fd=dfd)
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


def lexists(path):
    """True when `path` exists as anything, a dangling link included."""
    try:
        dfd, name = parent(path)
    except FileNotFoundError:
        return False
    try:
        return lstat(dfd, name) is not None
    finally:
        os.close(dfd)


def check_pycache(path):
    """Raise UnsafePath when the __pycache__ beside `path` exists and is not a directory."""
    dfd, _ = parent(path)
    try:
        st = lstat(dfd, "__pycache__")
    finally:
        os.close(dfd)
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise UnsafePath("%s/__pycache__ is a %s" % (os.path.dirname(path), kind_of(st.st_mode)))


MAX_TREE_ENTRIES = 1 << 20  # entries rmtree removes at most under one name


def rmtree(dfd, name, limit=MAX_TREE_ENTRIES):
    """Remove entry `name` of open directory `dfd` and everything below it, never following a
    symlink (a link is removed itself), with an explicit stack of directory fds (no recursion: a
    tree of any depth cannot exhaust Python's stack, review R4-5) and at most `limit` entries
    (then UnsafePath: what is left stays). Raises FileNotFoundError when `name` is missing,
    UnsafePath, OSError."""
    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dfd)
        return
    stack, seen = [], 0  # [(parent fd, name, fd, names left)]
    try:
        fd = os.open(name, OPEN_DIR, dir_fd=dfd)
        stack.append((dfd, name, fd, os.listdir(fd)))
        while stack:
            parent, entry, fd, names = stack[-1]
            if not names:
                stack.pop()
                os.close(fd)
                os.rmdir(entry, dir_fd=parent)
                continue
            child = names.pop()
            seen += 1
            if seen > limit:
                raise UnsafePath("more than %d entries under %s: not all removed" % (limit, name))
            if stat.S_ISDIR(os.stat(child, dir_fd=fd, follow_symlinks=False).st_mode):
                sub = os.open(child, OPEN_DIR, dir_fd=fd)
                stack.append((fd, child, sub, os.listdir(sub)))
            else:
                os.unlink(child, dir_fd=fd)
    finally:
        for _, _, fd, _ in stack:
            os.close(fd)
