"""Entry program (not a probe): run a command in a container's namespaces and cgroups with no more
uid, gid or capabilities than the container's process has (`fleetctl_container_exec: nsenter`,
review N1).

Run by the host's python3 on root's PATH (checked by trust.GUARD) as `python3 -I -S -c SOURCE
PID START UID GID -- ARGV...` (connection/command.py container_entry), before anything of the
container runs:
1. /proc/PID is opened once (a directory fd: every later read is of that process) and its
   namespaces that differ from ours are opened (nsenter(1)'s order: user first, mount last); then
   PID is checked to be the process the facts probe saw (START: field 22 of /proc/PID/stat, its
   start time), so a reused pid cannot redirect the entry;
2. this process forks: the parent stays in the host's namespaces and cgroups and only waits
   (TERM, INT and HUP forwarded), exiting with the child's status; the child joins every cgroup
   of PID (cgroup.procs of each hierarchy, host paths from /proc/self/mountinfo: its device
   controller and limits apply), enters the namespaces and forks again (a pid namespace takes
   effect for children), the middle process only waiting in turn;
3. the last child clears supplementary groups, sets the real, effective and saved gid and uid to
   GID and UID (translated through PID's uid_map and gid_map when its user namespace was
   entered), drops from its bounding set every capability PID's bounding set lacks (CapBnd,
   proc(5)), clears the ambient and inheritable sets, sets no_new_privs, and checks all of it by
   system call (capget, prctl: never the container's /proc); a root target then holds after exec
   exactly the capabilities its own bounding set allows, a non-root one none;
4. it execs ARGV (a path resolved in the container's root file system: what runs is the
   container's own file, with the container's ids and capabilities, but not its seccomp filter
   or LSM label: the report says so).

Once a namespace of the target is entered, nothing may be imported or read by path (the
container's files would answer): every module is imported first, the import system is emptied
and every failure is an os.write and os._exit(125), never a traceback (which opens files and
imports modules). util-linux nsenter cannot do step 3 for a root target (`-S 0` keeps every
capability), and a setpriv run after it would be the container's own binary (or the host's,
loading the container's libraries) run as full host root. Any failure is exit 125 with
`fleetctl-enter: WHY` on stderr; nothing of the container ran. Stdlib only, Python 3.8+, Linux.
"""

import os
import signal
import struct
import sys

# setns(2) nstype per /proc/PID/ns entry, in the order entered (user first: it grants the rights
# to enter the rest; mount last: it changes the root every later path is resolved in)
CLONE = (("user", 0x10000000), ("cgroup", 0x02000000), ("ipc", 0x08000000), ("uts", 0x04000000),
         ("net", 0x40000000), ("pid", 0x20000000), ("time", 0x00000080), ("mnt", 0x00020000))
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 38, 47, 4
PR_CAPBSET_READ, PR_GET_NO_NEW_PRIVS, PR_CAP_AMBIENT_IS_SET = 23, 39, 1
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
FAILED = 125


def fail(why):
    """Say `why` on stderr and exit FAILED, with nothing that imports or opens a file."""
    try:
        os.write(2, ("fleetctl-enter: %s\n" % (why,)).encode("utf-8", "replace"))
    finally:
        os._exit(FAILED)


def start_time(pid, proc_fd=None):
    """Field 22 of /proc/PID/stat (starttime, clock ticks since boot: proc(5)), as text; read
    through `proc_fd` (an open /proc/PID directory) when given."""
    text = _read_at(proc_fd, "stat") if proc_fd is not None else _read_at(None, "/proc/%d/stat" % pid)
    return text.rsplit(")", 1)[1].split()[19]


def _read_at(dir_fd, name):
    """The text of file `name` (relative to directory fd `dir_fd`, or a path when None)."""
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        chunks = []
        while True:
            b = os.read(fd, 65536)
            if not b:
                return b"".join(chunks).decode("utf-8", "replace")
            chunks.append(b)
    finally:
        os.close(fd)


def status_fields(text):
    """{name: value} of /proc/PID/status text (proc(5))."""
    return dict((k, v.strip()) for k, _, v in (line.partition(":") for line in text.splitlines()))


