"""The kbuild probe's helpers (stdlib only, Python 3.8+): the build lock and the tail of a child's log."""

from __future__ import annotations

import fcntl
import os
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


def tail(path: str) -> str:
    """The last LOG_TAIL_BYTES of file `path` as text (UTF-8, errors replaced). Raises OSError."""
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - LOG_TAIL_BYTES))
        return f.read().decode("utf-8", "replace")
