"""Deploying a kernel package to hosts: preflight, upload, remote build, reference test, then the
activation as a change through the change engine (changes.py), the same one playbooks use.

Per host, under the host's lock: recover a change a killed run left pending -> facts (the
interpreter that runs SGLang, which has torch) -> preflight (probes/kbuild.py: GPU arch, nvcc,
torch CUDA, ninja; no GPU means the `cpu` backend) -> build key (kernelpkg.build_key) -> if
`/var/lib/fleetctl/kernels/NAME/<key>/PASSED` exists the build is reused; else upload the
package to `<key>/src` (sha256 checked after upload), build into `<key>/build`, test against
the reference in a fresh process, mark PASSED -> changes.execute: swap the `current` symlink to
`<key>` (a ledger change, "pending") -> restart handler -> smoke gate -> "applied", or the link
is switched back.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from .changes import Change, ChangeOptions, Recovery, change_job, execute, new_change_id, restart_handlers
from .config import BUILD_DEADLINE_S, PROBE_SLACK_S, TEST_DEADLINE_S
from .fleet import Fleet, HostContext, HostFailed, HostResult
from .gather import gather
from .inventory import Host
from .kernelpkg import KernelPackage, build_key
from .vocab import HostStatus


@dataclass
class DeployOptions(ChangeOptions):
    """max_jobs: cap on parallel compile jobs on the host; build_timeout in seconds."""

    max_jobs: int = 4
    build_timeout: float = BUILD_DEADLINE_S


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


def run_deploy(fleet: Fleet, hosts: list[Host], pkg: KernelPackage, opts: DeployOptions) -> tuple[str, list[HostResult]]:
    """`fleetctl deploy kernel`: deploy `pkg` to `hosts` under one new change id.
    Returns (change id, results in inventory order)."""
    cid = new_change_id(f"kernel-{pkg.name}")
    return cid, fleet.run(hosts, deploy_job(pkg, cid, opts), f"deploy {pkg.name}")


def _build(ctx: HostContext, python: str, pkg: KernelPackage, backend: str, arch: str, bdir: str,
           current: str | None, opts: DeployOptions, data: dict) -> None:
    """Upload, build, test and mark PASSED one build dir. Sets data["build"], data["test"].
    Raises HostFailed (build or test failed: nothing activated)."""
    src, build = f"{bdir}/src", f"{bdir}/build"
    _upload(ctx, pkg, src)
    b = _kbuild(ctx, python, timeout=opts.build_timeout + PROBE_SLACK_S, action="build", src_dir=src,
                build_dir=build, arch=arch, deadline_s=opts.build_timeout, max_jobs=opts.max_jobs,
                **pkg.build_params(backend))
    data["build"] = {k: b.get(k) for k in ("ok", "seconds", "log_path", "timed_out", "removed_stale_lock")}
    if not b["ok"]:
        raise HostFailed(f"build failed ({'deadline' if b['timed_out'] else 'exit %s' % b['rc']}); "
                         f"log {b['log_path']}:\n{b['log_tail']}")
    t = _kbuild(ctx, python, timeout=TEST_DEADLINE_S + PROBE_SLACK_S, action="test", src_dir=src,
                module_path=b["module_path"], deadline_s=TEST_DEADLINE_S, **pkg.test_params(backend))
    data["test"] = t.get("result")
    if not t["ok"]:
        raise HostFailed(f"reference test failed, not activated (active build stays {current or 'none'}): "
                         f"{t.get('result') or t.get('stderr_tail')}")
    _kbuild(ctx, python, action="mark", build_dir=bdir, module_path=b["module_path"])


def _deploy(ctx: HostContext, rec: Recovery, pkg: KernelPackage, change_id: str, opts: DeployOptions) -> HostResult:
    facts = gather(ctx, scan=False)["facts"]
    python = facts["python"]["path"]
    pre = _kbuild(ctx, python, action="preflight", backends=sorted(pkg.backends))
    if pre["backend"] is None:
        raise HostFailed("preflight refused: " + "; ".join(pre["refusals"]))
    backend, f = pre["backend"], pre["facts"]
    torch, nvcc = f.get("torch") or {}, f.get("nvcc") or {}
    key = build_key(pkg, backend, torch.get("version"), torch.get("cuda"), nvcc.get("version"), pre["arch"])
    kdir = f"{opts.state_dir}/kernels/{pkg.name}"
    bdir = f"{kdir}/{key}"
    link = f"{kdir}/current"
    state = _kbuild(ctx, python, action="state", link=link, build_dir=bdir)
    current = state["current"]
    data = {"backend": backend, "arch": pre["arch"], "build_key": key, "previous": current,
            "recovered": rec.changes, "refusals": pre["refusals"], "reused": state["passed"]}
    result = ctx.result(HostStatus.OK, data=data)
    if not data["reused"]:
        _build(ctx, python, pkg, backend, pre["arch"], bdir, current, opts, data)
    if current == key:
        return result
    change = Change(change_id, f"kernel {pkg.name}",
                    [{"path": link, "kind": "link", "pre_target": current, "post_target": key}],
                    facts, f"{opts.state_dir}/kernels", restart_handlers(ctx))
    execute(ctx, result, change, opts)
    if result.status == HostStatus.FAILED:
        result.error = f"switched back to {current or 'no build'}: " + result.error.removeprefix("rolled back: ")
    return result
