"""Processes and ports: whether a pid runs, the processes of a group or of a command line, a free
loopback port."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path
from typing import Iterator


def alive(pid: int) -> bool:
    """Whether `pid` runs and is not a zombie (a killed orphan may wait a while for init to reap
    it): state from /proc/PID/stat, the field after the ")" that ends the command name (proc(5))."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def gone(pid: int, within: float = 2.0) -> bool:
    """Whether `pid` is no longer `alive` within `within` seconds: a SIGKILL takes effect when
    the kernel next runs the process, which on a loaded machine is not at once."""
    deadline = time.monotonic() + within
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def alive_pids(pids) -> list[int]:
    """The pids of `pids` (an iterable of ints) that run (`alive`), in their order."""
    return [p for p in pids if alive(p)]


def _running() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of /proc/PID/stat after the command name) of each process that runs and
    is not a zombie."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            yield int(pid), fields


def group_pids(pgid: int) -> list[int]:
    """Pids of the live (non-zombie) processes of process group `pgid`."""
    return [pid for pid, fields in _running() if int(fields[2]) == pgid]


def pids_naming(text: str) -> list[int]:
    """Pids of the live processes whose command line holds `text` (a path only the caller uses)."""
    found = []
    for pid, _ in _running():
        try:
            if text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return found


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel's pick; free until someone
    else binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, timeout: float = 30.0) -> bool:
    """Wait until something accepts TCP connections on 127.0.0.1:port; False after `timeout`
    seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.05)
    return False


def sigint_default() -> None:
    """A child's preexec_fn: SIGINT at its default, as a terminal's foreground job has it. A test
    run from a background job of a shell (`cmd &`, as CI scripts start it) inherits SIGINT
    ignored, and a Python child then never raises KeyboardInterrupt: the Ctrl-C tests would
    test nothing (or fail)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
