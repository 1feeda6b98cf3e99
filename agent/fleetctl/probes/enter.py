"""Entry program (not a probe): run a command in a container's namespaces and cgroups with no more
power than the container's process has (`fleetctl_container_exec: nsenter`, review N1).

Run by the host's python3 on root's PATH as `python3 -I -S -c SOURCE PID START UID GID -- ARGV...`
(connection/command.py container_entry), before anything of the container runs:
1. the namespaces of process PID that differ from ours are opened (nsenter(1)'s order: user
   first, mount last), then PID is checked to be the process the facts probe saw (START: field
   22 of /proc/PID/stat, its start time), so a reused pid cannot redirect the entry;
2. this process joins every cgroup of PID (cgroup.procs of each hierarchy, host paths from
   /proc/self/mountinfo): its device controller and limits apply;
3. it enters the namespaces and forks (a pid namespace takes effect for children); the parent
   forwards TERM, INT and HUP and exits with the child's status;
4. the child clears supplementary groups, sets the real, effective and saved gid and uid to
   GID and UID (translated through PID's uid_map and gid_map when its user namespace was
   entered), drops from its bounding set every capability PID's bounding set lacks (CapBnd,
   proc(5)), clears the ambient and inheritable sets, sets no_new_privs, and checks
   /proc/self/status says so; a root target then holds after exec exactly the capabilities its
   own bounding set allows, a non-root one none;
5. it execs ARGV (a path resolved in the container's root file system: what runs is the
   container's own file, at the container's power).

util-linux nsenter cannot do step 4 for a root target (`-S 0` keeps every capability), and a
setpriv run after it would be the container's own binary (or the host's, loading the
container's libraries) run as full host root. Any failure is exit 125 with `fleetctl-enter:
WHY` on stderr; nothing of the container ran. Stdlib only, Python 3.8+, Linux.
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
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
FAILED = 125


def fail(why):
    sys.stderr.write("fleetctl-enter: %s\n" % why)
    sys.stderr.flush()
    os._exit(FAILED)


def start_time(pid):
    """Field 22 of /proc/PID/stat (starttime, clock ticks since boot: proc(5)), as text."""
    with open("/proc/%d/stat" % pid) as f:
        return f.read().rsplit(")", 1)[1].split()[19]


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


def _capset_zero_inheritable(libc, keep):
    import ctypes
    """Set effective and permitted to `keep` (a bitmask) and inheritable to 0 (capset(2), v3)."""
    head = ctypes.create_string_buffer(struct.pack("Ii", _LINUX_CAPABILITY_VERSION_3, 0))
    data = ctypes.create_string_buffer(struct.pack("IIIIII", keep & 0xffffffff, keep & 0xffffffff, 0,
                                                   keep >> 32, keep >> 32, 0))
    if libc.capset(head, data) != 0:
        fail("capset: %s" % os.strerror(ctypes.get_errno()))


def drop(libc, uid, gid, bounding, last_cap):
    """Step 4 of the module docstring, in this (the child) process."""
    import ctypes
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
    with open("/proc/self/status") as f:
        eff = int(status_fields(f.read())["CapEff"], 16)
    _capset_zero_inheritable(libc, eff & bounding)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        fail("no_new_privs: %s" % os.strerror(ctypes.get_errno()))
    os.setresuid(uid, uid, uid)
    with open("/proc/self/status") as f:
        st = status_fields(f.read())
    ids = [int(x) for x in st["Uid"].split()] + [int(x) for x in st["Gid"].split()]
    if (ids[:3] != [uid] * 3 or ids[4:7] != [gid] * 3 or st.get("NoNewPrivs") != "1"
            or int(st["CapBnd"], 16) & ~bounding or int(st["CapInh"], 16) or int(st.get("CapAmb", "0"), 16)
            or (uid != 0 and int(st["CapEff"], 16))):
        fail("the dropped credentials are not what was asked: %s" % st)


def main(argv):
    """argv: PID START UID GID -- ARGV... (see the module docstring)."""
    if len(argv) < 6 or argv[4] != "--":
        fail("usage: PID START UID GID -- ARGV...")
    import ctypes  # here, not at the top: the facts probe imports this module for cgroup_targets
    pid, start, uid, gid, prog = int(argv[0]), argv[1], int(argv[2]), int(argv[3]), argv[5:]
    libc = ctypes.CDLL(None, use_errno=True)
    fds = []
    try:
        for name, flag in CLONE:
            try:
                if os.readlink("/proc/self/ns/" + name) == os.readlink("/proc/%d/ns/%s" % (pid, name)):
                    continue
            except FileNotFoundError:
                continue  # a kernel without this namespace type
            fds.append((name, flag, os.open("/proc/%d/ns/%s" % (pid, name), os.O_RDONLY | os.O_CLOEXEC)))
        if start_time(pid) != start:
            fail("pid %d is no longer the process the facts probe saw" % pid)
        with open("/proc/%d/status" % pid) as f:
            bounding = int(status_fields(f.read())["CapBnd"], 16)
        with open("/proc/%d/cgroup" % pid) as f, open("/proc/self/mountinfo") as m:
            procs = cgroup_targets(f.read(), m.read())
        if any(n == "user" for n, _, _ in fds):
            with open("/proc/%d/uid_map" % pid) as f, open("/proc/%d/gid_map" % pid) as g:
                uid, gid = inside_id(f.read(), uid), inside_id(g.read(), gid)
            if uid is None or gid is None:
                fail("the process's uid or gid is not mapped in its user namespace")
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last_cap = int(f.read())
    except (OSError, ValueError, IndexError, KeyError) as e:
        fail("reading process %d: %s" % (pid, e))
    for path in procs:
        try:
            with open(path, "w") as f:
                f.write("%d\n" % os.getpid())
        except OSError as e:
            fail("joining cgroup %s: %s" % (os.path.dirname(path), e.strerror))
    for name, flag, fd in fds:
        if libc.setns(fd, flag) != 0:
            fail("entering the %s namespace of pid %d: %s" % (name, pid, os.strerror(ctypes.get_errno())))
        os.close(fd)
    child = os.fork()
    if child:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda s, _f: os.kill(child, s))
        while True:
            try:
                _, status = os.waitpid(child, 0)
                break
            except InterruptedError:
                continue
        os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
    drop(libc, uid, gid, bounding, last_cap)
    os.chdir("/")
    try:
        os.execv(prog[0], prog)
    except OSError as e:
        fail("cannot run %s in the container: %s" % (prog[0], e.strerror))


if __name__ == "__main__":
    main(sys.argv[1:])
