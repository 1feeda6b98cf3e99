"""The controller side of the `fleetctl.sglang` collection's action plugins (pure: no host touched).

The action plugins (ansible_collections/fleetctl/sglang/plugins/action/) gather with the inspect
module, then call in here to turn Ansible's task vars into a fleetctl `Host`, plan with
fleetctl's own planner and the playbook's templates (apply.plan_installs, the same code as
`fleetctl apply`), shape the plan into the change module's argument and the result into
Ansible's (changed, diff as fleetctl's own unified diffs), and gate a smoke decode against a
baseline (engine/gates/smoke.gate), and keep the play's lease on fleetctl's host lock (the lock module,
run through the plugin's own `run`). Running modules stays in the plugins.
"""

from __future__ import annotations

from typing import Any, Callable

import base64
import hashlib
import math

from .. import __version__
from . import build
from ..engine.playbooks.apply import host_side, install_change_id, plan_installs, reinspect_install
from ..engine.changes import new_change_id
from ..engine.kernels import dispatch
from ..engine.kernels.deploy import activation
from ..errors import HostFailed, UsageError
from ..inventory import Host
from ..inventory.templates import needed
from ..engine.kernels.package import KernelPackage, load_package
from ..paths import find_playbook, project_dir
from ..engine.playbooks.model import Playbook, load_playbook
from ..engine.playbooks.plan import HostPlan
from ..engine.gates.smoke import gate
from ..engine.validate import SmokeOptions, smoke_targets
from ..vocab import PlanStatus

LOCK = "fleetctl.sglang.lock"
# The fact the lock module sets (and the patch and smoke plugins keep): the play's lease, {} when it holds none.
LEASE_FACT = "fleetctl_lease"
LEASE_S = 300  # the lock module's default lease_s: what a lease lasts from its last renewal (seconds)
AUTO_HOLDER = "ansible-playbook (fleetctl.sglang)"  # the holder of a lease a plugin took because the play held none
OFFLINE_TIMEOUT_S = 600  # the smoke probe's default offline_timeout (probes/traffic/smoke.py main)


def check_pins(version: str, probe_sha256: str) -> None:
    """Refuse (HostFailed) a collection built from another fleetctl than this controller's: its
    modules' probes and this planner must be the same release (module_utils/pins.py)."""
    here = build.probe_hash()
    if version != __version__ or probe_sha256 != here:
        raise HostFailed(f"collection fleetctl.sglang was built for fleetctl {version} (probes {probe_sha256[:12]}), "
                         f"this controller runs fleetctl {__version__} (probes {here[:12]}): rebuild it with "
                         "`fleetctl collection build` or install the matching fleetctl")


def host_from_vars(name: str, task_vars: dict, template: Callable[[Any], Any]) -> Host:
    """A fleetctl Host named `name` from Ansible's task vars: the vars fleetctl reads
    (inventory.templates.needed), each rendered by `template` (the action plugin's templar)."""
    return Host(name, {k: template(v) for k, v in task_vars.items() if needed(k)}, ())


def load(playbook: str, playbooks_dir: str | None) -> Playbook:
    """The fleetctl playbook named `playbook` (a name in the playbooks dir, or a .yaml path).
    Raises ParseError."""
    return load_playbook(find_playbook(playbook, playbooks_dir))


def plan(playbook: Playbook, host: Host, gathered: dict, install: str | None) -> list[tuple[dict | None, HostPlan]]:
    """Plan each selected install (see apply.plan_installs). Raises HostFailed: a failed plan
    (refused, e.g. the file changed since inspect) with its reasons."""
    plans = plan_installs(playbook, host, host_side(gathered), install)  # the collection enters no container
    failed = [f"{p.install}: {p.reason}" for _, p in plans if p.status == PlanStatus.FAILED]
    if failed:
        raise HostFailed("; ".join(failed))
    return plans


def diffs(plans: list[tuple[dict | None, HostPlan]]) -> list[dict]:
    """Ansible's result "diff": one {"prepared": text} per planned file, the text being the same
    unified diff `fleetctl apply --check --diff` prints."""
    return [{"prepared": f.diff} for _, p in plans for f in p.files]


def summary(plans: list[tuple[dict | None, HostPlan]]) -> list[dict]:
    """The plans as reported in the result: per install its status, reason, files (path,
    sha256s), edits, already applied and left alone sites, handlers."""
    out = []
    for _, p in plans:
        d = p.to_dict()
        d["files"] = [{k: f[k] for k in ("path", "pre_sha256", "post_sha256")} for f in d["files"]]
        out.append(d)
    return out


