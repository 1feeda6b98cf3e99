"""The kbuild probe's publish action (stdlib only, Python 3.8+): a build that passed its reference
test copied from the private state dir to PUBLIC/NAME/<key> (root, 0755/0644, no links), where an
unprivileged server process can read it, and PUBLIC/route-evidence/<uid> made for the servers'
route hook (evidence.py); every path reached from / without following a link."""

from __future__ import annotations

import errno
import os
import stat

from .. import evidence, safefs
from . import copy


_DIR = safefs.OPEN_DIR


class _Refused(Exception):
    """publish() will not publish (a link in the build, a foreign directory, ...): the message says why."""


def publish(params: dict) -> dict:
    """Publish a build that passed its reference test where the server process can read it.

    params: {build_dir: the private build STATE/kernels/NAME/<key> (src/, build/, PASSED),
    public_dir: PUBLIC/NAME/<key>, untested: the module path in build_dir of a build not tested
    yet (optional: then build_dir has no PASSED, the copy is made without one, and the reference
    test runs on it, as an unprivileged uid that cannot change it; mark writes PASSED there)}. PUBLIC (public_dir's grandparent) and PUBLIC/NAME are made
    root 0755 when missing and must be root's and writable by nobody else; every path is
    reached from / without following a link. When public_dir/PASSED exists the copy is reused
    (published copies are never changed), after checking that everything in it is root's, not
    group/other-writable and no link. Else src/ and build/ are copied into
    PUBLIC/NAME/.<key>.<random> (files root:root 0644, 0755 where the owner may execute; dirs
    0755; a symbolic link, FIFO, socket or device anywhere refuses the publish), PASSED written
    there naming the module at its published path (the private PASSED's path with build_dir
    replaced by public_dir), everything fsynced, then renamed to public_dir. Stale .<key>.*
    directories of a killed publish are removed first. Also makes PUBLIC/route-evidence (root,
    0755) and in it route-evidence/<uid> for root and the effective uid of each of
    params["server_pids"] (the servers': evidence.prepare). Owner root:root when run as root (as on the hosts), else the
    running user's.
    Returns {"ok": true, "published": public_dir, "module_path": the published module,
    "reused": bool, "evidence_dir"} or {"ok": false, "error": why} (nothing published)."""
    bdir = os.path.normpath(os.path.abspath(params["build_dir"]))
    pdir = os.path.normpath(params["public_dir"])
    pkg_dir, key = os.path.split(pdir)
    public, name = os.path.split(pkg_dir)
    if not os.path.isabs(pdir) or key.startswith(".") or not key or not name:
        return {"ok": False, "error": "public_dir %r is not an absolute PUBLIC/NAME/KEY" % params["public_dir"]}
    try:
        top = _open_path(os.path.dirname(public))
        try:
            pub = _subdir(top, os.path.basename(public), 0o755, public)
        finally:
            os.close(top)
        try:
            evidence_dir = evidence.prepare(pub, params.get("server_pids"), public)
            nfd = _subdir(pub, name, 0o755, pkg_dir)
        finally:
            os.close(pub)
        try:
            reused, module = _publish_into(nfd, bdir, pdir, key, params.get("untested"))
        finally:
            os.close(nfd)
    except (_Refused, copy.Refused, evidence.Refused, safefs.UnsafePath, OSError, UnicodeDecodeError) as e:
        return {"ok": False, "error": "not published: %s" % e}
    return {"ok": True, "published": pdir, "module_path": module, "reused": reused, "evidence_dir": evidence_dir}


def _published_module(nfd: int, key: str, pdir: str) -> str:
    """The module path the published copy `key` (in `nfd`) records in PASSED, after
    _check_published; _Refused when it is not a path inside the copy."""
    _check_published(nfd, key, pdir)
    fd = os.open(key, _DIR, dir_fd=nfd)
    try:
        pfd = os.open("PASSED", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)
    try:
        module = os.read(pfd, 1 << 16).decode("utf-8").strip()
    finally:
        os.close(pfd)
    if not module.startswith(pdir + "/"):
        raise _Refused("%s/PASSED names %s, not a module inside it" % (pdir, module))
    return module


