"""Kernel build probe (stdlib only, Python 3.8+): preflight, build and test a kernel package on the host.

main(params) dispatches on params["action"] to the kernel room's modules:
  preflight  facts (nvidia-smi compute_cap, nvcc --version, torch/version.py, triton's version,
             ninja) and a verdict: the backend to build ("triton", "cuda", "cpu" or None), why,
             the arch (TORCH_CUDA_ARCH_LIST value), refusals (preflight.py).
  build      in a child process (own process group), under an flock and a deadline, into an explicit
             build directory: torch.utils.cpp_extension.load (cpu, cuda), or the package's triton
             module's build(arch, out_dir) (the ahead-of-time compile: no GPU, no nvcc); the log is
             kept in BUILD_DIR/build.log (build.py).
  test       the package's test module against the built module in a fresh process (build.py).
  state      the package's active build (the `current` link's target), whether a build passed
             and is published, its dispatch table's bytes, whether the install has the route hook
             (state.py).
  mark       record that a build passed its reference test (BUILD_DIR/PASSED holds the module
             path; state.py).
  publish    copy a passed build from the private state dir to PUBLIC/NAME/<key> (root, 0755/0644,
             no links), where an unprivileged server process can read it (publish.py).
torch and triton are never imported here: builds and tests run in child processes of the host's
interpreter (proc.py: their PATH, lock and deadline).
"""

from __future__ import annotations

import sys

from .. import trust
from . import build, preflight, publish, state

# what a build's or a test's child imports as root (torch.utils.cpp_extension, the reference test;
# the triton build): the install's own packages
IMPORTS = ("torch", "triton")


def main(params: dict) -> dict:
    """Run params["action"] ("preflight", "build", "test", "state", "mark" or "publish") with the other
    params; see each function. The probe starts with `python -S` (probes.command); torch is
    the install's, so the site module's files are checked (trust.untrusted: the builds run
    this interpreter with its site, as root) before site.main() puts site-packages on sys.path,
    and before a build or test what its child imports (IMPORTS: trust.untrusted_imports, the
    import path and each package's tree). Raises RuntimeError naming the file when they must
    not be run."""
    why = trust.untrusted(sys.executable)
    if why:
        raise RuntimeError("interpreter %s refused: %s (fleetctl runs it as root)" % (sys.executable, why))
    import site
    site.main()
    if params["action"] in ("build", "test"):  # their children import the install's torch (and triton), as root
        why = trust.untrusted_imports(IMPORTS)
        if why:
            raise RuntimeError("not building or testing: root would import code another user may change: %s" % why)
    actions = {"preflight": preflight.preflight, "build": build.build, "test": build.test, "state": state.state,
               "mark": state.mark, "publish": publish.publish}
    return actions[params["action"]](params)
