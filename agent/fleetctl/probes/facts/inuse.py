"""Remote probe helper: the processes that use an install without being one of its servers.

Stdlib only (Python 3.8+), loaded by the facts probe bundle. A process uses an install when
its interpreter is the install's (the same environment: a venv's or conda env's prefix, else the
same interpreter binary; procs.interpreter gives the process's, /proc/PID/exe and argv[0]) or
when it has a file of the install open (/proc/PID/fd, proc(5)) or mapped (/proc/PID/maps: a
shared object of it loaded); an install's files are those under its environment's prefix (a
venv, a conda env) or, for an interpreter's own site directory, under its package directory.
Such a process is named unless it belongs to a server fleetctl identified (procs.find_servers:
the server and every process below it), to this probe (its own pid, its ancestors: the SSH
session that runs it) or to a peer of it (another fleetctl probe inspecting the host at the
same time: peer_probes). What a process runs is said by its command line, redacted (redact.argv),
quoted and bounded (MAX_CMDLINE characters), and at most MAX_PROCESSES are named per install
(with the count of the others): an answer bounded by design, whatever runs on the host.
"""

import os

from . import procs
from .. import redact, runas

MAX_PROCESSES = 8  # processes named per install; the others are counted
MAX_CMDLINE = 400  # characters of a command line kept
MAX_MAP_LINES = 100000  # lines of one /proc/PID/maps read (a process maps a few thousand)
MAX_FDS = 4096  # open files of one process looked at
MAX_RUNNING = 4096  # Python processes whose interpreters are asked about (host.candidates)


def env_root(python):
    """The environment interpreter path `python` belongs to: its prefix (the directory above its
    bin/) when that holds pyvenv.cfg (a venv, PEP 405) or conda-meta/ (a conda env), else None
    (an interpreter's own prefix, such as /usr: shared by far more than one install)."""
    prefix = os.path.dirname(os.path.dirname(python))
    if os.path.isfile(os.path.join(prefix, "pyvenv.cfg")) or os.path.isdir(os.path.join(prefix, "conda-meta")):
        return os.path.realpath(prefix)
    return None


def same_interpreter(a, b):
    """Whether interpreter paths `a` and `b` run the same environment: the same env_root, or,
    outside any env, the same binary (by real path)."""
    ra, rb = env_root(a), env_root(b)
    if ra or rb:
        return ra == rb
    return os.path.realpath(a) == os.path.realpath(b)


def install_files(inst):
    """The directory whose files are install `inst`'s (a discover() entry): its environment
    (env_root of its interpreter), else its package directory (else its location)."""
    sg = inst.get("sglang") or {}
    return env_root(inst["python"]["path"]) or os.path.realpath(sg.get("package_dir") or sg["location"])


def _under(path, top):
    return path == top or path.startswith(top.rstrip("/") + "/")


def _mapped(pid, tops):
    """The first of directories `tops` that a file mapped by process `pid` lies under (the path
    field of /proc/PID/maps, proc(5)), or None; at most MAX_MAP_LINES lines are read."""
    try:
        with open("/proc/%d/maps" % pid, "rb") as f:
            for n, line in enumerate(f):
                if n >= MAX_MAP_LINES:
                    break
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith(b"/"):
                    path = os.fsdecode(parts[5].rstrip(b"\n")).replace(" (deleted)", "")
                    hit = next((t for t in tops if _under(path, t)), None)
                    if hit:
                        return hit
    except OSError:
        pass
    return None


def _opened(pid, tops):
    """The first of directories `tops` that a file process `pid` holds open lies under
    (/proc/PID/fd links, at most MAX_FDS), or None."""
    try:
        fds = os.listdir("/proc/%d/fd" % pid)[:MAX_FDS]
    except OSError:
        return None
    for fd in fds:
        try:
            path = os.readlink("/proc/%d/fd/%s" % (pid, fd))
        except OSError:
            continue
        hit = next((t for t in tops if _under(path, t)), None)
        if hit:
            return hit
    return None


def cmdline_text(argv):
    """Command line `argv` as one bounded line: its words redacted (redact.argv), quoted as a
    shell would read them, cut at MAX_CMDLINE characters (then ending in "..." and the count
    of characters left out)."""
    import shlex
    line = " ".join(shlex.quote(a) for a in redact.argv(argv))
    if len(line) > MAX_CMDLINE:
        return line[:MAX_CMDLINE] + "... (%d more characters)" % (len(line) - MAX_CMDLINE)
    return line


