#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, fleetctl maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: patch
short_description: Apply a fleetctl playbook to a host's SGLang installs, with ledger, backups and rollback
description:
  - On the controller (action plugin) it gathers with M(fleetctl.sglang.inspect), plans with fleetctl's planner and
    the playbook's templates, then runs this module on the host with the plan as its argument.
  - The host side is fleetctl's change probe, the same as C(fleetctl apply) uses, with its ledger
    (C(state_dir)/ledger.jsonl), backups, pre-image sha256 check and atomic writes.
  - A written change stays C(pending) until M(fleetctl.sglang.smoke) with O(change_id) gates it and commits it, or
    O(state=committed) does; a pending change is what C(fleetctl apply) or C(fleetctl recover) undo after a failed run.
  - A pending change is written only under a live lease on fleetctl's host lock (M(fleetctl.sglang.lock)), so that
    no C(fleetctl apply) or C(recover) undoes it before the gate. The action plugin renews the play's lease (the fact
    C(fleetctl_lease)), or takes one when the play holds none (failing with the holder's name when another run
    holds the lock); a lease it took itself ends when the task leaves nothing pending, or fails. O(state=committed)
    and O(state=rolled_back) renew (or take) it the same way. On the host a pending change with no live lease in
    O(state_dir)/lock.lease is refused.
  - With C(--check) and C(--diff) it shows the same unified diffs as C(fleetctl apply --check --diff) and changes nothing.
version_added: "0.1.0"
author:
  - fleetctl maintainers (@fleetctl)
options:
  playbook:
    description: The fleetctl playbook, by name in the playbooks directory or as a path to a .yaml file.
    type: str
    default: defrag-tier0
  playbooks_dir:
    description: Where named playbooks are found (default fleetctl's own).
    type: path
  install:
    description: The install id to change (default every install a server runs from, else the only one).
    type: str
  state:
    description:
      - V(applied) writes the planned change (pending until gated or committed); V(committed) makes the pending
        change O(change_id) applied; V(rolled_back) restores the files of O(change_id) byte-identical from backup.
    type: str
    choices: [applied, committed, rolled_back]
    default: applied
  change_id:
    description: The change to commit or roll back (the RV(change_id) an earlier run returned).
    type: str
  commit:
    description: Commit the change at once after its compile and reinspect checks (no smoke gate).
    type: bool
    default: false
  force:
    description: Roll back even files changed since the apply.
    type: bool
    default: false
  state_dir:
    description: fleetctl's state directory on the host (ledger, backups, lock).
    type: path
    default: /var/lib/fleetctl
  plan:
    description: The change to write, made by the action plugin (change_id, playbook, operator, install, root,
      shared_tree, files with path, pre_sha256, post_sha256, new_text). Not for direct use.
    type: dict
attributes:
  check_mode:
    support: full
    description: Plans and diffs, changes nothing.
  diff_mode:
    support: full
    description: fleetctl's unified diffs.
  action:
    support: full
    description: The action plugin plans on the controller.
"""

EXAMPLES = r"""
- name: Defrag Tier 0
  fleetctl.sglang.patch:
    playbook: defrag-tier0
  register: patch
  notify: restart sglang

- name: Roll it back
  fleetctl.sglang.patch:
    state: rolled_back
    change_id: "{{ patch.change_id }}"
"""

RETURN = r"""
change_id:
  description: The change's ledger id (several installs changed - the last one's; see RV(changes)).
  returned: when a change was written, committed or rolled back
  type: str
changes:
  description: One entry per install changed (install, change_id, files).
  returned: when a change was written
  type: list
  elements: dict
plans:
  description: The plan per install (status, reason, files, edits, already_applied, left_alone, handlers).
  returned: with O(state=applied)
  type: list
  elements: dict
files:
  description: The files rolled back.
  returned: with O(state=rolled_back)
  type: list
  elements: str
pending:
  description: The changes still pending in the ledger afterwards (their ids).
  returned: when a change was written, committed or rolled back
  type: list
  elements: str
"""

import fcntl
import json
import os
import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.fleetctl.sglang.plugins.module_utils.change import actions as change, ledger


def run(module, action, **params):
    """One action of fleetctl's change probe; a refusal fails the module, changing nothing."""
    res = change.main(dict(params, action=action, state_dir=module.params["state_dir"]))
    if not res.get("ok"):
        module.fail_json(msg="%s: %s" % (action, res.get("error")), refused=bool(res.get("refused")))
    return res


