"""A host tool run to a deadline that holds (stdlib only, Python 3.8+): the runner the probes use
for the host's subsystems (the GPU tool nvidia-smi, a container runtime's inspect, systemctl).

CPython's subprocess.run(timeout=) kills the child at the timeout and then waits for it
(Lib/subprocess.py run(): `process.kill()` then `process.wait()`); a child in uninterruptible
sleep (proc(5) state D: nvidia-smi blocked in the driver after an Xid, a read of a hung device or
a dead network mount) does not die until its kernel call returns, so that wait outlives the
timeout (NVIDIA/gpu-monitoring-tools#46, leptonai/gpud#117). run() here starts the child in its
own session (setsid(2): its own process group, out of reach of the terminal's signals), sends the
group SIGKILL at the deadline, waits GRACE_S more, and then stops waiting: a child still there is
abandoned (left to the kernel; subprocess reaps it later, Lib/subprocess.py _cleanup) and named
with its pid and its state read from /proc/PID/stat (proc(5): field 3, "D" uninterruptible
sleep). The probe's own deadline inside the host's, and what did not answer: start(), limit(),
errors().
"""

import collections
import os
import signal
import subprocess
import time

GRACE_S = 1.0  # after SIGKILL, how long a child is waited for before it is left behind
RESERVE_S = 5.0  # of the host's deadline, kept for the probe's own work after a tool and its answer
MIN_S = 1.0  # the least a tool is given, whatever is left of the host's deadline
STATES = {"R": "running", "S": "sleeping", "D": "uninterruptible sleep", "T": "stopped", "t": "traced",
          "Z": "zombie", "X": "dead", "I": "idle"}  # proc(5) /proc/PID/stat field 3
# end: time.monotonic() at which this probe's host deadline (less RESERVE_S) ends; errors: of its run()s
_HOST = {"end": None, "errors": []}

# stdout and stderr as text (UTF-8, errors replaced); returncode None when it did not exit in time;
# error None when it exited in time, else the sentence saying what happened; state: proc(5)'s
# letter of a child left behind, else None
Ran = collections.namedtuple("Ran", "stdout stderr returncode error pid state")


def start(deadline_s):
    """A probe run starts: its host deadline set `deadline_s` seconds from now (the host's time
    left when the probe started, params["deadline_s"]; None: none, each tool gets its own limit
    only) and its record of the tools that did not answer (errors) emptied."""
    _HOST["end"] = None if deadline_s is None else time.monotonic() + float(deadline_s) - RESERVE_S
    _HOST["errors"] = []


def errors():
    """The error sentences (Ran.error) of this probe run's tools that did not answer in time,
    in order (see start)."""
    return list(_HOST["errors"])


def limit(cap_s):
    """Seconds a tool may take now: `cap_s` (its subsystem's own limit), less when the host's
    deadline (start) is nearer, but not under MIN_S for that."""
    if _HOST["end"] is None:
        return float(cap_s)
    return min(float(cap_s), max(MIN_S, _HOST["end"] - time.monotonic()))


def _stat(pid):
    """(command name, state letter, start time in seconds after boot) of process `pid` from
    /proc/PID/stat (proc(5): field 2, the executable's or script's base name cut to 15
    characters, in parentheses that may themselves hold ")"; field 3, the state; field 22, the
    start time in clock ticks), or None when it is gone or unreadable. Never its cmdline: that read
    waits on the process's memory lock, which a process stuck in a driver may hold."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    rest = text[text.rfind(")") + 1:].split()
    if len(rest) < 20 or not rest[19].isdigit():
        return None
    return text[text.find("(") + 1:text.rfind(")")], rest[0], int(rest[19]) / os.sysconf("SC_CLK_TCK")


def state(pid):
    """proc(5)'s state letter of process `pid` ("D": uninterruptible sleep), None when it is gone."""
    found = _stat(pid)
    return found[1] if found else None


def describe(name, pid, letter):
    """"NAME (pid N, state D: uninterruptible sleep)": a process named with its pid and state."""
    return "%s (pid %d, state %s: %s)" % (name, pid, letter, STATES.get(letter, "unknown"))


def stuck(path, older_than_s):
    """(pid, "D") of a process in uninterruptible sleep running the program `path` (by its
    command name: the base name of `path`) for more than `older_than_s` seconds (a run's own
    limit: a tool that old has not answered, such as one an earlier run left behind; a younger
    one may be only briefly in the driver), or None. A tool stuck in the driver is not started
    again while one is: such calls pile up (NVIDIA/gpu-monitoring-tools#46)."""
    name = os.path.basename(path)[:15]
    try:
        with open("/proc/uptime") as f:
            now = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    for entry in os.listdir("/proc"):
        found = _stat(int(entry)) if entry.isdigit() else None
        if found and found[:2] == (name, "D") and now - found[2] > older_than_s:
            return int(entry), "D"
    return None


def run(argv, cap_s, name=None):
    """Run `argv` (no stdin, stdout and stderr captured) for at most limit(cap_s) seconds:
    a Ran(stdout, stderr, returncode, error, pid, state).

    error is None when the child exited in time (whatever its status); else "NAME did not answer
    within N s: killed" (it died on SIGKILL within GRACE_S) or "NAME (pid N, state D:
    uninterruptible sleep) did not answer within N s and did not die on SIGKILL: left behind"
    (it is abandoned, never waited for: the call returns within limit(cap_s) + GRACE_S), or,
    when one of argv[0] has been stuck longer than that limit already (stuck: it is not started
    again), "NAME (pid N, state D: ...) from an earlier run is still stuck: not started again";
    each also kept for
    errors(). NAME: `name`, else argv[0]'s base name. Raises OSError when the child cannot start
    (FileNotFoundError: not there)."""
    name = name or os.path.basename(argv[0])
    seconds = round(limit(cap_s), 1)
    held = stuck(argv[0], seconds)
    if held:
        error = "%s from an earlier run is still stuck: not started again" % describe(name, *held)
        _HOST["errors"].append(error)
        return Ran("", "", None, error, held[0], held[1])
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=seconds)
        return Ran(_text(out), _text(err), p.returncode, None, p.pid, None)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(p.pid, signal.SIGKILL)  # its session's group: a child it started dies with it
    except OSError:
        pass
    try:
        p.communicate(timeout=GRACE_S)
    except subprocess.TimeoutExpired:  # a pipe still open: the child, or one that left its group, holds it
        for pipe in (p.stdout, p.stderr):
            pipe.close()
    if p.poll() is not None:
        error, letter = "%s did not answer within %g s: killed" % (name, seconds), None
    else:
        letter = state(p.pid) or "?"
        error = "%s did not answer within %g s and did not die on SIGKILL: left behind" % (
            describe(name, p.pid, letter), seconds)
    _HOST["errors"].append(error)
    return Ran("", "", None, error, p.pid, letter)


def _text(data):
    return data.decode("utf-8", "replace")