def inside_id(map_text, outside):
    """The id in a user namespace of id `outside` (as the reader sees it), from that namespace's
    uid_map or gid_map text (user_namespaces(7): "inside outside count" per line); None when
    unmapped."""
    for line in map_text.splitlines():
        f = line.split()
        if len(f) == 3 and int(f[1]) <= outside < int(f[1]) + int(f[2]):
            return int(f[0]) + outside - int(f[1])
    return None


def cgroup_targets(cgroup_text, mountinfo_text):
    """[path of cgroup.procs] that put a process in the cgroups that `cgroup_text`
    (/proc/PID/cgroup: "id:controllers:path", cgroups(7)) names, each in the hierarchy mounted
    as `mountinfo_text` (/proc/self/mountinfo, proc(5)) lists it: cgroup2 for id 0, else the
    cgroup (v1) mount whose super options hold the same controllers or name=. Raises
    ValueError for a hierarchy that is not mounted."""
    mounts = []
    for line in mountinfo_text.splitlines():
        left, _, right = line.partition(" - ")
        f, r = left.split(), right.split()
        if len(f) > 4 and len(r) > 2 and r[0] in ("cgroup", "cgroup2"):
            opts = set(r[2].split(","))
            mounts.append((r[0], opts, f[3], f[4]))
    out = []
    for line in cgroup_text.splitlines():
        hid, ctrls, path = (line.split(":", 2) + ["", ""])[:3]
        if hid == "0":
            found = [m for m in mounts if m[0] == "cgroup2"]
        else:
            want = set(c for c in ctrls.split(",") if c)
            found = [m for m in mounts if m[0] == "cgroup" and want <= m[1]]
        if not found:
            raise ValueError("cgroup hierarchy %r is not mounted here" % line)
        _, _, root, point = found[0]
        rel = path[len(root):] if root != "/" and path.startswith(root) else path
        out.append(os.path.join(point, rel.lstrip("/"), "cgroup.procs"))
    return out


def _caps(libc, ctypes, set_to=None):
    """(effective, permitted, inheritable) bitmasks of this thread by capget(2); with `set_to`
    (the same triple), capset(2) them first. Version 3 headers (64 capability bits)."""
    head = ctypes.create_string_buffer(struct.pack("Ii", _LINUX_CAPABILITY_VERSION_3, 0))
    if set_to is not None:
        e, p, i = set_to
        data = ctypes.create_string_buffer(struct.pack("IIIIII", e & 0xffffffff, p & 0xffffffff, i & 0xffffffff,
                                                       e >> 32, p >> 32, i >> 32))
        if libc.capset(head, data) != 0:
            fail("capset: %s" % os.strerror(ctypes.get_errno()))
    data = ctypes.create_string_buffer(24)
    if libc.capget(head, data) != 0:
        fail("capget: %s" % os.strerror(ctypes.get_errno()))
    e0, p0, i0, e1, p1, i1 = struct.unpack("IIIIII", data.raw)
    return e0 | e1 << 32, p0 | p1 << 32, i0 | i1 << 32


def drop(libc, ctypes, uid, gid, bounding, last_cap):
    """Step 3 of the module docstring, in this (the last child) process, checked by system
    call afterwards."""
    try:
        os.setgroups([])
    except PermissionError:
        pass  # a user namespace whose setgroups is denied: then there must be none to drop
    os.setresgid(gid, gid, gid)
    if os.getgroups() not in ([], [gid]):
        fail("cannot clear the supplementary groups %s" % os.getgroups())
    for cap in range(last_cap + 1):
        if not bounding >> cap & 1 and libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            fail("dropping capability %d: %s" % (cap, os.strerror(ctypes.get_errno())))
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    eff = _caps(libc, ctypes)[0] & bounding
    _caps(libc, ctypes, (eff, eff, 0))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        fail("no_new_privs: %s" % os.strerror(ctypes.get_errno()))
    os.setresuid(uid, uid, uid)
    eff, perm, inh = _caps(libc, ctypes)
    if (os.getresuid() != (uid,) * 3 or os.getresgid() != (gid,) * 3 or libc.prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0) != 1
            or inh or (eff | perm) & ~bounding or (uid != 0 and (eff or perm))
            or any(libc.prctl(PR_CAPBSET_READ, c, 0, 0, 0) == 1 for c in range(last_cap + 1) if not bounding >> c & 1)
            or any(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_IS_SET, c, 0, 0) == 1 for c in range(last_cap + 1))):
        fail("the dropped credentials are not what was asked (uid %d gid %d caps %x/%x/%x)" % (uid, gid, eff, perm, inh))


