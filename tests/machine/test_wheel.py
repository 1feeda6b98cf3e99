"""The wheel: built from a clean copy of the checkout, it holds every module under
agent/fleetctl (found by walking the tree, not from a list) and the package data fleetctl.paths
finds with importlib.resources, and `fleetctl --help` and `fleetctl lab --help` run from it in a
fresh venv (pip installs only the wheel: its dependencies come from this machine's Python, no
network)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "agent" / "fleetctl"
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info", "build", "dist")


def package_files() -> set[str]:
    """Every file of the package under agent/ (wheel paths: fleetctl/...), caches left out."""
    return {str(p.relative_to(PKG.parent)) for p in PKG.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".so")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("agent", "playbooks", "kernels"):
        shutil.copytree(ROOT / name, src / name, ignore=IGNORE)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    dist = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "-q", "-w", str(dist), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    found, = dist.glob("fleetctl-*.whl")
    return found


def test_the_wheel_holds_every_module_and_the_package_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    files = package_files()
    assert {f for f in files if f.endswith(".py")} and not files - names, sorted(files - names)
    for want in ("fleetctl/data/playbooks/defrag-tier0.yaml", "fleetctl/data/playbooks/templates/defrag-tier0/value.py.j2",
                 # the route hook's body: plain Python, package data all the same (its template includes it)
                 "fleetctl/data/playbooks/templates/route-verify-attention/fleetctl_verify.py",
                 "fleetctl/data/kernels/verify_attention/kernel.yaml",
                 "fleetctl/data/kernels/verify_attention/csrc/verify_attention.cu",
                 "fleetctl/lab/standin/restart.sh"):
        assert want in names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    assert (ROOT / "kernels/verify_attention/results/gpu_check.json").exists()
    assert not [n for n in names if "/results/" in n], "GPU measurements are not package data"


def test_the_package_walk_sees_a_new_module(tmp_path, monkeypatch):
    """The walk is the tree's: a module added anywhere under agent/fleetctl is in package_files."""
    fake = tmp_path / "fleetctl"
    (fake / "newroom").mkdir(parents=True)
    (fake / "newroom" / "thing.py").write_text("")
    (fake / "newroom" / "__pycache__").mkdir()
    (fake / "newroom" / "__pycache__" / "thing.cpython-311.pyc").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "PKG", fake)
    assert package_files() == {"fleetctl/newroom/thing.py"}


def test_fleetctl_help_runs_from_the_wheel_in_a_fresh_venv(wheel, tmp_path):
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of this checkout
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                        str(wheel)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import fleetctl; print(fleetctl.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr
    for args, words in ((["--help"], ("inspect", "apply", "deploy", "lab")), (["lab", "--help"], ("up", "down", "fault"))):
        r = subprocess.run([str(venv / "bin" / "fleetctl"), *args], capture_output=True, text=True, env=env,
                           cwd=tmp_path, timeout=60)
        assert r.returncode == 0, r.stderr
        assert all(w in r.stdout for w in words), r.stdout
