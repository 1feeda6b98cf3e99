"""The kbuild probe's triton build run locally (no SSH): the package's triton module
(kernels/verify_attention, kernel.yaml's `backends.triton`) compiled ahead of time by this
interpreter's triton as a host's SGLang interpreter compiles it (kbuild's build action), then its
reference test (kbuild's test action, test_kernel.py on the device). Without a GPU the build
targets sm_90 (triton needs no device to compile) and the test must be refused for want of a
device; on a GPU machine the build targets the device's arch and the test must pass.

For CI time the package is a variant whose kernel.yaml names a two-line module around the real
triton_verify.build limited to two instantiations (kernel.yaml's own build compiles all of
them: 86 s here, on the shared 2-core machine); on a GPU machine it is the package itself."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from conftest import kernel_variant
from fleetctl.engine.kernels.package import load_package
from fleetctl.probes.kernel import build, kbuild

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
ARCH = "%d.%d" % torch.cuda.get_device_capability() if torch.cuda.is_available() else "9.0"


TWO = '''"""verify_attention's triton build limited to two instantiations (a test variant, CI time)."""
import triton_verify
from triton_verify import load  # noqa: F401


def build(arch, out_dir):
    return triton_verify.build(arch, out_dir, keys={triton_verify.fwd_key("bf16", 128, 16, "sglang_tree"),
                                                    triton_verify.combine_key("bf16", 128)})
