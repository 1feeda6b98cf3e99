"""The one place a remote command line is assembled.

Every command fleetctl starts on a host is a list of words (argv), never a shell string with
values pasted in: values travel as separate words (or on stdin), so nothing a host or an
inventory says can be parsed as shell. `remote_argv` wraps each one in the deadline wrapper
(coreutils `timeout -k`, which runs the command in its own process group and kills that group at
the deadline, so the remote work dies even when fleetctl is gone) and, for a host with
ansible_become, in the become prefix (`become_argv`: sudo, outside the deadline wrapper, since a
non-root `timeout` could not kill root's command). A probe for an install in a container runs
inside it: `container_entry` is one more prefix, inside the deadline wrapper (the runtime's exec,
or nsenter, is what the wrapper kills), and the interpreter after it is executed directly
(distroless images have no `sh` or `timeout`). The few fixed scripts fleetctl needs
(upload, lock) live here as constants that take their values as positional parameters.
"""

from __future__ import annotations

import math
import shlex

from .. import probes

# Seconds between the remote `timeout`'s SIGTERM and its SIGKILL.
KILL_AFTER_S = 2
# Exit status of coreutils `timeout` when the command ran past its deadline (124), or needed the
# follow-up SIGKILL (128 + 9) (coreutils manual, "timeout invocation").
TIMEOUT_EXITS = (124, 137)

# $1 destination path, $2 octal mode, $3 sha256 of stdin. Writes a private temp file beside the
# destination, checks its hash, then renames it into place; the temp file never outlives a failure.
_UPLOAD = (
    'set -e; mkdir -p -- "$(dirname -- "$1")"; umask 077; '
    't=$(mktemp -- "$1.fleetctl-XXXXXX"); trap \'rm -f -- "$t"\' EXIT; cat > "$t"; '
    'got=$(sha256sum < "$t"); [ "${got%% *}" = "$3" ] || { echo "upload damaged: sha256 ${got%% *}" >&2; exit 1; }; '
    'chmod "$2" "$t"; mv -f -- "$t" "$1"; trap - EXIT'
)

# $1 state dir, $2 who holds it, $3 seconds to hold it at most, $4 seconds without a heartbeat
# byte after which the controller counts as gone, $5 the holder (_HOLD). flock -n fails at once
# (exit 75) when another run holds the lock.
_LOCK = 'umask 077 && mkdir -p -m 700 -- "$1" && exec flock -n -E 75 "$1/lock" sh -c "$5" "$1" "$2" "$3" "$4"'

# The lock's holder ($0 state dir, $1 who, $2 hold seconds, $3 heartbeat window seconds): says
# LOCKED, then reads one heartbeat byte at a time from stdin; EOF (released, or the controller's
# connection closed), no byte within the window (a silent controller: a cut link, a dead control
# node), or the hold time (CLOCK_BOOTTIME's /proc/uptime, never the wall clock) ends the hold.
# Then registration is closed (lock.groups renamed under lock.groups.lock, so a command that
# starts later refuses to), and the run's commands that still run (pid and start time, so a
# reused pid is never hit) get SIGTERM on their process group, SIGKILL when any of it is left
# KILL_AFTER_S later.
_HOLD = (
    'printf "%s since %s\\n" "$1" "$(date -u +%FT%TZ)" > "$0/lock.owner"; : > "$0/lock.groups"; echo LOCKED; '
    'end=$(( $(cut -d. -f1 /proc/uptime) + $2 )); '
    'while now=$(cut -d. -f1 /proc/uptime); [ "$now" -lt "$end" ]; do w=$((end - now)); [ "$w" -lt "$3" ] || w=$3; '
    'b=$(timeout "$w" head -c 1) && [ -n "$b" ] || break; done; '
    'flock "$0/lock.groups.lock" mv -f -- "$0/lock.groups" "$0/lock.groups.end"; '
    'k=; while read -r p s; do '
    '[ -n "$s" ] && [ "$(cut -d" " -f22 "/proc/$p/stat" 2>/dev/null)" = "$s" ] && '
    '{ kill -TERM -- "-$p" 2>/dev/null || kill -TERM "$p" 2>/dev/null; k="$k $p"; }; '
    'done < "$0/lock.groups.end"; '
    f'[ -z "$k" ] || {{ i=0; while [ "$i" -lt {KILL_AFTER_S * 10} ]; do a=; '
    'for p in $k; do kill -0 -- "-$p" 2>/dev/null && a=1; done; [ -n "$a" ] || break; sleep 0.1; i=$((i + 1)); done; '
    'for p in $k; do kill -KILL -- "-$p" 2>/dev/null; done; }; '
    'rm -f -- "$0/lock.groups.end"'
)

