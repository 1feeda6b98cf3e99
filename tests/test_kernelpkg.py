"""Kernel packages (kernel.yaml validation, path escapes, build keys) and the kbuild probe's
preflight / build / test actions run locally on the CPU backend (no SSH)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetctl import probes
from fleetctl.errors import ParseError
from fleetctl.kernelpkg import build_key, load_package
from fleetctl.probes import kbuild

KERNELS = Path(__file__).resolve().parents[1] / "kernels"
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
    assert set(pkg.backends) == {"cpu", "cuda"}
    assert pkg.backends["cuda"].sources == ("csrc/binding_cuda.cpp", "csrc/verify_attention.cu")
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
    r = subprocess.run(probes.command(sys.executable, "kbuild"),
                       input=probes.bundle("kbuild", {"action": "preflight", "backends": ["cpu", "cuda"]}),
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
    if not gpus:
        assert (out["backend"], out["arch"], out["refusals"]) == ("cpu", None, [])
    else:
        caps = sorted({g["compute_cap"] for g in out["facts"]["gpus"]}, key=lambda c: tuple(map(int, c.split("."))))
        assert out["arch"] == ";".join(caps) and out["backend"] in ("cuda", None)


def _facts(gpus=(), torch_cuda="12.8", nvcc="12.8", ninja="/usr/bin/ninja"):
    return {"python": "/venv/bin/python", "gpus": [{"name": "GPU", "compute_cap": c} for c in gpus],
            "gpu_error": None, "torch": {"version": "2.8.0", "cuda": torch_cuda, "path": "x"},
            "nvcc": nvcc and {"path": "/usr/local/cuda/bin/nvcc", "version": nvcc}, "ninja": ninja}


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
    got = kbuild.decide(facts, backends)
    assert (got["backend"], got["arch"]) == (want_backend, want_arch)
    assert len(got["refusals"]) == len(fragments)
    for fragment in fragments:
        assert any(fragment in r for r in got["refusals"]), got["refusals"]


# --- kbuild probe: build and test on the CPU backend -----------------------------------------

def _group_alive(pgid: int) -> list[int]:
    """Pids of live (non-zombie) processes in process group pgid."""
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(pid))
    return alive


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Deadline-killed build, then a stale torch lock, then the real build in the same directory."""
    pkg = load_package(KERNELS, "verify_attention")
    build_dir = tmp_path_factory.mktemp("kbuild") / "build"
    params = dict(action="build", src_dir=str(pkg.root), build_dir=str(build_dir), arch=None, max_jobs=2,
                  **pkg.build_params("cpu"))
    killed = kbuild.main(dict(params, deadline_s=6))
    end = time.monotonic() + 10
    while _group_alive(killed["pgid"]) and time.monotonic() < end:
        time.sleep(0.2)
    leftovers = _group_alive(killed["pgid"])
    (build_dir / "lock").touch()  # what a build killed inside torch's FileBaton leaves (if it did not already)
    ok = kbuild.main(dict(params, deadline_s=600))
    return pkg, killed, leftovers, ok


def test_build_deadline_kills_the_whole_process_group(built):
    _, killed, leftovers, _ = built
    assert killed["timed_out"] and not killed["ok"] and killed["module_path"] is None
    assert killed["rc"] == -9
    assert leftovers == []
    assert killed["log_tail"] is not None


def test_build_after_killed_build_and_stale_lock_succeeds(built):
    _, _, _, ok = built
    assert ok["ok"], ok["log_tail"]
    assert ok["removed_stale_lock"] and not ok["timed_out"]
    assert Path(ok["module_path"]).is_file()
    assert not (Path(ok["module_path"]).parent / "lock").exists()
    assert "verify_attention_cpu" in Path(ok["log_path"]).read_text()


def test_build_waits_for_the_flock_until_its_deadline(built, tmp_path):
    pkg = built[0]
    lock_path = tmp_path / "held.lock"
    with open(lock_path, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        t0 = time.monotonic()
        r = kbuild.main(dict(action="build", src_dir=str(pkg.root), build_dir=str(tmp_path / "b"),
                             lock_path=str(lock_path), deadline_s=1, **pkg.build_params("cpu")))
    assert r["timed_out"] and not r["ok"] and r["pgid"] is None
    assert 1 <= time.monotonic() - t0 < 5


def test_build_failure_returns_log_tail(tmp_path):
    (tmp_path / "broken.cpp").write_text("int f() { return undefined_name; }\n")
    r = kbuild.main(dict(action="build", src_dir=str(tmp_path), build_dir=str(tmp_path / "b"), name="broken",
                         sources=["broken.cpp"], deadline_s=300))
    assert not r["ok"] and not r["timed_out"] and r["rc"] != 0
    assert "undefined_name" in r["log_tail"]


def _test_params(pkg, src_dir, module_path):
    return dict(action="test", src_dir=str(src_dir), module_path=module_path, deadline_s=300, **pkg.test_params("cpu"))


def test_reference_test_passes_on_the_built_module(built):
    pkg, _, _, ok = built
    r = kbuild.main(_test_params(pkg, pkg.root, ok["module_path"]))
    assert r["ok"] and r["rc"] == 0, r
    assert r["result"]["ok"] and len(r["result"]["cases"]) == 12 and r["result"]["failures"] == []


def test_broken_reference_fails_the_test(built, tmp_path):
    pkg, _, _, ok = built
    src = tmp_path / "verify_attention"
    shutil.copytree(pkg.root, src, ignore=shutil.ignore_patterns("__pycache__"))
    ref = src / "reference.py"
    ref.write_text(ref.read_text().replace("* sm_scale\n", "* sm_scale * 1.01\n"))
    r = kbuild.main(_test_params(pkg, src, ok["module_path"]))
    assert not r["ok"] and r["rc"] == 1
    assert r["result"]["failures"] and not r["result"]["ok"]


def test_crashing_test_module_fails_the_test(built, tmp_path):
    pkg, _, _, ok = built
    src = tmp_path / "verify_attention"
    shutil.copytree(pkg.root, src, ignore=shutil.ignore_patterns("__pycache__"))
    (src / "test_kernel.py").write_text("raise SystemExit('test module broken')\n")
    r = kbuild.main(_test_params(pkg, src, ok["module_path"]))
    assert not r["ok"] and r["rc"] == 1 and r["result"] is None
    assert "test module broken" in r["stderr_tail"]
    json.dumps(r)  # the probe result crosses SSH as JSON


def test_builds_run_with_a_path_no_other_user_can_write(tmp_path, monkeypatch):
    """Review M6 / issue 13: root's build never looks up `c++`, `ninja` or `nvcc` in a directory a
    non-root user can write: such PATH entries, relative ones and missing ones are dropped; the
    interpreter's bin directory (trust-checked by the facts probe) comes first."""
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    safe, shared, group, theirs = (tmp_path / n for n in ("safe", "shared", "group", "theirs"))
    for d in (safe, shared, group, theirs):
        d.mkdir()
    shared.chmod(0o1777)  # even sticky: anyone may add a `ninja` there
    group.chmod(0o775)
    os.chown(theirs, 65534, 65534)
    monkeypatch.setenv("PATH", os.pathsep.join([str(shared), ".", "", str(group), str(theirs), str(safe),
                                                str(tmp_path / "missing"), "/usr/bin"]))
    assert kbuild._search_path(str(venv_bin / "python")).split(os.pathsep) == [str(venv_bin), str(safe), "/usr/bin"]