def entry(module, cid):
    """The ledger summary entry of change `cid`, or None."""
    return next((c for c in run(module, "status")["changes"] if c["change_id"] == cid), None)


def pending(state_dir):
    """The ids of the changes whose last state in the ledger is pending."""
    return [cid for cid, e in ledger.changes(state_dir).items() if e["state"] == ledger.PENDING]


def under_lease(state_dir, write):
    """write() while a live lease of fleetctl.sglang.lock holds fleetctl's host lock: STATE_DIR/lock.lease names
    this boot (/proc/sys/kernel/random/boot_id), a time on CLOCK_BOOTTIME not yet up and a running holder process
    (its /proc/PID/stat start); the record is held under its shared flock meanwhile, so its holder cannot end the
    lease during the write. Returns write()'s answer, or None (nothing written) when there is no live lease. The same
    reading as the lock module's `live` (modules share code only through module_utils, which are fleetctl's probes)."""
    try:
        f = os.fdopen(os.open(os.path.join(state_dir, "lock.lease"), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC))
    except OSError:
        return None
    with f:
        fcntl.flock(f, fcntl.LOCK_SH)
        try:
            lease = json.loads(f.read())
            with open("/proc/sys/kernel/random/boot_id") as b, open("/proc/%d/stat" % lease["pid"]) as st:
                bid, proc = b.read().strip(), st.read().rsplit(")", 1)[1].split()
            ok = lease["boot_id"] == bid and proc[0] not in ("Z", "X") and proc[19] == lease["start"] and \
                time.clock_gettime(time.CLOCK_BOOTTIME) < lease["expires"]
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            ok = False
        return write() if ok else None


def main():
    module = AnsibleModule(
        argument_spec=dict(
            playbook=dict(type="str", default="defrag-tier0"), playbooks_dir=dict(type="path"),
            install=dict(type="str"),
            state=dict(type="str", default="applied", choices=["applied", "committed", "rolled_back"]),
            change_id=dict(type="str"), commit=dict(type="bool", default=False), force=dict(type="bool", default=False),
            state_dir=dict(type="path", default="/var/lib/fleetctl"), plan=dict(type="dict"),
        ),
        required_if=[("state", "committed", ["change_id"]), ("state", "rolled_back", ["change_id"])],
        supports_check_mode=True,
    )
    p = module.params
    if p["state"] == "applied":
        if not p["plan"]:
            module.fail_json(msg="state=applied runs through the fleetctl.sglang.patch action plugin, which plans")
        if module.check_mode:
            module.exit_json(changed=True, change_id=p["plan"]["change_id"])
        if p["commit"]:
            res = run(module, "apply", commit=True, **p["plan"])
        else:
            res = under_lease(p["state_dir"], lambda: run(module, "apply", commit=False, **p["plan"]))
            if res is None:
                module.fail_json(msg="not writing a pending change without a lease on fleetctl's host lock (no live "
                                 "lease in %s/lock.lease): take one with fleetctl.sglang.lock first" % p["state_dir"])
        module.exit_json(changed=True, change_id=p["plan"]["change_id"], files=[f["path"] for f in p["plan"]["files"]],
                         ledger=res, pending=pending(p["state_dir"]))
    e = entry(module, p["change_id"])
    if e is None:
        module.fail_json(msg="no change %r in the ledger" % p["change_id"])
    sd = p["state_dir"]
    if p["state"] == "committed":
        if e["state"] == "applied":
            module.exit_json(changed=False, change_id=p["change_id"], pending=pending(sd))
        if not module.check_mode:
            run(module, "commit", change_id=p["change_id"], reason="gated by ansible")
        module.exit_json(changed=True, change_id=p["change_id"], pending=pending(sd))
    if e["state"] == "rolled-back":
        module.exit_json(changed=False, change_id=p["change_id"], files=[], pending=pending(sd))
    if module.check_mode:
        module.exit_json(changed=True, change_id=p["change_id"], files=e["files"])
    res = run(module, "rollback", change_id=p["change_id"], force=p["force"], reason="ansible rollback")
    module.exit_json(changed=True, change_id=p["change_id"], files=res.get("files", []), forced=res.get("forced") or [],
                     pending=pending(sd))


if __name__ == "__main__":
    main()