# $1 the lock holder's lock.groups, then the command (under the deadline wrapper, which makes its
# own process group, with this shell's pid: exec). This shell's pid and start time (/proc/PID/stat
# field 22) are appended to $1 under lock.groups.lock before the command starts, and only while
# the holder still takes them (else exit 125, nothing started).
_TIED = ('flock "$1.lock" sh -c \'[ -f "$0" ] && printf "%s %s\\n" "$1" "$2" >> "$0"\' '
         '"$1" "$$" "$(cut -d" " -f22 "/proc/$$/stat")" '
         '|| { echo "fleetctl: this run no longer holds the host lock: not started" >&2; exit 125; }; shift; exec "$@"')


def remote_argv(argv: list[str], timeout: float, tied: str | None = None) -> tuple[list[str], int]:
    """(the argv to start over there, the whole seconds it may run): `argv` under the deadline
    wrapper `timeout -k KILL_AFTER_S T`, T = ceil(timeout), at least 1. `tied`: the lock.groups
    file of the lock this connection holds (lock_argv): the command is registered there, so the
    lock's holder stops it when the run's controller is gone (security review turn 3, L3)."""
    if not isinstance(argv, (list, tuple)) or not argv or not all(isinstance(a, str) for a in argv):
        raise TypeError(f"a remote command is a non-empty list of strings, not {argv!r}")
    limit = max(1, math.ceil(timeout))
    wrapped = ["timeout", "-k", str(KILL_AFTER_S), str(limit), *argv]
    return (["sh", "-c", _TIED, "fleetctl-tied", tied, *wrapped] if tied else wrapped), limit


def become_argv(argv: list[str], user: str, flags: tuple[str, ...], prompt: str, ready: str) -> list[str]:
    """`argv` (already under the deadline wrapper) run by sudo as `user`: `sudo -S -p PROMPT
    FLAGS -u USER -- sh -c 'print READY on stderr; exec "$@"' ...`. -S: sudo reads a password
    from stdin, never a tty (sudo(8)); -p: its prompt is PROMPT, written to stderr with no
    newline, so the caller sees whether sudo asks before anything reaches the command's stdin;
    READY on a line of its own on stderr says sudo let the command start. `prompt` and `ready`
    are the caller's random markers (no `%`, which sudo's -p expands)."""
    if "%" in prompt:
        raise ValueError("a sudo prompt marker must not hold %")
    return ["sudo", "-S", "-p", prompt, *flags, "-u", user, "--",
            "sh", "-c", 'printf "%s\n" "$0" >&2; exec "$@"', ready, *argv]


# How a container is entered (inventory `fleetctl_container_exec`); "none": never.
CONTAINER_EXECS = ("docker", "podman", "crictl", "nsenter", "none")


def container_entry(how: str, container_id: str, pid: int, process: dict) -> list[str]:
    """The prefix that runs a command inside a container: `podman exec -i ID`, `docker exec -i
    ID`, `crictl exec -i ID` (the runtime applies the container's user, capabilities, cgroup,
    seccomp and LSM profile), or for "nsenter" fleetctl's entry program under the host's python3
    on PATH, cleared by trust.GUARD (probes.path_python; probes/enter.py: the namespaces and cgroups of the container's process `pid` as the host
    sees it, with that process's uid and gid, no capabilities beyond its bounding set and
    no_new_privs; `process`: {uid, gid, start_time} as probes/containers.process read them).
    Raises ValueError for another `how`, a container id that is not hex, or a process whose
    uid, gid or start time is unknown."""
    if how in ("podman", "docker", "crictl"):
        if not container_id or not all(c in "0123456789abcdef" for c in container_id):
            raise ValueError(f"container id {container_id!r} is not a hex id")
        return [how, "exec", "-i", container_id]
    if how == "nsenter":
        uid, gid, start = process.get("uid"), process.get("gid"), process.get("start_time")
        if not (isinstance(uid, int) and isinstance(gid, int) and isinstance(start, str) and start.isdigit()):
            raise ValueError(f"the uid, gid and start time of pid {pid} are unknown: not entered")
        return probes.path_python(["-c", probes.source("enter"), str(int(pid)), start, str(uid), str(gid), "--"])
    raise ValueError(f"no way to enter a container with {how!r} (one of {', '.join(CONTAINER_EXECS[:-1])})")


