# -*- coding: utf-8 -*-
# Copyright: (c) 2026, fleetctl maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""fleetctl.sglang.patch on the controller: gather (inspect module), plan (fleetctl's planner and
the playbook's templates), then, under the play's lease on fleetctl's host lock (renewed, or taken
when the play holds none: the lock module), the patch module on the host with the plan as its argument."""

from __future__ import annotations

import functools

from ansible.plugins.action import ActionBase
from ansible_collections.fleetctl.sglang.plugins.module_utils import pins

MODULE = "fleetctl.sglang.patch"
INSPECT = "fleetctl.sglang.inspect"


class ActionModule(ActionBase):
    """Plan on the controller, write on the host (see the module's documentation)."""

    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(("playbook", "playbooks_dir", "install", "state", "change_id", "commit", "force",
                             "state_dir"))

    def _module(self, name, args, task_vars):
        return self._execute_module(module_name=name, module_args=args, task_vars=task_vars)

    def _leased(self, ops, result, fact, failed, pending, task_vars):
        """`result` with the lease settled (ops.settle_lease) and its fact set for the play's later tasks."""
        fact = ops.settle_lease(functools.partial(self._module, task_vars=task_vars), fact, failed, pending)
        return dict(result, ansible_facts={ops.LEASE_FACT: fact})

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        args = self._task.args
        try:
            from fleetctl.collection import ops
            from fleetctl.errors import ParseError
            from fleetctl.errors import HostFailed
        except ImportError as e:
            return dict(result, failed=True, msg="fleetctl is not importable on the controller: %s" % e)
        base = {"state_dir": args.get("state_dir") or "/var/lib/fleetctl"}
        lock = functools.partial(self._module, task_vars=task_vars)
        if args.get("state", "applied") != "applied":
            fact = {}
            if not self._task.check_mode:  # commit and roll back under the lease, as fleetctl does
                try:
                    fact = ops.hold_lease(lock, ops.held_lease(task_vars, base["state_dir"]), base["state_dir"])
                except HostFailed as e:
                    return dict(result, failed=True, msg=str(e))
            done = self._module(MODULE, dict(args), task_vars)
            result.update(done)
            return self._leased(ops, result, fact, bool(done.get("failed")), done.get("pending"), task_vars) \
                if fact else result
        try:
            ops.check_pins(pins.FLEETCTL_VERSION, pins.PROBE_SHA256)
            host = ops.host_from_vars(task_vars["inventory_hostname"], task_vars, self._templar.template)
            playbook = ops.load(args.get("playbook", "defrag-tier0"), args.get("playbooks_dir"))
            gathered = self._module(INSPECT, {"python": host.python, "with_sources": True}, task_vars)
            if gathered.get("failed"):
                return dict(result, failed=True, msg="inspect: %s" % gathered.get("msg"))
            plans = ops.plan(playbook, host, gathered, args.get("install"))
        except (HostFailed, ParseError) as e:
            return dict(result, failed=True, msg=str(e))
        result["plans"] = ops.summary(plans)
        result["diff"] = ops.diffs(plans)
        todo = ops.changes(playbook, plans, "ansible@%s" % task_vars.get("inventory_hostname"), host.shared_tree)
        result["changed"] = bool(todo)
        if not todo or self._task.check_mode:
            return result
        try:
            fact = ops.hold_lease(lock, ops.held_lease(task_vars, base["state_dir"]), base["state_dir"])
        except HostFailed as e:
            return dict(result, failed=True, changed=False, msg=str(e))
        result["changes"] = []
        pending = None
        for inst, plan, change in todo:
            wrote = self._module(MODULE, dict(base, plan=change, commit=False), task_vars)
            if wrote.get("failed"):
                failed = dict(result, failed=True, msg=wrote.get("msg"), changed=bool(result["changes"]))
                return self._leased(ops, failed, fact, True, None, task_vars)
            pending = wrote.get("pending")
            result["changes"].append({"install": plan.install, "change_id": change["change_id"],
                                      "files": [f["path"] for f in change["files"]]})
            problems = []
            if "reinspect" in ops.checks(playbook, plan):
                again = self._module(INSPECT, {"python": host.python, "with_sources": True}, task_vars)
                problems = ["reinspect: %s" % again.get("msg")] if again.get("failed") else \
                    ops.reinspect(playbook, plan, host, inst, again)
            if problems:
                undone = [self._module(MODULE, dict(base, state="rolled_back", change_id=c["change_id"]), task_vars)
                          for c in reversed(result["changes"])]
                failed = dict(result, failed=True, rolled_back=[c["change_id"] for c in result["changes"]],
                              msg="%s (rolled back%s)" % ("; ".join(problems),
                                                          "" if not any(u.get("failed") for u in undone)
                                                          else ": FAILED, see fleetctl status"))
                return self._leased(ops, failed, fact, True, None, task_vars)
            if args.get("commit"):
                done = self._module(MODULE, dict(base, state="committed", change_id=change["change_id"]), task_vars)
                if done.get("failed"):
                    failed = dict(result, failed=True, msg=done.get("msg"))
                    return self._leased(ops, failed, fact, True, None, task_vars)
                pending = done.get("pending")
        result["change_id"] = result["changes"][-1]["change_id"]
        return self._leased(ops, result, fact, False, pending, task_vars)
