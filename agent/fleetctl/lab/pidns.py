"""PID namespaces (pid_namespaces(7)) read from /proc: a process's children, its pid in each
namespace, the members of a lab host's namespace.

All pids here are as this machine's root PID namespace sees them, unless named `nspid`."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

# ioctl_ns(2): NS_GET_PARENT = _IO(0xb7, 0x2), a new fd for the parent of a PID namespace
NS_GET_PARENT = 0xB702


def children(pid: int) -> list[int]:
    """Pids of `pid`'s children, from /proc/PID/task/PID/children (proc(5)), else from the
    PPid of every process."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        if not Path(f"/proc/{pid}").exists():
            return []
    out = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d))
        except (OSError, IndexError, ValueError):
            pass
    return out


def nspids(pid: int) -> list[int] | None:
    """The `NSpid:` line of /proc/PID/status (proc(5)): the process's pid in each PID namespace
    from this one down to its own, so its length is the namespace's depth + 1; None if gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return [int(x) for x in line.split()[1:]]
    except OSError:
        pass
    return None


def in_pidns(entry: str, namespaces: set[tuple[int, int]]) -> bool:
    """Whether /proc/ENTRY is a process (not a zombie) in one of `namespaces` ((st_dev, st_ino)
    of a /proc/PID/ns/pid link)."""
    if not entry.isdigit():
        return False
    try:
        st = os.stat(f"/proc/{entry}/ns/pid")
    except OSError:
        return False
    return (st.st_dev, st.st_ino) in namespaces


def pidns_members(init_pid: int) -> list[int]:
    """Pids (root view, ascending) of every live process in the PID namespace whose init is
    `init_pid` (its /proc/PID/ns/pid is the init's), and in PID namespaces nested in it (a
    container on the host: its NS_GET_PARENT chain, ioctl_ns(2), reaches the init's): what the
    host sees in its /proc. The init itself is included; zombies are not (their ns links are
    gone). [] if the init is gone."""
    try:
        target = os.stat(f"/proc/{init_pid}/ns/pid")
    except OSError:
        return []
    depth = len(nspids(init_pid) or [])
    out = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            st = os.stat(f"/proc/{d}/ns/pid")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
            out.append(int(d))
            continue
        levels = len(nspids(int(d)) or []) - depth
        if depth and levels > 0:
            try:
                fd = os.open(f"/proc/{d}/ns/pid", os.O_RDONLY)
            except OSError:
                continue
            try:
                for _ in range(levels):
                    parent = fcntl.ioctl(fd, NS_GET_PARENT)
                    os.close(fd)
                    fd = parent
                st = os.fstat(fd)
            except OSError:
                continue
            finally:
                os.close(fd)
            if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
                out.append(int(d))
    return sorted(out)


def root_pid(init_pid: int, nspid: int) -> int | None:
    """The root-view pid of the process that is `nspid` inside the init's PID namespace (as
    its own /proc, `$!` or a pid file there say), from NSpid; None if there is none."""
    depth = len(nspids(init_pid) or [])
    for pid in pidns_members(init_pid):
        ns = nspids(pid)
        if ns and depth and len(ns) >= depth and ns[depth - 1] == nspid:
            return pid
    return None


def is_pidns_init(pid: int) -> bool:
    """Whether `pid` is PID 1 of a PID namespace below the root one (NSpid ends in 1)."""
    ns = nspids(pid)
    return bool(ns) and len(ns) > 1 and ns[-1] == 1
