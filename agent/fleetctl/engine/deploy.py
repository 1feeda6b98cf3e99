"""Deploying a kernel package to hosts: preflight, upload, remote build, reference test, then the
activation as a change through the change engine (changes.py), the same one playbooks use.

Per host, under the host's lock: recover a change a killed run left pending -> facts (the
interpreter that runs SGLang, which has torch) -> preflight (probes/kbuild.py: GPU arch, nvcc,
torch CUDA, triton, ninja; the backend: --backend, else `triton` on a GPU host whose SGLang
interpreter imports triton, `cuda` on other GPU hosts, `cpu` without a GPU) -> build key
(kernelpkg.build_key) -> if `/var/lib/fleetctl/kernels/NAME/<key>/PASSED` exists the build is
reused; else upload the package to `<key>/src` (sha256 checked after upload), build into
`<key>/build` (cpu, cuda: torch.utils.cpp_extension; triton: the package's ahead-of-time
compile for the host's arch), test against the reference in a fresh process (on the device
for cuda and triton), mark PASSED -> changes.execute: swap the `current` symlink to
`<key>` (a ledger change, "pending") -> restart handler -> smoke gate (and, with --gate load, the
load gate: SGLang's own benchmark client before and after, engine/load.py) -> "applied", or the
link is switched back.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Callable, TypedDict

from .changes import Change, ChangeOptions, Recovery, change_job, execute, new_change_id, restart_handlers
from ..config import BUILD_DEADLINE_S, PROBE_SLACK_S, TEST_DEADLINE_S
from ..errors import HostFailed
from .context import HostContext, HostResult
from .fleet import Fleet
from .gather import gather, not_inspected
from ..inventory import Host
from .kernelpkg import KernelPackage, build_key
from .load import load_options
from ..vocab import HostStatus


@dataclass
class DeployOptions(ChangeOptions):
    """max_jobs: cap on parallel compile jobs on the host; build_timeout in seconds; check: check
    mode (preflight and build key only: nothing uploaded, built, locked or activated); backend:
    the operator's choice of backend (kernelpkg.BACKENDS; None: preflight chooses per host)."""

    max_jobs: int = 4
    build_timeout: float = BUILD_DEADLINE_S
    check: bool = False
    backend: str | None = None


class DeployData(TypedDict, total=False):
    """A deploy's result data: backend ("triton" | "cuda" | "cpu"), why (how preflight chose it),
    arch (compute capability "9.0", or None), build_key (sha256 hex), previous (the build key
    active before, or None), recovered (changes a killed run left pending), refusals
    (preflight's, for backends it refused), reused (a PASSED build of the key was already
    there), build ({ok, seconds, log_path, timed_out, removed_stale_lock}), test (the reference
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


def _kbuild(ctx: HostContext, python: str, timeout: float | None = None, **params) -> dict:
    return ctx.probe("kbuild", params, python=python, timeout=timeout)


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
    when the build would be activated (data["would_build"]: no PASSED build of its key yet), ok
    when it is already the active one; failed when preflight refuses."""
    def job(ctx: HostContext) -> HostResult:
        _, pre, key, state = _preflight(ctx, pkg, opts)
        current = state["current"]
        data: DeployData = {"check": True, "backend": pre["backend"], "why": pre["why"], "arch": pre["arch"],
                            "build_key": key,
                            "previous": current, "refusals": pre["refusals"], "reused": state["passed"],
                            "would_build": not state["passed"]}
        return ctx.result(HostStatus.OK if current == key else HostStatus.CHANGED, data=data)
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
                   arch: str | None, bdir: str, current: str | None, max_jobs: int, build_timeout: float,
                   data: DeployData) -> None:
    """Upload, build, test and mark PASSED one build dir: `upload(src_dir)` puts the package
    there, `kbuild(action, timeout, **params)` runs one probes/kbuild.py action on the host with
    the SGLang interpreter (`timeout`: seconds, None for the default). Sets data["build"],
    data["test"]. Raises HostFailed (build or test failed: nothing activated)."""
    src, build = f"{bdir}/src", f"{bdir}/build"
    upload(src)
    b = kbuild("build", build_timeout + PROBE_SLACK_S, src_dir=src, build_dir=build, arch=arch,
               deadline_s=build_timeout, max_jobs=max_jobs, **pkg.build_params(backend))
    data["build"] = {k: b.get(k) for k in ("ok", "seconds", "log_path", "timed_out", "removed_stale_lock")}
    if not b["ok"]:
        raise HostFailed(f"build failed ({'deadline' if b['timed_out'] else 'exit %s' % b['rc']}); "
                         f"log {b['log_path']}:\n{b['log_tail']}")
    t = kbuild("test", TEST_DEADLINE_S + PROBE_SLACK_S, src_dir=src, module_path=b["module_path"],
               deadline_s=TEST_DEADLINE_S, **pkg.test_params(backend))
    data["test"] = t.get("result")
    if not t["ok"]:
        raise HostFailed(f"reference test failed, not activated (active build stays {current or 'none'}): "
                         f"{t.get('result') or t.get('stderr_tail')}")
    kbuild("mark", None, build_dir=bdir, module_path=b["module_path"])


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