def peer_probes(table):
    """Pids in `table` (procs.proc_table's) of this probe's peers: the Python processes whose
    command line after argv[0] is this probe's own (/proc/self/cmdline: the same fleetctl
    bootstrap, started by another connection, run or operator inspecting the same host at the
    same time). A peer reads an install's files (the scan, grep -rl below it) but serves nothing,
    so it uses no install. A process that takes a peer's command line only hides itself (and
    what runs below it) from the list, as a process that closed its files would: a server is
    never one (procs.find_servers knows servers by their command lines)."""
    own = table.get(os.getpid())
    if not own or len(own[0]) < 2:
        return set()
    return {pid for pid, (argv, _) in table.items()
            if pid != os.getpid() and argv[1:] == own[0][1:] and procs.is_python(pid)}


def _skipped(table, servers):
    """Pids that use no install here whatever they run: this probe, its ancestors, its peers
    (peer_probes) with every process below them, and each server with every process below it
    and every one above it (its launchers: `conda run`, `timeout`, a supervisor; init itself
    is never one)."""
    skip = {os.getpid()}
    p = os.getppid()
    while p > 1 and p not in skip:
        skip.add(p)
        p = table[p][1] if p in table else 0
    peers = peer_probes(table)
    for pid in table:
        if pid in peers or peers.intersection(procs.ancestors(pid, table)):
            skip.add(pid)
    tops = {s["pid"] for s in servers}
    for pid in table:
        if pid in tops or tops.intersection(procs.ancestors(pid, table)):
            skip.add(pid)
    for pid in tops & set(table):
        skip.update(procs.ancestors(pid, table))
    return skip


def running(servers, host_view=lambda pid: False):
    """What the running processes say of where installs may be: ([(pid, python)] the interpreter
    of each Python process (procs.interpreter) that is no server's, nor this probe's (see
    _skipped: `servers`, procs.find_servers', are asked as servers), in pid order, at most
    MAX_RUNNING; sorted uids of all processes (their users' homes: host.homes)), both read
    from this mount namespace (and the others `host_view` reads as the host's: procs.proc_table)."""
    table, _ = procs.proc_table(host_view)
    skip = _skipped(table, servers)
    pythons, uids = [], set()
    for pid in sorted(table):
        ids = runas.ids_of(pid)
        if ids:
            uids.add(ids[0])
        if len(pythons) < MAX_RUNNING and pid not in skip and procs.is_python(pid):
            python = procs.interpreter(pid, table[pid][0])
            if python:
                pythons.append((pid, python))
    return pythons, sorted(uids)


def mark(installs, servers, host_view=lambda pid: False):
    """Set each install's (discover() entries) `in_use`: {"processes": [{pid, uid, cmdline
    (cmdline_text), why: "runs its interpreter PATH" | "has FILE's directory TOP mapped" | "has
    a file under TOP open"}], "more": count of the others}, the processes that use it and are no
    server's (module docstring), in pid order; `servers`: procs.find_servers' (their trees are
    left out). Processes in other mount namespaces are containers' (containers.py), left out
    unless `host_view(pid)` reads them as the host's."""
    for inst in installs:
        inst["in_use"] = {"processes": [], "more": 0}
    if not installs:
        return
    table, _ = procs.proc_table(host_view)
    skip = _skipped(table, servers)
    tops = [(inst, install_files(inst)) for inst in installs]
    for pid in sorted(table):
        if pid in skip:
            continue
        argv = table[pid][0]
        python = procs.interpreter(pid, argv) if procs.is_python(pid) else None
        found = {}
        for inst, top in tops:
            if python and same_interpreter(python, inst["python"]["path"]):
                found[id(inst)] = "runs its interpreter %s" % python
        rest = [top for inst, top in tops if id(inst) not in found]
        if rest:
            hit = _mapped(pid, rest)
            why = "has a file under %s mapped" % hit if hit else None
            if not hit:
                hit = _opened(pid, rest)
                why = "has a file under %s open" % hit if hit else None
            for inst, top in tops:
                if hit and top == hit and id(inst) not in found:
                    found[id(inst)] = why
        for inst in installs:
            if id(inst) in found:
                use = inst["in_use"]
                if len(use["processes"]) >= MAX_PROCESSES:
                    use["more"] += 1
                    continue
                ids = runas.ids_of(pid)
                use["processes"].append({"pid": pid, "uid": ids[0] if ids else None,
                                         "cmdline": cmdline_text(argv), "why": found[id(inst)][:MAX_CMDLINE]})
