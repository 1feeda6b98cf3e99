"""The kbuild probe's preflight action (stdlib only, Python 3.8+): the host's build facts (nvidia-smi
compute_cap, nvcc --version, torch/version.py, triton's version, ninja), read without importing
torch or triton, and the verdict: the backend to build ("triton", "cuda", "cpu" or None), why,
the arch (TORCH_CUDA_ARCH_LIST value), refusals."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys

from .. import bounded, runas
from ..facts import gpus, torchver


# Oldest CUDA (torch.version.cuda and nvcc) that can target each compute capability.
MIN_CUDA_FOR_ARCH = {"7.5": (10, 0), "8.0": (11, 0), "8.6": (11, 1), "8.9": (11, 8), "9.0": (11, 8),
                     "10.0": (12, 8), "12.0": (12, 8)}
# Oldest compute capability the triton backend builds for: tl.dot on bf16 needs sm_80 (Ampere).
TRITON_MIN_ARCH = (8, 0)
NVCC_S = 30  # `nvcc --version`'s limit (bounded.run)


def preflight(params: dict) -> dict:
    """Facts and verdict for params["backends"] (the package's backends, e.g. ["cpu", "cuda",
    "triton"]) and params.get("backend") (the operator's --backend; None: chosen from the host).

    Returns {"facts": gather_facts(), "backend": str|None, "choice": str, "why": str,
    "arch": str|None, "refusals": [str]} (see decide).
    """
    facts = gather_facts()
    return dict(facts=facts, **decide(facts, params["backends"], params.get("backend")))


def gather_facts() -> dict:
    """Build-relevant facts of this host and interpreter, read without importing torch or triton.

    gpus: [{"name", "compute_cap"}] of the healthy GPUs that answer nvidia-smi (gpus.gpu_facts:
    bounded, a stuck one left behind; [] without nvidia-smi); gpu_errors: gpus.parse's [{index,
    pci_bus_id, error[, faults]}] of lost and faulted GPUs; gpu_error: gpus.gpu_facts' reason
    (lost or faulted GPUs, nvidia-smi failed or stuck) or None, a refusal (decide); nvcc:
    {"path", "version"} or None, found as torch finds it (CUDA_HOME/CUDA_PATH, PATH,
    /usr/local/cuda); torch: {"version", "cuda", "path"} from torch/version.py
    (torchver.importable) or None; triton: {"version", "path"} (_triton) or None; ninja: its
    path (the interpreter's bin dir, then runas.SYSTEM_PATH: the builds' PATH) or None.
    """
    python = sys.executable
    facts = {"python": python, "gpus": [], "gpu_errors": [], "gpu_error": None, "cpu_count": os.cpu_count()}
    smi = shutil.which("nvidia-smi")
    if smi:
        rows, facts["gpu_errors"], facts["gpu_error"] = gpus.gpu_facts(smi)
        facts["gpus"] = [{"name": g["name"], "compute_cap": g["compute_cap"]} for g in rows]
    facts["nvcc"] = _nvcc()
    facts["torch"] = torchver.importable()
    facts["triton"] = _triton()
    facts["ninja"] = shutil.which("ninja", path=os.path.dirname(os.path.abspath(python)) + ":" + runas.SYSTEM_PATH)
    return facts


def decide(facts: dict, backends: list, forced: str | None = None) -> dict:
    """Which backend to build, for which arch, why, or why not:
    {"backend", "choice", "why", "arch", "refusals"}.

    choice: `forced` (the operator's --backend), else from the host: no GPU, cpu; a GPU host,
    triton when the package has a triton backend, triton is importable by this interpreter (the
    one SGLang runs; SGLang's wheels depend on triton), torch is a CUDA build and the GPUs are
    of one arch >= TRITON_MIN_ARCH; else cuda. why: one sentence, how choice was made. backend:
    choice, or None when there are refusals. arch: the GPUs' compute capabilities
    ("9.0", "9.0;12.0"), None for cpu.
    Refusals: torch missing, the GPUs unreadable, the package lacking the choice's backend; cpu
    and cuda: ninja missing (torch.utils.cpp_extension); cuda: _cuda_refusals; triton:
    _triton_refusals.
    """
    torch, cards = facts.get("torch"), facts.get("gpus") or []
    archs = sorted({g["compute_cap"] or "unknown" for g in cards}, key=_version)
    sms = ", ".join(_sm(a) for a in archs)
    refusals = []
    if not torch:
        refusals.append("torch is not installed for %s" % facts.get("python"))
    if facts.get("gpu_error"):
        refusals.append("cannot read the GPUs: %s" % facts["gpu_error"])
    if forced:
        choice, why = forced, "--backend %s (the operator's choice)" % forced
    elif not cards:
        choice, why = "cpu", "no GPU answers nvidia-smi"
    else:
        not_triton = _triton_refusals(facts, archs) if "triton" in backends else ["the package has no triton backend"]
        choice = "cuda" if not_triton else "triton"
        why = ("%s GPU and triton %s importable by %s" % (sms, facts["triton"]["version"], facts.get("python"))
               if choice == "triton" else "%s GPU, not triton: %s" % (sms, "; ".join(not_triton)))
    if choice not in backends:
        refusals.append("the package has no %s backend (it has %s)" % (choice, ", ".join(sorted(backends))) if forced
                        else "no GPU and the package has no cpu backend" if choice == "cpu"
                        else "GPU host (%s) but the package has no cuda backend" % sms)
    if choice in ("cpu", "cuda") and not facts.get("ninja"):
        refusals.append("ninja is not on PATH (torch.utils.cpp_extension needs it)")
    if choice == "cuda":
        refusals += _cuda_refusals(facts, archs)
    elif choice == "triton":
        refusals += _triton_refusals(facts, archs)
    arch = ";".join(archs) if archs and choice != "cpu" else None
    return {"backend": None if refusals else choice, "choice": choice, "why": why, "arch": arch, "refusals": refusals}


def _cuda_refusals(facts: dict, archs: list) -> list:
    """Why the cuda backend cannot be built for GPUs of `archs`: none (no GPU), nvcc missing,
    nvcc's major version differs from torch.version.cuda's, torch is a CPU build, or torch/nvcc
    are older than an arch needs (MIN_CUDA_FOR_ARCH, e.g. sm_120 needs CUDA >= 12.8)."""
    torch, nvcc = facts.get("torch"), facts.get("nvcc")
    if not archs:
        return ["no GPU answers nvidia-smi: the cuda backend builds for the host's GPU arch"]
    refusals = []
    tcuda = torch and torch.get("cuda")
    if not nvcc or not nvcc["version"]:
        refusals.append("nvcc not found or its version unreadable (CUDA_HOME, CUDA_PATH, PATH, /usr/local/cuda/bin)")
        nvcc = None
    if torch and not tcuda:
        refusals.append("torch %s is a CPU build (torch.version.cuda is None) on a GPU host" % torch["version"])
    if nvcc and tcuda and _version(nvcc["version"])[0] != _version(tcuda)[0]:
        refusals.append("nvcc %s major differs from torch's CUDA %s" % (nvcc["version"], tcuda))
    for arch in archs:
        need = MIN_CUDA_FOR_ARCH.get(arch)
        if need is None:
            refusals.append("%s is not a supported arch (%s)" % (_sm(arch), ", ".join(sorted(MIN_CUDA_FOR_ARCH))))
            continue
        for who, have in (("torch", tcuda), ("nvcc", nvcc and nvcc["version"])):
            if have and _version(have) < need:
                refusals.append("%s needs CUDA >= %d.%d; %s has CUDA %s" % (_sm(arch), need[0], need[1], who, have))
    return refusals


def _triton_refusals(facts: dict, archs: list) -> list:
    """Why the triton backend cannot be built and tested for GPUs of `archs`: no GPU (no arch to
    compile for, no device for the reference test), GPUs of more than one arch (a build targets
    one), an arch older than TRITON_MIN_ARCH or unknown, triton not importable by this
    interpreter or its version unreadable, torch a CPU build (the reference test runs on the
    device through torch)."""
    torch, triton = facts.get("torch"), facts.get("triton")
    refusals = []
    if not archs:
        refusals.append("no GPU answers nvidia-smi: the triton backend compiles for the host's GPU arch "
                        "and its reference test runs on the device")
    elif len(archs) > 1:
        refusals.append("GPUs of %d archs (%s): a triton build targets one" % (len(archs), ", ".join(map(_sm, archs))))
    for arch in archs:
        if len(_version(arch)) < 2 or _version(arch) < TRITON_MIN_ARCH:
            refusals.append("%s is older than the triton backend's sm_%d%d or unknown"
                            % ((_sm(arch),) + TRITON_MIN_ARCH))
    if not triton:
        refusals.append("triton is not importable by %s" % facts.get("python"))
    elif not triton.get("version"):
        refusals.append("triton's version is unreadable from %s" % triton["path"])
    if torch and not torch.get("cuda"):
        refusals.append("torch %s is a CPU build (torch.version.cuda is None): no device for the triton "
                        "backend's reference test" % torch["version"])
    return refusals


def _nvcc():
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [os.path.join(home, "bin", "nvcc")] if home else []
    candidates += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    for path in candidates:
        if path and os.access(path, os.X_OK):
            try:
                out = bounded.run([path, "--version"], NVCC_S).stdout  # a CUDA on a dead mount: left behind
            except OSError:
                out = ""
            m = re.search(r"release (\d+\.\d+)", out)
            return {"path": path, "version": m.group(1) if m else None}
    return None


def _triton():
    """The triton `import triton` gives: {"version": triton.__version__, "path": its
    __init__.py}, read from that file's top-level constants (triton is not imported: that loads
    its drivers), or None when it is not importable."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.origin:
        return None
    return {"version": torchver.fields(spec.origin).get("__version__"), "path": spec.origin}


def _sm(arch: str) -> str:
    return "sm_" + arch.replace(".", "")


def _version(text: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:2])
