# -*- coding: utf-8 -*-
# Copyright: (c) 2026, fleetctl maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""fleetctl.sglang.patch on the controller: gather (inspect module), plan (fleetctl's planner and
the playbook's templates), then the patch module on the host with the plan as its argument."""

from __future__ import annotations

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

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        args = self._task.args
        if args.get("state", "applied") != "applied":
            result.update(self._module(MODULE, dict(args), task_vars))
            return result
        try:
            from fleetctl.collection import ops
            from fleetctl.errors import ParseError
            from fleetctl.errors import HostFailed
        except ImportError as e:
            return dict(result, failed=True, msg="fleetctl is not importable on the controller: %s" % e)
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
        base = {"state_dir": args.get("state_dir") or "/var/lib/fleetctl"}
        result["changes"] = []
        for inst, plan, change in todo:
            wrote = self._module(MODULE, dict(base, plan=change, commit=False), task_vars)
            if wrote.get("failed"):
                return dict(result, failed=True, msg=wrote.get("msg"), changed=bool(result["changes"]))
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
                return dict(result, failed=True, rolled_back=[c["change_id"] for c in result["changes"]],
                            msg="%s (rolled back%s)" % ("; ".join(problems),
                                                        "" if not any(u.get("failed") for u in undone)
                                                        else ": FAILED, see fleetctl status"))
            if args.get("commit"):
                done = self._module(MODULE, dict(base, state="committed", change_id=change["change_id"]), task_vars)
                if done.get("failed"):
                    return dict(result, failed=True, msg=done.get("msg"))
        result["change_id"] = result["changes"][-1]["change_id"]
        return result
