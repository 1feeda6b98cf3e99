"""What root may import (probes/trust.py untrusted_imports), on real trees owned by other users,
as root: a package, a file in it, a link in it, a directory of sys.path or an editable install's
finder (PEP 660) that names another user's checkout is refused, naming the path; an all-root tree
is cleared. And the dispatch bench probe refuses to run the benchmark over such an import path
(its child is never started)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fleetctl.probes import trust

NOBODY = 65534
AGENT = Path(__file__).resolve().parents[2] / "agent"


@pytest.fixture
def site(monkeypatch):
    """A root-owned 0755 directory under /tmp put first on sys.path, holding the package `fcpkg`
    (a root-owned tree: __init__.py, sub/mod.py); removed after."""
    top = Path(tempfile.mkdtemp(prefix="fc-imports-", dir="/tmp"))
    top.chmod(0o755)
    pkg = top / "fcpkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "mod.py").write_text("X = 1\n")
    for d in (pkg, pkg / "sub"):
        d.chmod(0o755)
    monkeypatch.setattr(sys, "path", [str(top)] + sys.path)
    importlib.invalidate_caches()
    yield top, pkg
    shutil.rmtree(top, ignore_errors=True)


def test_a_root_tree_is_cleared(site):
    assert trust.untrusted_imports(("fcpkg", "fc_not_installed")) is None


def test_a_package_or_a_file_of_another_user_is_refused(site):
    _, pkg = site
    os.chown(pkg / "sub" / "mod.py", NOBODY, NOBODY)
    assert trust.untrusted_imports(("fcpkg",)) == f"{pkg}/sub/mod.py belongs to uid {NOBODY} (package fcpkg)"
    os.chown(pkg / "sub" / "mod.py", 0, 0)
    os.chown(pkg, NOBODY, NOBODY)
    assert trust.untrusted_imports(("fcpkg",)) == f"{pkg} belongs to uid {NOBODY} (package fcpkg)"


def test_a_group_writable_file_is_refused(site):
    _, pkg = site
    (pkg / "__init__.py").chmod(0o664)
    assert trust.untrusted_imports(("fcpkg",)) == f"{pkg}/__init__.py is writable by group or others (package fcpkg)"


def test_a_link_to_another_users_file_is_refused(site):
    top, pkg = site
    theirs = top / "theirs"
    theirs.mkdir(mode=0o755)
    (theirs / "evil.py").write_text("")
    os.chown(theirs, NOBODY, NOBODY)
    (pkg / "linked.py").symlink_to(theirs / "evil.py")
    why = trust.untrusted_imports(("fcpkg",))
    assert why == f"{theirs} belongs to uid {NOBODY} (resolving the link {pkg}/linked.py) (package fcpkg)", why


def test_a_directory_of_sys_path_that_others_may_write_is_refused(site, monkeypatch):
    top, _ = site
    shared = top / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setattr(sys, "path", sys.path + [str(shared)])
    assert trust.untrusted_imports(()) == f"{shared} is writable by group or others (on sys.path as {shared})"


class _EditableFinder:
    """What setuptools' PEP 660 finder (__editable___NAME_finder.py, imported by a root-owned .pth)
    does: it maps a top-level name to a checkout outside every sys.path directory."""

    def __init__(self, name: str, where: Path):
        self.name, self.where = name, where

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        return importlib.util.spec_from_file_location(fullname, self.where / "__init__.py",
                                                      submodule_search_locations=[str(self.where)])


def test_an_editable_install_from_another_users_checkout_is_refused(site, monkeypatch):
    top, _ = site
    checkout = top / "home" / "sglang"
    checkout.mkdir(parents=True)
    (checkout / "__init__.py").write_text("")
    for d in (top / "home", checkout):
        d.chmod(0o755)
    os.chown(checkout / "__init__.py", NOBODY, NOBODY)
    monkeypatch.setattr(sys, "meta_path", [_EditableFinder("fc_editable", checkout)] + sys.meta_path)
    why = trust.untrusted_imports(("fc_editable",))
    assert why == f"{checkout}/__init__.py belongs to uid {NOBODY} (package fc_editable)", why


def test_the_dispatch_bench_probe_never_starts_the_benchmark_over_such_a_path(tmp_path):
    """dispatchbench.main as the probe runs it (`python -S`, then its own site.main()) with another
    user's directory on the import path: refused before its child (which would write RAN) starts."""
    src = tmp_path / "src"
    src.mkdir()
    ran = tmp_path / "RAN"
    (src / "bench.py").write_text(f"open({str(ran)!r}, 'w').write('x')\nprint('{{}}')\n")
    theirs = Path(tempfile.mkdtemp(prefix="fc-theirs-", dir="/tmp"))
    try:
        os.chown(theirs, NOBODY, NOBODY)
        code = ("import json, sys; sys.path.insert(0, %r); from fleetctl.probes.kernel import dispatchbench; sys.path.append(%r)\n"
                "try:\n    print(json.dumps(dispatchbench.main(%r)))\nexcept RuntimeError as e:\n    print('REFUSED', e)\n"
                % (str(AGENT), str(theirs), {"src_dir": str(src), "script": "bench.py", "request": {}, "deadline_s": 30}))
        out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60)
        assert out.stdout.startswith("REFUSED not measuring: root would import code another user may change: "
                                     f"{theirs} belongs to uid {NOBODY}"), (out.stdout, out.stderr)
        assert not ran.exists()
        os.chown(theirs, 0, 0)
        theirs.chmod(0o755)
        out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60)
        res = json.loads(out.stdout)
        assert res["ok"] and res["answer"] == {} and ran.exists(), (out.stdout, out.stderr)
    finally:
        shutil.rmtree(theirs, ignore_errors=True)

