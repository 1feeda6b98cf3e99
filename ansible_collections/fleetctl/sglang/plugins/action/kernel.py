# -*- coding: utf-8 -*-
# Copyright: (c) 2026, fleetctl maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""fleetctl.sglang.kernel on the controller: load the package, find the SGLang interpreter (inspect
module), preflight and build key, then, as `fleetctl deploy kernel` does (engine/kernels/deploy.py), build
privately (STATE_DIR/kernels/NAME/<key>: transfer, build, test and mark on the host, the kernel
module's steps, deploy.build_and_test) unless a passed or published build of the key is there,
publish it (PUBLIC/NAME/<key>, kbuild's publish), and activate the `current` link and the dispatch
table (the task's `route`, else one that routes nothing: ops.kernel_table) as one ledger change
with the patch module's host side, under the play's lease on fleetctl's host lock (the lock
module: renewed, or taken when the play holds none). The same key with a table that routes the
same (dispatch.same_routing) is nothing to do."""

from __future__ import annotations

import functools

from ansible.plugins.action import ActionBase
from ansible_collections.fleetctl.sglang.plugins.module_utils import pins

MODULE = "fleetctl.sglang.kernel"
PATCH = "fleetctl.sglang.patch"
INSPECT = "fleetctl.sglang.inspect"


class ActionModule(ActionBase):
    """See the module's documentation."""

    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(("name", "kernels_dir", "state", "change_id", "commit", "force", "max_jobs",
                             "build_timeout", "state_dir", "route"))

    def _module(self, name, args, task_vars):
        return self._execute_module(module_name=name, module_args=args, task_vars=task_vars)

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        args = self._task.args
        state_dir = args.get("state_dir") or "/var/lib/fleetctl"
        if args.get("state", "activated") == "rolled_back":
            result.update(self._module(PATCH, {"state": "rolled_back", "change_id": args.get("change_id"),
                                               "force": args.get("force", False), "state_dir": state_dir}, task_vars))
            return result
        try:
            from fleetctl.collection import ops
            from fleetctl.engine.kernels import deploy, dispatch
            from fleetctl.errors import HostFailed, ParseError, UsageError
        except ImportError as e:
            return dict(result, failed=True, msg="fleetctl is not importable on the controller: %s" % e)

        def step(action, timeout=None, /, **params):  # one kernel module step, under a deadline; a failure ends the task
            # its children run as the install's servers' uid, else the owner's, else the inventory's
            # fleetctl_unprivileged_user or nobody (probes/runas.py), as the CLI's deploy runs them
            params = dict(params, server_pids=servers, unprivileged_user=host.unprivileged_user)
            args_ = {"step": action, "python": python, "params": params}
            if timeout is not None:  # build and test: their own deadline plus slack (deploy.build_and_test)
                args_["timeout"] = timeout
            res = self._module(MODULE, args_, task_vars)
            if res.get("failed"):
                raise HostFailed(res.get("msg"))
            return res["answer"]

        try:
            ops.check_pins(pins.FLEETCTL_VERSION, pins.PROBE_SHA256)
            route = ops.kernel_route(args.get("route"))
            host = ops.host_from_vars(task_vars["inventory_hostname"], task_vars, self._templar.template)
            pkg = ops.kernel_package(args.get("name"), args.get("kernels_dir"))
            gathered = self._module(INSPECT, {"python": host.python, "scan": False}, task_vars)
            if gathered.get("failed"):
                raise HostFailed("inspect: %s" % gathered.get("msg"))
            python = gathered["facts"]["python"]["path"]
            servers = [s["pid"] for s in gathered["facts"].get("servers") or [] if isinstance(s.get("pid"), int)]
            pre = step("preflight", backends=sorted(pkg.backends))
            key = deploy.preflight_key(pkg, pre)
            private, pub = deploy.private_dir(state_dir, pkg.name, key), deploy.public_paths(pkg.name, key)
            st = step("state", link=pub["link"], build_dir=private, public_dir=pub["build"], table=pub["table"],
                      hook=None)
            current = st["current"]
            reused = st["passed"] or st["published"]
            table = ops.kernel_table(pkg, key, pre["backend"], route)
            old = deploy.on_host_table(st["table"])
            same = current == key and dispatch.same_routing(old, table)
            result.update(backend=pre["backend"], arch=pre["arch"], build_key=key, previous=current, reused=reused,
                          refusals=pre["refusals"])
            if self._task.check_mode:  # the table it would write; a change unless published and in force already
                result.update(table=old if same else table, changed=not (same and st["published"]))
                return result
            if not reused:
                deploy.build_and_test(
                    step, lambda src: step("upload", src_dir=src, files=ops.transfer(pkg)), pkg,
                    pre["backend"], pre["arch"], private, pub["build"], current, int(args.get("max_jobs", 4)),
                    float(args.get("build_timeout", 1800)), result)
            published = step("publish", build_dir=private, public_dir=pub["build"])
            if not published["ok"]:
                raise HostFailed("%s (active build stays %s)" % (published["error"], current or "none"))
            result["published"] = published["published"]
            if same:  # nothing to activate; a build or a publish of the key is still a change on the host
                result.update(table=old, changed=not reused or not published["reused"])
                return result
            plan = ops.kernel_change(pkg, pub["root"], pub["link"], current, key,
                                     deploy.table_item(pub["table"], st["table"], table),
                                     "ansible@%s" % task_vars.get("inventory_hostname"), host.shared_tree)
            # the activation is written under the play's lease on fleetctl's host lock (renewed, or
            # taken here when the play holds none), as the patch action writes a change
            lock = functools.partial(self._module, task_vars=task_vars)
            fact = ops.hold_lease(lock, ops.held_lease(task_vars, state_dir), state_dir)
            wrote = self._module(PATCH, {"plan": plan, "commit": bool(args.get("commit")), "state_dir": state_dir},
                                 task_vars)
            fact = ops.settle_lease(lock, fact, bool(wrote.get("failed")), wrote.get("pending"))
            result["ansible_facts"] = {ops.LEASE_FACT: fact}
            if wrote.get("failed"):
                raise HostFailed("activation: %s" % wrote.get("msg"))
        except (HostFailed, ParseError, UsageError) as e:
            return dict(result, failed=True, msg=str(e))
        result.update(change_id=plan["change_id"], table=table, changed=True)
        return result
