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
    C(recover) take) and holds it after the task ends, in a detached holder process on the host.
  - While it is held, a concurrent C(fleetctl apply) fails fast naming the holder, so it cannot recover (undo) the
    play's pending change between M(fleetctl.sglang.patch) and the gate of M(fleetctl.sglang.smoke).
  - The lease lasts O(lease_s) seconds from its last renewal, counted on the host's C(CLOCK_BOOTTIME) (time since boot,
    suspend included), and belongs to the boot it was taken in (C(/proc/sys/kernel/random/boot_id)); it is recorded in
    O(state_dir)/lock.lease. Once it is void (its time up, or the host rebooted) its holder ends within a second and
    frees the lock, so C(fleetctl recover) works after a killed play.
  - M(fleetctl.sglang.patch) and M(fleetctl.sglang.smoke) renew the play's lease (the fact C(fleetctl_lease) this module
    sets), and M(fleetctl.sglang.patch) takes one itself when the play holds none; a pending change is never written
    without a lease.
  - O(state=released) ends the lease.
version_added: "0.1.0"
author:
  - fleetctl maintainers (@fleetctl)
options:
  state:
    description:
      - V(acquired) takes the lock, or renews the lease O(token) names when it is still live; V(released) frees it.
    type: str
    choices: [acquired, released]
    default: acquired
  lease_s:
    description: Seconds the lease lasts from now (taken or renewed); renew it before they are up.
    type: int
    default: 300
  wait_s:
    description: Seconds to wait for another holder before failing.
    type: int
    default: 5
  holder:
    description: Who holds the lock, as C(lock.owner) and a busy C(fleetctl apply) show it.
    type: str
    default: ansible-playbook
  token:
    description:
      - The lease to renew (its RV(lease.token), also the fact C(fleetctl_lease.token)); another live lease is another
        run's, and O(state=acquired) waits for it. With O(state=released), only that lease is released; omitted, the
        live lease is, whoever holds it.
    type: str
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

- name: Renew it before a long task
  fleetctl.sglang.lock:
    token: "{{ ansible_facts.fleetctl_lease.token }}"
    lease_s: 900

- name: Release it
  fleetctl.sglang.lock:
    state: released
"""

RETURN = r"""
lease:
  description:
    - The lease, as recorded in O(state_dir)/lock.lease (also set as the fact C(fleetctl_lease), with O(state_dir)).
  returned: when acquired
  type: dict
  contains:
    pid:
      description: The holder process, which holds the flock.
      type: int
    start:
      description: Its start (C(/proc/PID/stat) field 22, clock ticks after boot), so a reused pid is not taken for it.
      type: str
    holder:
      description: O(holder).
      type: str
    token:
      description: The lease's own random id, which O(token) names to renew or release it.
      type: str
    boot_id:
      description: The boot it was taken in (C(/proc/sys/kernel/random/boot_id)).
      type: str
    since:
      description: When it was taken (UTC, ISO 8601).
      type: str
    lease_s:
      description: The O(lease_s) of its last renewal.
      type: int
    expires:
      description: When it ends, in seconds since boot on C(CLOCK_BOOTTIME).
      type: float
