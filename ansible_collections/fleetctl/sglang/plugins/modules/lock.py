#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, fleetctl maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: lock
short_description: A lease on fleetctl's host lock, held across tasks (patch to gate)
description:
  - Takes fleetctl's per-host lock (C(flock) on O(state_dir)/lock, the lock C(fleetctl apply), C(deploy), C(rollback) and
    C(recover) take) and holds it after the task ends, for at most O(lease_s) seconds, in a detached C(flock) process.
  - While it is held, a concurrent C(fleetctl apply) fails fast naming the holder, so it cannot recover (undo) the
    play's pending change between M(fleetctl.sglang.patch) and the gate of M(fleetctl.sglang.smoke).
  - O(state=released) ends the lease; the lease also ends by itself after O(lease_s).
version_added: "0.1.0"
author:
  - fleetctl maintainers (@fleetctl)
options:
  state:
    description: V(acquired) takes the lock (a lease this holder already has is renewed), V(released) frees it.
    type: str
    choices: [acquired, released]
    default: acquired
  lease_s:
    description: Seconds the lock is held at most.
    type: int
    default: 1800
  wait_s:
    description: Seconds to wait for another holder before failing.
    type: int
    default: 5
  holder:
    description: Who holds the lock, as C(lock.owner) and a busy C(fleetctl apply) show it.
    type: str
    default: ansible-playbook
  state_dir:
    description: fleetctl's state directory on the host.
    type: path
    default: /var/lib/fleetctl
attributes:
  check_mode:
    support: full
    description: Reports whether it would take or free the lock.
  diff_mode:
    support: none
    description: Nothing to diff.
"""

EXAMPLES = r"""
- name: Lease fleetctl's host lock for the change
  fleetctl.sglang.lock:
    state: acquired
    lease_s: 1800

- name: Release it
  fleetctl.sglang.lock:
    state: released
"""

RETURN = r"""
lease:
  description: The lease (pid of the holding process, holder, expires as UNIX time).
  returned: when acquired
  type: dict
"""

import json
import os
import signal
import time

from ansible.module_utils.basic import AnsibleModule

BUSY = 75
HOLD = 'printf "%s since %s\\n" "$1" "$(date -u +%FT%TZ)" > "$0/lock.owner"; echo LOCKED; exec sleep "$2"'


def lease_path(state_dir):
    return os.path.join(state_dir, "lock.lease")


def current(state_dir):
    """The live lease recorded in state_dir, or None (its process gone, or the record stale)."""
    try:
        with open(lease_path(state_dir)) as f:
            lease = json.load(f)
        with open("/proc/%d/stat" % lease["pid"]) as f:
            start = f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None
    return lease if start == lease.get("start") else None


def start_holder(argv):
    """Start `argv` detached (own session, stdin and stderr /dev/null, stdout a pipe to us):
    (pid, the first line it prints, its exit status when it has already ended, else None)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the holder: outlives this module and the SSH session that ran it
        try:
            os.setsid()
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)
            os.dup2(w, 1)
            os.dup2(null, 2)
            os.closerange(3, 65536)
            os.execvp(argv[0], argv)
        finally:
            os._exit(127)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        line = f.readline(200)
    done, status = os.waitpid(pid, os.WNOHANG)
    return pid, line, (os.waitstatus_to_exitcode(status) if done else None)


def take(state_dir, holder, lease_s, wait_s):
    """Start the detached flock holder; returns the lease, or None when another run holds the lock."""
    deadline = time.time() + wait_s
    argv = ["flock", "-n", "-E", str(BUSY), os.path.join(state_dir, "lock"), "sh", "-c", HOLD,
            state_dir, holder, str(lease_s)]
    while True:
        pid, line, code = start_holder(argv)
        if line.strip() == b"LOCKED" and code is None:
            with open("/proc/%d/stat" % pid) as f:
                start = f.read().rsplit(")", 1)[1].split()[19]
            lease = {"pid": pid, "start": start, "holder": holder, "expires": int(time.time()) + lease_s}
            tmp = lease_path(state_dir) + ".tmp"
            with open(tmp, "w") as f:
                json.dump(lease, f)
            os.rename(tmp, lease_path(state_dir))
            return lease
        if code is None:
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code != BUSY or time.time() >= deadline:
            return None
        time.sleep(0.5)


def main():
    module = AnsibleModule(
        argument_spec=dict(state=dict(type="str", default="acquired", choices=["acquired", "released"]),
                           lease_s=dict(type="int", default=1800), wait_s=dict(type="int", default=5),
                           holder=dict(type="str", default="ansible-playbook"),
                           state_dir=dict(type="path", default="/var/lib/fleetctl")),
        supports_check_mode=True,
    )
    p = module.params
    sd = p["state_dir"]
    lease = current(sd)
    if p["state"] == "released":
        if lease is None:
            module.exit_json(changed=False)
        if not module.check_mode:
            os.killpg(lease["pid"], signal.SIGTERM)
            os.unlink(lease_path(sd))
        module.exit_json(changed=True)
    if lease is not None and lease["holder"] == p["holder"]:
        if not module.check_mode:
            os.killpg(lease["pid"], signal.SIGTERM)  # renew: a fresh lease from now
            time.sleep(0.1)
        else:
            module.exit_json(changed=False, lease=lease)
    if module.check_mode:
        module.exit_json(changed=True)
    os.makedirs(sd, mode=0o700, exist_ok=True)
    got = take(sd, p["holder"], p["lease_s"], p["wait_s"])
    if got is None:
        try:
            with open(os.path.join(sd, "lock.owner")) as f:
                who = f.read(200).strip()
        except OSError:
            who = "holder unknown"
        module.fail_json(msg="another fleetctl run is changing this host (%s)" % who)
    module.exit_json(changed=True, lease=got)


if __name__ == "__main__":
    main()
