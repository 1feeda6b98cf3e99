"""Run an install's code as an unprivileged uid (issue 48; review round 4, R4-1 to R4-3, R4-9).

Stdlib only, Python 3.8+, Linux. The one way a probe starts an install's interpreter with its
site module, or imports anything of its packages: site.py's `.pth` lines and `sitecustomize`,
meta-path finders, the packages and everything they import are the install's code, and no list
of checks covers Python's import system. So that code never runs with more privilege than the
install's own server already has:

- who, account(): the effective uid (with its gid and groups) of a server that runs from the
  install, which runs that code already; else the owner of the install's tree when that is not
  root; else an unprivileged account: `nobody` (uid 65534 where no account has that name: a
  minimal container image), or the one the inventory names (fleetctl_unprivileged_user). Never
  root: NoAccount says why and what to set.
- how, spawn() and run(): the child sets its real, effective and saved gid, groups and uid to
  the account's (setresgid(2), setgroups(2), setresuid(2): with every uid non-zero the kernel
  clears its capabilities), then no_new_privs (prctl(2) PR_SET_NO_NEW_PRIVS: a setuid program it
  starts gains nothing) and PR_SET_PDEATHSIG (it dies with the probe), each checked by system
  call before the exec; it runs in its own session and process group, killed whole at its
  deadline and at its end (what it left behind), with no file descriptor but its three, in `/`,
  with an environment built from nothing (environment(): the system's PATH; HOME, TMPDIR and
  TRITON_CACHE_DIR in a private directory of that uid, removed afterwards).
- what comes back is data: stdout and stderr read to a bound (run(): MAX_OUTPUT bytes, then the
  group is killed), files read by the caller as hostile (owner checked, no links, bounded).

Where fleetctl itself is not root it cannot drop and need not: the child runs as fleetctl's own
uid, the rest unchanged.
"""

import collections
import json
import os
import pwd
import selectors
import signal
import stat
import subprocess
import time

from . import result, safefs

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
NOBODY = "nobody"
NOBODY_ID = 65534  # the overflow uid and gid nobody has on Linux distributions (the kernel's overflowuid)
MAX_OUTPUT = 16 << 20  # bytes of stdout (and of stderr) a child may print before its group is killed
PRIVATE_PARENT = "/tmp"  # root's sticky directory: no other user can rename what root made in it
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_GET_NO_NEW_PRIVS = 1, 38, 39

Account = collections.namedtuple("Account", "uid gid groups why")
Account.__doc__ = """Who a child runs as: uid, gid, groups (ints) and why that one (text for reports)."""

Ran = collections.namedtuple("Ran", "returncode stdout stderr timed_out overflow")
Ran.__doc__ = """A finished child: its exit status (negative: killed by that signal), stdout and
stderr (bytes, at most MAX_OUTPUT each), whether its deadline killed it, and whether it printed
more than MAX_OUTPUT (then its group was killed)."""


class NoAccount(Exception):
    """No unprivileged account to run an install's code as: the text says why and what to set."""


def ids_of(pid):
    """(euid, egid, groups) of process `pid`: the effective ids, field 2 of /proc/PID/status's
    Uid: and Gid: lines (proc(5)), and its Groups:; None when it is gone or unreadable."""
    ids = {}
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("Uid", "Gid", "Groups"):
                    ids[k] = [int(x) for x in v.split()]
    except (OSError, ValueError):
        return None
    if len(ids.get("Uid") or ()) < 2 or len(ids.get("Gid") or ()) < 2:
        return None
    return ids["Uid"][1], ids["Gid"][1], ids.get("Groups") or []


def _user(uid, gid, why):
    """The Account of uid `uid`: its passwd entry's gid and groups (getgrouplist(3)), or `gid` and
    no groups when it has none."""
    try:
        pw = pwd.getpwuid(uid)
        return Account(uid, pw.pw_gid, sorted(set(os.getgrouplist(pw.pw_name, pw.pw_gid))), why)
    except (KeyError, OSError):
        return Account(uid, gid, [gid], why)


