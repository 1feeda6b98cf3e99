"""Waiting on file descriptors with poll(2), not select(2) (issue 55).

select.select raises ValueError for a descriptor numbered 1024 or more (FD_SETSIZE), and a
fleet of a few hundred hosts opens that many: each host's connection (a socket, and a paramiko
channel's pipe pair once it is waited on), its ProxyCommand's pipes, an OpenSSH client's three.
poll(2) has no such bound. Linux and macOS have select.poll.
"""

from __future__ import annotations

import math
import select

_READ = select.POLLIN | select.POLLPRI
_GONE = select.POLLHUP | select.POLLERR | select.POLLNVAL  # select(2) calls these readable (EOF, error)


def wait(read: list[int], write: list[int] | tuple = (), timeout: float | None = None) -> tuple[list[int], list[int]]:
    """(the descriptors of `read` ready to read, those of `write` ready to write), waiting at most
    `timeout` seconds (None: until one is; 0 or less: not at all) for either; what select.select
    answers for the same descriptors (a hung-up or failed one is ready: its read or write then
    says so), without its 1024 bound. Raises OSError as poll(2) does."""
    poller = select.poll()
    masks: dict[int, int] = {}
    for fd in read:
        masks[fd] = masks.get(fd, 0) | _READ
    for fd in write:
        masks[fd] = masks.get(fd, 0) | select.POLLOUT
    for fd, mask in masks.items():
        poller.register(fd, mask)
    ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
    events = poller.poll(ms)
    ready_r = [fd for fd, ev in events if fd in read and ev & (_READ | _GONE)]
    ready_w = [fd for fd, ev in events if fd in write and ev & (select.POLLOUT | _GONE)]
    return ready_r, ready_w
