"""Kernel packages (kernel.yaml validation, path escapes, build keys) and the kbuild probe's
preflight, run locally (no SSH, no compiler: the build and test actions are
tests/machine/test_kbuild.py)."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fleetctl import probes
from fleetctl.errors import ParseError
from fleetctl.engine.kernels.deploy import preflight_key
from fleetctl.engine.kernels.package import TritonBackend, build_key, load_package
from fleetctl.errors import HostFailed
from fleetctl.probes.kernel import preflight

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
GOOD = (KERNELS / "verify_attention" / "kernel.yaml").read_text()


@pytest.fixture
def kroot(tmp_path):
    """A kernels/ root holding a copy of verify_attention."""
    shutil.copytree(KERNELS / "verify_attention", tmp_path / "verify_attention",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _write(kroot: Path, text: str) -> None:
    (kroot / "verify_attention" / "kernel.yaml").write_text(text)


def test_real_package_loads():
    pkg = load_package(KERNELS, "verify_attention")
    assert set(pkg.backends) == {"cpu", "cuda", "triton"}
    assert pkg.backends["cuda"].sources == ("csrc/binding_cuda.cpp", "csrc/verify_attention.cu")
    assert pkg.backends["triton"] == TritonBackend(module="triton_verify.py", build="build", load="load")
    assert pkg.build_params("triton") == {"name": "verify_attention_triton", "kind": "triton",
                                          "module": "triton_verify.py", "build": "build", "load": "load"}
    assert pkg.test_params("triton")["device"] == "cuda" and pkg.test_params("cpu")["device"] == "cpu"
    assert pkg.tolerances["bfloat16"] == (1e-2, 2e-2)
    files = pkg.files()
    assert {"kernel.yaml", "reference.py", "test_kernel.py", "csrc/verify_attention.h"} <= set(files)
    assert not any("__pycache__" in f for f in files)


def _line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


MALFORMED = [
    # (description, edit of the good kernel.yaml, line marker or int, message fragment)
    ("missing test", lambda t: t.replace("test: test_kernel.py\n", ""), 2, "missing field 'test'"),
    ("sources not a list", lambda t: t.replace("sources: [csrc/verify_attention_cpu.cpp]",
                                               "sources: csrc/verify_attention_cpu.cpp"),
     "sources: csrc/verify_attention_cpu.cpp", "expected a list of strings"),
    ("missing source file", lambda t: t.replace("csrc/verify_attention_cpu.cpp", "csrc/nope.cpp"),
     "csrc/nope.cpp", "is not a file"),
    ("bad suffix", lambda t: t.replace("csrc/verify_attention_cpu.cpp", "reference.py"),
     "sources: [reference.py]", "is not one of"),
    ("unknown field", lambda t: t + "flags: [-O2]\n", "flags: [-O2]", "unknown field 'flags'"),
    ("unknown backend", lambda t: t.replace("  cpu:\n", "  rocm:\n"), "  rocm:", "unknown field 'rocm'"),
    ("name mismatch", lambda t: t.replace("name: verify_attention", "name: other"), "name: other",
     "differs from the directory name"),
    ("version not a string", lambda t: t.replace("version: 0.1.0", "version: 1.5"), "version: 1.5",
     "expected a non-empty string"),
    ("reference without function", lambda t: t.replace("reference.py:verify_attention_ref", "reference.py"),
     "reference: reference.py", "is not FILE.py:FUNCTION"),
    ("tolerance not a number", lambda t: t.replace("atol: 2.0e-3", "atol: tight"), "atol: tight",
     "expected a number >= 0"),
    ("tolerance missing rtol", lambda t: t.replace("{atol: 1.0e-2, rtol: 2.0e-2}", "{atol: 1.0e-2}"),
     "bfloat16:", "missing field 'rtol'"),
    ("duplicate key", lambda t: t.replace("test: test_kernel.py\n", "test: test_kernel.py\ntest: x.py\n"),
     "test: x.py", "duplicate key 'test'"),
    ("yaml syntax", lambda t: t.replace("sources: [csrc/binding_cuda.cpp,", "sources: [csrc/binding_cuda.cpp,,"),
     "csrc/binding_cuda.cpp,,", "expected the node content, but found ','"),  # the YAML parser's words
    ("not a mapping", lambda t: "- just\n- a list\n", 1, "expected a mapping"),
    ("triton module not python", lambda t: t.replace("module: triton_verify.py", "module: kernel.yaml"),
     "module: kernel.yaml", "is not a .py file"),
    ("triton module missing", lambda t: t.replace("module: triton_verify.py", "module: nope.py"),
     "module: nope.py", "is not a file"),
    ("triton module escapes", lambda t: t.replace("module: triton_verify.py", "module: ../triton_verify.py"),
     "module: ../triton_verify.py", "leaves the package directory"),
    ("triton build not a name", lambda t: t.replace("build: build", "build: build(arch)"),
     "build: build(arch)", "is not a function name"),
    ("triton load missing", lambda t: t.replace("    load: load\n", ""), "module: triton_verify.py",
     "missing field 'load'"),
    ("triton with sources", lambda t: t.replace("    load: load\n", "    load: load\n    sources: [a.cu]\n"),
     "sources: [a.cu]", "unknown field 'sources'"),
]


@pytest.mark.parametrize("edit,where,fragment", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_kernel_yaml_names_file_and_line(kroot, edit, where, fragment):
    text = edit(GOOD)
    assert text != GOOD
    _write(kroot, text)
    line = where if isinstance(where, int) else _line_of(text, where)
    with pytest.raises(ParseError) as e:
        load_package(kroot, "verify_attention")
    assert str(e.value).startswith(f"{kroot / 'verify_attention' / 'kernel.yaml'}:{line}: ")
    assert fragment in str(e.value)
    assert e.value.exit_code == 4


def test_missing_package(kroot):
    with pytest.raises(ParseError, match=r"no kernel package .absent.: .*kernel.yaml does not exist"):
        load_package(kroot, "absent")


@pytest.mark.parametrize("name", ["../verify_attention", "a/b", ".", "", "/etc", "x y"])
def test_kernel_name_that_escapes_is_rejected(kroot, name):
    with pytest.raises(ParseError, match="not an identifier"):
        load_package(kroot, name)


@pytest.mark.parametrize("path", ["../outside.cpp", "/etc/hosts.cpp", "csrc/../../outside.cpp"])
def test_source_path_that_escapes_is_rejected(kroot, path):
    (kroot / "outside.cpp").write_text("int x;\n")
    _write(kroot, GOOD.replace("csrc/verify_attention_cpu.cpp", path))
    with pytest.raises(ParseError, match="leaves the package directory") as e:
        load_package(kroot, "verify_attention")
    assert f"kernel.yaml:{_line_of(GOOD, 'csrc/verify_attention_cpu.cpp')}:" in str(e.value)


def test_symlinked_source_out_of_package_is_rejected(kroot, tmp_path_factory):
    outside = tmp_path_factory.mktemp("elsewhere") / "evil.cpp"
    outside.write_text("int x;\n")
    (kroot / "verify_attention" / "csrc" / "evil.cpp").symlink_to(outside)
    _write(kroot, GOOD.replace("csrc/verify_attention_cpu.cpp", "csrc/evil.cpp"))
    with pytest.raises(ParseError, match="symlink out"):
        load_package(kroot, "verify_attention")


def test_symlink_out_among_package_files_is_rejected(kroot, tmp_path_factory):
    outside = tmp_path_factory.mktemp("elsewhere") / "secret"
    outside.write_text("secret\n")
    pkg = load_package(kroot, "verify_attention")
    (kroot / "verify_attention" / "notes.txt").symlink_to(outside)
    with pytest.raises(ParseError, match="symlink out"):
        pkg.files()


def test_symlinked_package_directory_out_of_root_is_rejected(kroot, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    shutil.copytree(kroot / "verify_attention", elsewhere / "verify_attention")
    (kroot / "linked").symlink_to(elsewhere / "verify_attention")
    with pytest.raises(ParseError, match="leaves"):
        load_package(kroot, "linked")


def test_build_key_changes_with_arch_versions_flags_and_source_bytes(kroot):
    pkg = load_package(kroot, "verify_attention")
    base = ("cuda", "2.8.0+cu128", "12.8", "12.8", "9.0")
    key = build_key(pkg, *base)
    assert len(key) == 64 and key == build_key(load_package(kroot, "verify_attention"), *base)
    assert build_key(pkg, "cuda", "2.8.0+cu128", "12.8", "12.8", "12.0") != key
    assert build_key(pkg, "cuda", "2.9.0+cu128", "12.8", "12.8", "9.0") != key
    assert build_key(pkg, "cuda", "2.8.0+cu128", "12.8", "12.9", "9.0") != key
    assert build_key(pkg, "cpu", "2.8.0+cu128", "12.8", "12.8", "9.0") != key
    cu = kroot / "verify_attention" / "csrc" / "verify_attention.cu"
    data = bytearray(cu.read_bytes())
    data[-2] ^= 0x01  # one byte of one source
    cu.write_bytes(bytes(data))
    assert build_key(pkg, *base) != key
    cu.write_bytes(bytes(data[:-2]) + bytes([data[-2] ^ 0x01]) + bytes(data[-1:]))
    assert build_key(pkg, *base) == key
    _write(kroot, GOOD.replace("cuda_cflags: [-O3, -lineinfo]", "cuda_cflags: [-O2, -lineinfo]"))
    assert build_key(load_package(kroot, "verify_attention"), *base) != key


def test_triton_build_key_is_torch_triton_arch_and_sources(kroot):
    """The triton backend's key: torch's and Triton's versions, the arch, the package's bytes;
    Triton's version enters no other backend's key (cpu/cuda keys are the ones they were)."""
    pkg = load_package(kroot, "verify_attention")
    base = ("triton", "2.8.0+cu128", None, None, "9.0", "3.6.0")
    key = build_key(pkg, *base)
    assert len(key) == 64 and key == build_key(load_package(kroot, "verify_attention"), *base)
    assert build_key(pkg, "triton", "2.8.0+cu128", None, None, "9.0", "3.5.1") != key
    assert build_key(pkg, "triton", "2.9.0+cu128", None, None, "9.0", "3.6.0") != key
    assert build_key(pkg, "triton", "2.8.0+cu128", None, None, "12.0", "3.6.0") != key
    assert build_key(pkg, "cuda", "2.8.0+cu128", None, None, "9.0", "3.6.0") != key
    cuda = ("cuda", "2.8.0+cu128", "12.8", "12.8", "9.0")
    assert build_key(pkg, *cuda, "3.6.0") == build_key(pkg, *cuda) == build_key(pkg, *cuda, None)
    mod = kroot / "verify_attention" / "triton_verify.py"
    mod.write_bytes(mod.read_bytes() + b"\n")
    assert build_key(pkg, *base) != key


def _pre(backend, arch="9.0", torch="2.8.0+cu128", cuda="12.8", nvcc="12.8", triton="3.6.0"):
    """A kbuild preflight answer (preflight.preflight's shape) that chose `backend`."""
    return {"backend": backend, "choice": backend, "why": "test", "arch": arch, "refusals": [],
            "facts": {"torch": {"version": torch, "cuda": cuda}, "nvcc": nvcc and {"version": nvcc},
                      "triton": triton and {"version": triton, "path": "x"}}}


def test_preflight_key_reads_the_versions_each_backend_builds_with(kroot):
    """deploy.preflight_key: triton's key from torch, Triton and the arch (no nvcc: the
    ahead-of-time compile uses Triton's own ptxas); cuda's from torch, its CUDA and nvcc."""
    pkg = load_package(kroot, "verify_attention")
    key = preflight_key(pkg, _pre("triton"))
    assert key == build_key(pkg, "triton", "2.8.0+cu128", None, None, "9.0", "3.6.0")
    assert preflight_key(pkg, _pre("triton", nvcc=None)) == key  # nvcc plays no part
    assert preflight_key(pkg, _pre("triton", triton="3.5.1")) != key
    assert preflight_key(pkg, _pre("triton", arch="12.0")) != key
    assert preflight_key(pkg, _pre("cuda")) == build_key(pkg, "cuda", "2.8.0+cu128", "12.8", "12.8", "9.0")
    assert preflight_key(pkg, _pre("cuda", triton="3.5.1")) == preflight_key(pkg, _pre("cuda"))
    refused = dict(_pre(None), choice="triton", why="--backend triton (the operator's choice)",
                   refusals=["no GPU answers nvidia-smi: ..."])
    with pytest.raises(HostFailed, match=r"^preflight refused the triton backend \(--backend triton "
                                         r"\(the operator's choice\)\): no GPU answers nvidia-smi"):
        preflight_key(pkg, refused)


def test_results_do_not_enter_the_build_key(kroot):
    """Measurements committed under results/ (the GPU check's JSON) are about the package, not
    part of it: adding them must not invalidate every host's build. A `results` directory below
    the top level is source like any other."""
    pkg = load_package(kroot, "verify_attention")
    base = ("cuda", "2.8.0+cu128", "12.8", "12.8", "9.0")
    key = build_key(pkg, *base)
    (kroot / "verify_attention" / "results").mkdir(exist_ok=True)  # the package has H200 results now
    (kroot / "verify_attention" / "results" / "another_run.json").write_text("{}")
    assert not [f for f in pkg.files() if f.startswith("results/")] and build_key(pkg, *base) == key
    (kroot / "verify_attention" / "csrc" / "results").mkdir()
    (kroot / "verify_attention" / "csrc" / "results" / "table.h").write_text("// source\n")
    assert "csrc/results/table.h" in pkg.files() and build_key(pkg, *base) != key


# --- kbuild probe: preflight ------------------------------------------------------------------

def test_preflight_through_the_probe_wrapper():
    """The probe as the host runs it: bundle on stdin to `python -c WRAPPER`."""
    r = subprocess.run(probes.command(sys.executable),
                       input=probes.bundle("kernel.kbuild", {"action": "preflight", "backends": ["cpu", "cuda"]}),
                       capture_output=True, timeout=120)
    out = probes.parse_output(r.stdout, r.stderr, r.returncode)
    import torch

    assert out["facts"]["torch"]["version"] == torch.__version__
    assert out["facts"]["torch"]["cuda"] == torch.version.cuda
    assert out["facts"]["ninja"] and os.access(out["facts"]["ninja"], os.X_OK)
    # compared with what this test reads itself, not with one machine's constants (review L11)
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not os.environ.get("CUDA_HOME") and not os.environ.get("CUDA_PATH") and os.access(nvcc, os.X_OK):
        release = re.search(r"release (\d+\.\d+)", subprocess.run([nvcc, "--version"], capture_output=True,
                                                                    text=True, timeout=60).stdout)
        assert out["facts"]["nvcc"] == {"path": nvcc, "version": release and release.group(1)}
    elif not os.environ.get("CUDA_HOME") and not os.environ.get("CUDA_PATH"):
        assert out["facts"]["nvcc"] is None
    smi = shutil.which("nvidia-smi")
    gpus = [] if smi is None else [line for line in subprocess.run(
        [smi, "-L"], capture_output=True, text=True, timeout=60).stdout.splitlines() if line.startswith("GPU ")]
    assert len(out["facts"]["gpus"]) == len(gpus)
    try:
        triton = {"version": importlib.metadata.version("triton")}
    except importlib.metadata.PackageNotFoundError:
        triton = None
    assert (out["facts"]["triton"] and {"version": out["facts"]["triton"]["version"]}) == triton
    if not gpus:
        assert (out["backend"], out["arch"], out["refusals"]) == ("cpu", None, [])
        assert out["why"] == "no GPU answers nvidia-smi"
    else:
        caps = sorted({g["compute_cap"] for g in out["facts"]["gpus"]}, key=lambda c: tuple(map(int, c.split("."))))
        assert out["arch"] == ";".join(caps) and out["backend"] in ("cuda", None)


def _facts(gpus=(), torch_cuda="12.8", nvcc="12.8", ninja="/usr/bin/ninja", triton=None):
    return {"python": "/venv/bin/python", "gpus": [{"name": "GPU", "compute_cap": c} for c in gpus],
            "gpu_error": None, "torch": {"version": "2.8.0", "cuda": torch_cuda, "path": "x"},
            "nvcc": nvcc and {"path": "/usr/local/cuda/bin/nvcc", "version": nvcc}, "ninja": ninja,
            "triton": triton and {"version": triton, "path": "/venv/lib/triton/__init__.py"}}


@pytest.mark.parametrize("facts,backends,want_backend,want_arch,fragments", [
    (_facts(["9.0"]), ["cpu", "cuda"], "cuda", "9.0", []),
    (_facts(["9.0", "12.0"]), ["cuda"], "cuda", "9.0;12.0", []),
    (_facts([]), ["cpu", "cuda"], "cpu", None, []),
    (_facts([]), ["cuda"], None, None, ["no GPU and the package has no cpu backend"]),
    (_facts(["9.0"], nvcc="13.0"), ["cuda"], None, "9.0", ["nvcc 13.0 major differs from torch's CUDA 12.8"]),
    (_facts(["12.0"], torch_cuda="12.4", nvcc="12.4"), ["cuda"], None, "12.0",
     ["sm_120 needs CUDA >= 12.8; torch has CUDA 12.4", "sm_120 needs CUDA >= 12.8; nvcc has CUDA 12.4"]),
    (_facts(["9.0"], torch_cuda=None), ["cpu", "cuda"], None, "9.0", ["is a CPU build"]),
    (_facts(["9.0"], nvcc=None), ["cuda"], None, "9.0", ["nvcc not found"]),
    (_facts(["9.0"], ninja=None), ["cuda"], None, "9.0", ["ninja is not on PATH"]),
    (_facts(["6.1"]), ["cuda"], None, "6.1", ["sm_61 is not a supported arch"]),
    (_facts(["9.0"]), ["cpu"], None, "9.0", ["package has no cuda backend"]),
])
def test_preflight_decisions(facts, backends, want_backend, want_arch, fragments):
    got = preflight.decide(facts, backends)
    assert (got["backend"], got["arch"]) == (want_backend, want_arch)
    assert len(got["refusals"]) == len(fragments)
    for fragment in fragments:
        assert any(fragment in r for r in got["refusals"]), got["refusals"]


ALL = ["cpu", "cuda", "triton"]
TRITON_ON = "sm_90 GPU and triton 3.6.0 importable by /venv/bin/python"
NO_DEVICE = "no GPU answers nvidia-smi: the triton backend compiles for the host's GPU arch and its reference test runs on the device"


@pytest.mark.parametrize("facts,backends,forced,want,why,fragments", [
    # chosen from the host: triton where the GPU's arch is supported and SGLang's interpreter imports triton
    (_facts(["9.0"], triton="3.6.0"), ALL, None, ("triton", "triton", "9.0"), TRITON_ON, []),
    (_facts(["9.0"], nvcc=None, ninja=None, triton="3.6.0"), ALL, None, ("triton", "triton", "9.0"), TRITON_ON, []),
    (_facts(["12.0"], triton="3.6.0"), ["triton"], None, ("triton", "triton", "12.0"),
     "sm_120 GPU and triton 3.6.0 importable by /venv/bin/python", []),
    (_facts(["9.0"]), ALL, None, ("cuda", "cuda", "9.0"),
     "sm_90 GPU, not triton: triton is not importable by /venv/bin/python", []),
    (_facts(["9.0"], triton="3.6.0"), ["cpu", "cuda"], None, ("cuda", "cuda", "9.0"),
     "sm_90 GPU, not triton: the package has no triton backend", []),
    (_facts(["7.5"], triton="3.6.0"), ALL, None, ("cuda", "cuda", "7.5"),
     "sm_75 GPU, not triton: sm_75 is older than the triton backend's sm_80 or unknown", []),
    (_facts(["9.0", "12.0"], triton="3.6.0"), ALL, None, ("cuda", "cuda", "9.0;12.0"),
     "sm_90, sm_120 GPU, not triton: GPUs of 2 archs (sm_90, sm_120): a triton build targets one", []),
    (_facts(["9.0"], torch_cuda=None, triton="3.6.0"), ALL, None, (None, "cuda", "9.0"),
     "sm_90 GPU, not triton: torch 2.8.0 is a CPU build (torch.version.cuda is None): no device for the "
     "triton backend's reference test", ["is a CPU build (torch.version.cuda is None) on a GPU host"]),
    (_facts([], triton="3.6.0"), ALL, None, ("cpu", "cpu", None), "no GPU answers nvidia-smi", []),
    # the operator's --backend
    (_facts([], triton="3.6.0"), ALL, "triton", (None, "triton", None), "--backend triton (the operator's choice)",
     [NO_DEVICE]),
    (_facts(["9.0"]), ALL, "triton", (None, "triton", "9.0"), "--backend triton (the operator's choice)",
     ["triton is not importable by /venv/bin/python"]),
    (_facts(["9.0"], triton="3.6.0"), ["cpu", "cuda"], "triton", (None, "triton", "9.0"),
     "--backend triton (the operator's choice)", ["the package has no triton backend (it has cpu, cuda)"]),
    (_facts(["9.0"], triton="3.6.0"), ALL, "cuda", ("cuda", "cuda", "9.0"), "--backend cuda (the operator's choice)", []),
    (_facts(["9.0"], triton="3.6.0"), ALL, "cpu", ("cpu", "cpu", None), "--backend cpu (the operator's choice)", []),
    (_facts([], triton="3.6.0"), ALL, "cuda", (None, "cuda", None), "--backend cuda (the operator's choice)",
     ["no GPU answers nvidia-smi: the cuda backend builds for the host's GPU arch"]),
])
def test_backend_choice(facts, backends, forced, want, why, fragments):
    """Which backend preflight takes, why, and what it refuses: triton on a GPU host of one
    supported arch whose (SGLang's) interpreter imports triton and whose torch is a CUDA build,
    else cuda; cpu without a GPU; --backend overrides and is refused where it cannot build or test."""
    got = preflight.decide(facts, backends, forced)
    assert (got["backend"], got["choice"], got["arch"], got["why"]) == (*want, why)
    assert got["refusals"] == fragments if fragments == [NO_DEVICE] else len(got["refusals"]) == len(fragments)
    for fragment in fragments:
        assert any(fragment in r for r in got["refusals"]), got["refusals"]


# --- kbuild probe: build and test on the CPU backend -----------------------------------------