def account(servers=(), tree=None, user=None):
    """The account an install's code runs as (module docstring): `servers`, pids of servers
    running from the install; `tree`, its package directory (or its interpreter's prefix);
    `user`, the inventory's fleetctl_unprivileged_user (None: `nobody`). Returns an Account.
    Raises NoAccount when the account named (or `nobody`) does not exist or is root."""
    if os.geteuid() != 0:
        return Account(os.geteuid(), os.getegid(), sorted(set(os.getgroups())), "fleetctl's own uid (not root)")
    for pid in servers:
        ids = ids_of(pid)
        if ids is not None and ids[0] != 0:
            return Account(ids[0], ids[1], sorted(set(ids[2])), "the effective uid of server pid %d" % pid)
    if tree:
        try:
            st = os.stat(tree)
        except OSError:
            st = None
        if st is not None and st.st_uid != 0:
            return _user(st.st_uid, st.st_gid, "the owner of %s" % tree)
    name = user or NOBODY
    where = "fleetctl_unprivileged_user %s" % name if user else "the unprivileged account %s" % name
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        if not user:  # a minimal image (a container's) names no nobody: its conventional uid and gid
            return Account(NOBODY_ID, NOBODY_ID, [NOBODY_ID], "uid %d (no account named nobody here)" % NOBODY_ID)
        raise NoAccount("%s does not exist on this host: set fleetctl_unprivileged_user to an unprivileged "
                        "account that may read the install" % where)
    if pw.pw_uid == 0:
        raise NoAccount("%s is root: fleetctl never runs an install's code as root; name an unprivileged "
                        "account" % where)
    return Account(pw.pw_uid, pw.pw_gid, sorted(set(os.getgrouplist(name, pw.pw_gid))), where)


def private_dir(acct):
    """A fresh directory for one child: made by root in PRIVATE_PARENT (mode 0700, a random
    name), then given to the account. Returns its path; remove it with remove()."""
    import tempfile  # only where a child is started: a warm probe starts none (3 ms of its start)
    path = tempfile.mkdtemp(prefix="fleetctl-child-", dir=PRIVATE_PARENT)
    if os.geteuid() == 0:
        os.chown(path, acct.uid, acct.gid)
    return path


def remove(path):
    """Remove private directory `path` and what the child left in it (safefs.rmtree: never
    following a link, iteratively, at most safefs.MAX_TREE_ENTRIES entries); what is left past
    that, or busy, stays. Returns None when all went, else the first error's text."""
    parent, name = os.path.split(path)
    try:
        top = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        return str(e)
    try:
        safefs.rmtree(top, name)
    except FileNotFoundError:
        return None
    except (OSError, safefs.UnsafePath) as e:
        return str(e)
    finally:
        os.close(top)
    return None


def environment(home, extra=None):
    """A child's whole environment: PATH = SYSTEM_PATH, HOME = TMPDIR = `home` (its private
    directory), TRITON_CACHE_DIR = home/triton, LANG and LC_ALL = C.UTF-8, then `extra`."""
    env = {"PATH": SYSTEM_PATH, "HOME": home, "TMPDIR": home, "TRITON_CACHE_DIR": os.path.join(home, "triton"),
           "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    env.update(extra or {})
    return env


def _drop(acct, nice=0, rlimits=None):
    """preexec_fn of a child: `nice` added to its priority and `rlimits` ({resource.RLIMIT_*:
    soft and hard limit}) set, then become `acct` (module docstring), checked by system call; a
    failure raises, which subprocess reports in the parent (SubprocessError), and nothing runs."""
    import ctypes
    import resource
    libc = ctypes.CDLL(None, use_errno=True)
    root = os.geteuid() == 0

    def run():
        if nice:
            os.nice(nice)
        for which, value in (rlimits or {}).items():
            resource.setrlimit(which, (value, value))
        if root:
            os.setgroups(acct.groups)
            os.setresgid(acct.gid, acct.gid, acct.gid)
            os.setresuid(acct.uid, acct.uid, acct.uid)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or libc.prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0) != 1:
            raise OSError(ctypes.get_errno(), "no_new_privs could not be set")
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if root and (os.getresuid() != (acct.uid,) * 3 or os.getresgid() != (acct.gid,) * 3 or 0 in os.getresuid()):
            raise OSError("the child's ids are not %d:%d" % (acct.uid, acct.gid))
    return run


