# -*- coding: utf-8 -*-
# Copyright: (c) 2026, fleetctl maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""fleetctl.sglang.smoke on the controller: pick the servers (inventory, else the inspect module's
servers), run the smoke module, gate against the baseline (fleetctl's gate), commit on a pass. With
a change to commit, the play's lease on fleetctl's host lock (the lock module) is renewed to cover
the decode (or taken, when the play holds none), and renewed again before the commit."""

from __future__ import annotations

import functools

from ansible.plugins.action import ActionBase
from ansible_collections.fleetctl.sglang.plugins.module_utils import pins


class ActionModule(ActionBase):
    """See the module's documentation."""

    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(("baseline", "change_id", "offline_cmd", "health_timeout", "latency_tolerance",
                             "allow_token_drift", "state_dir", "repeat", "request_timeout"))

    def _module(self, name, args, task_vars):
        return self._execute_module(module_name=name, module_args=args, task_vars=task_vars)

    def _leased(self, ops, result, fact, failed, pending, task_vars):
        """`result` with the lease settled (ops.settle_lease) and, when the play holds one, its fact set."""
        if not fact:
            return result
        fact = ops.settle_lease(functools.partial(self._module, task_vars=task_vars), fact, failed, pending)
        return dict(result, ansible_facts={ops.LEASE_FACT: fact})

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
        run = functools.partial(self._module, task_vars=task_vars)
        state_dir = args.get("state_dir") or "/var/lib/fleetctl"
        fact = {}
        if args.get("change_id") and not self._task.check_mode:  # the pending change stays leased through the decode
            try:
                fact = ops.hold_lease(run, ops.held_lease(task_vars, state_dir), state_dir,
                                      extra_s=ops.smoke_bound_s(params))
            except HostFailed as e:
                return dict(result, failed=True, msg=str(e))
        ran = self._module("fleetctl.sglang.smoke", params, task_vars)
        if ran.get("failed"):
            return self._leased(ops, dict(result, **ran), fact, True, None, task_vars)
        res = ran["smoke"]
        result.update(changed=False, smoke=res)
        baseline = args.get("baseline")
        if not baseline:
            bad = smoke_problems(res)
            if bad:
                result.update(failed=True, msg="smoke failed: " + "; ".join(bad))
            return self._leased(ops, result, fact, bool(bad), None, task_vars)
        verdict = ops.gate_verdict(host, baseline, res, opts)
        result["validation"] = verdict
        if verdict["failed"]:
            return self._leased(ops, dict(result, failed=True, msg="validation failed: %s" % verdict["message"]),
                                fact, True, None, task_vars)
        pending = None
        if args.get("change_id"):
            try:  # the commit under the lease, renewed to the play's lease_s from now
                if fact:
                    fact = ops.hold_lease(run, fact, state_dir)
            except HostFailed as e:
                return dict(result, failed=True, msg=str(e))
            done = self._module("fleetctl.sglang.patch", {"state": "committed", "change_id": args["change_id"],
                                                          "state_dir": state_dir}, task_vars)
            if done.get("failed"):
                return self._leased(ops, dict(result, failed=True, msg=done.get("msg")), fact, True, None, task_vars)
            result["changed"] = bool(done.get("changed"))
            pending = done.get("pending")
        return self._leased(ops, result, fact, False, pending, task_vars)