def changes(playbook: Playbook, plans: list[tuple[dict | None, HostPlan]], operator: str,
            shared_tree: bool) -> list[tuple[dict | None, HostPlan, dict]]:
    """[(install, plan, the change module's `plan` argument)] for each plan that changes: a
    fresh change id per run (install_change_id per install), the files with their pre-image and
    post-image sha256 and new text, the root every file must lie in."""
    changing = [(inst, p) for inst, p in plans if p.status == PlanStatus.CHANGE]
    cid = new_change_id(playbook.name)
    out = []
    for n, (inst, p) in enumerate(changing, start=1):
        sg = inst["sglang"]
        out.append((inst, p, {
            "change_id": install_change_id(cid, n, len(changing)), "playbook": playbook.name, "operator": operator,
            "install": p.install, "root": sg.get("package_dir") or sg["location"], "shared_tree": shared_tree,
            "files": [{"path": f.path, "pre_sha256": f.pre_sha256, "post_sha256": f.post_sha256,
                       "new_text": f.new_text} for f in p.files]}))
    return out


def checks(playbook: Playbook, plan_: HostPlan) -> set[str]:
    """The validate steps of the plan ("compile", "reinspect", "smoke")."""
    return {v["step"] for v in plan_.validate}


def reinspect(playbook: Playbook, plan_: HostPlan, host: Host, inst: dict | None, gathered: dict) -> list[str]:
    """The playbook's reinspect check against facts gathered after the write (apply.reinspect_install)."""
    return reinspect_install(playbook, plan_, host, inst, gathered)


def smoke_params(host: Host, facts: dict | None, opts: SmokeOptions, offline_cmd: str | None,
                 request_timeout: float) -> dict:
    """The smoke module's arguments: the targets (validate.smoke_targets), waits, the offline
    command (the task's, else the host's fleetctl_smoke_cmd) and the servers' API key."""
    return {"servers": smoke_targets(host, facts, opts), "health_timeout": opts.health_timeout,
            "repeat": opts.repeat, "request_timeout": request_timeout,
            "offline_cmd": offline_cmd or host.smoke_cmd, "api_key": host.sglang_api_key,
            "server_user": host.server_user}


def smoke_bound_s(params: dict) -> float:
    """The longest the smoke module can run with `params` (smoke_params' answer), in seconds: per server named (at
    least one) its health wait and its requests (model and server info, the warm-up, `repeat` decodes, each within
    request_timeout), and the offline command's timeout. What a lease must cover beyond its own lease_s while the
    smoke decode runs."""
    per_server = params["health_timeout"] + (params["repeat"] + 3) * params["request_timeout"]
    return max(1, len(params["servers"])) * per_server + (OFFLINE_TIMEOUT_S if params.get("offline_cmd") else 0)


def held_lease(task_vars: dict, state_dir: str) -> dict:
    """The play's lease in state_dir as its fact (LEASE_FACT in task_vars' ansible_facts: the lock module's `lease`,
    plus "state_dir" and "auto"), or {} when the play holds none there. Facts, not inventory vars: an inventory
    cannot name a lease as the play's."""
    fact = (task_vars.get("ansible_facts") or {}).get(LEASE_FACT)
    ok = isinstance(fact, dict) and fact.get("token") and fact.get("state_dir", state_dir) == state_dir
    return dict(fact) if ok else {}


def hold_lease(run: Callable[[str, dict], dict], fact: dict, state_dir: str, extra_s: float = 0.0) -> dict:
    """Renew the play's lease `fact` (held_lease), or take a lease when it holds none (or its lease is void), for
    its lease_s (LEASE_S when new) + `extra_s` seconds from now, with the lock module (`run(module, args)`: its
    result). Returns the new fact: the lease, "state_dir", "lease_s" (the play's length, without extra_s) and "auto"
    (true when a plugin took it, not the play's lock task). Raises HostFailed with the lock module's reason (another
    run holds the lock: its holder and since when)."""
    lease_s = fact.get("lease_s") if isinstance(fact.get("lease_s"), int) and fact["lease_s"] >= 1 else LEASE_S
    args = {"state": "acquired", "state_dir": state_dir, "lease_s": int(math.ceil(lease_s + extra_s)),
            "holder": fact["holder"] if isinstance(fact.get("holder"), str) else AUTO_HOLDER}
    if isinstance(fact.get("token"), str):
        args["token"] = fact["token"]
    got = run(LOCK, args)
    if got.get("failed") or not isinstance(got.get("lease"), dict):
        raise HostFailed(f"no lease on fleetctl's host lock: {got.get('msg') or 'the lock module gave none'}")
    lease = got["lease"]
    renewed = lease.get("token") == fact.get("token")
    return dict(lease, state_dir=state_dir, lease_s=lease_s, auto=bool(fact.get("auto")) if renewed else True)