def spawn(argv, acct, env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/",
          nice=0, rlimits=None):
    """Start `argv` as `acct` (module docstring) with environment `env` (environment()): a Popen
    in its own session and process group (`nice`, `rlimits`: see _drop). Raises NoAccount when `acct` is root while fleetctl is,
    OSError or subprocess.SubprocessError when it cannot start (the drop failed: nothing ran)."""
    if os.geteuid() == 0 and acct.uid == 0:
        raise NoAccount("refusing to run an install's code as root")
    return subprocess.Popen(argv, stdin=stdin, stdout=stdout, stderr=stderr, cwd=cwd, env=env,
                            start_new_session=True, close_fds=True, preexec_fn=_drop(acct, nice, rlimits))


def killpg(pgid):
    """SIGKILL process group `pgid` (a spawned child's); nothing when it is gone."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def finish(proc, deadline):
    """Wait for spawned `proc` until the monotonic `deadline`, then kill its group; the group is
    killed at the child's end too (what it left behind), before the child is reaped (while its
    pid still names the group: waitid(2) WNOWAIT). Returns (returncode, timed_out)."""
    timed_out, delay = False, 0.01
    while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        time.sleep(min(delay, left))
        delay = min(delay * 2, 0.25)
    killpg(proc.pid)
    return proc.wait(), timed_out


def run(argv, acct, stdin=b"", timeout=60.0, extra_env=None, limit=MAX_OUTPUT, nice=0, rlimits=None):
    """Run `argv` as `acct` in `/` with a private directory (environment(), `extra_env` added)
    for at most `timeout` seconds, `stdin` written to it, stdout and stderr read up to `limit`
    bytes each (`nice`, `rlimits`: see _drop). Returns a Ran. Raises NoAccount, OSError,
    subprocess.SubprocessError (it could not start: nothing ran)."""
    home = private_dir(acct)
    try:
        proc = spawn(argv, acct, environment(home, extra_env), nice=nice, rlimits=rlimits)
        deadline = time.monotonic() + timeout
        out, timed_out, overflow = collect(proc, stdin, deadline, limit)
        code, late = finish(proc, deadline)
        return Ran(code, out[0], out[1], timed_out or late, overflow)
    finally:
        remove(home)


def collect(proc, data, deadline, limit=MAX_OUTPUT):
    """Write `data` to spawned proc's stdin (closed after it) and read its stdout and stderr until
    both end, the monotonic `deadline` passes or one exceeds `limit` bytes (then its group is
    killed): ([stdout, stderr], timed_out, overflow). The child is not reaped: finish() next."""
    sel = selectors.DefaultSelector()
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    for f in bufs:
        os.set_blocking(f.fileno(), False)
        sel.register(f, selectors.EVENT_READ)
    view = memoryview(data)
    if view:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    timed_out = overflow = False
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(left):
                f = key.fileobj
                if f is proc.stdin:
                    try:
                        view = view[os.write(f.fileno(), view[:65536]):]
                    except BrokenPipeError:
                        view = view[:0]
                    if not view:
                        sel.unregister(f)
                        f.close()
                    continue
                chunk = os.read(f.fileno(), 65536)
                if not chunk:
                    sel.unregister(f)
                    continue
                bufs[f] += chunk
                if len(bufs[f]) > limit:
                    overflow = True
            if overflow:
                break
        if timed_out or overflow:
            killpg(proc.pid)  # before its pipes close: it dies of the kill, not of a broken pipe
    finally:
        sel.close()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if not f.closed:
                f.close()
    return [bytes(bufs[proc.stdout][:limit]), bytes(bufs[proc.stderr][:limit])], timed_out, overflow


def rerun(python, params, acct, timeout, extra_env=None, nice=0, rlimits=None):
    """This probe's own bundle (FLEETCTL_BUNDLE, set by the probe wrapper) run again with
    `params` under `python -I` (its site module: the install's code) as `acct`, by run() with
    `timeout`, `extra_env`, `nice` and `rlimits`. Returns (its result, a dict, or None; why not,
    None when it answered: "did not answer within N s (run as uid U)", "printed no result (exit
    N, run as uid U): ...", or the probe's own error; the Ran). Raises NoAccount, OSError, subprocess.SubprocessError
    (it could not start: nothing ran)."""
    doc = json.loads(FLEETCTL_BUNDLE)  # noqa: F821 (set by the probe wrapper)
    doc["params"] = params
    ran = run([python, "-I", "-c", FLEETCTL_WRAPPER], acct, json.dumps(doc).encode(), timeout,  # noqa: F821
              extra_env, nice=nice, rlimits=rlimits)
    tail = ran.stderr.decode("utf-8", "replace").strip()[-1500:]
    if ran.timed_out:
        return None, "did not answer within %.0f s (run as uid %d)" % (timeout, acct.uid), ran
    found = result.after_marker(ran.stdout.decode("utf-8", "replace"))
    if found is None:
        return None, "printed no result (exit %d, run as uid %d): %s" % (ran.returncode, acct.uid, tail or "no output"), ran
    try:
        got = json.loads(found)
    except (ValueError, RecursionError):
        return None, "printed a result that is not JSON (exit %d)" % ran.returncode, ran
    if not isinstance(got, dict):
        return None, "printed a result that is not an object (exit %d)" % ran.returncode, ran
    if "__probe_error__" in got:
        return None, str(got["__probe_error__"]).strip()[-1500:], ran
    return got, None, ran


def read_output(path, uid, limit):
    """A file a child wrote, read as hostile: opened without following a link or blocking on a
    FIFO; its bytes when it is a regular file of `uid` of at most `limit` bytes, None when it is
    missing or not so. Raises ValueError when it is larger."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
            return None
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError("%s is over %d bytes" % (path, limit))
    return data


def read_as(acct, path, limit):
    """The bytes of regular file `path` (absolute) as `acct` may read it: in a forked child that
    becomes `acct` (setgroups, setresgid, setresuid) and reads it with safefs.read_file (reached
    from / without following a link, at most `limit` bytes); the parent reads the answer from a
    pipe, bounded. Where fleetctl is not root, read directly. Raises OSError or
    safefs.UnsafePath with the child's reason."""
    if os.geteuid() != 0:
        return safefs.read_file(path, limit)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing but the read, then _exit
        try:
            os.close(r)
            try:
                os.setgroups(acct.groups)
                os.setresgid(acct.gid, acct.gid, acct.gid)
                os.setresuid(acct.uid, acct.uid, acct.uid)
                out = b"D" + safefs.read_file(path, limit)
            except (OSError, safefs.UnsafePath) as e:
                out = b"E" + str(e).encode("utf-8", "replace")[:2000]
            view = memoryview(out)
            while view:
                view = view[os.write(w, view):]
        finally:
            os._exit(0)
    os.close(w)
    chunks, size = [], 0
    try:
        while size <= limit + 2048:
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    out = b"".join(chunks)
    if out[:1] == b"D" and len(out) <= limit + 1:
        return out[1:]
    raise OSError(out[1:].decode("utf-8", "replace") if out[:1] == b"E" else "the reading child gave no answer")
