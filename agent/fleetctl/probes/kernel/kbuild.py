"""Kernel build probe (stdlib only, Python 3.8+): preflight, build and test a kernel package on the host.

main(params) dispatches on params["action"] to the kernel room's modules:
  preflight  facts (nvidia-smi compute_cap, nvcc --version, torch/version.py, triton's version,
             ninja) and a verdict: the backend to build ("triton", "cuda", "cpu" or None), why,
             the arch (TORCH_CUDA_ARCH_LIST value), refusals (preflight.py), asked of the
             interpreter as an unprivileged uid (runas.rerun).
  build      in a child process run as an unprivileged uid (own process group), under an flock
             and a deadline, in a private directory: torch.utils.cpp_extension.load (cpu, cuda),
             or the package's triton module's build(arch, out_dir) (the ahead-of-time compile: no
             GPU, no nvcc); the build copied back checked into BUILD_DIR; the log kept in
             BUILD_DIR.log (build.py).
  test       the package's test module against the built module in a fresh process, run so too
             (build.py).
  state      the package's active build (the `current` link's target), whether a build passed
             and is published, its dispatch table's bytes, whether the install has the route hook
             (state.py).
  mark       record that a build passed its reference test (BUILD_DIR/PASSED holds the module
             path; state.py).
  publish    copy a passed build from the private state dir to PUBLIC/NAME/<key> (root, 0755/0644,
             no links), where an unprivileged server process can read it (publish.py).
torch and triton are never imported here, nor the install's site module run: no install code
runs as root (issue 48).
"""

from __future__ import annotations

import subprocess
import sys

from .. import runas
from . import build, preflight, publish, state

PREFLIGHT_TIMEOUT_S = 120  # the preflight child: an interpreter's start, nvidia-smi and nvcc --version


def main(params: dict) -> dict:
    """Run params["action"] ("preflight", "build", "test", "state", "mark" or "publish") with the other
    params; see each function. The probe starts with `python -S` (probes.command) as root and
    never imports the install's code or runs its site module: the preflight re-runs this bundle
    in the interpreter with its site (find_spec of torch and triton runs the install's finders)
    as build.account's uid (runas.rerun; params["child"] marks that run), the build and the test
    start their children so (build.py); state, mark and publish only read and write files.
    Raises RuntimeError when the preflight child cannot run or answer (the text says as whom)."""
    if params["action"] == "preflight" and not params.get("child"):
        return _preflight_child(params)
    actions = {"preflight": preflight.preflight, "build": build.build, "test": build.test, "state": state.state,
               "mark": state.mark, "publish": publish.publish}
    return actions[params["action"]](params)


def _preflight_child(params: dict) -> dict:
    acct = build.account(params)
    env = {k: v for k, v in build.child_env("/nonexistent", {}).items() if k in ("CUDA_HOME", "CUDA_PATH")}
    try:
        got, why, _ = runas.rerun(sys.executable, dict(params, child=True), acct, PREFLIGHT_TIMEOUT_S, env)
    except (OSError, subprocess.SubprocessError) as e:
        why = "cannot start: %s" % e
    if why:
        raise RuntimeError("the preflight, run as uid %d (%s) in %s: %s" % (acct.uid, acct.why, sys.executable, why))
    return dict(got, ran_as={"uid": acct.uid, "why": acct.why})
