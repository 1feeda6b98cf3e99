"""The kernel room's one checked copy (stdlib only, Python 3.8+): a directory tree copied as root's
files, what another uid left in it treated as hostile. kbuild's build copies a build made by an
unprivileged child back into the private build directory, its test gives the child a copy, and
publish copies a passed build into PUBLIC/NAME/<key>.

Directories and regular files only (a symbolic link, FIFO, socket or device refuses the copy),
never following a link on either side (every name opened relative to its directory's descriptor,
O_NOFOLLOW; files created O_EXCL), each file checked to be the one listed (inode and device),
owned root:root (when run as root) with 0755 for directories and executables, 0644 for the rest,
iteratively (no recursion: any depth), at most MAX_ENTRIES entries and MAX_BYTES bytes."""

from __future__ import annotations

import os
import stat

MAX_ENTRIES = 100_000  # files and directories one copy takes at most
MAX_BYTES = 8 << 30  # bytes one copy takes at most (a CUDA extension with its objects: some 100 MiB)
DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Refused(Exception):
    """The tree is not copied (a link, a device, too much, a file swapped meanwhile): says why."""


def tree(sfd: int, sname: str, dfd: int, dname: str, where: str, fsync: bool = False) -> None:
    """Copy directory `sname` of open directory `sfd` (its path `where`, for messages) as `dname`
    in open directory `dfd` (which must not hold it), by the module docstring's rules; `fsync`:
    each file and directory synced (publish). Raises Refused, OSError; a partial copy is left for
    the caller to remove."""
    left = [MAX_ENTRIES, MAX_BYTES]
    os.mkdir(dname, 0o700, dir_fd=dfd)
    src = os.open(sname, DIR, dir_fd=sfd)
    stack = [(src, os.open(dname, DIR, dir_fd=dfd), where, iter(sorted(os.listdir(src))))]
    try:
        while stack:
            s, d, here, names = stack[-1]
            entry = next(names, None)
            if entry is None:
                stack.pop()
                own(d, 0o755, fsync)
                os.close(s)
                os.close(d)
                continue
            left[0] -= 1
            if left[0] < 0:
                raise Refused("%s: more than %d entries" % (where, MAX_ENTRIES))
            path = os.path.join(here, entry)
            st = os.stat(entry, dir_fd=s, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                os.mkdir(entry, 0o700, dir_fd=d)
                sub = os.open(entry, DIR, dir_fd=s)
                stack.append((sub, os.open(entry, DIR, dir_fd=d), path, iter(sorted(os.listdir(sub)))))
            elif stat.S_ISREG(st.st_mode):
                _file(s, d, entry, st, path, left, fsync)
            else:
                raise Refused("%s is %s: not copied" % (path, "a symbolic link" if stat.S_ISLNK(st.st_mode)
                                                        else "not a regular file or directory"))
    finally:
        for s, d, _, _ in stack:
            os.close(s)
            os.close(d)


def _file(sfd: int, dfd: int, entry: str, st, path: str, left: list, fsync: bool) -> None:
    s = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=sfd)
    try:
        if (os.fstat(s).st_ino, os.fstat(s).st_dev) != (st.st_ino, st.st_dev):
            raise Refused("%s changed while being copied" % path)
        d = os.open(entry, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            while True:
                chunk = os.read(s, 1 << 20)
                if not chunk:
                    break
                left[1] -= len(chunk)
                if left[1] < 0:
                    raise Refused("%s: more than %d bytes" % (path, MAX_BYTES))
                view = memoryview(chunk)
                while view:
                    view = view[os.write(d, view):]
            own(d, 0o755 if st.st_mode & stat.S_IXUSR else 0o644, fsync)
        finally:
            os.close(d)
    finally:
        os.close(s)


def own(fd: int, mode: int, fsync: bool = False) -> None:
    """Give open file or directory `fd` to root:root (when running as root) with `mode` (after
    fchown, which may clear set-id bits), synced when `fsync`."""
    if os.geteuid() == 0:
        os.fchown(fd, 0, 0)
    os.fchmod(fd, mode)
    if fsync:
        os.fsync(fd)
