"""The children of the kbuild probe's actions (stdlib only, Python 3.8+): the PATH they run with
(only directories no user but root can write), the build lock, the deadline that kills a child's
whole process group, the tail of its log, and a bounded command of the preflight's."""

from __future__ import annotations

import fcntl
import os
import signal
import stat
import subprocess
import time

LOG_TAIL_BYTES = 4000  # how much of a child's log or stderr an answer carries


def flock(fd: int, deadline: float) -> bool:
    """Take an exclusive flock on fd, polling until the monotonic deadline; False if not taken."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def wait(proc: subprocess.Popen, deadline: float):
    """Wait for proc until the deadline, then kill its process group: (returncode, timed_out)."""
    try:
        return proc.wait(timeout=max(0.0, deadline - time.monotonic())), False
    except subprocess.TimeoutExpired:
        killpg(proc.pid)
        return proc.wait(), True


def killpg(pgid: int) -> None:
    """SIGKILL process group `pgid` (a child started with start_new_session); nothing when it is gone."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def tail(path: str) -> str:
    """The last LOG_TAIL_BYTES of file `path` as text (UTF-8, errors replaced). Raises OSError."""
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - LOG_TAIL_BYTES))
        return f.read().decode("utf-8", "replace")


def run(cmd: list) -> subprocess.CompletedProcess:
    """`cmd` run with no stdin for at most 30 s, its output captured as text; one that cannot start
    or times out gives returncode 127 and the error as its stderr."""
    try:
        return subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return subprocess.CompletedProcess(cmd, 127, "", str(e))


def _root_only(d: str) -> bool:
    """Whether directory `d` and every directory above it are owned by root (or this user) and
    writable by nobody else; above `d`, a sticky root-owned directory such as /tmp is fine (no
    other user can rename what root made in it), `d` itself never is."""
    if not os.path.isabs(d):
        return False
    d, leaf = os.path.realpath(d), True
    while True:
        try:
            st = os.stat(d)
        except OSError:
            return False
        shared = st.st_mode & 0o022 and (leaf or not st.st_mode & stat.S_ISVTX)
        if not os.path.isdir(d) or st.st_uid not in (0, os.geteuid()) or shared:
            return False
        if d == "/":
            return True
        d, leaf = os.path.dirname(d), False


def search_path(python: str) -> str:
    """The PATH builds run with: the interpreter's bin directory (where a venv's ninja lives;
    the facts probe's trust check cleared it), then this session's PATH, keeping only the
    directories that no user but root can write (review M6: a planted `c++`, `ninja` or `nvcc`
    in a user-writable directory on root's PATH would run as root). Relative and empty entries
    (the working directory) are dropped too."""
    dirs = [os.path.dirname(os.path.abspath(python))] + os.environ.get("PATH", os.defpath).split(os.pathsep)
    kept = []
    for d in dirs:
        if d not in kept and _root_only(d):
            kept.append(d)
    return os.pathsep.join(kept)