def _publish_into(nfd: int, bdir: str, pdir: str, key: str, untested: str | None = None) -> tuple:
    """publish()'s copy into the package dir (open descriptor `nfd`): (reused, published module path).
    `untested`: the private module path of a build not yet tested (no PASSED written; publish())."""
    for entry in os.listdir(nfd):
        if entry.startswith("." + key + "."):
            safefs.rmtree(nfd, entry)
    if safefs.lstat(nfd, key) is not None:
        if _lstat_in(nfd, key, "PASSED") is not None:
            return True, _published_module(nfd, key, pdir)
        safefs.rmtree(nfd, key)  # never published (no PASSED): a leftover nobody trusted
    if untested is None:
        with open(os.path.join(bdir, "PASSED")) as f:
            private_module = f.read().strip()
    else:
        private_module = os.path.normpath(untested)
    if not private_module.startswith(bdir + "/"):
        raise _Refused("%s/PASSED names %s, not a module inside the build" % (bdir, private_module))
    module = pdir + private_module[len(bdir):]
    tmp = ".%s.%s" % (key, os.urandom(8).hex())
    os.mkdir(tmp, 0o700, dir_fd=nfd)
    try:
        tfd = os.open(tmp, _DIR, dir_fd=nfd)
        try:
            sfd = os.open(bdir, _DIR)
            try:
                for part in ("src", "build"):
                    copy.tree(sfd, part, tfd, part, os.path.join(bdir, part), fsync=True)
            finally:
                os.close(sfd)
            if untested is None:
                write_passed(tfd, module)
            _own(tfd, 0o755)
        finally:
            os.close(tfd)
        try:
            os.rename(tmp, key, src_dir_fd=nfd, dst_dir_fd=nfd)
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY) or _lstat_in(nfd, key, "PASSED") is None:
                raise
            safefs.rmtree(nfd, tmp)  # published meanwhile: theirs is reused
            return True, _published_module(nfd, key, pdir)
        os.fsync(nfd)
    except BaseException:
        if safefs.lstat(nfd, tmp) is not None:
            safefs.rmtree(nfd, tmp)
        raise
    return False, module


def write_passed(dfd: int, module: str) -> None:
    """PASSED (the module path) in open directory `dfd`, created O_EXCL|O_NOFOLLOW, root's 0644, synced."""
    fd = os.open("PASSED", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    try:
        os.write(fd, (module + "\n").encode("utf-8"))
        _own(fd, 0o644)
    finally:
        os.close(fd)


def _own(fd: int, mode: int) -> None:
    copy.own(fd, mode, fsync=True)


def _check_published(nfd: int, key: str, pdir: str) -> None:
    """Raise _Refused unless the published copy `key` in `nfd` and everything in it is a
    directory or regular file of root's (this euid's) that no group or other may write."""
    def walk(dfd, where):
        for entry in os.listdir(dfd):
            st = os.stat(entry, dir_fd=dfd, follow_symlinks=False)
            _trusted(st, os.path.join(where, entry))
            if stat.S_ISDIR(st.st_mode):
                sub = os.open(entry, _DIR, dir_fd=dfd)
                try:
                    walk(sub, os.path.join(where, entry))
                finally:
                    os.close(sub)
    _trusted(os.stat(key, dir_fd=nfd, follow_symlinks=False), pdir)
    fd = os.open(key, _DIR, dir_fd=nfd)
    try:
        walk(fd, pdir)
    finally:
        os.close(fd)


def _trusted(st, path: str) -> None:
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        kind = "symbolic link" if stat.S_ISLNK(st.st_mode) else "special file"
        raise _Refused("%s in the published build is a %s" % (path, kind))
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise _Refused("%s in the published build is owned by uid %d or writable by others (mode %o): "
                       "not reusing it" % (path, st.st_uid, stat.S_IMODE(st.st_mode)))


def _open_path(path: str) -> int:
    """A descriptor of existing directory `path` (absolute), reached from / one component at a
    time without following a link (safefs.open_dir; _Refused names the component that is one)."""
    try:
        return safefs.open_dir(path)
    except safefs.UnsafePath as e:
        raise _Refused(str(e))


def _subdir(dfd: int, name: str, mode: int, path: str) -> int:
    """A descriptor of directory `name` in `dfd` (its path `path`), made root's with `mode` when
    missing. An existing one must be a directory (never a link) of root's (this euid's) that no
    group or other may write."""
    try:
        os.mkdir(name, mode, dir_fd=dfd)
        fd = os.open(name, _DIR, dir_fd=dfd)
        _own(fd, mode)
        os.fsync(dfd)
        return fd
    except FileExistsError:
        pass
    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        raise _Refused("%s is not a directory (%s)" % (path, "a symbolic link" if stat.S_ISLNK(st.st_mode)
                                                       else "mode %o" % st.st_mode))
    if st.st_uid != os.geteuid():
        raise _Refused("%s is owned by uid %d, not root: not publishing there" % (path, st.st_uid))
    if st.st_mode & 0o022:
        raise _Refused("%s is writable by group or others (mode %o): not publishing there"
                       % (path, stat.S_IMODE(st.st_mode)))
    return os.open(name, _DIR, dir_fd=dfd)


def _lstat_in(dfd: int, name: str, inner: str):
    """lstat of `inner` in directory `name` of `dfd` (None when either is missing or `name` is no directory)."""
    try:
        fd = os.open(name, _DIR, dir_fd=dfd)
    except OSError:
        return None
    try:
        return safefs.lstat(fd, inner)
    finally:
        os.close(fd)
