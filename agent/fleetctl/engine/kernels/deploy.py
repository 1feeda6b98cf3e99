"""Deploying a kernel package to hosts: preflight, upload, remote build, reference test, publish,
then the activation (the `current` link and the dispatch table) as a change through the change
engine (changes.py), the same one playbooks use.

Per host, under the host's lock: recover a change a killed run left pending -> facts (the
interpreter that runs SGLang, which has torch) -> preflight (probes/kernel/preflight.py: GPU arch, nvcc,
torch CUDA, triton, ninja; the backend: --backend, else `triton` on a GPU host whose SGLang
interpreter imports triton, `cuda` on other GPU hosts, `cpu` without a GPU) -> build key
(package.build_key) -> if the build is published (`PUBLIC/NAME/<key>/PASSED`, PUBLIC =
config.PUBLIC_KERNELS_DIR) or passed privately (`STATE_DIR/kernels/NAME/<key>/PASSED`) it is
reused; else upload the package to the private `<key>/src` (sha256 checked after upload), build
into `<key>/build` (cpu, cuda: torch.utils.cpp_extension; triton: the package's ahead-of-time
compile for the host's arch), test against the reference in a fresh process (on the device for
cuda and triton), mark PASSED -> publish (kbuild `publish`: a root-owned 0755/0644 copy at
`PUBLIC/NAME/<key>`, which an unprivileged server can read) -> the dispatch table
(engine/kernels/dispatch.py: --route as the operator gave it; else measured on a GPU host,
engine/kernels/measure.py; else "none") -> changes.execute: `PUBLIC/NAME/current` swapped to `<key>`
and `PUBLIC/NAME/dispatch.json` written, one ledger change ("pending"; root PUBLIC/NAME) ->
restart handler -> the gates (deploy_gates: the smoke gate; with --gate load, the load gate:
SGLang's own benchmark client before and after; on an install with the route hook, the route
gate: the build just activated must be the one routed) -> "applied", or link and table are put
back. The
same key with a table that routes the same (dispatch.same_routing) is nothing to do; the same
key with another table writes only the table.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from dataclasses import dataclass
from typing import Callable, TypedDict

from ..changes import (ApplyEntry, Change, ChangeOptions, FileWrite, LinkSwap, Recovery, change_job, execute,
                       new_change_id, restart_handlers)
from ..gates import Gate
from ..gates.load import LoadGate
from ..gates.route import RouteGate
from ..gates.smoke import SmokeGate
from ...config import BUILD_DEADLINE_S, PROBE_SLACK_S, PUBLIC_KERNELS_DIR, TEST_DEADLINE_S
from . import dispatch
from ...errors import HostFailed
from ..context import HostContext, HostResult
from ..fleet import Fleet
from ..gather import gather, not_inspected
from ...inventory import Host
from ...probes.facts.verifyroute import HOOK
from .package import KernelPackage, build_key
from ..load import load_options
from .measure import measured_table
from ...vocab import HostStatus


@dataclass
class DeployOptions(ChangeOptions):
    """max_jobs: cap on parallel compile jobs on the host; build_timeout in seconds; check: check
    mode (preflight and build key only: nothing uploaded, built, locked or activated); backend:
    the operator's choice of backend (package.BACKENDS; None: preflight chooses per host);
    route: the operator's --route as dispatch.parse_route gives it ("all", ["64:2:4:float32:8",
    ...]; None: measured on a GPU host, nothing routed without one)."""

    max_jobs: int = 4
    build_timeout: float = BUILD_DEADLINE_S
    check: bool = False
    backend: str | None = None
    route: str | list[str] | None = None


class DeployData(TypedDict, total=False):
    """A deploy's result data: backend ("triton" | "cuda" | "cpu"), why (how preflight chose it),
    arch (compute capability "9.0", or None), build_key (sha256 hex), previous (the build key
    active before, or None), recovered (changes a killed run left pending), refusals
    (preflight's, for backends it refused), reused (a PASSED build of the key was already
    there), build ({ok, seconds, log_path, timed_out, ran_as}), test (the reference
    test's result); the change engine adds change_id, handlers, validation. In
    check mode: check (True) and would_build instead of recovered, build and test."""

    backend: str | None
    why: str
    arch: str | None
    build_key: str
    previous: str | None
    recovered: list
    refusals: list
    reused: bool
    build: dict
    test: dict | None
    check: bool
    would_build: bool
    published: str
    table: dict | None
    table_note: str
    hooked: bool


def _kbuild(ctx: HostContext, python: str, timeout: float | None = None, **params) -> dict:
    """One probes/kernel/kbuild.py action on the host under `python`, with the inventory's
    fleetctl_unprivileged_user (whom its children run as, with params' server_pids: build.account).
    The action (build, publish, test, mark, ...) is the host's phase (HostContext.phase)."""
    ctx.phase(params.get("action") or "kbuild")
    return ctx.probe("kernel.kbuild", {**params, "unprivileged_user": ctx.host.unprivileged_user}, python=python,
                     timeout=timeout)


def _server_pids(facts: dict) -> list[int]:
    """The pids of the servers in `facts` (the install's: the builds run as their uid)."""
    return [s["pid"] for s in facts.get("servers") or [] if isinstance(s.get("pid"), int)]


def _upload(ctx: HostContext, pkg: KernelPackage, src_dir: str) -> None:
    """Put every package file under src_dir; each upload is checked against its sha256 on the
    host before it is renamed into place (Connection.put_bytes)."""
    for rel, data in pkg.files().items():
        try:
            ctx.conn.put_bytes(data, posixpath.join(src_dir, rel), timeout=ctx.remaining())
        except OSError as e:  # the host's refusals: permission denied, no space left, a damaged upload
            raise HostFailed(f"cannot upload {rel} to {src_dir}: {e}") from None


def deploy_job(pkg: KernelPackage, change_id: str, opts: DeployOptions):
    """The deploy job for one host (see the module docstring)."""
    return change_job(opts.state_dir, lambda ctx, rec: _deploy(ctx, rec, pkg, change_id, opts))


def check_job(pkg: KernelPackage, opts: DeployOptions):
    """The check-mode job for one host: what a deploy would do, changing nothing. Status changed
    when the build would be activated or the dispatch table rewritten (data["would_build"]: no
    passed build of its key yet; data["table"]: the table it would write, None where a deploy
    would measure it), ok when both are in force already; failed when preflight refuses."""
    def job(ctx: HostContext) -> HostResult:
        facts, pre, key, state = _preflight(ctx, pkg, opts)
        current = state["current"]
        data: DeployData = {"check": True, "backend": pre["backend"], "why": pre["why"], "arch": pre["arch"],
                            "build_key": key,
                            "previous": current, "refusals": pre["refusals"],
                            "reused": state["passed"] or state["published"],
                            "would_build": not (state["passed"] or state["published"]), "hooked": state["hooked"]}
        if opts.route is None and pre["backend"] in MEASURED_BACKENDS:
            data["table"], data["table_note"] = None, "measured on the host's GPU by the deploy (check mode measures nothing)"
            same = False
        else:
            data["table"] = _table(ctx, "", pkg, pre["backend"], key, None, facts, opts)
            same = dispatch.same_routing(on_host_table(state["table"]), data["table"])
        return ctx.result(HostStatus.OK if current == key and same else HostStatus.CHANGED, data=data)
    return job


def run_deploy(fleet: Fleet, hosts: list[Host], pkg: KernelPackage,
               opts: DeployOptions) -> tuple[str | None, list[HostResult]]:
    """`fleetctl deploy kernel`: deploy `pkg` to `hosts` under one new change id (check mode:
    no change id, check_job). Returns (change id or None, results in inventory order)."""
    if opts.check:
        return None, fleet.run(hosts, check_job(pkg, opts), f"deploy {pkg.name} (check)")
    cid = new_change_id(f"kernel-{pkg.name}")
    return cid, fleet.run(hosts, deploy_job(pkg, cid, opts), f"deploy {pkg.name}")


def build_and_test(kbuild: Callable[..., dict], upload: Callable[[str], None], pkg: KernelPackage, backend: str,
                   arch: str | None, bdir: str, pdir: str, current: str | None, max_jobs: int, build_timeout: float,
                   data: DeployData) -> None:
    """Upload, build, publish untested, test the published copy and mark PASSED one build:
    `upload(src_dir)` puts the package there, `kbuild(action, timeout, **params)` runs one
    probes/kernel/kbuild.py action on the host with the SGLang interpreter (`timeout`: seconds,
    None for the default); `bdir` the private build dir, `pdir` its published one
    (PUBLIC/NAME/<key>): the reference test runs on what is activated, as an unprivileged uid
    that cannot change it (issue 48). Sets data["build"], data["test"]. Raises HostFailed (build,
    publish or test failed: nothing activated; an untested copy has no PASSED, and the next
    publish replaces it)."""
    src, build = f"{bdir}/src", f"{bdir}/build"
    upload(src)
    b = kbuild("build", build_timeout + PROBE_SLACK_S, src_dir=src, build_dir=build, arch=arch,
               deadline_s=build_timeout, max_jobs=max_jobs, **pkg.build_params(backend))
    data["build"] = {k: b.get(k) for k in ("ok", "seconds", "log_path", "timed_out", "ran_as")}
    if not b["ok"]:
        raise HostFailed(f"build failed ({'deadline' if b['timed_out'] else 'exit %s' % b['rc']}); "
                         f"log {b['log_path']}:\n{b['log_tail']}")
    p = kbuild("publish", None, build_dir=bdir, public_dir=pdir, untested=b["module_path"])
    if not p["ok"]:
        raise HostFailed(f"{p['error']} (active build stays {current or 'none'})")
    t = kbuild("test", TEST_DEADLINE_S + PROBE_SLACK_S, src_dir=f"{pdir}/src", module_path=p["module_path"],
               deadline_s=TEST_DEADLINE_S, **pkg.test_params(backend))
    data["test"] = t.get("result")
    if not t["ok"]:
        raise HostFailed(f"reference test failed, not activated (active build stays {current or 'none'}): "
                         f"{t.get('result') or t.get('stderr_tail')}")
    kbuild("mark", None, build_dir=bdir, module_path=b["module_path"], public_dir=pdir, public_module=p["module_path"])


def preflight_key(pkg: KernelPackage, pre: dict) -> str:
    """The build key of `pkg` for a host from its kbuild preflight answer ({"backend", "choice",
    "why", "arch", "facts": {"torch", "nvcc", "triton"}}): for triton, torch's and triton's
    versions and the arch (nvcc is not used); for cuda, torch's, its CUDA's and nvcc's versions
    and the arch. Raises HostFailed "preflight refused the CHOICE backend (WHY): ..." when the
    backend cannot be built there."""
    if pre["backend"] is None:
        raise HostFailed(f"preflight refused the {pre['choice']} backend ({pre['why']}): " + "; ".join(pre["refusals"]))
    facts = pre["facts"]
    torch, nvcc, triton = facts.get("torch") or {}, facts.get("nvcc") or {}, facts.get("triton") or {}
    if pre["backend"] == "triton":
        return build_key(pkg, "triton", torch.get("version"), None, None, pre["arch"], triton.get("version"))
    return build_key(pkg, pre["backend"], torch.get("version"), torch.get("cuda"), nvcc.get("version"), pre["arch"])


def private_dir(state_dir: str, name: str, key: str) -> str:
    """STATE_DIR/kernels/NAME/<key>: where package `name`'s build `key` is uploaded, built and
    tested (root's 0700 state dir), before kbuild's publish copies it to public_paths' build."""
    return f"{state_dir}/kernels/{name}/{key}"


def public_paths(name: str, key: str, public: str = PUBLIC_KERNELS_DIR) -> dict[str, str]:
    """Where package `name`'s build `key` is published: {"root": PUBLIC/NAME (the activation's
    change root), "build": PUBLIC/NAME/<key>, "link": PUBLIC/NAME/current, "table":
    PUBLIC/NAME/dispatch.json}."""
    root = f"{public}/{name}"
    return {"root": root, "build": f"{root}/{key}", "link": f"{root}/current", "table": f"{root}/{dispatch.FILE}"}


def table_item(path: str, on_host: dict | None, table: dict) -> FileWrite:
    """The change probe's file item that writes `table` (dispatch.text) to `path`, over what
    the kbuild state action read there (`on_host`: None when absent, {"sha256", "text"}).
    Raises HostFailed when the state action could not read it ({"error"}: a link, not a
    regular file, too big)."""
    if on_host is not None and "error" in on_host:
        raise HostFailed(f"the dispatch table is not replaced: {on_host['error']}")
    new = dispatch.text(table)
    return FileWrite(path=path, pre_sha256=on_host["sha256"] if on_host else None,
                     post_sha256=hashlib.sha256(new.encode("utf-8")).hexdigest(), new_text=new)


def activation(link: str, current: str | None, key: str, table: FileWrite | None = None) -> list[ApplyEntry]:
    """The change probe's files of an activation: `link` swapped from `current` (None: no link) to
    `key` (left out when `table` is given and `current` is `key` already), then `table` (a
    table_item) when given: link and table are one change, rolled back together."""
    files: list[ApplyEntry] = [] if table is not None and current == key else [
        LinkSwap(path=link, kind="link", pre_target=current, post_target=key)]
    return files + ([table] if table is not None else [])


# backends whose table deploy measures when the operator gives no --route (a GPU to time on)
MEASURED_BACKENDS = ("cuda", "triton")


def on_host_table(answer: dict | None) -> dict | None:
    """The dispatch table the kbuild state action read (None, {"sha256", "text"}, {"error"}) as
    a dict, or None when absent, unreadable or not a JSON object."""
    if not answer or "text" not in answer:
        return None
    try:
        table = json.loads(answer["text"])
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return None
    return table if isinstance(table, dict) else None


def _table(ctx: HostContext, python: str, pkg: KernelPackage, backend: str, key: str, module_path: str | None,
           facts: dict, opts: DeployOptions) -> dict:
    """The dispatch table a deploy writes: the operator's --route (source "operator"); else on a
    GPU host (MEASURED_BACKENDS) the one measured there (engine/kernels/measure.py's measured_table);
    else none_table's."""
    if opts.route is not None:
        return dispatch.operator_table(pkg.name, key, backend, opts.route)
    if backend in MEASURED_BACKENDS:
        return measured_table(ctx, python, pkg, module_path, key, backend, facts)
    return dispatch.none_table(pkg.name, key, backend)


def _preflight(ctx: HostContext, pkg: KernelPackage, opts: DeployOptions) -> tuple[dict, dict, str, dict]:
    """(facts, kbuild preflight answer, build key, kbuild state answer) of `pkg` on the host:
    state over PUBLIC/NAME/current, the private build dir, the published one, the dispatch table
    and the install's route hook module (HOOK under facts["sglang"]["location"]).
    Raises HostFailed when the install SGLang runs from (a server's, or the only one seen) was
    not inspected (gather.not_inspected): its interpreter, which the kernel is built for, was
    not asked."""
    g = gather(ctx, scan=False)
    facts = g["facts"]
    unseen = not_inspected(g)
    blocked = [e["reason"] for e in unseen if e["servers"]] or ([e["reason"] for e in unseen] if not g.get("installs") else [])
    if blocked:
        raise HostFailed("; ".join(blocked))
    python = facts["python"]["path"]
    pre = _kbuild(ctx, python, action="preflight", backends=sorted(pkg.backends), backend=opts.backend,
                  server_pids=_server_pids(facts))
    key = preflight_key(pkg, pre)
    bdir = private_dir(opts.state_dir, pkg.name, key)
    pub = public_paths(pkg.name, key)
    location = (facts.get("sglang") or {}).get("location")
    state = _kbuild(ctx, python, action="state", link=pub["link"], build_dir=bdir, public_dir=pub["build"],
                    table=pub["table"], hook=posixpath.join(location, HOOK) if location else None)
    return facts, pre, key, state


def deploy_gates(name: str, key: str, hooked: bool, opts: DeployOptions) -> list[Gate]:
    """The gates of the activation of package `name`'s build `key`, in the order they run: the
    smoke gate; the load gate with --gate load (opts.load_settings); the route gate where the
    install has the route hook (`hooked`: kbuild state), which must see this very build routed.
    Raises ValueError (load.load_options)."""
    gates: list[Gate] = [SmokeGate()]
    if opts.load_gate:
        gates.append(LoadGate(load_options(opts.load_settings)))
    if hooked:
        gates.append(RouteGate(name, key))
    return gates


def _deploy(ctx: HostContext, rec: Recovery, pkg: KernelPackage, change_id: str, opts: DeployOptions) -> HostResult:
    facts, pre, key, state = _preflight(ctx, pkg, opts)
    python = facts["python"]["path"]
    backend = pre["backend"]
    bdir = private_dir(opts.state_dir, pkg.name, key)
    pub = public_paths(pkg.name, key)
    current = state["current"]
    data: DeployData = {"backend": backend, "why": pre["why"], "arch": pre["arch"], "build_key": key,
                        "previous": current, "recovered": rec.changes, "refusals": pre["refusals"],
                        "reused": state["passed"] or state["published"], "hooked": state["hooked"]}
    result = ctx.result(HostStatus.OK, data=data)
    if not data["reused"]:
        build_and_test(lambda action, timeout, **p: _kbuild(ctx, python, timeout, action=action,
                                                            server_pids=_server_pids(facts), **p),
                       lambda src: _upload(ctx, pkg, src), pkg, backend, pre["arch"], bdir, pub["build"], current,
                       opts.max_jobs, opts.build_timeout, data)
    published = _kbuild(ctx, python, action="publish", build_dir=bdir, public_dir=pub["build"],
                        server_pids=_server_pids(facts))
    if not published["ok"]:
        raise HostFailed(f"{published['error']} (active build stays {current or 'none'})")
    data["published"] = published["published"]
    table = _table(ctx, python, pkg, backend, key, published["module_path"], facts, opts)
    old = on_host_table(state["table"])
    if current == key and dispatch.same_routing(old, table):
        data["table"] = old
        return result
    data["table"] = table
    change = Change(change_id, f"kernel {pkg.name}",
                    activation(pub["link"], current, key, table_item(pub["table"], state["table"], table)), facts,
                    pub["root"], restart_handlers(ctx), gates=deploy_gates(pkg.name, key, state["hooked"], opts))
    execute(ctx, result, change, opts)
    if result.status == HostStatus.FAILED:
        data["table"] = old
        back = "the dispatch table put back" if current == key else f"switched back to {current or 'no build'}"
        result.error = f"{back}: " + result.error.removeprefix("rolled back: ")
    return result