"""

import errno
import fcntl
import json
import os
import signal
import time

from ansible.module_utils.basic import AnsibleModule

BUSY = 75  # the holder's exit status when another run holds the lock (as fleetctl's own lock command's)
TICK_S = 1.0  # how often the holder checks that its lease is still live
BOOT_ID = "/proc/sys/kernel/random/boot_id"


def boot():
    """(this boot's id from BOOT_ID, seconds since boot on CLOCK_BOOTTIME: suspend included, no clock steps)."""
    with open(BOOT_ID) as f:
        return f.read().strip(), time.clock_gettime(time.CLOCK_BOOTTIME)


def started(pid):
    """Process `pid`'s start (clock ticks after boot, /proc/PID/stat field 22, as text), or None when it is gone
    (or a zombie)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[19] if len(fields) > 19 and fields[0] not in ("Z", "X") else None  # a zombie holds no lock


def live(lease):
    """Whether `lease` (a lock.lease record, or None) is live: taken in this boot, its time not up, its holder
    running."""
    try:
        bid, now = boot()
        return lease["boot_id"] == bid and now < lease["expires"] and started(lease["pid"]) == lease["start"]
    except (TypeError, KeyError):
        return False


class Record:
    """STATE_DIR/lock.lease under its own flock: shared for readers, exclusive for writers (the holder's check,
    renew, release), so that a holder never ends a lease while it is being renewed or read. As a context
    manager: the record as a dict, or None (no file, empty, torn by a crash: no lease)."""

    def __init__(self, state_dir, write=False):
        self.path, self.write, self.f = os.path.join(state_dir, "lock.lease"), write, None

    def __enter__(self):
        flags = (os.O_RDWR | os.O_CREAT) if self.write else os.O_RDONLY
        try:
            fd = os.open(self.path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            self.f = os.fdopen(fd, "r+" if self.write else "r")
        except FileNotFoundError:
            return None
        fcntl.flock(self.f, fcntl.LOCK_EX if self.write else fcntl.LOCK_SH)
        try:
            got = json.loads(self.f.read() or "null")
        except ValueError:
            return None
        return got if isinstance(got, dict) else None

    def save(self, lease):
        """Write `lease` (a dict; None clears the record) in place."""
        self.f.seek(0)
        self.f.truncate()
        if lease is not None:
            self.f.write(json.dumps(lease))
        self.f.flush()

    def __exit__(self, *exc):
        if self.f is not None:
            self.f.close()
            self.f = None


def current(state_dir):
    """The live lease recorded in state_dir, or None."""
    with Record(state_dir) as lease:
        return lease if live(lease) else None


def hold(state_dir, holder, token, lease_s, said):
    """The holder (a process of its own, see start_holder): takes the flock on STATE_DIR/lock (fleetctl's lock file),
    writes lock.owner as fleetctl's lock command does, records the lease, says LOCKED on fd `said`, then keeps the
    lock while its record is live and still its own, checking every TICK_S; clears its record and returns (the lock
    freed as it exits) once not. Returns BUSY at once when another run holds the lock."""
    fd = os.open(os.path.join(state_dir, "lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return BUSY
        raise
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    o = os.open(os.path.join(state_dir, "lock.owner"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.write(o, ("%s since %s\n" % (holder, since)).encode())
    os.close(o)
    bid, now = boot()
    rec = Record(state_dir, write=True)
    with rec:
        rec.save({"pid": os.getpid(), "start": started(os.getpid()), "holder": holder, "token": token, "boot_id": bid,
                  "since": since, "lease_s": lease_s, "expires": now + lease_s})
    os.write(said, b"LOCKED\n")
    os.close(said)
    while True:
        time.sleep(TICK_S)
        with rec as lease:
            if lease is not None and lease.get("token") == token:
                if live(lease):
                    continue
                rec.save(None)
            return 0


def start_holder(state_dir, holder, token, lease_s):
    """Fork the holder (its own session, cwd /, stdin/stdout/stderr /dev/null, no other fd of ours: it outlives this
    module and the SSH session that ran it). Returns (its pid, the first line it says: b"LOCKED\\n", b"ERROR ...\\n",
    or b"" when it ended without a word)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # release() ends it so
            os.setsid()
            os.chdir("/")
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.closerange(3, w)
            os.closerange(w + 1, 65536)
            code = hold(state_dir, holder, token, lease_s, w)
        except BaseException as e:
            try:
                os.write(w, ("ERROR %s\n" % e).encode()[:400])
            except OSError:
                pass
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        return pid, f.readline(400)


def take(state_dir, holder, lease_s, wait_s):
    """Take the lock for a new lease (start_holder), trying again every 0.5 s while another run holds it, for
    wait_s seconds (time.monotonic: a clock step neither ends nor stretches the wait). Returns the lease, or None
    when the lock was still held. Raises OSError when the holder could not start (the state dir unusable)."""
    deadline = time.monotonic() + wait_s
    token = os.urandom(16).hex()
    while True:
        pid, said = start_holder(state_dir, holder, token, lease_s)
        if said == b"LOCKED\n":
            lease = current(state_dir)
            if lease is None or lease["token"] != token:
                raise OSError("the lock holder's lease ended at once")
            return lease
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code != BUSY:
            why = said.decode("utf-8", "replace").strip()
            raise OSError("the lock holder did not start (exit %s): %s" % (code, why))
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.5)


def renew(state_dir, token, lease_s):
    """Extend the live lease `token` to lease_s seconds from now. Returns it, or None when it is not live."""
    rec = Record(state_dir, write=True)
    with rec as lease:
        if not live(lease) or lease.get("token") != token:
            return None
        lease["expires"] = boot()[1] + lease_s
        lease["lease_s"] = lease_s
        rec.save(lease)
        return lease


def release(state_dir, lease):
    """End `lease`: its record cleared, its holder sent SIGTERM; returns once the holder is gone (5 s at most)."""
    rec = Record(state_dir, write=True)
    with rec as now:
        if now is not None and now.get("token") == lease["token"]:
            rec.save(None)
    if started(lease["pid"]) == lease["start"]:
        try:
            os.killpg(lease["pid"], signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + 5
    while started(lease["pid"]) == lease["start"] and time.monotonic() < deadline:
        time.sleep(0.05)


def main():
    module = AnsibleModule(
        argument_spec=dict(state=dict(type="str", default="acquired", choices=["acquired", "released"]),
                           lease_s=dict(type="int", default=300), wait_s=dict(type="int", default=5),
                           holder=dict(type="str", default="ansible-playbook"), token=dict(type="str", no_log=False),
                           state_dir=dict(type="path", default="/var/lib/fleetctl")),
        supports_check_mode=True,
    )
    p = module.params
    sd = p["state_dir"]
    if p["lease_s"] < 1 or p["wait_s"] < 0:
        module.fail_json(msg="lease_s must be 1 or more and wait_s 0 or more (got %d and %d)"
                         % (p["lease_s"], p["wait_s"]))
    lease = current(sd)
    if p["state"] == "released":
        if lease is None or (p["token"] and lease["token"] != p["token"]):
            module.exit_json(changed=False, ansible_facts={"fleetctl_lease": {}})
        if module.check_mode:
            module.exit_json(changed=True)
        release(sd, lease)
        module.exit_json(changed=True, ansible_facts={"fleetctl_lease": {}})
    if lease is not None and p["token"] and lease["token"] == p["token"]:
        got = lease if module.check_mode else renew(sd, p["token"], p["lease_s"])
        if got is not None:
            module.exit_json(changed=False, lease=got, ansible_facts={"fleetctl_lease": dict(got, state_dir=sd)})
    if module.check_mode:
        module.exit_json(changed=True)
    os.makedirs(sd, mode=0o700, exist_ok=True)
    try:
        got = take(sd, p["holder"], p["lease_s"], p["wait_s"])
    except OSError as e:
        module.fail_json(msg="could not take fleetctl's host lock in %s: %s" % (sd, e))
    if got is None:
        try:
            with open(os.path.join(sd, "lock.owner")) as f:
                who = f.read(200).strip()
        except OSError:
            who = "holder unknown"
        module.fail_json(msg="another fleetctl run is changing this host (%s)" % who)
    module.exit_json(changed=True, lease=got, ansible_facts={"fleetctl_lease": dict(got, state_dir=sd)})


if __name__ == "__main__":
    main()