def python_lock_argv(python: str, state_dir: str, who: str, hold_s: int, beat_s: int) -> list[str]:
    """lock_argv for a place with Python and nothing else (a distroless container): the same
    protocol (STATE_DIR/lock held with flock; LOCKED once held; exit 75, the holder on stdout,
    when another run holds it; released at EOF on stdin, after `beat_s` seconds without a
    heartbeat byte, or after `hold_s` seconds). Commands in the container are not registered
    with it (they are started by the runtime's exec, whose client the host's deadline wrapper kills)."""
    return [python, "-I", "-c", _PY_LOCK, state_dir, who, str(hold_s), str(beat_s)]


_PY_LOCK = r"""
import fcntl, os, select, sys, time
d, who, hold, beat = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
os.umask(0o077)
os.makedirs(d, mode=0o700, exist_ok=True)
fd = os.open(os.path.join(d, "lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except BlockingIOError:
    try:
        o = os.open(os.path.join(d, "lock.owner"), os.O_RDONLY | os.O_NOFOLLOW)
        sys.stdout.write(os.read(o, 4096).decode("utf-8", "replace"))
    except OSError:
        pass
    sys.exit(75)
o = os.open(os.path.join(d, "lock.owner"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
os.write(o, ("%s since %s\n" % (who, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))).encode())
os.close(o)
print("LOCKED", flush=True)
end = time.monotonic() + hold
while time.monotonic() < end:
    r, _, _ = select.select([0], [], [], max(0.0, min(beat, end - time.monotonic())))
    if not r or not os.read(0, 65536):
        break
"""


def shell_line(argv: list[str]) -> str:
    """`argv` as one POSIX shell line, each word quoted (for transports such as SSH's exec
    request that carry a string to the login shell)."""
    return shlex.join(argv)


# The line a command's exit status is reported on, at the end of its stderr (exit_status_line).
EXIT_LINE_PREFIX = b"\nfleetctl-exit:"


def exit_status_line(argv: list[str]) -> str:
    """`argv` as one shell line that ends its stderr with `\nfleetctl-exit:N\n` (N: its exit
    status) and exits with N: the status travels in-band, for a transport (the OpenSSH client)
    whose own failure status 255 a command could also return."""
    return shell_line(argv) + '; c=$?; printf \'\\nfleetctl-exit:%d\\n\' "$c" >&2; exit "$c"'


def operator_argv(cmd: str) -> list[str]:
    """An operator's own shell command (inventory `fleetctl_restart_cmd`, a playbook handler):
    run by `sh -c`, as written by the person who owns the host."""
    return ["sh", "-c", cmd]


def upload_argv(path: str, mode: int, sha256: str) -> list[str]:
    """The command that writes its stdin to `path` with `mode`, atomically, checked against
    `sha256` (hex)."""
    return ["sh", "-c", _UPLOAD, "fleetctl-upload", path, format(mode, "o"), sha256]


def lock_argv(state_dir: str, who: str, hold_s: int, beat_s: int) -> list[str]:
    """The command that holds STATE_DIR/lock for `hold_s` seconds at most, until its stdin
    closes, or until `beat_s` seconds pass without a heartbeat byte on it; it prints LOCKED once
    held, and exits 75 when another run holds it. Commands started with remote_argv(tied=
    STATE_DIR/lock.groups) while it holds are stopped (their process groups) when it ends."""
    return ["sh", "-c", _LOCK, "fleetctl-lock", state_dir, who, str(hold_s), str(beat_s), _HOLD]


def lock_groups(state_dir: str) -> str:
    """The file the lock's holder reads the run's commands from (remote_argv's `tied`)."""
    return f"{state_dir}/lock.groups"
