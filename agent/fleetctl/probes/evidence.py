"""PUBLIC/route-evidence: where route-verify-attention's hook writes each server process's routing
evidence (stdlib only, Python 3.8+; review R4-5). Root's, mode 0755: no other user may make an
entry in it, so none can take a server's directory first or plant a deep tree there; in it one
directory per server effective uid, that uid's, 0755, made by root where root knows the servers'
pids: kbuild's publish (every deploy) and the route check before a change (every
route-verify-attention apply and routed deploy). The hook only writes into its own uid's. When
the last kernel change is rolled back (no package's `current` link left), the change probe's
rollback removes it (remove)."""

import os
import stat

from . import runas, safefs

EVIDENCE = "route-evidence"


class Refused(Exception):
    """PUBLIC/route-evidence cannot be made so (not a directory, another owner's): says why."""


def uids(pids):
    """0 and the effective uid (runas.ids_of: the one the hook writes under) of each of `pids`
    still running, sorted; pids that are no positive ints are skipped."""
    out = {0}
    for pid in pids or []:
        if type(pid) is int and pid > 0:
            ids = runas.ids_of(pid)
            if ids is not None:
                out.add(ids[0])
    return sorted(out)


def prepare(pub, pids, path):
    """Make PUBLIC/route-evidence in open directory `pub` (PUBLIC, whose path is `path`) and in it
    `<uid>` for each of uids(pids) (module docstring). An existing route-evidence must be a
    directory of root's (this euid's), never a link; its mode is set to 0755 (earlier releases
    made it 01777). A `<uid>` entry that is not a directory of that uid with mode 0755 (a link, a
    file, another user's from the 01777 days) is removed with all in it (safefs.rmtree: no link
    followed, bounded) and made again. Returns the route-evidence path. Raises Refused, OSError,
    safefs.UnsafePath."""
    here = os.path.join(path, EVIDENCE)
    try:
        os.mkdir(EVIDENCE, 0o755, dir_fd=pub)
    except FileExistsError:
        pass
    st = os.stat(EVIDENCE, dir_fd=pub, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "uid %d" % st.st_uid
        raise Refused("%s is not a directory of uid %d (%s)" % (here, os.geteuid(), what))
    ev = os.open(EVIDENCE, safefs.OPEN_DIR, dir_fd=pub)
    try:
        os.fchmod(ev, 0o755)
        for uid in uids(pids):
            name = str(uid)
            st = safefs.lstat(ev, name)
            if st is not None and stat.S_ISDIR(st.st_mode) and st.st_uid == uid and stat.S_IMODE(st.st_mode) == 0o755:
                continue
            if st is not None:
                safefs.rmtree(ev, name)
            os.mkdir(name, 0o700, dir_fd=ev)
            fd = os.open(name, safefs.OPEN_DIR, dir_fd=ev)
            try:
                if os.geteuid() == 0:
                    os.fchown(fd, uid, -1)
                os.fchmod(fd, 0o755)
            finally:
                os.close(fd)
    finally:
        os.close(ev)
    return here


def remove(public):
    """Remove PUBLIC/route-evidence (`public`: PUBLIC's absolute path) and what is in it, reached
    from / without following a link (safefs.open_dir, safefs.rmtree: bounded, no link followed):
    the last kernel change was rolled back, nothing routes any more. Returns its path when it was
    removed, None when there was none, or "not removed: WHY"."""
    try:
        pub = safefs.open_dir(public)
    except FileNotFoundError:
        return None
    except (OSError, safefs.UnsafePath) as e:
        return "not removed: %s" % e
    try:
        safefs.rmtree(pub, EVIDENCE)
        return os.path.join(public, EVIDENCE)
    except FileNotFoundError:
        return None
    except (OSError, safefs.UnsafePath) as e:
        return "not removed: %s" % e
    finally:
        os.close(pub)