def settle_lease(run: Callable[[str, dict], dict], fact: dict, failed: bool, pending: list | None) -> dict:
    """End a lease a plugin took itself (fact "auto") when the task failed or leaves nothing pending in the
    ledger (`pending`: the patch module's list; None: unknown, kept), with the lock module (`run`). Returns the
    fact to set: {} when released, else `fact`. A lease of the play's own lock task is left to it."""
    if not fact.get("auto") or (not failed and (pending is None or pending)):
        return fact
    run(LOCK, {"state": "released", "token": fact["token"], "state_dir": fact["state_dir"]})
    return {}


def gate_verdict(host: Host, baseline: dict, after: dict, opts: SmokeOptions) -> dict:
    """The validation gate of `after` against `baseline` (gates.smoke.gate): its to_dict(), with
    "failed" (bool) and "message"."""
    verdict = gate(host, baseline, after, opts)
    return {**verdict.to_dict(), "failed": verdict.failed, "message": verdict.message}


def kernel_package(name: str, kernels_dir: str | None) -> KernelPackage:
    """Kernel package `name` from `kernels_dir` (default fleetctl's own kernels/). Raises ParseError."""
    return load_package(project_dir("kernels", kernels_dir), name)


def transfer(pkg: KernelPackage) -> dict[str, dict]:
    """The kernel module's upload argument: {relpath: {"b64": content, "sha256": hex}} of every
    package file (KernelPackage.files)."""
    return {rel: {"b64": base64.b64encode(data).decode(), "sha256": hashlib.sha256(data).hexdigest()}
            for rel, data in pkg.files().items()}


# the why of the table the kernel module writes without a `route`: it measures nothing (dispatch.describe shows
# the part before the first colon)
UNMEASURED = ("fleetctl.sglang.kernel measures nothing: a measured table comes from `fleetctl deploy kernel` on a "
              "GPU host; nothing routes unless route: all or route: SHAPES")


def kernel_route(route: Any) -> str | list[str] | None:
    """The kernel module's `route` task argument (None, "all", a shape spec, or a list of them:
    dispatch.SHAPE_FORM, each string may hold several, comma-separated) as the dispatch table's
    "route" (dispatch.parse_route: None, "all" or the shape specs). Raises UsageError "route: ..."
    for another type or a spec parse_route refuses."""
    if route is None:
        return None
    specs = [route] if isinstance(route, str) else route
    if not isinstance(specs, list) or not specs or not all(isinstance(s, str) for s in specs):
        raise UsageError(f"route: expected all or a list of {dispatch.SHAPE_FORM}, not {route!r}")
    try:
        return dispatch.parse_route(specs)
    except dispatch.RouteError as e:
        raise UsageError(f"route: {e}") from None  # the task's argument, as the CLI names its flag


def kernel_table(pkg: KernelPackage, key: str, backend: str, route: str | list[str] | None) -> dict:
    """The dispatch table the kernel module writes for build `key` of `pkg` (dispatch.py's shape):
    the task's `route` (kernel_route's answer) as the operator's table, else one that routes
    nothing (why UNMEASURED: the collection measures no speedup, even on a GPU host)."""
    if route is not None:
        return dispatch.operator_table(pkg.name, key, backend, route)
    return dispatch.none_table(pkg.name, key, backend, why=UNMEASURED)


def kernel_change(pkg: KernelPackage, root: str, link: str, current: str | None, key: str, table: dict,
                  operator: str, shared_tree: bool) -> dict:
    """The patch module's `plan` argument that activates build `key` with its dispatch table
    (deploy.activation): `link` swapped from `current` to `key` (left out when `current` is `key`
    already) and `table`, the dispatch table's change probe file item (deploy.table_item), as one
    change; a fresh "kernel-NAME" change id, ledger label "kernel NAME" (what `fleetctl deploy
    kernel` writes), every file inside `root` (PUBLIC/NAME: deploy.public_paths' "root")."""
    return {"change_id": new_change_id(f"kernel-{pkg.name}"), "playbook": f"kernel {pkg.name}", "operator": operator,
            "install": None, "root": root, "shared_tree": shared_tree, "files": activation(link, current, key, table)}
