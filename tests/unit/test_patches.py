"""`apply --export-patch` (engine/playbooks/patches.py) on a check result as check_job gives it, with what a
hostile host can put in it (security review N2): paths outside the install, a version or an
install id that is not what it says, and a link planted in the export directory. Each test
asserts on every file under its tmp_path (the temporary copy `patch` runs in is made there)."""

from __future__ import annotations

import posixpath
import tempfile
from pathlib import Path

import pytest

from fleetctl.engine.context import HostResult
from fleetctl.engine.playbooks.patches import ExportError, check_patch, groups, write_patches
from fleetctl.engine.playbooks.plan import plan_host
from fleetctl.engine.playbooks.model import load_playbook
from fleetctl.vocab import HostStatus
from oracles import PLAYBOOK, host_inputs

SRC = "need_sort = a or b\n"
LOCATION = "/opt/venv/lib/python3.11/site-packages"
INSTALL = f"host:{LOCATION}"


def check_result(rel: str = "sglang/a.py", version: str = "0.5.23", install: str = INSTALL) -> HostResult:
    """lab-04's check result for --export-patch (data plans, install_sglang, texts) of one
    planned file, named `rel` wherever the host's answer names it."""
    plan = plan_host(load_playbook(PLAYBOOK), "lab-04", {}, *host_inputs({"sglang/a.py": SRC}, location=LOCATION))
    fc = plan.files[0]
    path = posixpath.join(LOCATION, rel)
    diff = fc.diff.replace(" a/sglang/a.py", f" a/{rel}").replace(" b/sglang/a.py", f" b/{rel}")
    return HostResult("lab-04", "10.213.7.14", HostStatus.CHANGED, data={
        "plans": [{"install": install, "files": [{"rel": rel, "path": path, "pre_sha256": fc.pre_sha256,
                                                  "post_sha256": fc.post_sha256, "diff": diff}]}],
        "install_sglang": {install: {"version": version}},
        "texts": {path: {"pre_text": SRC, "post_text": fc.new_text}}})


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """tmp_path holding `tmp` (where check_patch's temporary copy is made) and an empty
    `pristine` (no release wheel: patches are checked against the host's pre-images)."""
    (tmp_path / "tmp").mkdir()
    (tmp_path / "pristine").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    return tmp_path


def everything(root: Path) -> list[str]:
    """Every path under `root` (links not followed), relative to it."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("rel, why", [
    ("../x", "not relative to the install"),
    ("../../owned.py", "not relative to the install"),
    ("sglang/../../x", "not relative to the install"),
    ("ABS/abs/owned.py", "not relative to the install"),  # ABS: this test's tmp_path, an absolute path
    ("sglang/a\x00b", "holds the character U+0000"),
    ("sglang/a\nb", "holds the character U+000A"),
])
def test_a_path_outside_the_install_is_refused_and_nothing_is_written(tree, rel, why):
    rel = rel.replace("ABS", str(tree))
    with pytest.raises(ExportError) as e:
        write_patches([check_result(rel)], "defrag-tier0", tree / "out", tree / "pristine")
    assert str(e.value) == f"host lab-04: refused a path from the host: {rel!r} ({why})"
    assert everything(tree) == ["pristine", "tmp"]


@pytest.mark.parametrize("version", ["0.5.23/../../evil", "0.5.23\n--- a/sglang/evil.py", "*"])
def test_a_version_that_is_not_pep_440_is_refused(tree, version):
    """The version goes into the patch's name, a wheel glob and its header: refused first."""
    with pytest.raises(ExportError) as e:
        write_patches([check_result(version=version)], "defrag-tier0", tree / "out", tree / "pristine")
    assert str(e.value) == (f"host lab-04: refused a version from the host: {version!r} "
                            "(not a PEP 440 public version in canonical form)")
    assert everything(tree) == ["pristine", "tmp"]


def test_an_install_id_with_a_line_break_is_refused(tree):
    """The install id (a path the host reported) goes into the patch's header, which `patch`
    reads: a line break there would add a hunk of the host's choosing to the exported patch."""
    evil = f"{INSTALL}\n--- a/sglang/evil.py\n+++ b/sglang/evil.py\n@@ -0,0 +1 @@\n+import os\n"
    with pytest.raises(ExportError) as e:
        write_patches([check_result(install=evil)], "defrag-tier0", tree / "out", tree / "pristine")
    assert str(e.value) == f"host lab-04: refused an install id from the host: {evil!r} (holds the character U+000A)"
    assert everything(tree) == ["pristine", "tmp"]


def test_a_link_planted_in_the_export_dir_is_not_followed(tree):
    """The patch's own name in DIR is a link to a file outside: the patch replaces the link,
    and the file it pointed to is unchanged."""
    r = check_result()
    name = f"defrag-tier0-sglang-0.5.23-{groups([r])[0].key}.patch"
    (tree / "outside").mkdir()
    (tree / "outside" / "victim.py").write_text("keep\n")
    (tree / "out").mkdir()
    (tree / "out" / name).symlink_to(tree / "outside" / "victim.py")
    assert write_patches([r], "defrag-tier0", tree / "out", tree / "pristine") == [tree / "out" / name]
    assert (tree / "outside" / "victim.py").read_text() == "keep\n"
    written = tree / "out" / name
    assert not written.is_symlink() and written.is_file()
    assert written.read_text().endswith(r.data["plans"][0]["files"][0]["diff"])
    assert "checked against: the pre-images fleetctl read on the host (no release wheel)" in written.read_text()
    assert everything(tree) == ["out", f"out/{name}", "outside", "outside/victim.py", "pristine", "tmp"]


def test_a_patch_that_makes_a_file_not_planned_fails_its_check(tree):
    """check_patch: beside the planned post-images, the patched copy holds no other file."""
    r = check_result()
    f = r.data["plans"][0]["files"][0]
    extra = "--- a/sglang/evil.py\n+++ b/sglang/evil.py\n@@ -0,0 +1 @@\n+import os\n"
    with pytest.raises(ExportError) as e:
        check_patch(f["diff"] + extra, {"sglang/a.py": SRC.encode()}, {"sglang/a.py": f["post_sha256"]})
    assert str(e.value) == "the patch makes sglang/evil.py, which fleetctl did not plan"
    assert everything(tree) == ["pristine", "tmp"]