def kernel_paths(state_dir: str, name: str, key: str) -> tuple[str, str, str]:
    """(kernels dir: the root every activation lies in, the build's dir, the `current` link)
    of package `name`'s build `key` under STATE_DIR/kernels/NAME."""
    return f"{state_dir}/kernels", f"{state_dir}/kernels/{name}/{key}", f"{state_dir}/kernels/{name}/current"


def activation(link: str, current: str | None, key: str) -> list[dict]:
    """The change probe's files of an activation: `link` swapped from `current` (None: no link) to `key`."""
    return [{"path": link, "kind": "link", "pre_target": current, "post_target": key}]


def _preflight(ctx: HostContext, pkg: KernelPackage, opts: DeployOptions) -> tuple[dict, dict, str, dict]:
    """(facts, kbuild preflight answer, build key, kbuild state answer) of `pkg` on the host.
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
    pre = _kbuild(ctx, python, action="preflight", backends=sorted(pkg.backends), backend=opts.backend)
    key = preflight_key(pkg, pre)
    _, bdir, link = kernel_paths(opts.state_dir, pkg.name, key)
    return facts, pre, key, _kbuild(ctx, python, action="state", link=link, build_dir=bdir)


def _deploy(ctx: HostContext, rec: Recovery, pkg: KernelPackage, change_id: str, opts: DeployOptions) -> HostResult:
    facts, pre, key, state = _preflight(ctx, pkg, opts)
    python = facts["python"]["path"]
    backend = pre["backend"]
    root, bdir, link = kernel_paths(opts.state_dir, pkg.name, key)
    current = state["current"]
    data: DeployData = {"backend": backend, "why": pre["why"], "arch": pre["arch"], "build_key": key,
                        "previous": current, "recovered": rec.changes, "refusals": pre["refusals"],
                        "reused": state["passed"]}
    result = ctx.result(HostStatus.OK, data=data)
    if not data["reused"]:
        build_and_test(lambda action, timeout, **p: _kbuild(ctx, python, timeout, action=action, **p),
                       lambda src: _upload(ctx, pkg, src), pkg, backend, pre["arch"], bdir, current, opts.max_jobs,
                       opts.build_timeout, data)
    if current == key:
        return result
    change = Change(change_id, f"kernel {pkg.name}", activation(link, current, key), facts, root,
                    restart_handlers(ctx), load=load_options(opts.load_settings) if opts.load_gate else None)
    execute(ctx, result, change, opts)
    if result.status == HostStatus.FAILED:
        result.error = f"switched back to {current or 'no build'}: " + result.error.removeprefix("rolled back: ")
    return result