'''


def two_instantiations(d: Path) -> None:
    (d / "triton_two.py").write_text(TWO)
    yaml = d / "kernel.yaml"
    yaml.write_text(yaml.read_text().replace("module: triton_verify.py", "module: triton_two.py"))


@pytest.fixture(scope="module")
def triton_build():
    """(package, the key's directory, kbuild's build answer) of one triton build for ARCH, under a
    directory any uid may read (the reference test runs as nobody on what it is given, as on a
    host's published copy)."""
    top = Path(tempfile.mkdtemp(prefix="fleetctl-triton-", dir="/tmp"))
    top.chmod(0o755)
    (top / "kernels").mkdir(mode=0o755)
    kernels = KERNELS if torch.cuda.is_available() else kernel_variant(top / "kernels", "two", two_instantiations)
    pkg = load_package(kernels, "verify_attention")
    key_dir = top / "triton-key"
    key_dir.mkdir(mode=0o755)
    r = kbuild.main(dict(action="build", src_dir=str(pkg.root), build_dir=str(key_dir / "build"), arch=ARCH,
                         deadline_s=900, **pkg.build_params("triton")))
    yield pkg, key_dir, r
    shutil.rmtree(top, ignore_errors=True)


def test_triton_build_compiles_for_the_arch_with_no_gpu_needed(triton_build):
    pkg, key_dir, r = triton_build
    assert r["ok"] and not r["timed_out"] and r["rc"] == 0, r["log_tail"]
    module = Path(r["module_path"])
    assert module == key_dir / "build" / "verify_attention_triton.py" and module.is_file()
    compile(module.read_text(), str(module), "exec")  # the module the test and `current` import parses
    manifest = r["manifest"]
    assert manifest == json.loads((key_dir / "build" / "kernels" / "manifest.json").read_text())
    assert manifest["arch"] == int(ARCH.replace(".", ""))
    assert manifest["triton"] == importlib.metadata.version("triton")
    assert len(manifest["instantiations"]) >= 2 if torch.cuda.is_available() else len(manifest["instantiations"]) == 2
    cubins = sorted((key_dir / "build" / "kernels").rglob("*.cubin"))
    assert len(cubins) >= len(manifest["instantiations"])
    assert all(c.read_bytes()[:4] == b"\x7fELF" for c in cubins)


def test_triton_reference_test_runs_on_the_device(triton_build):
    pkg, key_dir, r = triton_build
    assert r["ok"], r["log_tail"]
    t = kbuild.main(dict(action="test", src_dir=str(pkg.root), module_path=r["module_path"], deadline_s=600,
                         **pkg.test_params("triton")))
    if torch.cuda.is_available():
        assert t["ok"] and t["result"]["failures"] == [], t
    else:
        assert not t["ok"] and t["rc"] == 1 and t["result"] is None
        assert "RuntimeError: no CUDA device for the reference test of the triton build" in t["stderr_tail"]


def test_failing_triton_build_returns_log_tail(tmp_path):
    (tmp_path / "k.py").write_text("def build(arch, out_dir):\n    raise ValueError('no config for sm_%d' % arch)\n")
    r = kbuild.main(dict(action="build", src_dir=str(tmp_path), build_dir=str(tmp_path / "b"), arch="12.0",
                         name="k_triton", kind="triton", module="k.py", build="build", load="load", deadline_s=120))
    assert not r["ok"] and not r["timed_out"] and r["rc"] == 1 and r["module_path"] is None
    assert "ValueError: no config for sm_120" in r["log_tail"]
    assert not (tmp_path / "b" / "k_triton.py").exists()


def test_the_triton_builds_module_leaves_sys_path_as_it_found_it(tmp_path, monkeypatch):
    """The written BUILD_DIR/NAME.py (build._TRITON_MODULE) puts the uploaded package's dir on
    sys.path only while the package's module loads (its sibling imports work), never after: in
    SGLang's process it would shadow top-level modules."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "sibling_of_triton_verify.py").write_text("KERNELS = 'compiled'\n")
    (src / "tv_for_path_test.py").write_text("import sibling_of_triton_verify\n\n\ndef load(out_dir):\n"
                                             "    return type('K', (), {'where': out_dir, "
                                             "'what': sibling_of_triton_verify.KERNELS})\n")
    args = {"arch": 90, "out_dir": str(tmp_path / "build" / "kernels"), "src_dir": str(src), "load": "load",
            "module_name": "tv_for_path_test", "module": str(src / "tv_for_path_test.py")}
    (tmp_path / "build").mkdir()
    path = build._write_triton_module({"name": "verify_attention_triton", "module": "tv_for_path_test.py"}, args)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = list(sys.path)
    spec = importlib.util.spec_from_file_location("verify_attention_triton_path_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert (mod.where, mod.what) == (args["out_dir"], "compiled")
    assert sys.path == before
    for name in ("tv_for_path_test", "sibling_of_triton_verify"):
        sys.modules.pop(name, None)


def test_the_triton_builds_module_works_from_its_published_copy(tmp_path, monkeypatch):
    """The written module finds the kernels and the package's sources relative to its own
    __file__: published by kbuild's publish (a copy at PUBLIC/NAME/<key>) and the private build
    removed, the copy imports and loads from the published kernels and sources."""
    key = "c" * 64
    bdir = tmp_path / "state" / "kernels" / "verify_attention" / key
    src = bdir / "src"
    src.mkdir(parents=True)
    (src / "sibling_of_published.py").write_text("KERNELS = 'published'\n")
    (src / "tv_for_publish_test.py").write_text("import os\nimport sibling_of_published\n\n\ndef load(out_dir):\n"
                                                "    return type('K', (), {'where': out_dir, 'listed': os.listdir(out_dir), "
                                                "'what': sibling_of_published.KERNELS})\n")
    (bdir / "build" / "kernels").mkdir(parents=True)
    (bdir / "build" / "kernels" / "manifest.json").write_text("{}\n")
    args = {"arch": 90, "out_dir": str(bdir / "build" / "kernels"), "src_dir": str(src), "load": "load",
            "module_name": "tv_for_publish_test", "module": str(src / "tv_for_publish_test.py")}
    path = build._write_triton_module({"name": "verify_attention_triton", "module": "tv_for_publish_test.py"}, args)
    (bdir / "PASSED").write_text(path + "\n")
    public = tmp_path / "public"
    r = kbuild.main(dict(action="publish", build_dir=str(bdir), public_dir=str(public / "verify_attention" / key)))
    assert r["ok"], r
    shutil.rmtree(bdir)
    pdir = public / "verify_attention" / key
    assert r["module_path"] == str(pdir / "build" / "verify_attention_triton.py")
    assert str(tmp_path / "state") not in Path(r["module_path"]).read_text()  # no private path baked in
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = list(sys.path)
    spec = importlib.util.spec_from_file_location("verify_attention_triton_publish_test", r["module_path"])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert (mod.where, mod.listed, mod.what) == (str(pdir / "build" / "kernels"), ["manifest.json"], "published")
    assert sys.path == before
    for name in ("tv_for_publish_test", "sibling_of_published"):
        sys.modules.pop(name, None)