def _seal():
    """Empty the import system, and make an uncaught exception an exit, not a traceback: from
    here on nothing may be read by path (the container's files would answer)."""
    sys.meta_path[:] = []
    sys.path_hooks[:] = []
    sys.path[:] = []
    sys.path_importer_cache.clear()
    sys.excepthook = lambda t, v, tb: fail("%s: %s" % (t.__name__, v))


def _wait(child):
    """Wait for `child`, forwarding TERM, INT and HUP to it, and exit with its status (128 + the
    signal that killed it)."""
    def forward(sig, _frame):
        try:
            os.kill(child, sig)
        except OSError:
            pass
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    _, status = os.waitpid(child, 0)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def main(argv):
    """argv: PID START UID GID -- ARGV... (see the module docstring)."""
    import ctypes  # here, not at the top: the facts probe imports this module for cgroup_targets
    if len(argv) < 6 or argv[4] != "--":
        fail("usage: PID START UID GID -- ARGV...")
    pid, start, uid, gid, prog = int(argv[0]), argv[1], int(argv[2]), int(argv[3]), argv[5:]
    libc = ctypes.CDLL(None, use_errno=True)
    fds = []
    try:
        proc_fd = os.open("/proc/%d" % pid, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        for name, flag in CLONE:
            try:
                if os.readlink("/proc/self/ns/" + name) == os.readlink("ns/" + name, dir_fd=proc_fd):
                    continue
            except FileNotFoundError:
                continue  # a kernel without this namespace type
            fds.append((name, flag, os.open("ns/" + name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=proc_fd)))
        bounding = int(status_fields(_read_at(proc_fd, "status"))["CapBnd"], 16)
        procs = cgroup_targets(_read_at(proc_fd, "cgroup"), _read_at(None, "/proc/self/mountinfo"))
        if any(n == "user" for n, _, _ in fds):
            uid = inside_id(_read_at(proc_fd, "uid_map"), uid)
            gid = inside_id(_read_at(proc_fd, "gid_map"), gid)
            if uid is None or gid is None:
                fail("the process's uid or gid is not mapped in its user namespace")
        last_cap = int(_read_at(None, "/proc/sys/kernel/cap_last_cap"))
        if start_time(pid, proc_fd) != start:  # last: all read above is that process's
            fail("pid %d is no longer the process the facts probe saw" % pid)
    except (OSError, ValueError, IndexError, KeyError) as e:
        fail("reading process %d: %s" % (pid, e))
    _seal()
    try:
        child = os.fork()
        if child:
            _wait(child)  # the parent: in the host's namespaces and cgroups
        for path in procs:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
                os.write(fd, b"%d\n" % os.getpid())
                os.close(fd)
            except OSError as e:
                fail("joining cgroup %s: %s" % (path, e.strerror))
        for name, flag, fd in fds:
            if libc.setns(fd, flag) != 0:
                fail("entering the %s namespace of pid %d: %s" % (name, pid, os.strerror(ctypes.get_errno())))
            os.close(fd)
        child = os.fork()
        if child:
            _wait(child)
        drop(libc, ctypes, uid, gid, bounding, last_cap)
        os.chdir("/")
        os.execv(prog[0], prog)
    except BaseException as e:  # noqa: B036 (anything at all: an exit, never a traceback)
        fail("%s: %s" % (type(e).__name__, e))


if __name__ == "__main__":
    main(sys.argv[1:])
