"""Deploying a kernel package to hosts: preflight, upload, remote build, reference test, atomic
activation, validation gate, rollback.

Per host, under the host's lock: recover a change a killed run left pending -> facts (the
interpreter that runs SGLang, which has torch) -> preflight (probes/kbuild.py: GPU arch, nvcc,
torch CUDA, ninja; no GPU means the `cpu` backend) -> build key (kernelpkg.build_key) -> if
`/var/lib/fleetctl/kernels/NAME/<key>/PASSED` exists the build is reused; else upload the
package to `<key>/src` (sha256 checked after upload), build into `<key>/build`, test against
the reference in a fresh process, mark PASSED -> swap the `current` symlink to `<key>` (a ledger
change, "pending") -> restart handler -> smoke gate -> "applied", or the link is switched back.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field

from .apply import ROLLBACK_RESERVE_S, STATE_DIR, ApplyOptions, change_probe, finish_change, locked, recover
from .fleet import CHANGED, FAILED, OK, HostContext, HostFailed, HostResult
from .gather import gather
from .kernelpkg import KernelPackage, build_key
from .validate import SmokeOptions, smoke

BUILD_DEADLINE_S = 1800.0
TEST_DEADLINE_S = 600.0


@dataclass
class DeployOptions:
    """max_jobs: cap on parallel compile jobs on the host; build_timeout in seconds."""

    smoke: SmokeOptions = field(default_factory=SmokeOptions)
    max_jobs: int = 4
    build_timeout: float = BUILD_DEADLINE_S
    operator: str = field(default_factory=lambda: ApplyOptions().operator)
    state_dir: str = STATE_DIR


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
    return locked(opts.state_dir, lambda ctx: _deploy(ctx, pkg, change_id, opts))


def _deploy(ctx: HostContext, pkg: KernelPackage, change_id: str, opts: DeployOptions) -> HostResult:
    recovered, _ = recover(ctx, opts.state_dir)
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
            "recovered": recovered, "refusals": pre["refusals"], "reused": state["passed"]}
    result = HostResult(ctx.host.name, ctx.conn.address, OK, data=data)
    if not data["reused"]:
        src, build = f"{bdir}/src", f"{bdir}/build"
        _upload(ctx, pkg, src)
        b = _kbuild(ctx, python, timeout=opts.build_timeout + 60, action="build", src_dir=src, build_dir=build,
                    arch=pre["arch"], deadline_s=opts.build_timeout, max_jobs=opts.max_jobs,
                    **pkg.build_params(backend))
        data["build"] = {k: b.get(k) for k in ("ok", "seconds", "log_path", "timed_out", "removed_stale_lock")}
        if not b["ok"]:
            raise HostFailed(f"build failed ({'deadline' if b['timed_out'] else 'exit %s' % b['rc']}); "
                             f"log {b['log_path']}:\n{b['log_tail']}")
        t = _kbuild(ctx, python, timeout=TEST_DEADLINE_S + 60, action="test", src_dir=src,
                    module_path=b["module_path"], deadline_s=TEST_DEADLINE_S, **pkg.test_params(backend))
        data["test"] = t.get("result")
        if not t["ok"]:
            raise HostFailed(f"reference test failed, not activated (active build stays {current or 'none'}): "
                             f"{t.get('result') or t.get('stderr_tail')}")
        _kbuild(ctx, python, action="mark", build_dir=bdir, module_path=b["module_path"])
    if current == key:
        return result
    baseline = smoke(ctx, facts, opts.smoke, reserve=ROLLBACK_RESERVE_S)
    change_probe(ctx, "apply", opts.state_dir, change_id=change_id, playbook=f"kernel {pkg.name}",
                 operator=opts.operator, files=[{"path": link, "kind": "link", "pre_target": current,
                                                 "post_target": key}], commit=False)
    result.status, data["change_id"] = CHANGED, change_id
    cmd = ctx.host.vars.get("fleetctl_restart_cmd")
    handlers = [{"name": "restart sglang", "command": cmd}] if cmd else []
    finish_change(ctx, result, change_id, opts.state_dir, handlers, lambda: [], baseline, facts, opts.smoke, None)
    if result.status == FAILED:
        result.error = f"switched back to {current or 'no build'}: " + result.error.removeprefix("rolled back: ")
    return result
