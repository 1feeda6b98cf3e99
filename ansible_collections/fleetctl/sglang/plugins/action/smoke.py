# -*- coding: utf-8 -*-
# Copyright: (c) 2026, fleetctl maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""fleetctl.sglang.smoke on the controller: pick the servers (inventory, else the inspect module's
servers), run the smoke module, gate against the baseline (fleetctl's gate), commit on a pass."""

from __future__ import annotations

from ansible.plugins.action import ActionBase
from ansible_collections.fleetctl.sglang.plugins.module_utils import pins


class ActionModule(ActionBase):
    """See the module's documentation."""

    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(("baseline", "change_id", "offline_cmd", "health_timeout", "latency_tolerance",
                             "allow_token_drift", "state_dir", "repeat", "request_timeout"))

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        from fleetctl.collection import ops
        from fleetctl.config import REQUEST_TIMEOUT_S
        from fleetctl.errors import HostFailed
        from fleetctl.engine.validate import SmokeOptions, smoke_problems

        args = self._task.args
        try:
            ops.check_pins(pins.FLEETCTL_VERSION, pins.PROBE_SHA256)
        except HostFailed as e:
            return dict(result, failed=True, msg=str(e))
        host = ops.host_from_vars(task_vars["inventory_hostname"], task_vars, self._templar.template)
        opts = SmokeOptions(health_timeout=float(args.get("health_timeout", 600)), repeat=int(args.get("repeat", 3)),
                            latency_tolerance=float(args.get("latency_tolerance", 1.25)),
                            allow_token_drift=bool(args.get("allow_token_drift", False)))
        facts = None
        if host.sglang_port is None:
            g = self._execute_module(module_name="fleetctl.sglang.inspect", module_args={"scan": False},
                                     task_vars=task_vars)
            facts = g.get("facts")
        params = ops.smoke_params(host, facts, opts, args.get("offline_cmd"),
                                  float(args.get("request_timeout", REQUEST_TIMEOUT_S)))
        ran = self._execute_module(module_name="fleetctl.sglang.smoke", module_args=params, task_vars=task_vars)
        if ran.get("failed"):
            return dict(result, **ran)
        res = ran["smoke"]
        result.update(changed=False, smoke=res)
        baseline = args.get("baseline")
        if not baseline:
            bad = smoke_problems(res)
            if bad:
                result.update(failed=True, msg="smoke failed: " + "; ".join(bad))
            return result
        verdict = ops.gate_verdict(host, baseline, res, opts)
        result["validation"] = verdict
        if verdict["failed"]:
            return dict(result, failed=True, msg="validation failed: %s" % verdict["message"])
        if args.get("change_id"):
            done = self._execute_module(module_name="fleetctl.sglang.patch", task_vars=task_vars, module_args={
                "state": "committed", "change_id": args["change_id"],
                "state_dir": args.get("state_dir") or "/var/lib/fleetctl"})
            if done.get("failed"):
                return dict(result, failed=True, msg=done.get("msg"))
            result["changed"] = bool(done.get("changed"))
        return result
